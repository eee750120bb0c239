"""`arbiterd run`, `arena status` and `events`, as other programs will drive them: real processes
(and, for `events`, a real control server answering from a real journal)."""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from arbiterd import __version__, render
from arbiterd.arena import Arena
from arbiterd.cli import main as cli
from arbiterd.cli.commands import render_status
from arbiterd.daemon.control.server import ControlServer
from arbiterd.daemon.observe.journal import Journal
from arbiterd.events import parse_event
from arbiterd.status import DaemonStatus
from tests.conftest import Processes
from tests.support.waiting import wait_until
from tests.test_control import FakeService, LoopThread

ARBITERD = [sys.executable, "-m", "arbiterd"]

# A child that reports the signals it receives and exits 7 after SIGTERM or SIGINT.
TRAPPING_CHILD = textwrap.dedent(
    """
    import signal, sys
    def on(signum, frame):
        print("got", signum, flush=True)
        sys.exit(7)
    signal.signal(signal.SIGTERM, on)
    signal.signal(signal.SIGINT, on)
    print("ready", flush=True)
    signal.pause()
    """
)


def arbiterd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ARBITERD, *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )


def start_run(procs: Processes, arena: Arena, *args: str) -> subprocess.Popen[str]:
    return procs.start([*ARBITERD, "run", "--arena", str(arena.path), *args])


def test_run_exits_with_the_commands_status(arena: Arena) -> None:
    done = arbiterd("run", "--arena", str(arena.path), "--", "sh", "-c", "exit 3")
    assert done.returncode == 3
    assert arena.observe().holder_pid is None


def test_run_holds_the_token_while_the_command_runs(arena: Arena) -> None:
    script = f"import json,sys; print(open('{arena.path}/holder.json').read())"
    done = arbiterd(
        "run", "--arena", str(arena.path), "--name", "blender", "--", sys.executable, "-c", script
    )
    assert done.returncode == 0, done.stderr
    holder = json.loads(done.stdout)
    assert holder["name"] == "blender"
    assert holder["model"] is None


def test_run_reports_a_command_killed_by_a_signal_as_128_plus_n(arena: Arena) -> None:
    done = arbiterd("run", "--arena", str(arena.path), "--", "sh", "-c", "kill -9 $$")
    assert done.returncode == 128 + signal.SIGKILL


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_run_forwards_signals_to_the_command(
    arena: Arena, procs: Processes, signum: signal.Signals
) -> None:
    runner = start_run(procs, arena, "--", sys.executable, "-c", TRAPPING_CHILD)
    assert runner.stdout is not None
    assert runner.stdout.readline().strip() == "ready"
    os.kill(runner.pid, signum)
    assert runner.stdout.readline().split() == ["got", str(int(signum))]
    assert runner.wait(timeout=10) == 7
    assert arena.observe().holder_pid is None


def test_run_waits_for_the_holder_and_says_who_it_is(arena: Arena, procs: Processes) -> None:
    holder = start_run(procs, arena, "--name", "game", "--", sys.executable, "-c", TRAPPING_CHILD)
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "ready"
    waiter = start_run(procs, arena, "--", "true")
    wait_until(lambda: waiter.pid in arena.observe().waiter_pids, 10, "the waiter")
    os.kill(holder.pid, signal.SIGTERM)
    assert holder.wait(timeout=10) == 7
    assert waiter.wait(timeout=10) == 0
    assert waiter.stderr is not None
    stderr = waiter.stderr.read()
    assert (
        f"arbiterd run: waiting for the GPU, held by game (arbiterd run, pid {holder.pid}), "
        "1st in queue\n" in stderr
    )
    assert "got the GPU after" in stderr


