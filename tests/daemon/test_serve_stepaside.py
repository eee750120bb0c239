"""Stepping aside end to end (issue 45): a real daemon whose [yield] watches a file standing in
for a GPU's device node (its open events are real inotify; the /proc scan is real), and real
programs: one that opens the node under a name the rules know, one that never opens it (as a
Vulkan program on llvmpipe, which opens no node), one nobody named, and one the user names with
`arbiterd yield`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.daemon import Daemon, arbiterd_cli, serving, tiny
from tests.support.waiting import wait_until

# The stand-in programs' names, this run's own: a rule of another run's daemon on this machine
# (the same user's processes) does not name them. 15 characters at most, as the kernel keeps.
GAME = f"game{os.getpid()}"
RENDER = f"render{os.getpid()}"
QUIET = f"quiet{os.getpid()}"


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the stand-in node and the stand-in programs: copies of sleep(1) under
    the names the rules look for (a process's name is its executable's)."""
    folder = tmp_path_factory.mktemp("stepaside")
    (folder / "renderD128").write_bytes(b"")
    sleep = shutil.which("sleep")
    assert sleep is not None
    for name in (GAME, RENDER, QUIET):
        shutil.copy(sleep, folder / name)
    return folder


@pytest.fixture(scope="module")
def daemon(tiny_model: Path, stand_ins: Path) -> Iterator[Daemon]:
    rules = {
        "programs": [GAME, f"*{RENDER}*"],
        "nodes": [stand_ins / "renderD128"],
        "scan_s": 0.3,
    }
    models = {"m": tiny(tiny_model, n_ctx=512), "patient": tiny(tiny_model, max_queue_s=0.5)}
    with serving(models, yield_keys=rules) as running:
        yield running


def start(stand_ins: Path, name: str, *, opens_node: bool) -> subprocess.Popen[bytes]:
    """`name` running for a minute, holding the stand-in node open or not."""
    program = stand_ins / name
    if opens_node:
        # The shell opens the node on fd 3 and becomes the program, which inherits it.
        script = f'exec 3<"{stand_ins / "renderD128"}"; exec "{program}" 60'
        return subprocess.Popen(["bash", "-c", script])
    return subprocess.Popen([str(program), "60"])


def status(daemon: Daemon) -> dict[str, Any]:
    with daemon.client() as client:
        found: dict[str, Any] = client.call("status")
    return found


def aside_for(daemon: Daemon) -> dict[str, Any] | None:
    found: dict[str, Any] | None = status(daemon)["stepped_aside"]
    return found


