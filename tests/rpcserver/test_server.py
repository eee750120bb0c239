"""`arbiterd rpc-server` (issue 27): ggml's own RPC server serving this machine's CPU, run as a
real process on 127.0.0.1 and asked over the wire (arbiterd.native.rpc.probe); its refusals,
and its exit on SIGTERM and SIGINT; with --clients, several clients answered at once, each by
a process of its own, idle again once its connection closes, and all of them ending with the
front. The choice of devices and the listen checks are also tested as pure functions, over
device lists no engine made."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from arbiterd.errors import BadValueError, DeviceUnreachableError, UsageError
from arbiterd.native import ggml, rpc
from arbiterd.rpcserver import server as rpcserver
from tests.support.daemon import free_port
from tests.support.waiting import wait_until

ARBITERD = [sys.executable, "-m", "arbiterd"]
START_TIMEOUT_S = 60.0  # the engine loads before the server listens
EXIT_TIMEOUT_S = 10.0
# The server serves the CPU: its process need not start a Vulkan driver.
CPU_ONLY = {**os.environ, "GGML_VK_VISIBLE_DEVICES": ""}
EX_USAGE, EX_DATAERR, EX_OSERR = 64, 65, 71


class Server:
    """`arbiterd rpc-server` in a subprocess, its output in a file; killed and reaped after."""

    def __init__(self, log: Path, *args: str) -> None:
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.log = log
        with log.open("w") as out:
            self.process = subprocess.Popen(
                [*ARBITERD, "rpc-server", "--listen", self.endpoint, *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=CPU_ONLY,
            )

    def answers(self) -> rpc.ServerInfo | None:
        assert self.process.poll() is None, self.log.read_text()
        try:
            return rpc.probe(self.endpoint, timeout_s=1.0)
        except DeviceUnreachableError:
            return None

    def wait_serving(self) -> rpc.ServerInfo:
        wait_until(self.answers, START_TIMEOUT_S, f"the RPC server on {self.endpoint}")
        info = self.answers()
        assert info is not None
        return info

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=EXIT_TIMEOUT_S)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    running = Server(tmp_path / "rpc-server.log", "--device", "cpu", "--threads", "2")
    yield running
    running.close()


def arbiterd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ARBITERD, *args], capture_output=True, text=True, timeout=120, env=CPU_ONLY, check=False
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_rpc_server_serves_the_cpu_to_a_probe_and_exits_0_on_a_signal(
    server: Server, signum: signal.Signals
) -> None:
    info = server.wait_serving()
    assert info.endpoint == server.endpoint
    assert info.version[:2] == (rpc.PROTOCOL_MAJOR, rpc.PROTOCOL_MINOR)
    [device] = info.devices
    assert device.index == 0
    assert 0 < device.free_bytes <= device.total_bytes
    # Our line first, then ggml's own, which reach the log while it serves (line-buffered).
    lines = server.log.read_text().splitlines()
    ours = next(i for i, line in enumerate(lines) if line.startswith("serving "))
    assert lines[ours].startswith("serving CPU: ")
    assert lines[ours].endswith(f" on {server.endpoint}")
    assert any(line.startswith("Starting RPC server v7.") for line in lines[ours + 1 :])
    server.process.send_signal(signum)
    assert server.process.wait(timeout=EXIT_TIMEOUT_S) == 0
    with pytest.raises(DeviceUnreachableError, match="not reachable"):
        rpc.probe(server.endpoint, timeout_s=1.0)


def test_rpc_server_serves_the_next_client_once_one_has_gone(server: Server) -> None:
    first = server.wait_serving()
    second = server.answers()  # the probe's connection closed: the server took the next
    assert second is not None
    assert (second.version, len(second.devices)) == (first.version, len(first.devices))


def test_a_server_busy_with_another_client_is_up_though_it_answers_nobody_else(
    server: Server,
) -> None:
    server.wait_serving()
    with socket.create_connection(("127.0.0.1", server.port)) as other:
        other.sendall(bytes([14]) + (24).to_bytes(8, "little") + bytes(24))  # HELLO
        assert len(other.recv(64)) > 0  # the server serves this client now
        with pytest.raises(DeviceUnreachableError, match="serves one client at a time"):
            rpc.probe(server.endpoint, timeout_s=0.5)
        rpc.check_listening(server.endpoint, timeout_s=0.5)  # busy is not down
    server.process.kill()
    server.process.wait(timeout=EXIT_TIMEOUT_S)
    with pytest.raises(DeviceUnreachableError, match=f"RPC server {server.endpoint} is not"):
        rpc.check_listening(server.endpoint, timeout_s=0.5)


# -- several clients at once (--clients N, arbiterd/rpcserver/front.py) ------------------------


def children(pid: int) -> set[int]:
    """The processes `pid` started that still run."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended since
            found |= {int(c) for c in (task / "children").read_text().split()}
    return found


