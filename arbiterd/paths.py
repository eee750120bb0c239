"""Where arbiterd keeps its per-user files; owns the XDG lookups, their safety checks (a private
folder's, a trusted file's), the creation of every folder arbiterd makes (runtime, arena,
state, config): 0700 at every level, and the device ids with the folder of each device's arena
(issue 27).

Never creates anything outside the directories it is given, never follows a path it was not given.
"""

from __future__ import annotations

import enum
import ipaddress
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from arbiterd.errors import ArbiterError, BadValueError, RuntimeDirError

ARENA_ENV = "ARBITERD_ARENA"
DEFAULT_DEVICE = "gpu0"
PRIVATE_DIR_MODE = 0o700
OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


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
    if (foreign := owner_problem(label, st)) is not None:
        return foreign
    if st.st_mode & 0o077:
        return f"{label} has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700"
    return None


def trusted_file_problem(label: str, st: os.stat_result) -> str | None:
    """Why a file whose content we act on (stat `st`, named `label` in the message) cannot be
    trusted — it must be a regular file we own that neither group nor others can write: what
    they could write, we would do — or None when it can."""
    if not stat.S_ISREG(st.st_mode):
        return f"{label} is not a regular file"
    if (foreign := owner_problem(label, st)) is not None:
        return foreign
    if st.st_mode & OTHERS_WRITE:
        return (
            f"{label} has mode {stat.S_IMODE(st.st_mode):04o}, which lets group or others write it"
        )
    return None


def owner_problem(label: str, st: os.stat_result) -> str | None:
    """Why what `st` is the stat of (named `label`) is not ours: its owner, or None."""
    if st.st_uid != os.getuid():
        return f"{label} is owned by uid {st.st_uid}, not by you (uid {os.getuid()})"
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


# -- devices and their arenas (issue 27; docs/arena-protocol.md § Devices) -----------------------

DEVICE_ID_SHAPES = "gpuN (N = 0, 1, ...), rpc:HOST:PORT, rpc:HOST:PORT/N or cpu"
# The longest file name Linux filesystems take (NAME_MAX); a longer folder name cannot exist.
FOLDER_NAME_MAX_BYTES = 255
# An IPv6 host's folder name starts so, its colons become underscores: no host name has one.
IPV6_FOLDER_PREFIX = "ip6_"
_NUMBER = r"0|[1-9][0-9]*"  # one spelling per number: no leading zeros
_GPU_RE = re.compile(rf"gpu(?P<index>{_NUMBER})")
_RPC_RE = re.compile(
    rf"rpc:(?P<host>\[[^\]]*\]|[^:/\[\]]*):(?P<port>{_NUMBER})(?:/(?P<index>{_NUMBER}))?"
)
# A host name (RFC 1123) or a dotted IPv4 address: letters, digits, '-' inside labels, dots.
_HOSTNAME_RE = re.compile(
    r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)*"
)
_HOSTNAME_MAX = 253
_PORT_MAX = 65535


class DeviceKind(enum.StrEnum):
    """What a device id names."""

    GPU = "gpu"  # a local GPU, in ggml's order
    RPC = "rpc"  # a device of a llama.cpp RPC server
    CPU = "cpu"


@dataclass(frozen=True)
class DeviceId:
    """A device id, parsed (`parse_device_id`); `str()` gives its one canonical spelling, the one
    that names its arena's folder and orders it among the others: sorting DeviceIds sorts their
    spellings (the canonical order of arbiterd/arena/devices.py)."""

    kind: DeviceKind
    index: int = 0  # gpuN's N, or the device's number on its RPC server
    host: str = ""  # an RPC server's host name or IPv4 address (lower case), or IPv6 address
    port: int = 0

    def __str__(self) -> str:
        if self.kind is DeviceKind.RPC:
            host = f"[{self.host}]" if ":" in self.host else self.host
            return f"rpc:{host}:{self.port}" + (f"/{self.index}" if self.index else "")
        if self.kind is DeviceKind.GPU:
            return f"gpu{self.index}"
        return "cpu"

    def __lt__(self, other: DeviceId) -> bool:
        return str(self) < str(other)

    @property
    def folder_name(self) -> str:
        """Its arena's folder name: safe on any filesystem (letters, digits, '.', '-', '_';
        no ':', '/', brackets) and unambiguous. `rpc:HOST:PORT/N` becomes `rpc-HOST-PORT-dN`
        (nothing for N = 0), an IPv6 HOST `ip6_` and its compressed form with '_' for ':'.
        Read from the right, the last field is `dN` or the port, the one before it the port,
        and the rest the host: a host name has no '_', so an IPv6 host cannot pass for one."""
        if self.kind is not DeviceKind.RPC:
            return str(self)
        host = self.host
        if ":" in host:
            host = IPV6_FOLDER_PREFIX + host.replace(":", "_")
        return f"rpc-{host}-{self.port}" + (f"-d{self.index}" if self.index else "")


