"""Footprints on real devices (issue 44): what a worker predicts from the GGUF before the load is
within 10 % of what the engine measures once the model is warm, on Vulkan0 (llvmpipe, whose
storage range keeps gemma-3-270m's tied output on the CPU) and on RPC servers (which take a
copy of it), and a model split over two servers is measured on them together."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from arbiterd import footprint
from arbiterd.footprint import CPU, DeviceFootprint
from arbiterd.gguf import read_header
from arbiterd.native import ggml
from arbiterd.spec import ModelSpec, Residency
from arbiterd.worker.engine import InPlaceBackend, select_backend
from tests.support.rpcservers import RpcServer, rpc_servers

GOAL = 0.10  # issue 44: predicted within 10 % of measured, per device


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RpcServer]]:
    with rpc_servers(tmp_path_factory.mktemp("rpc"), 2) as running:
        yield running


def warm_footprints(
    model: Path, devices: tuple[str, ...]
) -> tuple[tuple[DeviceFootprint, ...], tuple[DeviceFootprint, ...]]:
    spec = ModelSpec(
        name="m", path=model, n_ctx=1024, residency=Residency.IN_PLACE, devices=devices
    )
    backend = select_backend(spec)
    assert isinstance(backend, InPlaceBackend), "the engine is not the arbiterd build"
    try:
        backend.load()
        return backend.predicted_footprint, backend.footprint()
    finally:
        backend.close()


def assert_within_goal(
    predicted: tuple[DeviceFootprint, ...], measured: tuple[DeviceFootprint, ...]
) -> None:
    for device, guess, found in footprint.matched(predicted, measured):
        assert guess is not None, f"{device} was measured but not predicted"
        assert found is not None, f"{device} was predicted but not measured"
        off = footprint.error([guess], [found])
        assert abs(off) <= GOAL, f"{device}: predicted {guess}, measured {found} ({off:+.1%})"


@pytest.mark.parametrize("which", ["tiny", "gemma"])
def test_on_vulkan0_the_prediction_is_within_the_goal(
    vulkan0: ggml.Device, which: str, tiny_model: Path, request: pytest.FixtureRequest
) -> None:
    model = tiny_model if which == "tiny" else request.getfixturevalue("gemma_model")
    predicted, measured = warm_footprints(model, ("gpu0",))
    assert {f.device for f in measured} == {CPU, "gpu0"}
    assert_within_goal(predicted, measured)
    if which == "gemma":  # its 170 MiB output matrix is more than llvmpipe binds: the CPU's
        host = next(f for f in measured if f.device == CPU)
        assert host.compute_bytes > 512 << 20  # the logits of a 512-token micro-batch


def test_on_an_rpc_server_the_tied_output_is_copied_and_predicted_so(
    servers: list[RpcServer], gemma_model: Path
) -> None:
    predicted, measured = warm_footprints(gemma_model, (servers[0].device,))
    assert_within_goal(predicted, measured)
    remote = next(f for f in measured if f.device == servers[0].device)
    # The server holds every weight but the embeddings, and the output's copy of them.
    every_weight = sum(t.nbytes for t in read_header(gemma_model, tensors=True).tensors)
    assert abs(remote.weights_bytes - every_weight) < 1 << 20  # buffers align their tensors


def test_a_model_on_two_servers_is_measured_on_them_together(
    servers: list[RpcServer], tiny_model: Path
) -> None:
    devices = tuple(server.device for server in servers)
    predicted, measured = warm_footprints(tiny_model, devices)
    assert "+".join(devices) in {f.device for f in measured}
    assert_within_goal(predicted, measured)