def ask(daemon: Daemon) -> None:
    body = {"model": "m", "prompt": "the fox", "max_tokens": 2, "temperature": 0}
    response = httpx.post(f"{daemon.url}/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text


def step_events(daemon: Daemon) -> list[dict[str, Any]]:
    with daemon.client() as client:
        found = client.call("events", limit=500)["events"]
    return [e for e in found if e["event"] == "step_aside"]


def stop(program: subprocess.Popen[bytes]) -> None:
    program.kill()
    program.wait()


def test_a_named_program_opening_the_node_makes_the_model_step_aside_until_it_exits(
    daemon: Daemon, stand_ins: Path
) -> None:
    ask(daemon)
    assert status(daemon)["models"][0]["state"] == "warm"
    game = start(stand_ins, GAME, opens_node=True)
    try:
        wait_until(lambda: aside_for(daemon) is not None, 10, "the step aside")
        aside = aside_for(daemon)
        assert aside is not None
        assert (aside["program"], aside["pid"]) == (GAME, game.pid)
        assert f"named in [yield] programs ('{GAME}')" in aside["reason"]
        wait_until(lambda: status(daemon)["models"][0]["state"] == "cold", 10, "the release")
        holder = status(daemon)["holder"]
        assert holder["pid"] == daemon.process.pid
        assert holder["name"] == f"{GAME} (pid {game.pid}; arbiterd stepped aside)"
        # A request meanwhile waits for the program, and is served once it is gone.
        served = threading.Event()

        def ask_and_say() -> None:
            ask(daemon)
            served.set()

        asker = threading.Thread(target=ask_and_say)
        asker.start()
        time.sleep(1.0)  # a window in which a request not made to wait would be served
        assert not served.is_set()
        assert status(daemon)["models"][0]["state"] == "cold"
    finally:
        stop(game)
    asker.join(timeout=60)
    assert served.is_set()
    assert aside_for(daemon) is None
    aside_event, back_event = step_events(daemon)[-2:]
    assert (aside_event["aside"], aside_event["program"], aside_event["pid"]) == (
        True,
        GAME,
        game.pid,
    )
    assert (back_event["aside"], back_event["why"]) == (False, "it exited")


@pytest.fixture
def nodeless(tiny_model: Path, stand_ins: Path) -> Iterator[Daemon]:
    """A daemon on a machine without a node to watch (the one [yield] names is not there), as
    one whose only Vulkan device is llvmpipe: it looks for named programs every scan_s."""
    rules = {"programs": [f"*{RENDER}*"], "nodes": [stand_ins / "absent"], "scan_s": 0.3}
    with serving({"m": tiny(tiny_model, n_ctx=512)}, yield_keys=rules) as running:
        yield running


def test_a_named_program_is_caught_by_the_look_by_name_where_no_node_rings(
    nodeless: Daemon, stand_ins: Path
) -> None:
    """As a Vulkan program on llvmpipe: it opens no device node, and `programs` names it."""
    daemon = nodeless
    ask(daemon)
    program = start(stand_ins, RENDER, opens_node=False)
    try:
        wait_until(lambda: aside_for(daemon) is not None, 10, "the step aside")
        aside = aside_for(daemon)
        assert aside is not None
        assert aside["pid"] == program.pid
        wait_until(lambda: status(daemon)["models"][0]["state"] == "cold", 10, "the release")
    finally:
        stop(program)
    wait_until(lambda: aside_for(daemon) is None, 10, "the return")
    ask(daemon)
    assert status(daemon)["models"][0]["state"] == "warm"


def test_a_program_nobody_named_opening_the_node_changes_nothing(
    daemon: Daemon, stand_ins: Path
) -> None:
    """No reader measures its memory on this machine, and its name is in no rule."""
    ask(daemon)
    program = start(stand_ins, QUIET, opens_node=True)
    try:
        time.sleep(1.5)  # the ring's look and its follow-ups up to 1 s
        assert aside_for(daemon) is None
        assert status(daemon)["models"][0]["state"] == "warm"
    finally:
        stop(program)


def test_a_named_program_that_takes_part_through_arbiterd_run_is_not_stepped_aside_for(
    daemon: Daemon, stand_ins: Path
) -> None:
    """It waited for the GPU and holds the token: the models already gave it up."""
    ask(daemon)
    script = f'exec 3<"{stand_ins / "renderD128"}"; exec "{stand_ins / GAME}" 60'
    command = ["bash", "-c", script]
    run = subprocess.Popen(
        [sys.executable, "-m", "arbiterd", "run", "--arena", str(daemon.arena), "--", *command],
        start_new_session=True,  # its command shares the token: both go, by their group
    )
    try:
        wait_until(lambda: status(daemon)["holder"]["pid"] == run.pid, 10, "the run's hold")
        time.sleep(1.5)  # the ring's look and its follow-ups up to 1 s
        assert aside_for(daemon) is None
        assert status(daemon)["waiters"] == []
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    ask(daemon)


def test_yield_until_exit_and_resume_from_the_cli(daemon: Daemon, stand_ins: Path) -> None:
    ask(daemon)
    program = start(stand_ins, QUIET, opens_node=False)
    try:
        said = arbiterd_cli(
            "yield", "--until-exit", str(program.pid), "--socket", str(daemon.socket)
        )
        assert said.startswith(f"stepped aside for {QUIET} (pid {program.pid}): asked for")
        assert status(daemon)["models"][0]["state"] == "cold"
        text = arbiterd_cli("status", "--socket", str(daemon.socket))
        assert f"stepped aside for {QUIET} (pid {program.pid})" in text
        said = arbiterd_cli("resume", "--socket", str(daemon.socket))
        assert said.strip() == "no longer stepped aside: the models may take the GPU again"
        ask(daemon)
        # Passed over from now on: the looks that follow do not step aside for it again.
        time.sleep(1.0)  # the ring's look and its follow-ups up to 1 s
        assert aside_for(daemon) is None
        assert status(daemon)["models"][0]["state"] == "warm"
    finally:
        stop(program)
    back = step_events(daemon)[-1]
    assert (back["aside"], back["why"]) == (False, "resumed by the user")


def test_yield_to_a_second_program_hands_the_gpu_on_and_names_it(
    daemon: Daemon, stand_ins: Path
) -> None:
    ask(daemon)
    first = start(stand_ins, QUIET, opens_node=False)
    second = start(stand_ins, QUIET, opens_node=False)
    try:
        with daemon.client() as client:
            client.call("yield", pid=first.pid)
            client.call("yield", pid=second.pid)
        assert status(daemon)["holder"]["name"] == (
            f"{QUIET} (pid {second.pid}; arbiterd stepped aside)"
        )
        handed, taken = step_events(daemon)[-2:]
        assert (handed["aside"], handed["pid"], handed["why"]) == (
            False,
            first.pid,
            f"arbiterd yield asked for {QUIET} (pid {second.pid})",
        )
        assert (taken["aside"], taken["pid"]) == (True, second.pid)
    finally:
        stop(second)
        stop(first)
    wait_until(lambda: aside_for(daemon) is None, 10, "the return")
    ask(daemon)


def test_yield_for_a_process_that_is_not_running_is_refused(daemon: Daemon) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "arbiterd",
            "yield",
            "--until-exit",
            str(gone.pid),
            "--socket",
            str(daemon.socket),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert f"no process {gone.pid} of yours is running" in done.stderr


def test_a_request_meanwhile_is_told_for_whom_the_daemon_stepped_aside_or_gets_a_503(
    daemon: Daemon, stand_ins: Path
) -> None:
    """The waiting notices of issue 30 and max_queue_s name the program, not the daemon."""
    ask(daemon)
    game = start(stand_ins, GAME, opens_node=True)
    holder = f"{GAME} (pid {game.pid}; arbiterd stepped aside)"
    try:
        wait_until(lambda: status(daemon)["holder"]["name"] == holder, 10, "the step aside")
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        with httpx.Client(base_url=daemon.url, timeout=60) as http:
            reply = http.post("/chat/completions", json={**chat, "model": "patient"})
            assert reply.status_code == 503
            assert f"held by {holder}; try again in 1 s" in reply.json()["error"]["message"]
            with http.stream(
                "POST", "/chat/completions", json={**chat, "model": "m", "stream": True}
            ) as streamed:
                lines = streamed.iter_lines()
                assert next(lines) == f": waiting for the GPU, held by {holder}, 1st in queue"
                stop(game)
                data = [line for line in lines if line.startswith("data: ")]
        assert data[-1] == "data: [DONE]"
    finally:
        stop(game)


def test_status_says_what_the_daemon_watches_and_that_it_steps_aside_by_names_only_here(
    daemon: Daemon, stand_ins: Path
) -> None:
    watch = status(daemon)["yield_watch"]
    assert watch == (
        f"watching {stand_ins / 'renderD128'} (inotify); "
        "names only: no reader measures other programs' memory here"
    )


def test_a_reload_applies_a_changed_yield_table(daemon: Daemon, stand_ins: Path) -> None:
    """Last in the file: it changes the module's daemon, and puts its config back after."""
    ask(daemon)
    before = daemon.config.read_text()
    named = f'"{GAME}", "*{RENDER}*"'
    assert named in before
    daemon.config.write_text(before.replace(named, f'"{QUIET}"'))
    program = start(stand_ins, QUIET, opens_node=False)
    try:
        with daemon.client() as client:
            client.call("reload")
        wait_until(lambda: aside_for(daemon) is not None, 10, "the step aside")
        aside = aside_for(daemon)
        assert aside is not None
        assert (aside["pid"], aside["reason"]) == (
            program.pid,
            f"named in [yield] programs ('{QUIET}')",
        )
    finally:
        stop(program)
        daemon.config.write_text(before)
        with daemon.client() as client:
            client.call("reload")
    wait_until(lambda: aside_for(daemon) is None, 10, "the return")
