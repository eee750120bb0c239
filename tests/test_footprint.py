"""The footprint predictor (issue 44) is pure: a header and a layout in, per-device figures out.
Headers are made here, tensor by tensor, so each rule of llama.cpp's layout it follows is seen
alone: where each layer's weights go, the tied output's copy, the weights a Vulkan device cannot
bind, the weights the CPU repacks, the KV's cells and the compute buffers' phases."""

from __future__ import annotations

from pathlib import Path

import pytest

from arbiterd.footprint import (
    CPU,
    LLVMPIPE_STORAGE_RANGE_BYTES,
    DeviceFootprint,
    Layout,
    ModelFootprint,
    error,
    matched,
    predict,
)
from arbiterd.gguf import GgufHeader, Tensor, read_header
from tests.support.tiny_gguf import DEFAULT_SPEC

F32, F16, Q4_K, Q8_0 = 0, 1, 12, 8
MiB = 1 << 20


def header(
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_vocab: int = 512,
    n_ff: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    tied: bool = False,
    matrix_type: int = F32,
    embd_type: int = F32,
    architecture: str = "llama",
    sliding_window: int = 0,
) -> GgufHeader:
    tensors = [Tensor("token_embd.weight", (n_embd, n_vocab), embd_type)]
    for il in range(n_layer):
        tensors += [
            Tensor(f"blk.{il}.attn_norm.weight", (n_embd,), F32),
            Tensor(f"blk.{il}.attn_q.weight", (n_embd, n_embd), matrix_type),
            Tensor(f"blk.{il}.ffn_up.weight", (n_embd, n_ff), matrix_type),
        ]
    tensors.append(Tensor("output_norm.weight", (n_embd,), F32))
    if not tied:
        tensors.append(Tensor("output.weight", (n_embd, n_vocab), matrix_type))
    shape = {
        "block_count": n_layer,
        "embedding_length": n_embd,
        "head_count": heads,
        "head_count_kv": kv_heads,
    }
    if sliding_window:
        shape["sliding_window"] = sliding_window
    return GgufHeader(3, len(tensors), architecture, 2048, None, shape, tensors=tuple(tensors))


def on(found: tuple[DeviceFootprint, ...], device: str) -> DeviceFootprint:
    return next(f for f in found if f.device == device)


def layer_bytes(n_embd: int = 64, n_ff: int = 128) -> int:
    return 4 * (n_embd + n_embd * n_embd + n_embd * n_ff)


def test_on_the_cpu_mapped_weights_are_the_host_copys_and_count_nothing() -> None:
    found = predict(header(), Layout(n_ctx=1024))
    assert [f.device for f in found] == [CPU]
    assert found[0].weights_bytes == 0
    assert found[0].kv_bytes > 0
    assert found[0].compute_bytes > 0


def test_a_gpu_takes_every_block_and_the_output_layer_the_cpu_keeps_the_embeddings() -> None:
    found = predict(header(), Layout(n_ctx=1024, devices=("gpu0",)))
    output = 4 * (64 + 64 * 512)  # the output norm and matrix
    assert on(found, "gpu0").weights_bytes == 2 * layer_bytes() + output
    assert on(found, CPU).weights_bytes == 0  # the embeddings are mapped from the file
    assert on(found, CPU).kv_bytes == 0


def test_n_gpu_layers_offloads_the_last_layers_and_keeps_the_first_on_the_cpu() -> None:
    found = predict(header(n_layer=4), Layout(n_ctx=1024, devices=("gpu0",), n_gpu_layers=2))
    # Of the five layers (four blocks, then the output layer) the last two: block 3 and output.
    assert on(found, "gpu0").weights_bytes == layer_bytes() + 4 * (64 + 64 * 512)
    assert on(found, "gpu0").kv_bytes == on(found, CPU).kv_bytes // 3  # 1 of 4 blocks vs 3


def test_two_devices_share_the_layers_by_the_split() -> None:
    found = predict(
        header(n_layer=3), Layout(n_ctx=1024, devices=("gpu0", "rpc:h:1"), split=(1.0, 1.0))
    )
    # Four layers: blocks 0 and 1 on gpu0, block 2 and the output layer on the server.
    assert on(found, "gpu0").kv_bytes == 2 * on(found, "rpc:h:1").kv_bytes
    assert on(found, "rpc:h:1").weights_bytes == layer_bytes() + 4 * (64 + 64 * 512)


def test_a_tied_output_is_copied_to_the_output_layers_device() -> None:
    tied = predict(header(tied=True), Layout(n_ctx=1024, devices=("gpu0",)))
    untied = predict(header(), Layout(n_ctx=1024, devices=("gpu0",)))
    assert on(tied, "gpu0").weights_bytes == on(untied, "gpu0").weights_bytes