def hello(conn: socket.socket) -> None:
    conn.sendall(bytes([14]) + (24).to_bytes(8, "little") + bytes(24))
    assert len(conn.recv(64)) > 0  # a server answers this client


def test_a_server_of_several_clients_answers_a_second_while_the_first_is_connected(
    tmp_path: Path,
) -> None:
    server = Server(tmp_path / "front.log", "--device", "cpu", "--clients", "3")
    try:
        server.wait_serving()
        assert rpc.serves_several(server.endpoint, timeout_s=5)
        with (
            socket.create_connection(("127.0.0.1", server.port)) as first,
            socket.create_connection(("127.0.0.1", server.port)) as second,
        ):
            hello(first)
            hello(second)
            info = rpc.probe(server.endpoint, timeout_s=5.0)  # a third, all three connected
            assert info.version[:2] == (rpc.PROTOCOL_MAJOR, rpc.PROTOCOL_MINOR)
            serving = children(server.process.pid)
            assert len(serving) >= 3  # a process for each client, and spares
        # Each client's process is idle again once its connection closed (ggml's server frees
        # what a client held when it leaves).
        wait_until(
            lambda: not serving & (children(server.process.pid) - spares(server)),
            10,
            "the clients' processes to end",
        )
        assert "serving up to 3 clients at once on" in server.log.read_text()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=EXIT_TIMEOUT_S) == 0
        wait_until(
            lambda: not any(Path(f"/proc/{p}").exists() for p in serving),
            10,
            "every server process to end with the front",
        )
    finally:
        server.close()


def spares(server: Server) -> set[int]:
    """The front's server processes that serve no client: those with no connection but
    their listening socket (a served one has its client's too)."""
    idle = set()
    for pid in children(server.process.pid):
        try:
            sockets = [f for f in Path(f"/proc/{pid}/fd").iterdir() if "socket" in os.readlink(f)]
        except FileNotFoundError:  # it ended since it was listed: a spare stopped
            continue
        if len(sockets) <= 1:
            idle.add(pid)
    return idle


def test_a_killed_front_takes_its_server_processes_with_it(tmp_path: Path) -> None:
    server = Server(tmp_path / "front.log", "--device", "cpu", "--clients", "2")
    try:
        server.wait_serving()
        started = children(server.process.pid)
        assert started
        server.process.kill()  # no handler runs: the kernel ends them (PR_SET_PDEATHSIG)
        server.process.wait(timeout=EXIT_TIMEOUT_S)
        wait_until(
            lambda: not any(Path(f"/proc/{p}").exists() for p in started),
            10,
            "the server processes to end with the killed front",
        )
    finally:
        server.close()


def test_a_server_of_one_client_is_told_apart(server: Server) -> None:
    server.wait_serving()
    assert not rpc.serves_several(server.endpoint, timeout_s=1.0)


def test_clients_must_be_one_or_more() -> None:
    done = arbiterd("rpc-server", "--clients", "0")
    assert done.returncode == EX_DATAERR
    assert "--clients must be 1 or more, got 0" in done.stderr


