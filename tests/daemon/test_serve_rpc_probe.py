"""A daemon whose configured RPC server is a liar (issue 40): another local user listens on its
port, claims 2^32-1 devices and answers for each. The model placed on it fails naming the
server, `arbiterd devices` names it unreachable and why, and the daemon keeps answering, its
memory flat."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from arbiterd.cli.controlclient import ControlClient
from tests.support.daemon import Daemon, serving, tiny
from tests.support.rpcservers import FakeRpcServer

CLAIMED = 2**32 - 1
DEVICES_CALLS = 7  # as many as the audit made, more than the daemon's default threads (6 here)
DEVICES_TIMEOUT_S = 30.0  # far past a probe's bound: only a probe that never ends misses it
STATUS_TIMEOUT_S = 5.0
# What the daemon's resident memory may grow by over the devices calls: the audit's seven grew
# it by 139 MB; an answer of two entries is a few kB.
RSS_GROWTH_BYTES = 16 << 20


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024  # in kB
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def ask_devices(daemon: Daemon) -> dict[str, Any]:
    with ControlClient.connect(daemon.socket, timeout_s=DEVICES_TIMEOUT_S) as client:
        return client.call("devices")


def test_a_server_claiming_four_billion_devices_is_named_and_the_daemon_answers_on(
    tiny_model: Path,
) -> None:
    with FakeRpcServer(devices=CLAIMED) as liar:
        device = f"rpc:{liar.endpoint}"
        models = {
            "near": tiny(tiny_model),
            "far": tiny(tiny_model, n_gpu_layers=99, devices=[device]),
        }
        with serving(models, daemon_keys={"rpc_servers": [liar.endpoint]}) as daemon:
            claims = f"RPC server {liar.endpoint} claims {CLAIMED} devices"
            far = next(m for m in daemon.wait_ready()["models"] if m["name"] == "far")
            assert far["state"] == "failed"
            assert claims in far["last_error"]

            before = resident_bytes(daemon.process.pid)
            with ThreadPoolExecutor(DEVICES_CALLS, thread_name_prefix="devices") as pool:
                replies = list(pool.map(lambda _: ask_devices(daemon), range(DEVICES_CALLS)))
            for reply in replies:
                [entry] = [d for d in reply["devices"] if d["id"] == device]
                assert not entry["reachable"]
                assert entry["reason"].startswith(claims)
            with ControlClient.connect(daemon.socket, timeout_s=STATUS_TIMEOUT_S) as client:
                assert {m["name"] for m in client.call("status")["models"]} == {"near", "far"}
            assert resident_bytes(daemon.process.pid) - before < RSS_GROWTH_BYTES
        assert liar.memory_asked == 0
