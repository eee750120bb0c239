"""`arbiterd run --device` and `arbiterd arena status --device` (issue 27): device ids name
arenas, gpu0's being --arena's and every other device's its sibling folder; a command on several
devices holds every one of their tokens, taken in the canonical order, while it runs. Real
processes, as other programs drive them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from arbiterd.arena import Arena
from arbiterd.paths import device_arena_of
from tests.conftest import Processes
from tests.support.waiting import wait_until

ARBITERD = [sys.executable, "-m", "arbiterd"]
RPC = "rpc:127.0.0.1:50052"
EX_USAGE, EX_DATAERR, EX_TEMPFAIL = 64, 65, 75

# The command: which token.lock files it inherited open, and what each arena's holder.json says.
SHOW_HOLD = textwrap.dedent(
    """
    import json, os, sys
    fds = sorted(
        os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
        if os.path.exists(f"/proc/self/fd/{fd}")
        and os.readlink(f"/proc/self/fd/{fd}").endswith("token.lock")
    )
    holders = {arena: json.load(open(f"{arena}/holder.json")) for arena in sys.argv[1:]}
    print(json.dumps({"pid": os.getpid(), "fds": fds, "holders": holders}))
    """
)


def arbiterd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ARBITERD, *args], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture
def gpu0(tmp_path: Path) -> Path:
    return tmp_path / "arena" / "gpu0"


def test_run_on_two_devices_holds_both_tokens_and_its_command_inherits_both(gpu0: Path) -> None:
    rpc_arena = device_arena_of(RPC, gpu0)
    assert rpc_arena == gpu0.parent / "rpc-127.0.0.1-50052"
    done = arbiterd(
        "run", "--arena", str(gpu0), "--device", RPC, "--device", "gpu0", "--name", "render",
        "--", sys.executable, "-c", SHOW_HOLD, str(gpu0), str(rpc_arena),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["fds"] == sorted([str(gpu0 / "token.lock"), str(rpc_arena / "token.lock")])
    for arena in (gpu0, rpc_arena):
        holder = shown["holders"][str(arena)]
        assert holder["name"] == "render"
        assert holder["command_pid"] == shown["pid"]
    # Both let go once it exited.
    for arena in (gpu0, rpc_arena):
        assert Arena(arena).observe().holder_pid is None


def test_run_without_device_means_gpu0_and_its_arena_is_arenas_own(gpu0: Path) -> None:
    for device in ([], ["--device", "gpu0"]):
        done = arbiterd(
            "run", "--arena", str(gpu0), *device, "--", sys.executable, "-c", SHOW_HOLD, str(gpu0)
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["fds"] == [str(gpu0 / "token.lock")]
    assert sorted(p.name for p in gpu0.parent.iterdir()) == ["gpu0"]  # no other arena made


def test_run_on_two_devices_holds_the_first_while_it_waits_for_the_second_and_lets_go_on_timeout(
    gpu0: Path, procs: Processes
) -> None:
    gpu1 = Arena(device_arena_of("gpu1", gpu0))
    holder = procs.actor(gpu1, "hold", "game")
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "acquired"
    # Named in either order, gpu0 comes first: held while the runner waits on gpu1.
    runner = procs.start(
        [*ARBITERD, "run", "--arena", str(gpu0), "--device", "gpu1", "--device", "gpu0",
         "--timeout", "30", "--", "true"]
    )  # fmt: skip
    wait_until(lambda: runner.pid in gpu1.observe().waiter_pids, 10, "the runner to wait on gpu1")
    assert Arena(gpu0).observe().holder_pid == runner.pid
    # Its first line, said once its try for gpu1 failed (read before the game ends: a game
    # gone between the runner's queueing and its try is no wait, and says nothing).
    assert runner.stderr is not None
    said = runner.stderr.readline()
    assert said.startswith(
        f"arbiterd run: gpu1: waiting for the GPU, held by game (pid {holder.pid})"
    )
    assert holder.stdin is not None
    holder.stdin.close()  # the game ends: the runner gets gpu1 too, runs, and lets go of both
    assert runner.wait(timeout=10) == 0
    assert Arena(gpu0).observe().holder_pid is None

    again = procs.actor(gpu1, "hold", "game")
    assert again.stdout is not None
    assert again.stdout.readline().strip() == "acquired"
    done = arbiterd(
        "run", "--arena", str(gpu0), "--device", "gpu1", "--device", "gpu0", "--timeout", "0.3",
        "--", "true",
    )  # fmt: skip
    assert done.returncode == EX_TEMPFAIL, done.stderr
    assert "the GPU tokens of gpu0, gpu1 were not all free within 0.3 s" in done.stderr
    assert Arena(gpu0).observe().holder_pid is None  # let go when the wait for gpu1 gave up


def test_run_refuses_a_device_named_twice_or_of_no_known_shape(gpu0: Path) -> None:
    twice = arbiterd(
        "run", "--arena", str(gpu0), "--device", "cpu", "--device", "cpu", "--", "true"
    )
    assert twice.returncode == EX_DATAERR
    assert twice.stderr == "arbiterd run: device cpu named twice\n"
    bad = arbiterd("run", "--arena", str(gpu0), "--device", "cuda0", "--", "true")
    assert bad.returncode == EX_DATAERR
    assert bad.stderr.startswith("arbiterd run: device id 'cuda0': expected gpuN")


def test_arena_status_of_a_device_is_its_arenas(gpu0: Path, procs: Processes) -> None:
    rpc_arena = Arena(device_arena_of(RPC, gpu0))
    holder = procs.actor(rpc_arena, "hold", "train")
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "acquired"
    done = arbiterd("arena", "status", "--arena", str(gpu0), "--device", RPC, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["arena"] == str(rpc_arena.path)
    assert (report["holder"]["pid"], report["holder"]["name"]) == (holder.pid, "train")
    mine = json.loads(arbiterd("arena", "status", "--arena", str(gpu0), "--json").stdout)
    assert (mine["arena"], mine["holder"]) == (str(gpu0), None)
    text = arbiterd("arena", "status", "--arena", str(gpu0), "--device", RPC).stdout
    assert text.splitlines()[:2] == [
        f"arena    {rpc_arena.path}",
        f"holder   train (pid {holder.pid}) since " + text.splitlines()[1].split(" since ")[1],
    ]


def test_arena_status_shows_one_device(gpu0: Path) -> None:
    done = arbiterd("arena", "status", "--arena", str(gpu0), "--device", "gpu0", "--device", "cpu")
    assert done.returncode == EX_USAGE
    assert done.stderr == (
        "arbiterd arena: arena status shows one device's arena: give --device once\n"
    )


def test_a_device_id_names_its_arena_beside_the_default_one(runtime_dir: Path) -> None:
    done = arbiterd("arena", "status", "--device", "gpu1", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["arena"] == str(runtime_dir / "arbiterd" / "arena" / "gpu1")
    assert os.listdir(runtime_dir / "arbiterd" / "arena") == ["gpu1"]