def test_rpc_server_refuses_an_address_beyond_loopback_without_allow_remote() -> None:
    done = arbiterd("rpc-server", "--listen", f"0.0.0.0:{free_port()}")
    assert done.returncode == EX_USAGE, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("arbiterd rpc-server: refusing to listen on 0.0.0.0:")
    for why in ("no authentication", "--allow-remote", "SSH tunnel"):
        assert why in line
    assert "Starting RPC server" not in done.stdout  # refused before the engine loaded


def test_a_local_server_that_exits_before_it_answers_is_an_error_with_its_log(
    tmp_path: Path,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # bound, not listening: a probe is refused at once
        endpoint = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(DeviceUnreachableError, match="the port is in use"):
            rpcserver.start_local(endpoint, tmp_path / "server.log", START_TIMEOUT_S)


def test_rpc_server_on_a_port_in_use_exits_with_one_clear_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = arbiterd("rpc-server", "--listen", f"127.0.0.1:{port}", "--device", "cpu")
    assert done.returncode == EX_OSERR, done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"arbiterd rpc-server: cannot listen on 127.0.0.1:{port}: the port is in use "
        "(another rpc-server?)"
    )


def test_rpc_server_whose_ggml_server_cannot_start_exits_non_zero_saying_so() -> None:
    """The port taken after our own check (a race): ggml's server returns, and so do we."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        script = (
            "import sys; from arbiterd.cli import main; from arbiterd.rpcserver import server; "
            "server._check_free = lambda listen: None; "
            f"sys.exit(main.main(['rpc-server', '--listen', '127.0.0.1:{port}']))"
        )
        done = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=120,
            env=CPU_ONLY,
            check=False,
        )
    assert done.returncode == EX_OSERR, done.stderr
    assert "Failed to create server socket" in done.stderr  # ggml's own line
    assert done.stderr.splitlines()[-1].startswith(
        f"arbiterd rpc-server: ggml's RPC server could not serve on 127.0.0.1:{port}"
    )


def test_rpc_server_names_the_devices_there_are_for_one_that_is_not() -> None:
    done = arbiterd("rpc-server", "--listen", f"127.0.0.1:{free_port()}", "--device", "gpu7")
    assert done.returncode == EX_DATAERR, done.stderr
    line = done.stderr.splitlines()[-1]
    assert line.startswith("arbiterd rpc-server: --device gpu7: this machine has no such device")
    assert "cpu (CPU: " in line


# -- the listen address and the devices, as pure functions ------------------------------------


def test_listen_takes_an_ipv4_address_and_a_port() -> None:
    assert str(rpcserver.parse_listen("127.0.0.1:50052", allow_remote=False)) == "127.0.0.1:50052"
    assert str(rpcserver.parse_listen("127.1.2.3:1", allow_remote=False)) == "127.1.2.3:1"
    assert str(rpcserver.parse_listen("0.0.0.0:50052", allow_remote=True)) == "0.0.0.0:50052"
    for bad in ("localhost:50052", "[::1]:50052", "127.0.0.1", "127.0.0.1:0", "1.2.3.4:x"):
        with pytest.raises(BadValueError, match="--listen"):
            rpcserver.parse_listen(bad, allow_remote=True)
    for remote in ("0.0.0.0:50052", "192.168.1.5:50052"):
        with pytest.raises(UsageError, match="no authentication"):
            rpcserver.parse_listen(remote, allow_remote=False)


def device(name: str, kind: str, registry: str = "") -> ggml.Device:
    return ggml.Device(name, f"{name} model", kind, 1, 2, registry=registry or name)


CPU = device("CPU", "cpu")
VULKAN0, VULKAN1 = device("Vulkan0", "gpu", "Vulkan"), device("Vulkan1", "igpu", "Vulkan")
REMOTE = device("RPC0", "gpu", "RPC")
BLAS = device("BLAS", "accel")


def test_devices_by_default_are_the_first_gpu_or_else_the_cpu() -> None:
    assert rpcserver.choose_devices([REMOTE, VULKAN0, VULKAN1, CPU], None) == [VULKAN0]
    assert rpcserver.choose_devices([REMOTE, BLAS, CPU], None) == [CPU]


def test_gpu_ids_count_local_gpus_only_in_ggml_order() -> None:
    listed = [REMOTE, BLAS, VULKAN0, VULKAN1, CPU]
    assert rpcserver.choose_devices(listed, ["gpu1", "cpu", "gpu0"]) == [VULKAN1, CPU, VULKAN0]


def test_devices_refused_name_the_devices_there_are() -> None:
    listed = [REMOTE, VULKAN0, CPU]
    with pytest.raises(BadValueError, match=r"gpu1.*no such device.*gpu0 \(Vulkan0: Vulkan0"):
        rpcserver.choose_devices(listed, ["gpu1"])
    with pytest.raises(BadValueError, match="this machine's own devices"):
        rpcserver.choose_devices(listed, ["rpc:127.0.0.1:50052"])
    with pytest.raises(BadValueError, match="named twice"):
        rpcserver.choose_devices(listed, ["cpu", "cpu"])
    with pytest.raises(BadValueError, match="expected gpuN"):
        rpcserver.choose_devices(listed, ["GPU0"])


def test_the_serving_line_numbers_several_devices_as_clients_name_them() -> None:
    listen = rpcserver.Listen("127.0.0.1", 50052)
    assert rpcserver.serving_line([CPU], listen) == "serving CPU: CPU model on 127.0.0.1:50052"
    assert rpcserver.serving_line([VULKAN0, CPU], listen) == (
        "serving Vulkan0: Vulkan0 model (device 0), CPU: CPU model (device 1) on 127.0.0.1:50052"
    )


def test_a_server_of_one_client_busy_with_another_is_told_apart(server: Server) -> None:
    server.wait_serving()
    with socket.create_connection(("127.0.0.1", server.port)) as other:
        hello(other)  # it serves this client now: nobody else gets an answer
        assert not rpc.serves_several(server.endpoint, timeout_s=1.0)


def test_lending_needs_its_devices_named_and_a_key_that_only_its_user_can_read(
    tmp_path: Path,
) -> None:
    listen = f"127.0.0.1:{free_port()}"
    done = arbiterd("rpc-server", "--lend", "--listen", listen)
    assert done.returncode == EX_USAGE, done.stderr
    assert "--lend needs --device" in done.stderr
    done = arbiterd("rpc-server", "--lend", "--device", "cpu", "--listen", listen)
    assert done.returncode == EX_USAGE, done.stderr
    assert "--lend needs --key-file FILE" in done.stderr
    key = tmp_path / "lease.key"
    key.write_text("secret\n")
    key.chmod(0o644)
    done = arbiterd(
        "rpc-server", "--lend", "--device", "cpu", "--listen", listen, "--key-file", str(key)
    )
    assert done.returncode == EX_DATAERR, done.stderr
    assert f"lets group or others read it; chmod 600 {key}" in done.stderr


def test_a_lender_says_where_it_lends_and_admits_nobody_before_a_lease(tmp_path: Path) -> None:
    key = tmp_path / "lease.key"
    key.write_text("secret\n")
    key.chmod(0o600)
    port = free_port()
    lender = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "arbiterd",
            "rpc-server",
            "--lend",
            "--device",
            "cpu",
            "--listen",
            f"127.0.0.1:{port}",
            "--key-file",
            str(key),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "ARBITERD_ARENA": str(tmp_path / "arena" / "gpu0")},
    )
    try:
        assert lender.stdout is not None
        assert lender.stdout.readline().strip() == (
            f"lending cpu on 127.0.0.1:{port}, leases on 127.0.0.1:{port + 1}"
        )
        rpc.check_listening(f"127.0.0.1:{port}", timeout_s=START_TIMEOUT_S)
        with pytest.raises(DeviceUnreachableError):  # accepted, and closed unserved
            rpc.probe(f"127.0.0.1:{port}", timeout_s=5.0)
    finally:
        lender.terminate()
        assert lender.wait(10) == 0
        assert lender.stdout is not None
        lender.stdout.close()
