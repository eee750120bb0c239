"""Vision on real llama.cpp (CPU): a tiny random projector is loaded just in time, its images
decoded as embeddings, and the prompt cache runs through them (issue 12)."""

from __future__ import annotations

import base64
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest

from arbiterd.errors import ModelLoadError, RequestError
from arbiterd.spec import KvPolicy, ModelSpec, Residency
from arbiterd.worker.engine import InPlaceBackend, ReloadBackend, select_backend
from arbiterd.worker.engine import backend as backend_module
from arbiterd.worker.engine.backend import LlamaBackend
from arbiterd.worker.engine.images import decode_embeddings
from arbiterd.worker.vision import MARKER
from tests.support.images import jpeg, png
from tests.support.requests import request_for
from tests.support.tiny_gguf import TinyModelSpec, write_tiny_llama
from tests.support.tiny_mmproj import TinyProjectorSpec, write_tiny_mmproj

N_IMAGE = TinyProjectorSpec().n_image_tokens


def chat(*turns: tuple[str, str], images: tuple[bytes, ...] | list[bytes] = ()) -> dict[str, Any]:
    return {
        "messages": [{"role": role, "content": text} for role, text in turns],
        "images": [base64.b64encode(image).decode() for image in images],
        "max_tokens": 6,
        "temperature": 0,
    }


def vision(tiny_model: Path, mmproj: Path, **spec: Any) -> ReloadBackend:
    return ReloadBackend(
        ModelSpec(name="eye", path=tiny_model, n_ctx=512, n_gpu_layers=0, mmproj=mmproj, **spec)
    )


@pytest.fixture
def eye(tiny_model: Path, tiny_mmproj: Path) -> Iterator[ReloadBackend]:
    engine = vision(tiny_model, tiny_mmproj)
    engine.load()
    yield engine
    engine.close()


def encoder_loaded(engine: LlamaBackend) -> bool:
    assert engine._projector is not None
    return engine._projector.loaded


def actions(generation: Any) -> list[str]:
    return [step.action for step in generation.encoder_steps]


def test_an_image_is_encoded_by_a_projector_loaded_just_for_it(eye: ReloadBackend) -> None:
    generation = eye.generate(
        request_for("chat", chat(("user", f"what is {MARKER} this"), images=[png()])), None
    )
    assert actions(generation) == ["load", "encode", "free"]
    # the image became positions of the prompt: its text plus N_IMAGE
    text_only = eye.prepare(request_for("chat", chat(("user", "what is  this"))), lambda: False)
    assert generation.prompt_tokens >= N_IMAGE + len(text_only.prompt_tokens) - 2
    assert generation.prompt_tokens_evaluated == generation.prompt_tokens
    assert generation.completion_tokens > 0
    assert eye._projector is not None
    assert not eye._projector.loaded
    load, encode, free = generation.encoder_steps
    assert free.bytes_ is not None
    assert load.bytes_ == free.bytes_ > 0
    assert encode.images == 1
    assert encode.bytes_ == N_IMAGE * TinyModelSpec().n_embd * 4


