"""Which of this user's programs run on the GPU: the device nodes to watch, and a scan of /proc
that names each process and says which of those nodes it holds open.

Reads only, from roots that tests point elsewhere: `dev` (the nodes) and `procfs`. A process
of another user is not ours to read (its fd links are refused) and is skipped; one that exits
while it is read is simply not in the scan. Blocking file I/O: the lookout runs a scan with fds
in a thread of its own, and a names-only scan that reads only what is new on its loop.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

DEV = Path("/dev")
PROCFS = Path("/proc")
# The nodes a GPU program opens: DRM render and primary nodes (every Mesa and AMD/Intel
# driver, Vulkan and OpenGL alike), NVIDIA's per-GPU nodes (not nvidiactl nor nvidia-uvm, which
# every CUDA program opens beside them), and AMD's compute node (ROCm).
NODE_PATTERNS = ("dri/renderD*", "dri/card*", "nvidia[0-9]*", "kfd")


def device_nodes(dev: Path = DEV) -> tuple[Path, ...]:
    """The GPU device nodes present under `dev`, sorted; none on a machine without a GPU."""
    found: set[Path] = set()
    for pattern in NODE_PATTERNS:
        found.update(p for p in dev.glob(pattern) if not p.is_dir())
    return tuple(sorted(found))


def node_dirs(dev: Path = DEV) -> tuple[Path, ...]:
    """Where nodes appear and disappear (a driver loaded, a GPU plugged in)."""
    return (dev, dev / "dri")


@dataclass(frozen=True)
class Program:
    """One process of this user, as the scan saw it."""

    pid: int
    start: int  # clock ticks after boot (/proc/PID/stat field 22): with `pid`, one process
    name: str  # the kernel's comm (15 characters at most), or argv[0]'s base name when longer
    cmdline: tuple[str, ...]
    parent: int
    nodes: frozenset[str] = field(default_factory=frozenset)  # device nodes it holds open

    @property
    def key(self) -> tuple[int, int]:
        """What stays one process when a pid is reused."""
        return (self.pid, self.start)

    @property
    def on_gpu(self) -> bool:
        return bool(self.nodes)


@dataclass(frozen=True)
class Scan:
    programs: tuple[Program, ...]
    with_fds: bool  # False: names only, `nodes` not read
    others: frozenset[int] = frozenset()  # pids seen that are not ours (or were gone at once)


def scan(
    nodes: Iterable[Path],
    *,
    procfs: Path = PROCFS,
    uid: int | None = None,
    with_fds: bool = True,
    known: Scan | None = None,
) -> Scan:
    """Every process of `uid` (default: ours) and, `with_fds`, the `nodes` each holds open.

    A names-only scan given the `known` scan before it reads only the processes that are new
    since: the others keep the name and command line it read (a pid reused between the two is
    taken for the process before it until a scan with fds reads everything again)."""
    uid = os.getuid() if uid is None else uid
    wanted = {os.path.realpath(node) for node in nodes}
    before = {} if known is None or with_fds else {p.pid: p for p in known.programs}
    not_ours = frozenset() if known is None or with_fds else known.others
    programs: list[Program] = []
    others: set[int] = set()
    try:
        entries = os.listdir(procfs)
    except OSError:
        return Scan((), with_fds)
    for entry in entries:
        if not entry.isdigit():
            continue
        pid = int(entry)
        if pid in not_ours:
            others.add(pid)
            continue
        program = before.get(pid)
        if program is not None:
            programs.append(dataclasses.replace(program, nodes=frozenset()))
            continue
        program = _read(procfs / entry, pid, uid, wanted if with_fds else None)
        if program is None:
            others.add(pid)
        else:
            programs.append(program)
    return Scan(tuple(programs), with_fds, frozenset(others))


def read_program(pid: int, *, procfs: Path = PROCFS, uid: int | None = None) -> Program | None:
    """Process `pid` if it runs as `uid` (default: ours), its nodes not read; None if not."""
    return _read(procfs / str(pid), pid, os.getuid() if uid is None else uid, None)


def _read(root: Path, pid: int, uid: int, wanted: set[str] | None) -> Program | None:
    try:
        if os.stat(root).st_uid != uid:
            return None
        stat = (root / "stat").read_text(errors="replace")
        cmdline = (root / "cmdline").read_bytes()
    except OSError:
        return None  # gone meanwhile
    # comm is in parentheses and may itself hold spaces and parentheses: the last ")" ends it.
    open_paren, close_paren = stat.find("("), stat.rfind(")")
    fields = stat[close_paren + 2 :].split()
    if open_paren < 0 or close_paren < 0 or len(fields) < 20:
        return None
    if fields[0] in ("Z", "X"):
        return None  # exited: a zombie its parent has not reaped holds nothing
    comm = stat[open_paren + 1 : close_paren]
    args = tuple(a.decode(errors="replace") for a in cmdline.split(b"\0")[:-1])
    nodes = frozenset() if wanted is None else _open_nodes(root / "fd", wanted)
    try:
        parent, start = int(fields[1]), int(fields[19])
    except ValueError:
        return None
    return Program(pid, start, _name(comm, args), args, parent, nodes)


def _name(comm: str, args: tuple[str, ...]) -> str:
    """comm, unless the kernel cut it at 15 characters and argv[0] says the rest."""
    if len(comm) == 15 and args:
        base = os.path.basename(args[0])
        if base.startswith(comm):
            return base
    return comm


def _open_nodes(fd_dir: Path, wanted: set[str]) -> frozenset[str]:
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return frozenset()  # gone, or a kernel thread
    held = set()
    for fd in fds:
        try:
            target = os.readlink(fd_dir / fd)
        except OSError:
            continue
        if target in wanted:
            held.add(target)
    return frozenset(held)


def descendants(programs: Iterable[Program], root: int) -> set[int]:
    """`root` and every process below it in the scan (the daemon's workers, their servers)."""
    children: dict[int, list[int]] = {}
    for program in programs:
        children.setdefault(program.parent, []).append(program.pid)
    found, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found