def test_run_says_again_who_holds_the_gpu_when_it_changes(arena: Arena, procs: Processes) -> None:
    holder = start_run(procs, arena, "--name", "game", "--", sys.executable, "-c", TRAPPING_CHILD)
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "ready"
    first = start_run(procs, arena, "--name", "render", "--", "sleep", "2")
    wait_until(lambda: first.pid in arena.observe().waiter_pids, 10, "the first waiter")
    second = start_run(procs, arena, "--", "true")
    wait_until(lambda: second.pid in arena.observe().waiter_pids, 10, "the second waiter")
    os.kill(holder.pid, signal.SIGTERM)
    assert second.wait(timeout=20) == 0
    assert second.stderr is not None
    lines = second.stderr.read().splitlines()
    assert lines[0] == (
        f"arbiterd run: waiting for the GPU, held by game (arbiterd run, pid {holder.pid}), "
        "2nd in queue"
    )
    # Looked at every second: the instant between the two holders may be seen too.
    assert (
        f"arbiterd run: waiting for the GPU, held by render (arbiterd run, pid {first.pid}), "
        "1st in queue"
    ) in lines
    assert lines[-1].startswith("arbiterd run: got the GPU after")


def test_run_times_out_with_status_75(arena: Arena, procs: Processes) -> None:
    holder = start_run(procs, arena, "--name", "game", "--", "sleep", "30")
    wait_until(lambda: arena.observe().holder_pid == holder.pid, 10, "the holder")
    done = arbiterd("run", "--arena", str(arena.path), "--timeout", "0.2", "--", "true")
    assert done.returncode == 75
    assert "not free within 0.2 s" in done.stderr
    assert arena.observe().waiter_pids == ()


def test_run_interrupted_while_waiting_exits_130_and_withdraws(
    arena: Arena, procs: Processes
) -> None:
    holder = start_run(procs, arena, "--", "sleep", "30")
    wait_until(lambda: arena.observe().holder_pid == holder.pid, 10, "the holder")
    # Ten times, the signal sent as soon as the waiter queues: it lands anywhere in the wait's
    # first moments (once it hit the report starting its thread, and the run exited 1).
    for _ in range(10):
        waiter = start_run(procs, arena, "--", "true")

        def queued(pid: int = waiter.pid) -> bool:
            return pid in arena.observe().waiter_pids

        wait_until(queued, 10, "the waiter")
        os.kill(waiter.pid, signal.SIGINT)
        assert waiter.wait(timeout=10) == 130
        assert arena.observe().waiter_pids == ()
        assert arena.observe().holder_pid == holder.pid


