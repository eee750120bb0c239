"""The `devices` reply (issue 27) from real parts: the engine's labels, RPC endpoints that refuse
or take a connection without answering, and arenas held by this process."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from arbiterd import render
from arbiterd.arena import Arena
from arbiterd.cli.commands import render_devices
from arbiterd.control import DeviceEntry
from arbiterd.daemon.control.devicelist import list_devices, local_devices
from arbiterd.paths import device_arena_of

LABELS = ["Vulkan0: llvmpipe (LLVM 19.1.7, 256 bits)", "BLAS: OpenBLAS", "CPU: AMD EPYC",
          "RPC0: 127.0.0.1:50052", "Vulkan1: Radeon"]  # fmt: skip


@pytest.fixture
def gpu0(tmp_path: Path) -> Path:
    arena = tmp_path / "arena" / "gpu0"
    arena.mkdir(parents=True)
    return arena


@pytest.fixture
def closed_port() -> int:
    """A port on 127.0.0.1 nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that takes connections and never answers: a ggml RPC server serving another
    client keeps the next in its listen queue just so."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        yield int(listener.getsockname()[1])


def test_local_devices_are_numbered_in_ggmls_order_accelerators_and_rpc_left_out() -> None:
    found = [(str(d.device), d.ggml, d.kind) for d in local_devices(LABELS)]
    assert found == [("gpu0", "Vulkan0", "gpu"), ("cpu", "CPU", "cpu"), ("gpu1", "Vulkan1", "gpu")]


def test_a_server_that_refuses_connections_is_unreachable_with_the_reason(
    gpu0: Path, closed_port: int
) -> None:
    listed = asyncio.run(list_devices(LABELS[:1], gpu0, [f"127.0.0.1:{closed_port}"]))
    assert [d.id for d in listed] == ["gpu0", f"rpc:127.0.0.1:{closed_port}"]
    local, remote = listed
    assert (local.reachable, local.arena, local.holder) == (True, str(gpu0), None)
    assert not remote.reachable
    assert "not reachable" in (remote.reason or "")
    assert remote.arena == str(device_arena_of(remote.id, gpu0))
    table = render_devices(listed).splitlines()
    assert table[0].split() == ["DEVICE", "KIND", "DESCRIPTION", "FREE", "/", "TOTAL", "HOLDER",
                                "NOTE"]  # fmt: skip
    assert table[2].startswith(f"rpc:127.0.0.1:{closed_port}")
    assert "unreachable: " in table[2]


def test_a_silent_server_whose_arena_is_held_is_serving_its_holder(
    gpu0: Path, silent_server: int
) -> None:
    device = f"rpc:127.0.0.1:{silent_server}"
    with Arena(device_arena_of(device, gpu0)).acquire("split-model"):
        [listed] = asyncio.run(
            list_devices([], gpu0, [f"127.0.0.1:{silent_server}"], timeout_s=0.3)
        )
    assert (listed.id, listed.reachable, listed.holder) == (device, True, "split-model")
    assert listed.free_bytes is None
    assert (listed.reason or "").startswith("serving split-model")


def test_a_silent_server_nobody_holds_is_unreachable(gpu0: Path, silent_server: int) -> None:
    [listed] = asyncio.run(list_devices([], gpu0, [f"127.0.0.1:{silent_server}"], timeout_s=0.3))
    assert not listed.reachable
    assert listed.holder is None


def test_no_devices_at_all_says_why() -> None:
    assert render_devices([]).startswith("no devices listed")


def test_a_lent_devices_lease_is_its_notes_first_words() -> None:
    lent = DeviceEntry(
        id="rpc:10.0.0.5:50052",
        description="10.0.0.5:50052",
        kind="gpu",
        holder="lease of rpc:10.0.0.5:50052: revoked: the lender's game (pid 7) wants its GPU",
        reachable=False,
        reason="not reachable: Connection refused",
        lease=render.lease("revoked", "10.0.0.5:50053", "game (pid 7)", None),
    )
    [_, row] = render_devices([lent]).splitlines()
    note = row[row.index("lease revoked") :]
    assert note == (
        "lease revoked: the lender's game (pid 7) wants its GPU; "
        "unreachable: not reachable: Connection refused"
    )


@pytest.mark.parametrize(
    ("state", "by", "reason", "said"),
    [
        ("granted", None, None, "granted by 10.0.0.5:50053"),
        ("waiting", "game (pid 7)", None, "waiting: the lender's game (pid 7) has its GPU"),
        ("revoking", "game (pid 7)", None, "revoking: the lender's game (pid 7) wants its GPU"),
        ("refused", None, "wrong key: no lease", "refused: wrong key: no lease"),
        (
            "unreachable",
            None,
            "10.0.0.5:50053: no answer",
            "unreachable: 10.0.0.5:50053: no answer",
        ),
    ],
)
def test_a_lease_is_said_in_a_few_words(
    state: str, by: str | None, reason: str | None, said: str
) -> None:
    assert render.lease(state, "10.0.0.5:50053", by, reason) == said
