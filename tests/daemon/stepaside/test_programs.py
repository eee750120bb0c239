"""The /proc scan and the device nodes (stepaside/programs.py), on real processes that hold a
temporary file open as a GPU program holds its render node, and on a folder laid out like /dev.
Every process a test starts leads a session of its own, and the whole session is killed when
the test ends."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from arbiterd.daemon.stepaside.programs import (
    Program,
    Scan,
    _name,
    descendants,
    device_nodes,
    node_dirs,
    read_program,
    scan,
)
from tests.support.waiting import wait_until

TIMEOUT_S = 10.0
LONG_NAME = "averyveryverylongname"  # the kernel keeps 15 characters of it: "averyveryverylo"


class Started:
    """Starts processes, each in a session of its own, and kills each session when closed."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[bytes]] = []

    def __call__(self, *argv: str | Path) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([str(a) for a in argv], start_new_session=True)
        self._procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its session's group: children too
            proc.wait(timeout=TIMEOUT_S)


@pytest.fixture
def start() -> Iterator[Started]:
    started = Started()
    try:
        yield started
    finally:
        started.close()


@pytest.fixture
def node(tmp_path: Path) -> Path:
    """A file standing in for a render node."""
    path = tmp_path / "renderD128"
    path.write_bytes(b"")
    return path


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().rstrip("\n")
    except OSError:
        return ""


def runs(pid: int, comm_is: str, *argv: str | Path) -> None:
    """Wait until `pid` has exec'd `argv`: the kernel renames a process and then sets up its
    command line, a moment after Popen has returned."""

    def done() -> bool:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False
        return comm(pid) == comm_is and cmdline == b"".join(f"{a}\0".encode() for a in argv)

    wait_until(done, TIMEOUT_S, f"{pid} to run {argv}")


def holding(start: Started, path: Path) -> subprocess.Popen[bytes]:
    """sleep(1) holding `path` open on fd 3, as a GPU program holds its node: the shell opens
    it and becomes sleep, which inherits it."""
    proc = start("bash", "-c", f'exec 3<"{path}"; exec sleep 30')
    runs(proc.pid, "sleep", "sleep", "30")
    return proc


def found(result: Scan, pid: int) -> Program:
    matching = [p for p in result.programs if p.pid == pid]
    assert len(matching) == 1, f"pid {pid} in the scan {len(matching)} times"
    return matching[0]


# -- scan ------------------------------------------------------------------------------------


def test_a_process_holding_a_node_open_is_found_with_that_node(start: Started, node: Path) -> None:
    proc = holding(start, node)

    result = scan([node])

    assert result.with_fds
    program = found(result, proc.pid)
    assert program.nodes == frozenset({os.path.realpath(node)})
    assert program.on_gpu
    assert (program.name, program.cmdline, program.parent) == (
        "sleep",
        ("sleep", "30"),
        os.getpid(),
    )
    assert program.key == (proc.pid, program.start)
    assert program.start > 0
    assert not found(result, os.getpid()).on_gpu  # this process holds no node


def test_a_names_only_scan_lists_the_process_without_its_nodes(start: Started, node: Path) -> None:
    proc = holding(start, node)

    result = scan([node], with_fds=False)

    assert not result.with_fds
    program = found(result, proc.pid)
    assert (program.name, program.cmdline) == ("sleep", ("sleep", "30"))
    assert program.nodes == frozenset()


def test_a_names_only_scan_after_another_reads_only_the_processes_new_since(
    start: Started, node: Path
) -> None:
    """What the earlier scan read is kept (here a name no process has, to tell it apart); a
    process started since is read; one of `others` is not read again; one gone is dropped."""
    kept = holding(start, node)
    earlier = scan([node])
    marked = dataclasses.replace(found(earlier, kept.pid), name="as-read-before")
    gone = Program(pid=2**22 + 1, start=1, name="gone", cmdline=(), parent=1)
    known = Scan((marked, gone), with_fds=True, others=frozenset({os.getpid()}))
    new = start("sleep", "30")
    runs(new.pid, "sleep", "sleep", "30")

    result = scan([node], with_fds=False, known=known)

    assert found(result, kept.pid).name == "as-read-before"
    assert found(result, kept.pid).nodes == frozenset()  # a names-only scan says no nodes
    assert found(result, new.pid).cmdline == ("sleep", "30")
    assert os.getpid() in result.others
    assert all(p.pid != os.getpid() for p in result.programs)
    assert all(p.pid != gone.pid for p in result.programs)
    # A scan with fds reads everything again.
    assert found(scan([node], known=known), kept.pid).name == "sleep"


