"""Where arbiterd keeps its per-user files; owns the XDG lookups, their safety checks, and the
creation of every folder arbiterd makes (runtime, arena, state, config): 0700 at every level.

Never creates anything outside the directories it is given, never follows a path it was not given.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from arbiterd.errors import ArbiterError, RuntimeDirError

ARENA_ENV = "ARBITERD_ARENA"
DEFAULT_DEVICE = "gpu0"
PRIVATE_DIR_MODE = 0o700


def runtime_dir(env: Mapping[str, str] | None = None) -> Path:
    """`$XDG_RUNTIME_DIR/arbiterd`, after checking the runtime dir is the user's own and private.

    The arena's lock files live here; a runtime dir that others can write would let them plant
    files (XDG Base Directory spec: it MUST be owned by the user with access mode 0700).
    """
    env = os.environ if env is None else env
    raw = env.get("XDG_RUNTIME_DIR", "")
    if not raw:
        raise RuntimeDirError(f"XDG_RUNTIME_DIR is not set (no login session?); {_set_it()}")
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


def _set_it() -> str:
    """How to give this shell a runtime dir, as commands that work when pasted: the one a login
    session makes when it is there, else a private folder in the user's home (the same path in
    every shell, so the daemon and its clients meet; not in /tmp, where another user could
    make it first)."""
    session = Path(f"/run/user/{os.getuid()}")
    if session.is_dir():
        return f"run: export XDG_RUNTIME_DIR={session}"
    private = Path.home() / ".cache" / "arbiterd-runtime"
    return f"run: mkdir -p -m 700 {private} && export XDG_RUNTIME_DIR={private}"


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


def make_private_dirs(directory: Path, error: type[ArbiterError]) -> None:
    """Create `directory` and every missing parent with mode 0700; existing ones are left as
    they are. `mkdir(parents=True)` would give the parents `0777 & ~umask` (0755 under the
    usual umask 022), and a later private-folder check on one of them would then refuse it."""
    missing: list[Path] = []
    current = directory
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for path in reversed(missing):
        try:
            path.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:
            continue  # made by someone else meanwhile: checked like any existing folder
        except OSError as exc:
            raise error(f"cannot create {path}: {exc.strerror or exc}") from None
        # mkdir's mode is masked by the umask; a umask such as 0277 must not make it unusable.
        os.chmod(path, PRIVATE_DIR_MODE)


def ensure_private_dir(directory: Path, error: type[ArbiterError]) -> None:
    """Create `directory` as `make_private_dirs` does, then require it to be ours and 0700:
    whoever can write it could replace what we keep there. Refusals carry the one-line fix."""
    make_private_dirs(directory, error)
    try:
        st = os.lstat(directory)
    except OSError as exc:
        raise error(f"cannot read {directory}: {exc.strerror or exc}") from None
    problem = private_dir_problem(str(directory), st)
    if problem is None:
        return
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
        problem += f" (chmod 700 {directory})"
    raise error(problem)
