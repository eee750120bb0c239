"""Looking for programs that start using the GPU, without polling for them: an inotify watch on
the GPU's device nodes rings when any process opens or closes one (IN_OPEN, IN_CLOSE_*), and
each ring is followed by a whole look, on a thread of the lookout's own: which processes hold a
node (programs.scan) and what each holds on the device (the telemetry readers), handed to
`on_look` on the daemon's loop.

Owns one inotify instance read through the loop's `add_reader`, as configwatch.py does, and the
timers of the looks:
- after a ring, a look once the burst of opens has settled (SETTLE_S), then again at
  FOLLOW_UPS_S: a program allocates its memory after it opens the node;
- by name every `scan_s` while `[yield] programs` names any and no node is there to ring (a
  machine whose GPU, as llvmpipe, opens no node), reading the names of the processes new
  since the last look, not their fds;
- a whole look every SAFETY_SCAN_S, for programs that opened a node before the daemon started
  or whose opens the watch missed.
A node that goes (a driver reloaded, a GPU unplugged) or appears is seen through watches on
/dev and /dev/dri, and the watches are set again. Without inotify, the safety look at the
`scan_s` rate stands in for the rings, after one warning.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from inotify_simple import INotify, flags

from arbiterd.daemon.configwatch import why_not
from arbiterd.daemon.stepaside.policy import Sighting
from arbiterd.daemon.stepaside.programs import (
    DEV,
    NODE_PATTERNS,
    PROCFS,
    Scan,
    device_nodes,
    node_dirs,
    scan,
)
from arbiterd.errors import ArbiterError

log = logging.getLogger(__name__)

SETTLE_S = 0.02  # a program opens several nodes in a burst (card and render node, each GPU)
FOLLOW_UPS_S = (0.25, 1.0, 3.0)  # after a ring: what the program allocated since it opened
SAFETY_SCAN_S = 30.0
NODE_EVENTS = flags.OPEN | flags.CLOSE_WRITE | flags.CLOSE_NOWRITE
NODE_GONE = flags.DELETE_SELF | flags.IGNORED
DIR_EVENTS = flags.CREATE | flags.DELETE | flags.ONLYDIR

# What a whole look measures: pid -> device bytes, from the telemetry readers (vramwatch.py),
# for every process they see; empty where no reader sees other programs.
Measure = Callable[[], dict[int, int]]


class Lookout:
    """From `start` until `close`, hands each look's sightings to `on_look`."""

    def __init__(
        self,
        on_look: Callable[[tuple[Sighting, ...], bool, float], None],
        *,
        measure: Measure,
        scan_s: float,
        by_name: bool,
        dev: Path = DEV,
        procfs: Path = PROCFS,
        nodes: Iterable[Path] | None = None,
    ) -> None:
        # (sightings, whole, when the look began, time.time()): whole looks read fds and memory
        self._on_look = on_look
        self._measure = measure
        self._scan_s = scan_s
        self._by_name = by_name
        self._dev = dev
        self._procfs = procfs
        # [yield] nodes, the ones the config names (or a test's stand-in files); None: /dev's.
        self._fixed_nodes = None if nodes is None else tuple(nodes)
        self.nodes: tuple[Path, ...] = ()
        self._inotify: INotify | None = None
        self._watches: dict[int, Path] = {}
        self._inodes: dict[Path, int] = {}  # each watched node's inode when its watch was set
        self._timers: list[asyncio.TimerHandle] = []
        self._periodic: asyncio.TimerHandle | None = None
        self._looking: asyncio.Task[None] | None = None
        self._again: bool | None = None  # a look asked for while one runs (True: whole)
        self._since_whole = 0.0  # seconds of timed looks since the last whole one
        self._last: Scan | None = None  # the latest scan: a look by name reads only what is new
        # Whole looks run here, one thread of its own: the loop's default pool would wake a
        # thread or two more for each.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lookout")
        self.rings = 0

    @property
    def watching(self) -> bool:
        return self._inotify is not None

    def start(self) -> None:
        try:
            self._inotify = INotify()
        except OSError as exc:
            log.warning(
                "not watching the GPU's device nodes: %s; looking every %s s",
                why_not(exc),
                self._scan_s,
            )
        else:
            asyncio.get_running_loop().add_reader(self._inotify.fileno(), self._readable)
        self._arm_nodes()
        self.look(whole=True)
        self._schedule_periodic()

    async def close(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        if self._periodic is not None:
            self._periodic.cancel()
        inotify, self._inotify = self._inotify, None
        if inotify is not None:
            asyncio.get_running_loop().remove_reader(inotify.fileno())
            inotify.close()
        looking, self._looking = self._looking, None
        if looking is not None:
            looking.cancel()
            await asyncio.gather(looking, return_exceptions=True)
        self._thread.shutdown(wait=False)

    def look(self, *, whole: bool) -> None:
        """A look now (or once the one running ends); a whole one reads fds and memory."""
        if self._looking is not None and not self._looking.done():
            self._again = whole or bool(self._again)
            return
        self._looking = asyncio.get_running_loop().create_task(self._looks(whole), name="lookout")

    def _look_whole(self) -> None:
        self.look(whole=True)

    def _arm_nodes(self) -> None:
        """Watch every node there is now (again, after one came or went)."""
        fixed = self._fixed_nodes
        self.nodes = fixed if fixed else device_nodes(self._dev)
        if self._inotify is None:
            return
        watched = set(self._watches.values())
        # The folders nodes appear in: a node created there (a driver loaded) is watched then.
        folders = {p.parent for p in fixed} if fixed else set(node_dirs(self._dev))
        for folder in sorted(folders - watched):
            if folder.is_dir():
                self._add_watch(folder, DIR_EVENTS)
        for node in self.nodes:
            try:
                inode = os.stat(node).st_ino
            except OSError:
                continue  # gone again
            # A node made again under its name is another inode: the old watch sees nothing.
            if self._inodes.get(node) != inode and self._add_watch(node, NODE_EVENTS):
                self._inodes[node] = inode

    def _add_watch(self, path: Path, mask: int) -> bool:
        assert self._inotify is not None
        try:
            wd = self._inotify.add_watch(path, mask)
        except OSError as exc:
            if path.exists():
                log.warning("cannot watch %s: %s", path, why_not(exc))
            return False
        self._watches[wd] = path
        return True

    def _readable(self) -> None:
        assert self._inotify is not None  # the reader goes with it
        ring = rearm = False
        for event in self._inotify.read(timeout=0):
            path = self._watches.get(event.wd)
            if event.mask & flags.Q_OVERFLOW:
                ring = rearm = True
            elif event.mask & NODE_GONE:
                gone = self._watches.pop(event.wd, None)
                if gone is not None:
                    self._inodes.pop(gone, None)
                rearm = True
            elif event.mask & (flags.CREATE | flags.DELETE):
                if path is not None and self._may_be_node(path, event.name):
                    # Deleted: a node made again may get the inode's number back.
                    self._inodes.pop(path / event.name, None)
                    rearm = True
            elif path is not None:
                ring = True
        if rearm:
            self._arm_nodes()
            ring = True
        if ring:
            self.rings += 1
            self._rang()

    def _may_be_node(self, folder: Path, name: str) -> bool:
        """Whether `name`, created in or deleted from `folder`, may be a node to watch."""
        if self._fixed_nodes:
            return folder / name in self._fixed_nodes
        return name == "dri" or any(
            fnmatch.fnmatchcase(str((folder / name).relative_to(self._dev)), pattern)
            for pattern in NODE_PATTERNS
        )

    def _rang(self) -> None:
        """Someone opened or closed a node: a look once the burst settles, then follow-ups."""
        loop = asyncio.get_running_loop()
        for timer in self._timers:
            timer.cancel()
        self._timers = [
            loop.call_later(delay, self._look_whole) for delay in (SETTLE_S, *FOLLOW_UPS_S)
        ]

    def _schedule_periodic(self) -> None:
        """The next timed look: every scan_s when names are looked for and no node would ring
        for the program (none here to watch: a machine whose GPU opens no node, as llvmpipe),
        or without inotify; else a whole one every SAFETY_SCAN_S."""
        rings = any(node.exists() for node in self.nodes)
        frequent = self._inotify is None or (self._by_name and not rings)
        delay = self._scan_s if frequent else SAFETY_SCAN_S
        self._periodic = asyncio.get_running_loop().call_later(delay, self._timed, delay)

    def _timed(self, waited_s: float) -> None:
        self._since_whole += waited_s
        whole = self._inotify is None or self._since_whole >= SAFETY_SCAN_S
        if whole:
            self._since_whole = 0.0
        self.look(whole=whole)
        self._schedule_periodic()

    async def _looks(self, whole: bool) -> None:
        while True:
            began = time.time()
            try:
                # A look by name reads only the processes new since the last look (programs.py):
                # less than a millisecond, on the loop; a thread's hand-offs would cost more
                # wake-ups than the look itself.
                if whole:
                    loop = asyncio.get_running_loop()
                    sightings = await loop.run_in_executor(self._thread, self._look, whole)
                else:
                    sightings = self._look(whole)
            except (ArbiterError, OSError) as exc:
                log.warning("looking for GPU programs failed: %s", exc)
            else:
                self._on_look(sightings, whole, began)
            again, self._again = self._again, None
            if again is None:
                return
            whole = again

    def _look(self, whole: bool) -> tuple[Sighting, ...]:
        found = scan(self.nodes, procfs=self._procfs, with_fds=whole, known=self._last)
        self._last = found
        used = self._measure() if whole else {}
        return tuple(Sighting(p, used.get(p.pid)) for p in found.programs)