def test_a_process_that_does_not_hold_the_node_has_no_nodes(
    start: Started, node: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    other.write_bytes(b"")
    plain = start("sleep", "30")
    elsewhere = holding(start, other)  # holds a file open, just not a watched one
    holder = holding(start, node)

    result = scan([node])

    assert found(result, plain.pid).nodes == frozenset()
    assert found(result, elsewhere.pid).nodes == frozenset()
    assert found(result, holder.pid).nodes == frozenset({os.path.realpath(node)})
    assert found(scan([]), holder.pid).nodes == frozenset()  # no node watched


def test_a_node_named_through_a_symlink_matches_by_its_real_path(
    start: Started, node: Path, tmp_path: Path
) -> None:
    link = tmp_path / "by-path-render"
    link.symlink_to(node)
    by_target = holding(start, node)
    by_link = holding(start, link)  # the kernel's fd link names the target either way

    result = scan([link])

    real = frozenset({os.path.realpath(node)})
    assert found(result, by_target.pid).nodes == real
    assert found(result, by_link.pid).nodes == real
    assert found(scan([node]), by_link.pid).nodes == real


def test_a_name_the_kernel_cut_at_15_characters_is_given_whole(
    start: Started, tmp_path: Path
) -> None:
    sleep = shutil.which("sleep")
    assert sleep is not None
    program = tmp_path / LONG_NAME
    shutil.copy(sleep, program)
    proc = start(program, "30")
    runs(proc.pid, LONG_NAME[:15], program, "30")  # what the kernel keeps of the name

    assert found(scan([]), proc.pid).name == LONG_NAME
    read = read_program(proc.pid)
    assert read is not None
    assert read.name == LONG_NAME


def test_the_full_name_is_taken_from_argv0_only_when_it_extends_the_cut_name() -> None:
    cut = LONG_NAME[:15]
    assert _name(cut, (f"/opt/bin/{LONG_NAME}", "30")) == LONG_NAME
    assert _name(cut, ("/opt/bin/somethingelse",)) == cut  # argv[0] rewritten: not its name
    assert _name(cut, ()) == cut  # no command line (a zombie, a kernel thread)
    assert _name("python3", ("/usr/bin/python3.12", "main.py")) == "python3"  # not cut


def test_the_scan_is_of_one_users_processes(start: Started) -> None:
    proc = start("sleep", "30")
    ours = scan([])
    assert {os.getpid(), proc.pid} <= {p.pid for p in ours.programs}

    theirs = scan([], uid=os.getuid() + 12345)
    assert not {os.getpid(), proc.pid} & {p.pid for p in theirs.programs}


def test_a_procfs_that_cannot_be_read_gives_an_empty_scan(tmp_path: Path) -> None:
    assert scan([], procfs=tmp_path / "nothing") == Scan((), True)
    assert scan([], procfs=tmp_path / "nothing", with_fds=False) == Scan((), False)


def test_stat_is_parsed_past_a_name_with_spaces_and_parentheses_and_bad_entries_skipped(
    tmp_path: Path, node: Path
) -> None:
    """A laid-out procfs: the name ends at stat's last ')'; what is not a pid, or a process
    whose files are gone or cut short, is not in the scan."""
    procfs = tmp_path / "proc"

    def entry(name: str, stat: str | None, cmdline: bytes = b"") -> Path:
        folder = procfs / name
        (folder / "fd").mkdir(parents=True)
        if stat is not None:
            (folder / "stat").write_text(stat)
            (folder / "cmdline").write_bytes(cmdline)
        return folder

    rest = " ".join(["0"] * 17)  # fields 5 to 21 of stat(5)
    odd = entry("4242", f"4242 (a) b (c)) S 7 {rest} 98765 0 0\n", b"a) b (c)\0--flag\0")
    (odd / "fd" / "3").symlink_to(node)
    (odd / "fd" / "4").symlink_to(tmp_path)
    entry("self", f"4242 (self) S 7 {rest} 1 0 0\n")
    entry("4243", "4243 (short) S 1 2 3\n")
    entry("4244", None)

    result = scan([node], procfs=procfs)

    assert result.programs == (
        Program(
            4242,
            98765,
            "a) b (c)",
            ("a) b (c)", "--flag"),
            7,
            frozenset({os.path.realpath(node)}),
        ),
    )


# -- read_program ----------------------------------------------------------------------------


def test_read_program_reads_a_running_process_without_its_nodes(start: Started, node: Path) -> None:
    proc = holding(start, node)

    program = read_program(proc.pid)

    assert program is not None
    assert program.key == found(scan([node]), proc.pid).key
    assert (program.name, program.cmdline, program.parent) == (
        "sleep",
        ("sleep", "30"),
        os.getpid(),
    )
    assert program.nodes == frozenset()


def test_read_program_gives_none_for_an_exited_process_or_another_users() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait(timeout=TIMEOUT_S)  # reaped: its pid is no process now
    assert read_program(proc.pid) is None
    assert read_program(os.getpid()) is not None
    assert read_program(os.getpid(), uid=os.getuid() + 12345) is None


# -- descendants -----------------------------------------------------------------------------


def test_descendants_follow_a_real_process_tree(start: Started) -> None:
    # The outer shell starts an inner one in the background, which runs sleep and waits.
    outer = start("bash", "-c", 'bash -c "sleep 30; true" & wait')

    def sleeping() -> tuple[tuple[Program, ...], Program | None]:
        programs = scan([], with_fds=False).programs
        inner = {p.pid for p in programs if p.parent == outer.pid}
        sleeps = [p for p in programs if p.parent in inner and p.name == "sleep"]
        return programs, (sleeps[0] if sleeps else None)

    wait_until(lambda: sleeping()[1], TIMEOUT_S, "the inner shell to start sleep")
    programs, sleep = sleeping()
    assert sleep is not None

    below = descendants(programs, outer.pid)

    assert {outer.pid, sleep.parent, sleep.pid} <= below
    assert os.getpid() not in below
    assert descendants(programs, sleep.pid) == {sleep.pid}


def test_descendants_of_hand_built_programs() -> None:
    def program(pid: int, parent: int) -> Program:
        return Program(pid, pid, f"p{pid}", (), parent)

    # 1 ─ 2 ─ 4 ─ 5, 1 ─ 3; 6 ─ 7 apart; 8 and 9 each other's parent.
    programs = [program(5, 4), program(4, 2), program(2, 1), program(3, 1), program(7, 6)]
    programs += [program(8, 9), program(9, 8)]

    assert descendants(programs, 1) == {1, 2, 3, 4, 5}
    assert descendants(programs, 2) == {2, 4, 5}
    assert descendants(programs, 6) == {6, 7}  # the root need not be in the scan
    assert descendants(programs, 5) == {5}
    assert descendants(programs, 100) == {100}
    assert descendants(programs, 8) == {8, 9}  # a loop ends
    assert descendants([], 1) == {1}


# -- device_nodes ----------------------------------------------------------------------------


def test_device_nodes_are_the_gpu_nodes_of_a_dev_folder(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    (dev / "dri" / "by-path").mkdir(parents=True)
    (dev / "nvidia-caps").mkdir()
    for name in (
        "dri/renderD129",
        "dri/renderD128",
        "dri/card1",
        "dri/card0",
        "nvidia0",
        "nvidia1",
        "nvidiactl",
        "nvidia-uvm",
        "nvidia-modeset",
        "nvidia-caps/nvidia-cap1",
        "kfd",
        "null",
        "fb0",
    ):
        (dev / name).write_bytes(b"")
    (dev / "dri" / "by-path" / "pci-0000:03:00.0-render").symlink_to("../renderD128")
    (dev / "dri" / "by-path" / "pci-0000:03:00.0-card").symlink_to("../card0")

    nodes = device_nodes(dev)

    assert nodes == tuple(
        dev / name
        for name in (
            "dri/card0",
            "dri/card1",
            "dri/renderD128",
            "dri/renderD129",
            "kfd",
            "nvidia0",
            "nvidia1",
        )
    )
    assert node_dirs(dev) == (dev, dev / "dri")


def test_a_folder_named_like_a_node_is_not_a_node(tmp_path: Path) -> None:
    (tmp_path / "dri" / "card0").mkdir(parents=True)
    (tmp_path / "kfd").mkdir()
    assert device_nodes(tmp_path) == ()


def test_a_machine_without_gpu_nodes_has_none(tmp_path: Path) -> None:
    (tmp_path / "null").write_bytes(b"")
    assert device_nodes(tmp_path) == ()
    assert device_nodes(tmp_path / "absent") == ()


def test_a_zombie_is_not_listed(start: Started) -> None:
    """A process that exited and is not reaped yet (its parent killed, and a PID 1 that reaps
    nothing, as in some containers) still has a /proc entry: it is no program to step aside for,
    nor one whose exit would be seen again and again."""
    exited = start("true")

    def zombie() -> bool:
        stat = Path(f"/proc/{exited.pid}/stat").read_text()
        return stat[stat.rfind(")") + 2] == "Z"

    wait_until(zombie, TIMEOUT_S, "the child to exit unreaped")
    assert all(p.pid != exited.pid for p in scan([]).programs)
    assert read_program(exited.pid) is None