def parse_device_id(text: str) -> DeviceId:
    """A device id as written in a config, on a command line or by a foreign program; one that
    is not of the shapes of DEVICE_ID_SHAPES is refused (BadValueError naming them).

    Spellings of one device map to one id: a host name is lower-cased, an IPv6 address
    compressed (`[0:0::1]` is `[::1]`), and `/0` dropped (device 0 is `rpc:HOST:PORT`). Two
    spellings of one server that only DNS could tell apart (`localhost`, `127.0.0.1`) stay two
    ids: name each server one way."""
    if text == "cpu":
        return DeviceId(DeviceKind.CPU)
    gpu = _GPU_RE.fullmatch(text)
    if gpu is not None:
        return DeviceId(DeviceKind.GPU, int(gpu["index"]))
    rpc = _RPC_RE.fullmatch(text)
    if rpc is None:
        raise BadValueError(f"device id {text!r}: expected {DEVICE_ID_SHAPES}")
    port = int(rpc["port"])
    if not 1 <= port <= _PORT_MAX:
        raise BadValueError(f"device id {text!r}: the port must be 1 to {_PORT_MAX}")
    device = DeviceId(DeviceKind.RPC, int(rpc["index"] or 0), _rpc_host(text, rpc["host"]), port)
    if len(device.folder_name.encode()) > FOLDER_NAME_MAX_BYTES:
        raise BadValueError(f"device id {text!r}: too long to name a folder")
    return device


def _rpc_host(text: str, raw: str) -> str:
    """The host of an `rpc:` id in its one spelling; BadValueError naming what it must be."""
    if raw.startswith("["):
        inner = raw[1:-1]
        try:
            if "%" in inner:  # a zone (fe80::1%eth0) names an interface of this machine only
                raise ValueError(inner)
            return _rfc5952(ipaddress.IPv6Address(inner))
        except ValueError:
            raise BadValueError(
                f"device id {text!r}: {raw} is not an IPv6 address (without a %zone)"
            ) from None
    host = raw.lower()
    if len(host) > _HOSTNAME_MAX or not _HOSTNAME_RE.fullmatch(host):
        raise BadValueError(
            f"device id {text!r}: HOST must be a host name, an IPv4 address or an IPv6 address "
            f"in brackets, got {raw!r}"
        )
    return host


def _rfc5952(address: ipaddress.IPv6Address) -> str:
    """RFC 5952's text of `address` (lower case, the longest run of two or more zero groups
    as '::', the first of equal runs), always in hex: Python's own spelling of an IPv4-mapped
    address changed in 3.13, and an arena's folder name must not depend on the version."""
    groups = [int.from_bytes(address.packed[i : i + 2], "big") for i in range(0, 16, 2)]
    best_start, best_len, start = -1, 1, -1
    for i, group in enumerate([*groups, 1]):  # a sentinel ends a run that reaches the end
        if group == 0 and start < 0:
            start = i
        elif group != 0 and start >= 0:
            if i - start > best_len:
                best_start, best_len = start, i - start
            start = -1
    text = [f"{group:x}" for group in groups]
    if best_start < 0:
        return ":".join(text)
    head, tail = text[:best_start], text[best_start + best_len :]
    return ":".join(head) + "::" + ":".join(tail)


def device_arena_of(device: str | DeviceId, gpu0_arena: Path) -> Path:
    """The arena of `device` when gpu0's arena is `gpu0_arena` (`[daemon] arena`, `--arena`,
    `$ARBITERD_ARENA` or the default): gpu0's own, or the sibling folder named by the device
    (DeviceId.folder_name). Refused (BadValueError) when the sibling is gpu0's arena itself, as
    it would be for gpu1 beside an arena configured as `.../gpu1`: two devices in one arena
    would let a model take one token twice and wait for itself."""
    device = parse_device_id(device) if isinstance(device, str) else device
    if str(device) == DEFAULT_DEVICE:
        return gpu0_arena
    arena = gpu0_arena.parent / device.folder_name
    if arena == gpu0_arena:
        raise BadValueError(
            f"the arena of {device} would be {arena}, which is {DEFAULT_DEVICE}'s arena: "
            f"give {DEFAULT_DEVICE}'s arena a folder name that is no device's"
        )
    return arena


def device_arena(device: str | DeviceId, env: Mapping[str, str] | None = None) -> Path:
    """The arena of `device` by default: gpu0's is default_arena(env), every other device's its
    sibling folder, `$XDG_RUNTIME_DIR/arbiterd/arena/FOLDER_NAME` unless $ARBITERD_ARENA moves
    gpu0's."""
    return device_arena_of(device, default_arena(env))


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
