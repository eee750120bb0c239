"""The vision projector on a Vulkan device (issue 25): with the model on Vulkan0 and a budget too
tight for both, the swap path takes the weights off the device (the KV left there), loads the
projector onto it, encodes, frees it and brings the weights back — device buffers freed and
uploaded again from the host copy of the file, which the CPU tier's swap never runs (there the
weights are the host copy's pages, mapped, and do not move). Each answer is
compared, text and logprobs exactly, with the same request to a model whose projector went
beside the weights on the same device.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from arbiterd.errors import RequestError
from arbiterd.native import ggml
from arbiterd.spec import KvPolicy, ModelSpec, Residency
from arbiterd.worker.engine import Generation, InPlaceBackend, select_backend
from tests.support.images import png
from tests.support.requests import request_for
from tests.worker.test_engine_vision import CONVERSATION, actions, chat, encoder_loaded

SETUP_HINT = "the installed llama_cpp is not the arbiterd engine build"
# Images of different content: each must come out as its own answer, as it does beside.
IMAGE_SEEDS = (11, 12, 13)


def on_device(model: Path, mmproj: Path, *, vram_budget: int = 0, **spec: Any) -> InPlaceBackend:
    """A vision model on the device (n_gpu_layers is ModelSpec's default, -1: every layer),
    loaded; `vram_budget` 0 leaves its projector beside the weights (a device whose driver runs
    on the CPU gives no budget of its own)."""
    engine = select_backend(
        ModelSpec(
            name="eye",
            path=model,
            n_ctx=512,
            mmproj=mmproj,
            residency=Residency.IN_PLACE,
            **spec,
        ),
        vram_budget=vram_budget,
    )
    assert isinstance(engine, InPlaceBackend), SETUP_HINT
    engine.load()
    return engine


def asked(*turns: tuple[str, str], images: tuple[bytes, ...] = ()) -> dict[str, Any]:
    """test_engine_vision's chat, with logprobs: the answer's floats tell images apart where
    the tiny random model's text alone ("z z z") does not."""
    return {**chat(*turns, images=images), "logprobs": 3}


def answer(generation: Generation) -> dict[str, Any]:
    """The message and every logprob it reports, compared exactly."""
    first: dict[str, Any] = generation.response["choices"][0]
    return {"message": first["message"], "logprobs": first["logprobs"]}


def follow_up(first: Generation) -> tuple[tuple[str, str], ...]:
    said = str(first.response["choices"][0]["message"]["content"])
    return (CONVERSATION, ("assistant", said), ("user", "and the dog"))


@pytest.fixture
def beside(vulkan0: ggml.Device, tiny_model: Path, tiny_mmproj: Path) -> Iterator[InPlaceBackend]:
    """The reference: the same model on the device with its projector loaded beside it."""
    engine = on_device(tiny_model, tiny_mmproj)
    yield engine
    engine.close()


def tight_budget(beside: InPlaceBackend, tiny_mmproj: Path) -> int:
    """A byte less than the warm model and its projector take together on the device."""
    return beside.resident_bytes() + tiny_mmproj.stat().st_size - 1


def test_on_the_device_the_weights_leave_while_the_projector_encodes_and_answer_as_beside(
    beside: InPlaceBackend, tiny_model: Path, tiny_mmproj: Path
) -> None:
    budget = tight_budget(beside, tiny_mmproj)
    swapping = on_device(tiny_model, tiny_mmproj, vram_budget=budget)
    try:
        warm_bytes = swapping.resident_bytes()
        assert warm_bytes == beside.resident_bytes() > 0  # the model's device buffers
        for seed in IMAGE_SEEDS:
            image = png(seed=seed)
            expected = beside.generate(
                request_for("chat", asked(CONVERSATION, images=(image,))), None
            )
            assert {step.path for step in expected.encoder_steps} == {"beside"}
            swapped = swapping.generate(
                request_for("chat", asked(CONVERSATION, images=(image,))), None
            )
            assert actions(swapped) == ["release", "load", "encode", "free", "restore"]
            steps = swapped.encoder_steps
            assert {step.path for step in steps} == {"swap"}
            release, load, _, free, restore = steps
            # The weights left the device and came back, byte for byte as many; the projector
            # held the device between, with the KV and never the weights beside it.
            assert restore.bytes_ is not None
            assert release.bytes_ == restore.bytes_ > 0
            assert load.bytes_ == free.bytes_ == tiny_mmproj.stat().st_size
            peaks = [step.peak_bytes for step in steps]
            assert None not in peaks
            assert 0 < max(peak for peak in peaks if peak is not None) <= budget
            assert not swapping._swapped_out
            assert swapping.resident_bytes() == warm_bytes
            assert answer(swapped) == answer(expected)
            assert swapped.prompt_tokens == expected.prompt_tokens
            # The KV stayed on the device through the swap: the next turn evaluates only its
            # suffix, and answers as the model that never moved.
            turns = follow_up(swapped)
            again = swapping.generate(request_for("chat", asked(*turns, images=(image,))), None)
            reference = beside.generate(request_for("chat", asked(*turns, images=(image,))), None)
            assert actions(again) == []
            assert again.prompt_tokens_evaluated <= again.prompt_tokens - swapped.prompt_tokens + 1
            assert answer(again) == answer(reference)
    finally:
        swapping.close()


def test_a_failed_encode_on_the_device_swap_brings_the_weights_back_to_answer_as_before(
    beside: InPlaceBackend, tiny_model: Path, tiny_mmproj: Path
) -> None:
    text = asked(("user", "still there"))
    expected = beside.generate(request_for("chat", text), None)
    swapping = on_device(tiny_model, tiny_mmproj, vram_budget=tight_budget(beside, tiny_mmproj))
    try:
        warm_bytes = swapping.resident_bytes()
        with pytest.raises(RequestError, match="corrupt or truncated"):
            swapping.generate(request_for("chat", asked(CONVERSATION, images=(png()[:60],))), None)
        assert not swapping._swapped_out
        assert not encoder_loaded(swapping)
        assert swapping.resident_bytes() == warm_bytes
        assert answer(swapping.generate(request_for("chat", text), None)) == answer(expected)
    finally:
        swapping.close()


def follow_up_reference(
    beside: InPlaceBackend,
    turns: tuple[tuple[str, str], ...],
    image: bytes,
    kv: KvPolicy,
    tiny_model: Path,
) -> Generation:
    """The follow-up as a model that never released answers it: `beside`, whose cache holds
    the first turn as a kept KV does; for `drop`, a model that has seen nothing, which evaluates
    the whole conversation in the same batches as a dropped cache does (logits depend on how a
    prompt is split into batches)."""
    if kv is not KvPolicy.DROP:
        return beside.generate(request_for("chat", asked(*turns, images=(image,))), None)
    assert beside._projector is not None
    fresh = on_device(tiny_model, beside._projector.path)
    try:
        return fresh.generate(request_for("chat", asked(*turns, images=(image,))), None)
    finally:
        fresh.close()


@pytest.mark.parametrize("kv", list(KvPolicy))
def test_a_resident_projector_leaves_the_device_with_the_model_and_comes_back_with_it(
    beside: InPlaceBackend, tiny_model: Path, tiny_mmproj: Path, kv: KvPolicy
) -> None:
    image = png(seed=5)
    expected = beside.generate(request_for("chat", asked(CONVERSATION, images=(image,))), None)
    engine = on_device(tiny_model, tiny_mmproj, encoder_resident=True)
    try:
        first = engine.generate(request_for("chat", asked(CONVERSATION, images=(image,))), None)
        assert actions(first) == ["encode"]  # loaded on the device with the model
        assert answer(first) == answer(expected)
        released = engine.release(kv)
        # The weights and the projector both left the device.
        assert released.weights_bytes > tiny_mmproj.stat().st_size
        assert not encoder_loaded(engine)
        restored = engine.restore()
        assert restored.weights_bytes == released.weights_bytes
        assert encoder_loaded(engine)
        turns = follow_up(first)
        again = engine.generate(request_for("chat", asked(*turns, images=(image,))), None)
        assert answer(again) == answer(follow_up_reference(beside, turns, image, kv, tiny_model))
        if kv is KvPolicy.DROP:
            # The cache went: the image is encoded again, by the projector loaded on warm-up.
            assert actions(again) == ["encode"]
            assert again.prompt_tokens_evaluated == again.prompt_tokens
        else:
            assert actions(again) == []  # its image is in the cache kept across the release
            assert again.prompt_tokens_evaluated <= again.prompt_tokens - first.prompt_tokens + 1
    finally:
        engine.close()
