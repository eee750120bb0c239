"""The doorbell (arbiterd/arena/doorbell.py): a holder asleep on its token's bells is woken by
every kind of waiter, and by nothing it does itself; and it never stops seeing waiters when
inotify cannot be had.

Whether a wait ended by a ring or by its timeout is what `wait` returns, so these tests use long
timeouts and assert the return value: no clock decides them."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import pytest

from arbiterd.arena import Arena
from arbiterd.arena import doorbell as doorbell_module
from arbiterd.arena.doorbell import FOLLOW_UPS_S, Bell, Change, Doorbell, ring
from tests.conftest import Processes

GPU_JOB = Path(__file__).parents[2] / "docs" / "examples" / "gpu-job.sh"
LONG_S = 60.0  # a wait that ends by its timeout failed the test long before


def asleep_until_wanted(doorbell: Doorbell, wanted: object) -> int:
    """Sleep on `doorbell` and probe after each ring until `wanted()` is true; how many rings
    it took. Fails if a sleep ends by its timeout."""
    assert callable(wanted)
    rings = 0
    while not wanted():
        assert doorbell.wait(LONG_S), "the sleep ended by its timeout: no bell rang"
        rings += 1
    return rings


def test_a_waiter_of_the_queue_rings_the_holder(arena: Arena, procs: Processes) -> None:
    with arena.acquire("model") as token, Doorbell() as doorbell:
        doorbell.arm(token.bells())
        assert not token.wanted()  # the probe right after arming: nobody yet
        waiter = procs.actor(arena, "hold", "waiter")
        assert asleep_until_wanted(doorbell, token.wanted) >= 1
        token.hand_over()
    assert waiter.stdout is not None
    assert waiter.stdout.readline().strip() == "acquired"


def test_the_documents_shell_example_rings_the_holder(arena: Arena, procs: Processes) -> None:
    env = dict(os.environ, ARBITERD_ARENA=str(arena.path))
    with arena.acquire("model") as token, Doorbell() as doorbell:
        doorbell.arm(token.bells())
        # It opens want.lock, then flock(1) locks it: the follow-up rings see the lock.
        job = procs.start(["sh", str(GPU_JOB), "true"], env=env)
        asleep_until_wanted(doorbell, token.wanted)
        handed = threading.Thread(target=token.hand_over)
        handed.start()
        assert job.wait(timeout=30) == 0
        handed.join(timeout=10)


def test_a_bare_waiter_of_the_protocols_steps_rings_the_holder(arena: Arena) -> None:
    with arena.acquire("model") as token, Doorbell() as doorbell:
        doorbell.arm(token.bells())
        want = os.open(arena.want_path, os.O_RDWR | os.O_CLOEXEC)  # step 1: open, then lock
        try:
            fcntl.flock(want, fcntl.LOCK_SH)
            asleep_until_wanted(doorbell, token.wanted)
        finally:
            os.close(want)


def test_a_waiter_that_kept_want_lock_open_rings_nothing(arena: Arena) -> None:
    """What the safety probe is for (docs/arena-protocol.md): a program that locks a want.lock
    it opened long before makes no event."""
    with arena.acquire("model") as token, Doorbell() as doorbell:
        want = os.open(arena.want_path, os.O_RDWR | os.O_CLOEXEC)
        try:
            doorbell.arm(token.bells())
            fcntl.flock(want, fcntl.LOCK_SH)
            assert not doorbell.wait(0.2)
            assert token.wanted()  # the probe still sees it
        finally:
            os.close(want)


def test_the_follow_up_rings_stop(arena: Arena) -> None:
    with arena.acquire("model") as token, Doorbell() as doorbell:
        doorbell.arm(token.bells())
        os.close(os.open(arena.want_path, os.O_RDONLY | os.O_CLOEXEC))  # opened, never locked
        rings = 0
        while doorbell.wait(2 * FOLLOW_UPS_S[-1]):
            rings += 1
        assert 1 <= rings <= 1 + len(FOLLOW_UPS_S)
        assert not token.wanted()


def test_the_holders_own_probe_and_observers_ring_nothing(arena: Arena) -> None:
    with arena.acquire("model") as token, Doorbell() as doorbell:
        doorbell.arm(token.bells())
        for _ in range(100):
            assert not token.wanted()
        arena.observe()
        arena.read_holder_file()
        assert not doorbell.wait(0.2)


def test_ring_wakes_a_bell_on_that_file(tmp_path: Path) -> None:
    path = tmp_path / "leave.lock"
    path.touch()
    with Doorbell() as doorbell:
        doorbell.arm((Bell(path, Change.OPENED),))
        ring(path)
        assert doorbell.wait(LONG_S)


def test_a_disarmed_doorbell_hears_no_bell(arena: Arena) -> None:
    with arena.acquire("model") as token, Doorbell() as doorbell:
        doorbell.arm(token.bells())
        doorbell.disarm()
        ring(arena.want_path)
        assert not doorbell.wait(0.2)


def test_wake_from_another_thread_ends_a_sleep_and_is_harmless_once_closed() -> None:
    doorbell = Doorbell()
    threading.Timer(0.05, doorbell.wake).start()
    assert doorbell.wait(LONG_S)
    doorbell.close()
    doorbell.wake()  # a late io thread: nothing is written anywhere
    doorbell.close()


def test_an_arena_removed_under_its_holder_is_said(
    arena: Arena, caplog: pytest.LogCaptureFixture
) -> None:
    with arena.acquire("model") as token, Doorbell() as doorbell:
        doorbell.arm(token.bells())
        with caplog.at_level(logging.WARNING, logger=doorbell_module.__name__):
            shutil.rmtree(arena.path)
            assert doorbell.wait(LONG_S)
        assert f"{arena.queue_path} was removed under us" in caplog.text
        token.release()  # and it still lets go, though it cannot clear holder.json
    assert not token.held


@pytest.mark.parametrize(
    ("code", "limit"),
    [
        (errno.EMFILE, "fs.inotify.max_user_instances"),
        (errno.ENOSPC, "fs.inotify.max_user_watches"),
        (errno.ENOSYS, "inotify cannot watch it"),
    ],
)
def test_without_inotify_an_armed_doorbell_probes_as_before_and_says_why_once(
    arena: Arena,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    code: int,
    limit: str,
) -> None:
    def unavailable() -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(doorbell_module, "INotify", unavailable)
    monkeypatch.setattr(doorbell_module, "_warned", set())
    with caplog.at_level(logging.WARNING, logger=doorbell_module.__name__):
        first, second = Doorbell(), Doorbell()
    assert limit in first.fallback
    assert caplog.text.count(limit) == 1  # said once, however many holders
    with arena.acquire("model") as token:
        first.arm(token.bells())
        # Armed, it rings every FALLBACK_PROBE_S whatever the timeout: the holder probes.
        assert first.wait(LONG_S)
        second.disarm()
        assert not second.wait(0.05)  # disarmed, nothing to probe for
    first.close()
    second.close()


def test_a_watch_that_cannot_be_added_falls_back_to_probing(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(doorbell_module, "_warned", set())
    with arena.acquire("model") as token, Doorbell() as doorbell:

        def full(path: object, mask: int) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        assert doorbell._inotify is not None
        monkeypatch.setattr(doorbell._inotify, "add_watch", full)
        doorbell.arm(token.bells())
        assert "fs.inotify.max_user_watches" in doorbell.fallback
        assert doorbell.wait(LONG_S)


def test_an_arbiterd_run_waiter_rings_the_holder(arena: Arena, procs: Processes) -> None:
    with arena.acquire("model") as token, Doorbell() as doorbell:
        doorbell.arm(token.bells())
        argv = [sys.executable, "-m", "arbiterd", "run", "--arena", str(arena.path), "--", "true"]
        run = procs.start(argv)
        asleep_until_wanted(doorbell, token.wanted)
        token.hand_over()
    assert run.wait(timeout=30) == 0, run.stderr.read() if run.stderr else ""