def test_the_encoder_is_alive_only_while_it_encodes(
    eye: ReloadBackend, tiny_mmproj: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    projector = eye._projector
    assert projector is not None
    assert not projector.loaded
    seen: list[tuple[bool, int]] = []
    encode = projector.encode

    def watched(data: bytes) -> Any:
        seen.append((projector.loaded, projector.loaded_bytes()))
        return encode(data)

    monkeypatch.setattr(projector, "encode", watched)
    eye.generate(request_for("chat", chat(("user", f"{MARKER} hello"), images=[png()])), None)
    assert seen == [(True, tiny_mmproj.stat().st_size)]  # counted in resident_bytes meanwhile
    assert not projector.loaded
    assert projector.loaded_bytes() == 0


CONVERSATION = ("user", f"look {MARKER} what is it")


def test_a_follow_up_turn_evaluates_only_its_suffix(eye: ReloadBackend) -> None:
    image = png()
    first = eye.generate(request_for("chat", chat(CONVERSATION, images=[image])), None)
    answer = first.response["choices"][0]["message"]["content"]
    turns = (CONVERSATION, ("assistant", answer), ("user", "and the dog"))
    follow = eye.generate(request_for("chat", chat(*turns, images=[image])), None)
    suffix = follow.prompt_tokens - first.prompt_tokens  # the answer and the new question
    assert 0 < suffix < 60
    assert follow.prompt_tokens_evaluated <= suffix + 1
    cached = follow.response["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first.prompt_tokens - 1  # the whole first prompt, image included
    assert actions(follow) == []  # its image is in the cached prefix: no projector at all


def test_the_cache_survives_a_cold_round_trip(eye: ReloadBackend) -> None:
    image = png(seed=3)
    first = eye.generate(request_for("chat", chat(CONVERSATION, images=[image])), None)
    eye.release(KvPolicy.HOST)
    eye.restore()
    answer = first.response["choices"][0]["message"]["content"]
    turns = (CONVERSATION, ("assistant", answer), ("user", "more"))
    again = eye.generate(request_for("chat", chat(*turns, images=[image])), None)
    assert again.prompt_tokens_evaluated <= again.prompt_tokens - first.prompt_tokens + 1
    assert actions(again) == []


@pytest.mark.parametrize("kv", [KvPolicy.HOST, KvPolicy.DEVICE])
def test_the_in_place_backend_keeps_images_in_its_cache_across_a_release(
    tiny_model: Path, tiny_mmproj: Path, kv: KvPolicy
) -> None:
    spec = ModelSpec(
        name="eye",
        path=tiny_model,
        n_ctx=512,
        n_gpu_layers=0,
        mmproj=tiny_mmproj,
        encoder_resident=True,
        residency=Residency.IN_PLACE,
    )
    engine = select_backend(spec)
    assert isinstance(engine, InPlaceBackend), "the installed llama_cpp is not the engine build"
    engine.load()
    try:
        image = png(seed=5)
        first = engine.generate(request_for("chat", chat(CONVERSATION, images=[image])), None)
        assert encoder_loaded(engine)  # resident
        engine.release(kv)
        assert not encoder_loaded(engine)  # going cold frees it
        engine.restore()
        assert encoder_loaded(engine)  # and warming up loads it again
        answer = first.response["choices"][0]["message"]["content"]
        turns = (CONVERSATION, ("assistant", answer), ("user", "more"))
        again = engine.generate(request_for("chat", chat(*turns, images=[image])), None)
        assert again.prompt_tokens_evaluated <= again.prompt_tokens - first.prompt_tokens + 1
        assert actions(again) == []
    finally:
        engine.close()


def test_a_kept_cache_serves_a_new_worker_which_lays_the_image_out_but_never_encodes_it(
    eye: ReloadBackend, tiny_model: Path, tiny_mmproj: Path
) -> None:
    image = png(seed=6)
    first = eye.generate(request_for("chat", chat(CONVERSATION, images=[image])), None)
    kept = eye.kept_kv()  # what an unload writes to its state file (issue 14)
    assert kept is not None
    assert min(kept.tokens) < 0  # the image's placeholders are part of it
    fresh = vision(tiny_model, tiny_mmproj)
    fresh.load()
    try:
        fresh.adopt_kv(kept)
        answer = first.response["choices"][0]["message"]["content"]
        turns = (CONVERSATION, ("assistant", answer), ("user", "more"))
        again = fresh.generate(request_for("chat", chat(*turns, images=[image])), None)
        assert actions(again) == ["load", "free"]  # laid out (a new worker knows no image)
        assert again.prompt_tokens_evaluated <= again.prompt_tokens - first.prompt_tokens + 1
    finally:
        fresh.close()


def test_another_image_is_encoded_again(eye: ReloadBackend) -> None:
    eye.generate(request_for("chat", chat(CONVERSATION, images=[png(seed=1)])), None)
    other = eye.generate(request_for("chat", chat(CONVERSATION, images=[png(seed=2)])), None)
    assert actions(other) == ["load", "encode", "free"]
    # the text before the image is still cached; the image and what follows are not
    assert other.prompt_tokens_evaluated >= N_IMAGE
    assert other.prompt_tokens_evaluated < other.prompt_tokens


def test_a_resident_encoder_stays_while_warm_and_goes_when_cold(
    tiny_model: Path, tiny_mmproj: Path
) -> None:
    engine = vision(tiny_model, tiny_mmproj, encoder_resident=True)
    engine.load()
    try:
        assert encoder_loaded(engine)
        first = engine.generate(request_for("chat", chat(CONVERSATION, images=[png()])), None)
        assert actions(first) == ["encode"]  # loaded with the model, kept since
        assert encoder_loaded(engine)
        released = engine.release(KvPolicy.HOST)
        assert not encoder_loaded(engine)
        assert released.weights_bytes > tiny_mmproj.stat().st_size
        assert engine.resident_bytes() == 0
        restored = engine.restore()
        assert encoder_loaded(engine)  # warm again: loaded with the model
        assert restored.weights_bytes > tiny_mmproj.stat().st_size
        again = engine.generate(request_for("chat", chat(CONVERSATION, images=[png(seed=8)])), None)
        assert actions(again) == ["encode"]
    finally:
        engine.close()


def test_a_corrupt_image_is_a_bad_request_and_frees_the_encoder(eye: ReloadBackend) -> None:
    truncated = png()[:60]
    with pytest.raises(RequestError, match="corrupt or truncated"):
        eye.generate(request_for("chat", chat(CONVERSATION, images=[truncated])), None)
    assert eye._projector is not None
    assert not eye._projector.loaded
    text = eye.generate(request_for("chat", chat(("user", "still there"))), None)
    assert text.completion_tokens > 0
    assert actions(text) == []  # the failed request's load and free are not reported here


def test_a_jpeg_is_decoded_and_one_the_decoder_refuses_is_a_bad_request(
    eye: ReloadBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    answered = eye.generate(request_for("chat", chat(CONVERSATION, images=[jpeg(40, 24)])), None)
    assert actions(answered) == ["load", "encode", "free"]
    # libmtmd hands what stb_image refuses to ffprobe, from PATH: never a client's bytes.
    ran = tmp_path / "ran"
    for name in ("ffprobe", "ffmpeg"):
        program = tmp_path / name
        program.write_text(f"#!/bin/sh\ntouch {ran}\nexit 1\n")
        program.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with pytest.raises(RequestError, match="corrupt or truncated"):
        eye.generate(request_for("chat", chat(CONVERSATION, images=[jpeg(lossless=True)])), None)
    assert not encoder_loaded(eye)
    assert not ran.exists()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (chat(CONVERSATION, images=[b"GIF89a..."]), r"images\[0\] is not a PNG or JPEG image"),
        (chat(CONVERSATION, ("user", MARKER), images=[png()]), "kept 2 of the request's 1"),
        (chat(("user", "none here"), images=[png()]), "kept 0 of the request's 1 images"),
        ({**chat(CONVERSATION), "images": ["not base64!"]}, r"images\[0\] is not base64"),
    ],
    ids=["not_an_image", "a_marker_too_many", "image_without_marker", "not_base64"],
)
def test_bad_images_are_refused_before_the_model_runs(
    eye: ReloadBackend, body: dict[str, Any], message: str
) -> None:
    with pytest.raises(RequestError, match=message):
        eye.prepare(request_for("chat", body), lambda: False)


def test_a_model_without_a_projector_refuses_images(tiny_model: Path) -> None:
    engine = ReloadBackend(ModelSpec(name="plain", path=tiny_model, n_ctx=256, n_gpu_layers=0))
    engine.load()
    try:
        with pytest.raises(RequestError, match="takes no images: its config names no mmproj"):
            engine.prepare(request_for("chat", chat(CONVERSATION, images=[png()])), lambda: False)
    finally:
        engine.close()


def test_a_projector_of_another_width_fails_the_model_at_load(
    tiny_model: Path, tmp_path: Path
) -> None:
    wide = write_tiny_mmproj(tmp_path / "wide.gguf", TinyProjectorSpec(projection_dim=96))
    engine = vision(tiny_model, wide)
    with pytest.raises(ModelLoadError, match=r"mismatch between text model \(n_embd = 64\)"):
        engine.load()
    engine.close()


def test_a_model_whose_embedding_width_differs_is_caught_too(
    tiny_mmproj: Path, tmp_path: Path
) -> None:
    other = write_tiny_llama(tmp_path / "wide.gguf", TinyModelSpec(n_embd=128))
    engine = vision(other, tiny_mmproj)
    with pytest.raises(ModelLoadError, match="and mmproj"):
        engine.load()
    engine.close()


def test_a_bidirectional_image_is_decoded_in_one_batch_or_refused(tiny_model: Path) -> None:
    # Gemma 3's images attend both ways (mtmd_decode_use_non_causal); the tiny projector's do
    # not, so the decode is driven directly.
    llm = llama_cpp.Llama(
        model_path=str(tiny_model), n_ctx=256, n_batch=8, n_gpu_layers=0, verbose=False
    )
    try:
        llm.eval([300, 301])
        embd = np.zeros((6, TinyModelSpec().n_embd), dtype=np.float32)
        decode_embeddings(llm, embd, 2, 0, non_causal=True)
        memory = llama_cpp.llama_get_memory(llm.ctx)
        assert llama_cpp.llama_memory_seq_pos_max(memory, 0) == 7
        too_big = np.zeros((9, TinyModelSpec().n_embd), dtype=np.float32)
        with pytest.raises(RequestError, match="exceeds the model's batch of 8"):
            decode_embeddings(llm, too_big, 8, 0, non_causal=True)
        assert llama_cpp.llama_memory_seq_pos_max(memory, 0) == 7
    finally:
        llm.close()


# -- beside or swap: the projector within the device budget -------------------------------------


def in_place_eye(tiny_model: Path, mmproj: Path, *, vram_budget: int = 0) -> InPlaceBackend:
    spec = ModelSpec(
        name="eye",
        path=tiny_model,
        n_ctx=512,
        n_gpu_layers=0,
        mmproj=mmproj,
        residency=Residency.IN_PLACE,
    )
    engine = select_backend(spec, vram_budget=vram_budget)
    assert isinstance(engine, InPlaceBackend), "the installed llama_cpp is not the engine build"
    engine.load()
    return engine


def tight_budget(tiny_model: Path, tiny_mmproj: Path) -> int:
    """A byte less than the warm model and its projector take together."""
    probe = in_place_eye(tiny_model, tiny_mmproj)
    try:
        return probe.resident_bytes() + tiny_mmproj.stat().st_size - 1
    finally:
        probe.close()


def answer_of(generation: Any) -> str:
    return str(generation.response["choices"][0]["message"]["content"])


def test_a_projector_that_fits_goes_beside_the_weights(tiny_model: Path, tiny_mmproj: Path) -> None:
    budget = tight_budget(tiny_model, tiny_mmproj) + 1
    engine = in_place_eye(tiny_model, tiny_mmproj, vram_budget=budget)
    try:
        generation = engine.generate(request_for("chat", chat(CONVERSATION, images=[png()])), None)
        assert actions(generation) == ["load", "encode", "free"]
        assert {step.path for step in generation.encoder_steps} == {"beside"}
        # the peak is the warm model and the projector together: the budget, exactly
        assert generation.encoder_steps[-1].peak_bytes == budget
    finally:
        engine.close()


def test_under_a_tight_budget_the_weights_leave_while_the_projector_encodes(
    tiny_model: Path, tiny_mmproj: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    budget = tight_budget(tiny_model, tiny_mmproj)
    image = png(seed=11)
    beside = in_place_eye(tiny_model, tiny_mmproj)
    try:
        expected = beside.generate(request_for("chat", chat(CONVERSATION, images=[image])), None)
    finally:
        beside.close()
    engine = in_place_eye(tiny_model, tiny_mmproj, vram_budget=budget)
    projector = engine._projector
    assert projector is not None
    seen: list[str] = []  # what the device held at each move, as the engine says
    load, weights_on = projector._load, engine._weights_on

    def watched_load(*args: Any) -> None:
        seen.append(f"load with the weights {'off' if engine._swapped_out else 'on'}")
        load(*args)

    def watched_weights_on() -> int:
        seen.append(f"weights on with the projector {'loaded' if projector.loaded else 'freed'}")
        return weights_on()

    monkeypatch.setattr(projector, "_load", watched_load)
    monkeypatch.setattr(engine, "_weights_on", watched_weights_on)
    try:
        generation = engine.generate(request_for("chat", chat(CONVERSATION, images=[image])), None)
        assert seen == ["load with the weights off", "weights on with the projector freed"]
        assert actions(generation) == ["release", "load", "encode", "free", "restore"]
        steps = generation.encoder_steps
        assert {step.path for step in steps} == {"swap"}
        assert "exceed the budget" in steps[0].reason
        peaks = [step.peak_bytes for step in steps]
        assert None not in peaks
        known = [peak for peak in peaks if peak is not None]
        assert 0 < max(known) == known[-1] <= budget
        release, _, _, _, restore = steps
        assert restore.bytes_ is not None
        # On the CPU the weights are the host copy's pages (issue 28): the swap frees what the CPU
        # owns of them, none for F32 (tests/device/test_vision_device.py sees a device's leave).
        assert release.bytes_ == restore.bytes_ == 0
        assert answer_of(generation) == answer_of(expected)  # greedy, the same image
        assert generation.prompt_tokens == expected.prompt_tokens
        assert not engine._swapped_out
        # The KV stayed on the device: a follow-up turn evaluates only its suffix.
        turns = (CONVERSATION, ("assistant", answer_of(generation)), ("user", "and the dog"))
        follow = engine.generate(request_for("chat", chat(*turns, images=[image])), None)
        assert follow.prompt_tokens_evaluated <= follow.prompt_tokens - generation.prompt_tokens + 1
        assert actions(follow) == []
    finally:
        engine.close()


def test_a_failed_encode_on_the_swap_path_brings_the_weights_back(
    tiny_model: Path, tiny_mmproj: Path
) -> None:
    engine = in_place_eye(
        tiny_model, tiny_mmproj, vram_budget=tight_budget(tiny_model, tiny_mmproj)
    )
    try:
        with pytest.raises(RequestError, match="corrupt or truncated"):
            engine.generate(request_for("chat", chat(CONVERSATION, images=[png()[:60]])), None)
        assert not engine._swapped_out
        assert not encoder_loaded(engine)
        text = engine.generate(request_for("chat", chat(("user", "still there"))), None)
        assert text.completion_tokens > 0
    finally:
        engine.close()


def test_the_reload_backend_cannot_swap_and_says_it_loaded_beside(
    tiny_model: Path, tiny_mmproj: Path
) -> None:
    engine = ReloadBackend(
        ModelSpec(name="eye", path=tiny_model, n_ctx=512, n_gpu_layers=0, mmproj=tiny_mmproj),
        vram_budget=1,
    )
    engine.load()
    try:
        generation = engine.generate(request_for("chat", chat(CONVERSATION, images=[png()])), None)
        assert actions(generation) == ["load", "encode", "free"]
        load = generation.encoder_steps[0]
        assert load.path == "beside"
        assert "the reload backend cannot take the weights off the device" in load.reason
        assert load.reason.endswith("loaded beside")
    finally:
        engine.close()


def test_a_resident_projector_stays_beside_whatever_the_budget(
    tiny_model: Path, tiny_mmproj: Path
) -> None:
    engine = vision(tiny_model, tiny_mmproj, encoder_resident=True)
    engine.vram_budget = 1
    engine.load()
    try:
        generation = engine.generate(request_for("chat", chat(CONVERSATION, images=[png()])), None)
        assert actions(generation) == ["encode"]
        assert generation.encoder_steps[0].path == "beside"
    finally:
        engine.close()


def test_without_a_budget_a_cpu_model_loads_its_projector_beside(eye: ReloadBackend) -> None:
    # the engine cannot measure free memory for a model on the CPU: the budget is unknown
    assert eye._encoder_budget(eye.resident_bytes()) == 0
    generation = eye.generate(request_for("chat", chat(CONVERSATION, images=[png()])), None)
    assert [step.path for step in generation.encoder_steps] == ["beside"] * 3
    assert generation.encoder_steps[0].reason == ""


def test_without_a_budget_a_gpu_model_measures_the_free_memory(
    eye: ReloadBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # as a model offloaded to a GPU sees it: what it holds plus what the device has free
    monkeypatch.setattr(eye, "spec", dataclasses.replace(eye.spec, n_gpu_layers=-1))
    monkeypatch.setattr(backend_module, "runs_on_cpu", lambda spec: False)  # its layers on a GPU
    monkeypatch.setattr(backend_module, "free_device_bytes", lambda: 1000)
    assert eye._encoder_budget(5000) == 6000
    monkeypatch.setattr(backend_module, "free_device_bytes", lambda: None)  # ggml cannot tell
    assert eye._encoder_budget(5000) == 0
    eye.vram_budget = 7000  # a configured budget wins
    assert eye._encoder_budget(5000) == 7000
