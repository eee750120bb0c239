"""The RPC probe (native/rpc.py) against servers that lie (issue 40): one that claims 2^32-1
devices and answers for each, one that answers a byte at a time. Each is a real socket served by
tests/support/rpcservers.py's FakeRpcServer; ggml's own server is probed in
tests/rpcserver/test_server.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from arbiterd.errors import DeviceUnreachableError
from arbiterd.native import rpc
from tests.support.rpcservers import FakeRpcServer

# How long a probe that ends may take here: far more than its own bound, so that only a probe
# that does not end fails on it.
ENDS_WITHIN_S = 30.0


def probe_error(server: FakeRpcServer, timeout_s: float) -> BaseException | None:
    """What probing `server` raised (None: nothing), once the probe has ended; the test fails
    if it has not ended within ENDS_WITHIN_S (the server is closed then, which ends it)."""
    with ThreadPoolExecutor(1, thread_name_prefix="test-probe") as pool:
        future = pool.submit(rpc.probe, server.endpoint, timeout_s)
        try:
            return future.exception(timeout=ENDS_WITHIN_S)
        except TimeoutError:
            server.close()
            raise AssertionError(
                f"the probe of {server.endpoint} had not ended after {ENDS_WITHIN_S:g} s"
            ) from None


def test_a_server_claiming_four_billion_devices_is_named_and_none_is_asked_for() -> None:
    with FakeRpcServer(devices=2**32 - 1) as server:
        error = probe_error(server, timeout_s=2.0)
        assert isinstance(error, DeviceUnreachableError)
        assert str(error).startswith(f"RPC server {server.endpoint} claims 4294967295 devices")
        assert server.memory_asked == 0


def test_a_server_answering_a_byte_at_a_time_is_cut_off_at_the_probes_timeout() -> None:
    # Each byte well within one read's timeout, the hello's 36 in about 1 s; but a probe of all
    # its 64 devices (24 bytes each) would take 47 s.
    with FakeRpcServer(devices=rpc.MAX_DEVICES, byte_delay_s=0.03) as server:
        error = probe_error(server, timeout_s=3.0)
        assert isinstance(error, DeviceUnreachableError)
        assert str(error).startswith(
            f"RPC server {server.endpoint} did not finish answering within 3 s"
        )
        assert server.memory_asked < rpc.MAX_DEVICES


def test_a_server_of_as_many_devices_as_ggml_can_have_is_probed_whole() -> None:
    with FakeRpcServer(devices=rpc.MAX_DEVICES) as server:
        info = rpc.probe(server.endpoint, timeout_s=10.0)
    assert [device.index for device in info.devices] == list(range(rpc.MAX_DEVICES))
    assert {device.total_bytes for device in info.devices} == {FakeRpcServer.MEMORY_BYTES}


def test_a_server_that_takes_the_connection_and_never_answers_is_called_busy() -> None:
    with FakeRpcServer(devices=1, byte_delay_s=ENDS_WITHIN_S) as server:
        error = probe_error(server, timeout_s=0.3)
        assert isinstance(error, DeviceUnreachableError)
        assert "did not answer within 0.3 s: it serves one client at a time" in str(error)
