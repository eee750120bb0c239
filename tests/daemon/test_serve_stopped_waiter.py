"""A stopped waiter at the head of the queue on a real daemon (issue 40 item 1): a program
first in line for the GPU is stopped while the GPU is free; a model's request behind it is
served within the bound, the daemon publishes and journals a `passed_over` event naming it, and
the stopped program keeps its place."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from arbiterd.arena import Arena
from arbiterd.arena.token import PASS_OVER_S, STALL_CHECK_S
from tests.conftest import Processes
from tests.daemon.test_serve_frozen import complete, next_event
from tests.support.daemon import arbiterd_cli, openai_client, serving, tiny
from tests.support.signals import stop
from tests.support.waiting import wait_until

# Generous: a tiny model's warm-up and answer on a busy machine, on top of the bound. Before
# issue 40 the request waited until the program ran again (the audit's clients timed out).
ANSWER_WITHIN_S = PASS_OVER_S + STALL_CHECK_S + 20.0


def test_a_request_behind_a_stopped_first_waiter_is_served_and_said(
    tiny_model: Path, procs: Processes
) -> None:
    with (
        serving({"alpha": tiny(tiny_model)}) as daemon,
        openai_client(daemon, timeout_s=ANSWER_WITHIN_S) as api,
        daemon.client() as watcher,
        ThreadPoolExecutor(1) as pool,
    ):
        watcher.call("subscribe")
        arena = Arena(daemon.arena)
        holder = arena.acquire("test", timeout_s=30)  # alpha lets go for us: it is cold now
        program = procs.actor(arena, "hold", "program")  # a program first in line
        wait_until(lambda: [w.pid for w in arena.observe().queue] == [program.pid], 10, "queue")
        stop(program.pid)  # as Ctrl-Z would
        answer = pool.submit(complete, api, "alpha")  # alpha queues behind the program
        wait_until(lambda: len(arena.observe().queue) == 2, 30, "alpha to queue behind it")
        holder.release()  # the GPU is free, and its first waiter cannot take it
        assert answer.result(timeout=ANSWER_WITHIN_S)
        passed = next_event(watcher, lambda e: e["event"] == "passed_over")
        assert (passed["model"], passed["pid"], passed["reason"]) == (
            "alpha",
            program.pid,
            "stopped",
        )
        assert passed["arena"] == str(daemon.arena)
        assert [w.pid for w in arena.observe().queue] == [program.pid]  # it keeps its place
        program.send_signal(signal.SIGCONT)
        wait_until(lambda: arena.observe().holder_pid == program.pid, 30, "the program's turn")
        assert program.stdin is not None
        program.stdin.close()
        assert program.wait(timeout=10) == 0
        shown = arbiterd_cli("events", "--journal", str(daemon.journal))
        assert f"alpha went before pid {program.pid}, ahead of it in the queue: stopped" in shown