def test_arena_status_json_shows_the_live_holder_and_waiters(
    arena: Arena, procs: Processes
) -> None:
    holder = start_run(procs, arena, "--name", "comfyui", "--", "sleep", "30")
    wait_until(lambda: arena.observe().holder_pid == holder.pid, 10, "the holder")
    waiters = [start_run(procs, arena, "--priority", "batch", "--", "true")]
    wait_until(lambda: len(arena.observe().queue) == 1, 10, "the batch waiter to queue")
    waiters.append(start_run(procs, arena, "--priority", "interactive", "--", "true"))
    want = sorted(w.pid for w in waiters)
    wait_until(lambda: list(arena.observe().waiter_pids) == want, 10, "both waiters")
    wait_until(lambda: len(arena.observe().queue) == 2, 10, "both waiters to queue")
    done = arbiterd("arena", "status", "--arena", str(arena.path), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["arena"] == str(arena.path)
    assert report["holder"]["pid"] == holder.pid
    assert report["holder"]["name"] == "comfyui"
    assert isinstance(report["holder"]["since"], float)
    assert [w["pid"] for w in report["waiters"]] == want
    assert all(w["name"] for w in report["waiters"])
    # the queue in the order it is served: the interactive waiter, though it came second
    assert [(w["pid"], w["priority"]) for w in report["queue"]] == [
        (waiters[1].pid, "interactive"),
        (waiters[0].pid, "batch"),
    ]
    assert report["queue"][0]["ticket"] > report["queue"][1]["ticket"]  # the arrival times
    text = arbiterd("arena", "status", "--arena", str(arena.path))
    assert f"holder   comfyui (pid {holder.pid}) since" in text.stdout
    # A waiter is shown by the name its ticket gives, `arbiterd run`'s as when it holds.
    assert f"queue 1  true (pid {waiters[1].pid}) (interactive)" in text.stdout
    assert [w["name"] for w in report["queue"]] == ["true", "true"]


def test_arena_status_of_a_free_arena(arena: Arena) -> None:
    report = json.loads(arbiterd("arena", "status", "--arena", str(arena.path), "--json").stdout)
    assert report["holder"] is None
    assert report["waiters"] == []
    assert report["queue"] == []


def test_run_refuses_an_unknown_priority_naming_the_allowed_ones(arena: Arena) -> None:
    done = arbiterd("run", "--arena", str(arena.path), "--priority", "urgent", "--", "true")
    assert done.returncode == 65
    assert "--priority must be one of interactive, normal, batch, got 'urgent'" in done.stderr


def test_default_arena_lives_in_the_runtime_dir(runtime_dir: Path) -> None:
    done = arbiterd("arena", "status", "--json", env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["arena"] == str(runtime_dir / "arbiterd" / "arena" / "gpu0")
    override = runtime_dir / "elsewhere"
    env = dict(os.environ, ARBITERD_ARENA=str(override))
    assert json.loads(arbiterd("arena", "status", "--json", env=env).stdout)["arena"] == str(
        override
    )


def test_each_bad_input_has_its_own_exit_status_and_one_line(
    arena: Arena, runtime_dir: Path, tmp_path: Path
) -> None:
    not_executable = tmp_path / "data.txt"
    not_executable.write_text("x")
    at = ["--arena", str(arena.path)]
    cases = {
        "missing --": (["run", *at, "true"], 64),
        "negative timeout": (["run", *at, "--timeout", "-1", "--", "true"], 65),
        "no command": (["run", *at, "--"], 64),
        "not found": (["run", *at, "--", "no-such-program-xyz"], 127),
        "not executable": (["run", *at, "--", str(not_executable)], 126),
        "unwritable arena": (["run", "--arena", "/proc/no/arena", "--", "true"], 73),
    }
    for what, (args, code) in cases.items():
        done = arbiterd(*args)
        assert done.returncode == code, f"{what}: {done.returncode} {done.stderr}"
        assert done.stderr.count("\n") == 1, f"{what}: not one line: {done.stderr!r}"
        assert done.stderr.startswith("arbiterd run: ")
    insecure = dict(os.environ)
    runtime_dir.chmod(0o755)
    done = arbiterd("arena", "status", env=insecure)
    assert (done.returncode, done.stderr.count("\n")) == (78, 1)
    assert "must be 0700" in done.stderr
    del insecure["XDG_RUNTIME_DIR"]
    done = arbiterd("arena", "status", env=insecure)
    assert done.returncode == 78
    assert "XDG_RUNTIME_DIR is not set" in done.stderr


def test_the_advice_for_a_missing_runtime_dir_works_when_pasted(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "ARBITERD_ARENA")}
    env["HOME"] = str(tmp_path)
    advice = arbiterd("arena", "status", env=env).stderr.strip()
    command = advice.split("run: ", 1)[1]
    done = subprocess.run(
        ["bash", "-c", f"{command} && {shlex.join(ARBITERD)} arena status"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, (command, done.stderr)


def test_the_tray_without_pyside6_is_one_clear_line(tmp_path: Path) -> None:
    # A Python that cannot import PySide6 (a stand-in package shadows it), as with `pip
    # install arbiterd` without the gui extra.
    shadow = tmp_path / "PySide6"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('No module named PySide6')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = arbiterd("tray", "--screenshot", str(tmp_path / "x.png"), env=env)
    assert done.returncode == 69
    assert done.stderr.count("\n") == 1
    assert "pip install 'arbiterd[gui]'" in done.stderr


# Every subcommand whose --help page is arbiterd's own (`tray` has its own parser, in the gui).
COMMANDS = [
    ["run"],
    ["arena", "status"],
    ["daemon"],
    ["status"],
    ["events"],
    ["warm"],
    ["release"],
    ["pin"],
    ["unpin"],
    ["hold"],
    ["unhold"],
    ["reload"],
    ["demo"],
    ["install"],
    ["uninstall"],
]


def help_page(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as exited:
        cli.main([*args, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_version_is_the_installed_distributions() -> None:
    done = arbiterd("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"arbiterd {metadata.version('arbiterd')}\n"


def test_version_without_package_metadata_is_the_source_trees(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"arbiterd {__version__} (source tree, not installed)\n"


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_help_page_says_what_it_does_and_shows_an_example(
    command: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    page = help_page(capsys, *command)
    paragraphs = page.split("\n\n")
    assert paragraphs[0].startswith(f"usage: arbiterd {' '.join(command)}")
    description = paragraphs[1]
    assert "\n" not in description, description
    assert description.endswith("."), description
    example = paragraphs[-1].splitlines()
    assert example[0] in ("example:", "examples:")
    assert len(example) > 1, page
    assert all(line.startswith(f"  arbiterd {' '.join(command)}") for line in example[1:]), page


def test_run_help_needs_no_double_dash(arena: Arena) -> None:
    done = arbiterd("run", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: arbiterd run")
    assert "--timeout S" in done.stdout
    # After "--", --help is the command's own.
    echo = [sys.executable, "-c", "import sys; print(*sys.argv[1:])"]
    done = arbiterd("run", "--arena", str(arena.path), "--", *echo, "--help")
    assert (done.returncode, done.stdout) == (0, "--help\n")


def test_main_help_lists_each_command_with_its_description_on_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    page = help_page(capsys)
    # A command's line is indented by 4; a wrapped description's next line by more.
    listed = {line.split()[0]: line for line in page.splitlines() if re.match(r"    [a-z]", line)}
    assert {command[0] for command in COMMANDS} | {"tray"} <= set(listed)
    for name, line in listed.items():
        assert len(line.split()) > 1, f"{name}'s description is not on its line:\n{page}"
    assert "--version" in page


# -- arbiterd status: what runs each model (issue 15) -------------------------------------------

STOCK = "libllama at /x/libllama.so does not export llama_context_release_device (a stock build)"
CPU_WARNING = "the models run on the CPU: this engine cannot offload to the GPU this machine has"


def rendered(status: dict[str, Any]) -> str:
    """`arbiterd status` of the status object a daemon sent."""
    return render_status(DaemonStatus.from_json(status))


def status_model(name: str, **fields: object) -> dict[str, object]:
    return {"name": name, "state": "cold", "queue": 0, "served": 0, **fields}


def test_status_shows_each_backend_the_engine_and_each_reason_and_warning_once() -> None:
    engine = {"offload": False, "devices": ["CPU: test cpu"]}
    text = rendered(
        {
            "models": [
                status_model("story", backend="reload", fallback_reason=STOCK),
                status_model("chat", backend="reload", fallback_reason=STOCK),
                status_model("tiny", backend="reload", fallback_reason=STOCK),
            ],
            "engine": engine | {"cpu_cause": "engine", "cpu_note": CPU_WARNING},
        }
    )
    lines = text.splitlines()
    header = lines[0].split()
    assert header[:3] == ["MODEL", "STATE", "BACKEND"]
    assert [line.split()[:3] for line in lines[1:4]] == [
        ["story", "cold", "reload"],
        ["chat", "cold", "reload"],
        ["tiny", "cold", "reload"],
    ]
    assert lines[4:7] == [
        "engine: CPU only (this engine cannot offload to a GPU)",
        f"warning: {CPU_WARNING}",  # the engine's: once, for every model
        f"backend reload (story, chat, tiny): {STOCK}",
    ]


def test_status_of_in_place_models_on_a_gpu_has_no_reason_or_warning() -> None:
    text = rendered(
        {
            "models": [status_model("chat", backend="in-place", fallback_reason="")],
            "engine": {"offload": True, "devices": ["CPU: test cpu", "CUDA0: NVIDIA H200"]},
        }
    )
    lines = text.splitlines()
    assert lines[1].split()[:3] == ["chat", "cold", "in-place"]
    assert lines[2] == "engine: CUDA0: NVIDIA H200 (GPU offload)"
    assert not any(line.startswith(("backend", "warning")) for line in lines)


def test_status_of_a_daemon_whose_workers_did_not_say_hello_yet() -> None:
    lines = rendered({"models": [status_model("chat", backend=None)]}).splitlines()
    assert lines[1].split()[:3] == ["chat", "cold", "-"]
    assert not any(line.startswith("engine") for line in lines)


def test_status_notes_a_silent_holder_and_figures_that_are_stale() -> None:
    text = rendered(
        {
            "models": [
                status_model("chat", state="warm", stale_s=3.2, silent_s=31.4),
                status_model("story", stale_s=None, silent_s=None),
            ]
        }
    )
    chat, story = text.splitlines()[1:3]
    assert chat.endswith(
        "chat holds the GPU and has shown no sign of life for 31 s; stale: no answer for 3 s"
    )
    assert "stale" not in story
    assert "sign of life" not in story


# -- arbiterd events: the daemon's journal, over its socket ----------------------------------------

AT = 1_718_000_000.5
WAIT_S = 30.0


def handoff(at: float, source: str, target: str) -> dict[str, Any]:
    return {"event": "handoff", "at": at, "from": source, "to": target, "holder_pid": 7,
            "waited_from": at - 1, "wait_s": 0.5, "release_s": 0.4, "restore_s": 0.5}  # fmt: skip


def human(*bodies: dict[str, Any]) -> list[str]:
    return [render.event_line(parse_event(body)) for body in bodies]


class Daemon:
    """A control server on `socket` whose history is `journal`, on a loop of its own."""

    def __init__(self, socket: Path, journal: Journal) -> None:
        self.socket = socket
        self.journal = journal
        self.loop = LoopThread()
        self.server = ControlServer(FakeService(), socket, history=journal.read)
        self.loop.run(self.server.start())

    def close(self) -> None:
        self.loop.run(self.server.close())
        self.loop.close()


@pytest.fixture
def places(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """Where the daemon's journal is, and what a config names: another socket and journal."""
    short = Path(tempfile.mkdtemp(prefix="ae", dir="/tmp"))  # a socket path fits in 108 bytes
    config = tmp_path / "config.toml"
    config.write_text(
        f'[daemon]\nsocket = "{short / "arbiterd" / "control.sock"}"\n'
        f'arena = "{short / "arena"}"\njournal = "{tmp_path / "named.sqlite3"}"\n'
        '[models.qwen]\npath = "/m/q.gguf"\n'
    )
    yield {
        "socket": short / "arbiterd" / "control.sock",
        "daemon journal": tmp_path / "elsewhere.sqlite3",
        "named journal": tmp_path / "named.sqlite3",
        "config": config,
    }
    shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def daemon(places: dict[str, Path]) -> Iterator[Daemon]:
    with Journal(places["daemon journal"]) as journal:
        running = Daemon(places["socket"], journal)
        yield running
        running.close()


def test_events_come_from_the_daemon_whatever_journal_the_config_names(
    daemon: Daemon, places: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    with Journal(places["named journal"]) as named:
        named.append({"event": "hold", "at": AT, "held": True})  # not the daemon's
    daemon.journal.append(handoff(AT, "a", "b"))
    daemon.journal.append({"event": "wait", "at": AT + 9, "model": "a", "holder_name": "steam"})
    assert cli.main(["events", "--config", str(places["config"])]) == 0
    assert capsys.readouterr().out.splitlines() == human(
        handoff(AT, "a", "b"), {"event": "wait", "at": AT + 9, "model": "a", "holder_name": "steam"}
    )
    assert cli.main(["events", "--socket", str(daemon.socket), "--since", str(AT + 1)]) == 0
    assert capsys.readouterr().out.splitlines() == human(
        {"event": "wait", "at": AT + 9, "model": "a", "holder_name": "steam"}
    )


def test_events_json_is_each_stored_object_with_its_seq(
    daemon: Daemon, capsys: pytest.CaptureFixture[str]
) -> None:
    seq = daemon.journal.append(handoff(AT, "a", "b"))
    assert cli.main(["events", "--json", "--socket", str(daemon.socket)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line) for line in lines] == [{**handoff(AT, "a", "b"), "seq": seq}]


def test_events_while_the_daemon_is_down_read_the_journal_its_config_names(
    places: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    with Journal(places["named journal"]) as named:
        named.append(handoff(AT, "a", "b"))
    assert cli.main(["events", "--config", str(places["config"])]) == 0
    assert capsys.readouterr().out.splitlines() == human(handoff(AT, "a", "b"))
    # A socket named on its own has no journal beside it: nothing is guessed.
    assert cli.main(["events", "--socket", str(places["socket"])]) == 69
    assert "arbiterd is not running" in capsys.readouterr().err


def test_events_reads_the_journal_file_it_is_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "journal.sqlite3"
    with Journal(path) as journal:
        journal.append(handoff(AT, "a", "b"))
    assert cli.main(["events", "--journal", str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == human(handoff(AT, "a", "b"))


def test_events_follow_prints_each_new_event_as_the_daemon_journals_it(
    daemon: Daemon, procs: Processes
) -> None:
    daemon.journal.append(handoff(AT, "a", "b"))
    follower = procs.start(
        [*ARBITERD, "events", "--follow", "--since", str(AT - 1), "--socket", str(daemon.socket)]
    )
    lines: queue.Queue[str] = queue.Queue()
    stdout = follower.stdout
    assert stdout is not None

    def pump() -> None:
        for line in stdout:
            lines.put(line.rstrip("\n"))

    threading.Thread(target=pump, name="follower-stdout", daemon=True).start()
    assert lines.get(timeout=WAIT_S) == human(handoff(AT, "a", "b"))[0]
    daemon.journal.append(handoff(AT + 5, "b", "a"))  # after the follower has read the first
    assert lines.get(timeout=WAIT_S) == human(handoff(AT + 5, "b", "a"))[0]


def test_status_names_each_group_and_whether_it_holds_the_gpu() -> None:
    group = {"name": "rag", "models": ["qwen", "nomic"], "holds_token": True, "failure": ""}
    stopped = {**group, "name": "pair", "holds_token": False, "failure": "OSError: gone"}
    lines = rendered(
        {
            "models": [status_model("qwen"), status_model("nomic")],
            "groups": [group, stopped],
            "holder": {"pid": 42, "name": "group rag"},
        }
    ).splitlines()
    assert "group rag (qwen, nomic): holds the GPU" in lines
    assert (
        "group pair (qwen, nomic): does not hold the GPU; its keeper stopped: OSError: gone"
        in lines
    )


def test_status_shows_a_fitting_sets_budget_and_what_made_it() -> None:
    GiB = 1 << 30
    fitting = {
        "name": "fitting",
        "models": ["qwen", "nomic"],
        "holds_token": True,
        "device": "gpu0",
        "fitting": True,
        "budget_bytes": 9 * GiB,
        "warm": ["qwen", "nomic"],
        "used_bytes": 6 * GiB,
        "withdrawals": 2,
        "size_bytes": 12 * GiB,
        "size_source": "nvml",
        "reserve_bytes": GiB // 2,
        "others_bytes": 5 * GiB // 2,
    }
    unknown = {**fitting, "device": "gpu1", "budget_bytes": 0, "warm": [], "used_bytes": 0}
    unknown |= {"size_bytes": None, "size_source": "", "others_bytes": 0, "withdrawals": 0}
    crowded = {**fitting, "device": "gpu2", "budget_bytes": 0, "others_bytes": 12 * GiB}
    lines = rendered(
        {"models": [status_model("qwen")], "groups": [fitting, unknown, crowded]}
    ).splitlines()
    assert (
        "fitting set on gpu0 (qwen, nomic): holds the GPU; warm: qwen, nomic, 6.0 GiB of 9.0 GiB "
        "(12.0 GiB by nvml - 512.0 MiB reserve - 2.5 GiB others); 2 made to leave" in lines
    )
    assert (
        "fitting set on gpu1 (qwen, nomic): holds the GPU; warm: none, 0 B of no budget: gpu1's "
        "memory is not known, each warm alone; 0 made to leave" in lines
    )
    assert (
        "fitting set on gpu2 (qwen, nomic): holds the GPU; warm: qwen, nomic, 6.0 GiB of no room "
        "(12.0 GiB by nvml - 512.0 MiB reserve - 12.0 GiB others), each warm alone; "
        "2 made to leave" in lines
    )


def test_status_splits_host_ram_into_copies_kv_and_released_weights() -> None:
    ram = {
        "host_copies_bytes": 253 << 20,
        "host_kv_bytes": 96 << 20,
        "host_weights_bytes": 246 << 20,
        "budget_bytes": 0,
    }
    lines = rendered(
        {"models": [status_model("chat")], "host_ram_bytes": 595 << 20, "host_ram": ram}
    ).splitlines()
    assert (
        "host RAM: 595.0 MiB = model file copies 253.0 MiB (each counted once) + KV caches kept "
        "on the host 96.0 MiB + weights' own copies 246.0 MiB; budget none"
    ) in lines


def test_events_into_a_pipe_its_reader_closed_ends_quietly(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite3"
    with Journal(path) as journal:
        for n in range(2000):
            journal.append(handoff(AT + n, "a", "b"))
    # `arbiterd events --journal PATH | head -1`, with the reader's end closed at once.
    reader, writer = os.pipe()
    os.close(reader)
    with os.fdopen(writer, "wb") as stdout:
        done = subprocess.run(
            [*ARBITERD, "events", "--journal", str(path)],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.stderr == ""
    assert done.returncode == 128 + signal.SIGPIPE


def test_run_usage_names_every_option_it_takes() -> None:
    for option in ("--arena", "--name", "--priority", "--timeout"):
        assert option in cli.RUN_USAGE


def test_daemon_help_names_the_defaults_of_its_paths_and_port(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["daemon", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("config.toml", "127.0.0.1:8642", "control.sock", "arena/gpu0"):
        assert default in text


def test_a_daemon_not_running_is_said_with_how_to_start_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    socket = str(tmp_path / "none.sock")
    assert cli.main(["status", "--socket", socket]) == 69
    err = capsys.readouterr().err
    assert err.startswith(f"arbiterd status: arbiterd is not running (no daemon on {socket})")
    assert "start it: arbiterd daemon" in err
    # Once `arbiterd install` has written the unit, the unit is how.
    unit = tmp_path / "config/systemd/user/arbiterd.service"
    unit.parent.mkdir(parents=True)
    unit.write_text("[Service]\n")
    assert cli.main(["status", "--socket", socket]) == 69
    assert "start it: systemctl --user start arbiterd.service" in capsys.readouterr().err


def test_status_checks_a_footprint_against_what_a_gpu_reader_reads() -> None:
    MiB = 1 << 20
    device = {"device": "gpu0", "weights_bytes": 90 * MiB, "kv_bytes": 10 * MiB}
    footprint = {"predicted": [{**device, "compute_bytes": 3 * MiB}]}
    footprint["measured"] = [{**device, "compute_bytes": 5 * MiB}]
    chat = status_model("chat", footprint=footprint, vram_bytes=412 * MiB)
    telemetry = {"source": "nvml", "devices": []}
    lines = rendered({"models": [chat], "telemetry": telemetry}).splitlines()
    assert (
        "footprint (chat): gpu0 predicted 103.0 MiB, measured 105.0 MiB (-1.9 %); "
        "nvml reads 412.0 MiB for its worker" in lines
    )
    # The engines' own accounting is the measured figure itself: nothing to check it against.
    text = rendered({"models": [chat], "telemetry": {**telemetry, "source": "accounting"}})
    assert "reads" not in next(ln for ln in text.splitlines() if ln.startswith("footprint"))
