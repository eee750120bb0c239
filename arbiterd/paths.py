"""Where arbiterd keeps its per-user files; owns the XDG lookups and their safety checks.

Never creates anything outside the directories it resolves, never follows a path it was not given.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from arbiterd.errors import RuntimeDirError

ARENA_ENV = "ARBITERD_ARENA"
DEFAULT_DEVICE = "gpu0"


def runtime_dir(env: Mapping[str, str] | None = None) -> Path:
    """`$XDG_RUNTIME_DIR/arbiterd`, after checking the runtime dir is the user's own and private.

    The arena's lock files live here; a runtime dir that others can write would let them plant
    files (XDG Base Directory spec: it MUST be owned by the user with access mode 0700).
    """
    env = os.environ if env is None else env
    raw = env.get("XDG_RUNTIME_DIR", "")
    if not raw:
        raise RuntimeDirError(
            "XDG_RUNTIME_DIR is not set (no login session?); set it or pass --arena DIR"
        )
    base = Path(raw)
    if not base.is_absolute():
        raise RuntimeDirError(f"XDG_RUNTIME_DIR={raw!r} is not an absolute path")
    try:
        st = base.stat()
    except FileNotFoundError:
        raise RuntimeDirError(f"XDG_RUNTIME_DIR={raw} does not exist") from None
    except OSError as exc:
        raise RuntimeDirError(f"XDG_RUNTIME_DIR={raw} cannot be read: {exc.strerror}") from None
    problem = private_dir_problem(f"XDG_RUNTIME_DIR={raw}", st)
    if problem is not None:
        raise RuntimeDirError(problem)
    return base / "arbiterd"


def private_dir_problem(label: str, st: os.stat_result) -> str | None:
    """Why a directory (stat `st`, named `label` in the message) is not private to us — it
    must be a directory we own with no group or other access — or None when it is."""
    if not stat.S_ISDIR(st.st_mode):
        return f"{label} is not a directory"
    if st.st_uid != os.getuid():
        return f"{label} is owned by uid {st.st_uid}, not by you (uid {os.getuid()})"
    if st.st_mode & 0o077:
        return f"{label} has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700"
    return None


def default_arena(env: Mapping[str, str] | None = None) -> Path:
    """The first GPU's arena: `$ARBITERD_ARENA`, else `$XDG_RUNTIME_DIR/arbiterd/arena/gpu0`."""
    env = os.environ if env is None else env
    override = env.get(ARENA_ENV, "")
    if override:
        return Path(override)
    return runtime_dir(env) / "arena" / DEFAULT_DEVICE


def resolve_arena(explicit: str | None, env: Mapping[str, str] | None = None) -> Path:
    """`--arena DIR` when given, else the default arena."""
    return Path(explicit) if explicit else default_arena(env)