def test_a_weight_larger_than_a_vulkan_device_binds_stays_on_the_cpu_with_the_logits() -> None:
    big = header(tied=True, n_embd=640, n_vocab=262144, embd_type=Q8_0)
    embeddings = 640 // 32 * 34 * 262144
    assert embeddings > LLVMPIPE_STORAGE_RANGE_BYTES
    limited = Layout(n_ctx=1024, devices=("gpu0",), largest_weight=(("gpu0", 128 * MiB),))
    kept = predict(big, limited)
    copied = predict(big, Layout(n_ctx=1024, devices=("gpu0",)))
    assert on(copied, "gpu0").weights_bytes - on(kept, "gpu0").weights_bytes == embeddings
    logits = 512 * 262144 * 4  # a micro-batch's logits, f32
    assert on(kept, CPU).compute_bytes >= logits > on(kept, "gpu0").compute_bytes
    assert on(copied, "gpu0").compute_bytes >= logits > on(copied, CPU).compute_bytes


def test_the_cpu_counts_the_weights_it_repacks_and_only_those() -> None:
    model = header(n_embd=256, n_ff=512, matrix_type=Q4_K)
    repacked = predict(model, Layout(n_ctx=1024, repack=True))
    mapped = predict(model, Layout(n_ctx=1024, repack=False))
    matrices = (2 * (256 * 256 + 256 * 512) + 256 * 512) // 256 * 144  # blocks and output
    assert on(repacked, CPU).weights_bytes == matrices
    assert on(mapped, CPU).weights_bytes == 0


def test_the_kv_cache_has_n_ctx_cells_rounded_up_to_256_whatever_the_sequences() -> None:
    model = header()
    per_cell = 2 * 2 * 2 * 16 * 2  # K and V, 2 layers, 2 KV heads of 16, f16
    assert on(predict(model, Layout(n_ctx=1000)), CPU).kv_bytes == 1024 * per_cell
    assert on(predict(model, Layout(n_ctx=1024)), CPU).kv_bytes == 1024 * per_cell
    quantized = predict(model, Layout(n_ctx=1024, cache_type="q8_0"))
    assert on(quantized, CPU).kv_bytes == 1024 * per_cell // 2 * 34 // 32


def test_an_encoder_has_no_kv_cache() -> None:
    assert on(predict(header(architecture="bert"), Layout(n_ctx=512)), CPU).kv_bytes == 0


def test_the_compute_buffer_is_the_largest_phase_of_a_micro_batch() -> None:
    tokens, cells = 512, 1024
    mask = tokens * cells * 4
    stream = 3 * tokens * 64 * 4
    attention = tokens * cells * 4 * 4 + stream  # 4 heads' scores
    logits = tokens * 50_000 * 4 + 2 * tokens * 64 * 4
    small = predict(header(), Layout(n_ctx=1024))
    assert on(small, CPU).compute_bytes == mask + attention
    large_vocabulary = predict(header(n_vocab=50_000), Layout(n_ctx=1024))
    assert on(large_vocabulary, CPU).compute_bytes == logits
    windowed = predict(header(sliding_window=512), Layout(n_ctx=1024))
    assert on(windowed, CPU).compute_bytes == 2 * mask + attention  # a mask per attention


def test_the_error_is_a_signed_share_of_the_measured_total() -> None:
    predicted = (DeviceFootprint("gpu0", 90, 0, 0), DeviceFootprint(CPU, 0, 0, 20))
    measured = (DeviceFootprint("gpu0", 100, 0, 0), DeviceFootprint(CPU, 0, 0, 10))
    assert error(predicted, measured) == 0.0
    assert error(predicted[:1], measured[:1]) == pytest.approx(-0.1)
    assert ModelFootprint.of(predicted, ()).error is None


def test_devices_measured_together_meet_their_predictions_added_up() -> None:
    predicted = (
        DeviceFootprint(CPU, 0, 0, 5),
        DeviceFootprint("gpu0", 10, 1, 2),
        DeviceFootprint("rpc:h:1", 20, 1, 2),
    )
    measured = (DeviceFootprint("gpu0+rpc:h:1", 30, 2, 4), DeviceFootprint(CPU, 0, 0, 5))
    rows = matched(predicted, measured)
    assert rows[0] == ("gpu0+rpc:h:1", DeviceFootprint("gpu0+rpc:h:1", 30, 2, 4), measured[0])
    assert rows[1] == (CPU, predicted[0], measured[1])


def test_the_tiny_models_table_adds_up_to_its_file(tiny_model: Path) -> None:
    read = read_header(tiny_model, tensors=True)
    assert len(read.tensors) == read.tensor_count
    assert read.tensors[0].name == "token_embd.weight"
    assert read.tensors[0].shape == (DEFAULT_SPEC.n_embd, DEFAULT_SPEC.n_vocab)
    data = sum(t.nbytes for t in read.tensors)
    assert 0 < tiny_model.stat().st_size - data < 64 * 1024  # the header and its alignment
    on_gpu = predict(read, Layout(n_ctx=256, devices=("gpu0",)))
    embeddings = DEFAULT_SPEC.n_embd * DEFAULT_SPEC.n_vocab * 4
    assert on(on_gpu, "gpu0").weights_bytes == data - embeddings
