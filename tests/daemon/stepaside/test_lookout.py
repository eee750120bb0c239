"""The lookout on a real inotify, watching files that stand in for the GPU's device nodes, with
real processes opening them and the /proc scan real: a ring brings a whole look at once, a node
made again is watched again, looks by name come every scan_s only where no node rings."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from arbiterd.daemon.stepaside.lookout import Lookout
from arbiterd.daemon.stepaside.policy import Sighting
from tests.support import waiting

DEADLINE_S = 10.0


class Looks:
    """What the lookout handed over, look by look."""

    def __init__(self) -> None:
        self.seen: list[tuple[tuple[Sighting, ...], bool]] = []

    def __call__(self, sightings: tuple[Sighting, ...], whole: bool, began: float) -> None:
        self.seen.append((sightings, whole))

    def holding(self, pid: int) -> Sighting | None:
        """`pid`'s sighting in the latest whole look, if it held a node then."""
        for sightings, whole in reversed(self.seen):
            if whole:
                held = (s for s in sightings if s.program.pid == pid and s.program.on_gpu)
                return next(held, None)
        return None


@contextlib.asynccontextmanager
async def looking(lookout: Lookout) -> AsyncIterator[Lookout]:
    lookout.start()
    try:
        yield lookout
    finally:
        await lookout.close()


@contextlib.contextmanager
def holding_open(node: Path) -> Iterator[subprocess.Popen[bytes]]:
    program = subprocess.Popen(["bash", "-c", f'exec 3<"{node}"; exec sleep 30'])
    try:
        yield program
    finally:
        program.kill()
        program.wait()


def test_a_process_opening_a_watched_node_rings_and_the_look_names_it_with_its_memory(
    tmp_path: Path,
) -> None:
    node = tmp_path / "renderD128"
    node.write_bytes(b"")
    looks = Looks()
    measured: dict[int, int] = {}

    async def scenario() -> None:
        lookout = Lookout(looks, measure=lambda: measured, scan_s=60, by_name=False, nodes=[node])
        async with looking(lookout):
            await waiting.until(lambda: looks.seen, DEADLINE_S, "the first look")
            assert lookout.watching
            loop = asyncio.get_running_loop()
            with holding_open(node) as program:
                opened = loop.time()
                measured[program.pid] = 3 << 30
                await waiting.until(
                    lambda: looks.holding(program.pid), DEADLINE_S, "a look that sees it"
                )
                # The bash start, the ring, the settle and one scan of /proc: well under a
                # second, where the next timed look would come in a minute.
                assert loop.time() - opened < 2.0
                sighting = looks.holding(program.pid)
                assert sighting is not None
                assert sighting.program.nodes == {str(node)}
                assert sighting.used_bytes == 3 << 30
                assert lookout.rings >= 1

    asyncio.run(scenario())


def test_a_node_made_again_is_watched_again(tmp_path: Path) -> None:
    node = tmp_path / "renderD128"
    node.write_bytes(b"")
    looks = Looks()

    async def scenario() -> None:
        lookout = Lookout(looks, measure=dict, scan_s=60, by_name=False, nodes=[node])
        async with looking(lookout):
            await waiting.until(lambda: looks.seen, DEADLINE_S, "the first look")
            rings = lookout.rings
            node.unlink()  # a driver unloaded
            await waiting.until(lambda: lookout.rings > rings, DEADLINE_S, "the node gone")
            node.write_bytes(b"")  # and loaded again: a new inode under the name
            await waiting.until(lambda: lookout.rings > rings + 1, DEADLINE_S, "the node back")
            rings = lookout.rings
            with holding_open(node):
                await waiting.until(lambda: lookout.rings > rings, DEADLINE_S, "the open to ring")

    asyncio.run(scenario())


def test_looks_by_name_come_every_scan_s_only_where_names_matter_and_no_node_rings(
    tmp_path: Path,
) -> None:
    node = tmp_path / "renderD128"
    node.write_bytes(b"")
    absent = tmp_path / "renderD129"  # a node the config names that is not there

    async def count(by_name: bool, nodes: list[Path]) -> list[bool]:
        looks = Looks()
        lookout = Lookout(looks, measure=dict, scan_s=0.1, by_name=by_name, nodes=nodes)
        async with looking(lookout):
            await asyncio.sleep(0.75)
        return [whole for _, whole in looks.seen]

    by_name = asyncio.run(count(True, [absent]))
    assert by_name[0] is True  # the first look is whole
    assert by_name[1:].count(False) >= 4
    # A node that rings for every program opening it: nothing but the first look meanwhile.
    assert asyncio.run(count(True, [node])) == [True]
    assert asyncio.run(count(False, [absent])) == [True]  # no names to look for


def test_a_look_lists_this_users_processes_by_name_without_reading_their_fds(
    tmp_path: Path,
) -> None:
    looks = Looks()

    async def scenario() -> None:
        lookout = Lookout(looks, measure=dict, scan_s=0.1, by_name=True, nodes=[])
        async with looking(lookout):
            await waiting.until(
                lambda: any(not whole for _, whole in looks.seen), DEADLINE_S, "a look by name"
            )

    asyncio.run(scenario())
    sightings = next(s for s, whole in looks.seen if not whole)
    mine = next(s for s in sightings if s.program.pid == os.getpid())
    assert mine.program.name.startswith("python")
    assert mine.program.nodes == frozenset()
    assert mine.used_bytes is None
