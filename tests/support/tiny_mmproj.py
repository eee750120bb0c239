"""Generator for a tiny, random-weight multimodal projector (mmproj) GGUF used by the tests.

This module owns the on-disk layout of the test projector: a LLaVA-style ("mlp") CLIP vision
tower that llama.cpp's mtmd/clip loads and runs in milliseconds on a CPU. It is the projector
type that needs the fewest tensors (clip.cpp `load_tensors`, `PROJECTOR_TYPE_MLP`): a patch
embedding, position embeddings, one encoder block and the two-layer MLP `mm.0` / `mm.2`, whose
output width is the text model's `n_embd` (`clip_n_mmproj_embd` reads `mm.2.weight`'s rows).

One block is loaded but, as in LLaVA (which takes the second-to-last layer's features), none
runs: the block only has to exist for the loader.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt

from tests.support.tiny_gguf import DEFAULT_SPEC

__all__ = ["TinyProjectorSpec", "write_tiny_mmproj"]

_WEIGHT_STD = 0.02
_LAYER_NORM_EPS = 1e-6
# CLIP's normalisation, as LLaVA's converter writes it (clip.vision.image_mean / image_std).
_IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
_IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class TinyProjectorSpec:
    """Hyper-parameters of the generated projector (defaults: a ~60 KB file, 4 image tokens)."""

    image_size: int = 32  # every image is resized to image_size x image_size
    patch_size: int = 16  # (image_size / patch_size)^2 image tokens
    n_embd: int = 32  # the vision tower's width
    n_head: int = 2
    n_ff: int = 64
    projection_dim: int = DEFAULT_SPEC.n_embd  # output width: the text model's n_embd
    seed: int = 0

    @property
    def n_image_tokens(self) -> int:
        """How many embeddings (text positions) one image becomes."""
        return (self.image_size // self.patch_size) ** 2


def _random(rng: np.random.Generator, *shape: int) -> npt.NDArray[np.float32]:
    return (rng.standard_normal(shape, dtype=np.float32) * _WEIGHT_STD).astype(np.float32)


def _tensors(spec: TinyProjectorSpec) -> list[tuple[str, npt.NDArray[np.float32]]]:
    rng = np.random.default_rng(spec.seed)
    n_pos = spec.n_image_tokens + 1  # + the class embedding
    e, ff, out = spec.n_embd, spec.n_ff, spec.projection_dim
    blk = "v.blk.0"
    return [
        # numpy shapes are ggml's ne reversed: a (rows=out, cols=in) matrix.
        ("v.patch_embd.weight", _random(rng, e, 3, spec.patch_size, spec.patch_size)),
        ("v.class_embd", _random(rng, e)),
        ("v.position_embd.weight", _random(rng, n_pos, e)),
        (f"{blk}.attn_q.weight", _random(rng, e, e)),
        (f"{blk}.attn_k.weight", _random(rng, e, e)),
        (f"{blk}.attn_v.weight", _random(rng, e, e)),
        (f"{blk}.attn_out.weight", _random(rng, e, e)),
        (f"{blk}.ln1.weight", np.ones(e, dtype=np.float32)),
        (f"{blk}.ln1.bias", np.zeros(e, dtype=np.float32)),
        (f"{blk}.ln2.weight", np.ones(e, dtype=np.float32)),
        (f"{blk}.ln2.bias", np.zeros(e, dtype=np.float32)),
        (f"{blk}.ffn_up.weight", _random(rng, ff, e)),
        (f"{blk}.ffn_down.weight", _random(rng, e, ff)),
        ("mm.0.weight", _random(rng, out, e)),
        ("mm.0.bias", np.zeros(out, dtype=np.float32)),
        ("mm.2.weight", _random(rng, out, out)),
        ("mm.2.bias", np.zeros(out, dtype=np.float32)),
    ]


def write_tiny_mmproj(path: Path, spec: TinyProjectorSpec = TinyProjectorSpec()) -> Path:
    """Write a loadable random-weight mmproj GGUF to `path` and return `path`.

    The same `spec` always produces a byte-identical file."""
    if spec.image_size % spec.patch_size or spec.n_embd % spec.n_head:
        raise ValueError(f"image_size / patch_size and n_embd / n_head must divide: {spec}")
    path = Path(path)
    writer = gguf.GGUFWriter(path, "clip")
    try:
        writer.add_name("arbiterd-tiny-mmproj")
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        writer.add_bool("clip.has_vision_encoder", True)
        writer.add_string("clip.projector_type", "mlp")
        writer.add_uint32("clip.vision.image_size", spec.image_size)
        writer.add_uint32("clip.vision.patch_size", spec.patch_size)
        writer.add_uint32("clip.vision.embedding_length", spec.n_embd)
        writer.add_uint32("clip.vision.feed_forward_length", spec.n_ff)
        writer.add_uint32("clip.vision.block_count", 1)
        writer.add_uint32("clip.vision.projection_dim", spec.projection_dim)
        writer.add_uint32("clip.vision.attention.head_count", spec.n_head)
        writer.add_float32("clip.vision.attention.layer_norm_epsilon", _LAYER_NORM_EPS)
        writer.add_array("clip.vision.image_mean", list(_IMAGE_MEAN))
        writer.add_array("clip.vision.image_std", list(_IMAGE_STD))
        for name, tensor in _tensors(spec):
            writer.add_tensor(name, tensor)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path
