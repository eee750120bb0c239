"""The arbiterd engine's vocabularies tokenize as llama.cpp's do, on upstream's tokenizer test data.

llama-residency.patch replaces, once a vocabulary has loaded, llama.cpp's map from each token's
text to its id (a second copy of every text) with an index of ids over the texts the vocabulary
keeps anyway (arbiterd/native/README.md). Every tokenizer reaches the ids through it: byte
fallback, special tokens, the merges' results. llama.cpp ships a vocabulary-only GGUF per
tokenizer family with inputs and the ids its unpatched code gives them (`models/ggml-vocab-*`,
what its test-tokenizer-0 reads); scripts/setup.sh keeps them beside the engine it builds and
installs them under the environment's share/. No double: the installed engine tokenizes, as in a
worker.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

VOCAB_TESTS = Path(sys.prefix) / "share" / "arbiterd" / "llama-vocab-tests"
SETUP_HINT = (
    f"{VOCAB_TESTS} is missing: scripts/setup.sh installs llama.cpp's tokenizer test data there"
    " when it installs the arbiterd engine"
)
# How test-tokenizer-0 separates the inputs of a .inp file.
SEPARATOR = "\n__ggml_vocab_test__\n"


def vocabularies() -> list[Path]:
    return sorted(VOCAB_TESTS.glob("ggml-vocab-*.gguf")) if VOCAB_TESTS.is_dir() else []


def cases(gguf: Path) -> list[tuple[str, list[int]]]:
    """(input, the ids upstream's code gives it) of a vocabulary's .inp and .out files."""
    inputs = Path(f"{gguf}.inp").read_bytes().decode().split(SEPARATOR)
    if inputs[-1] == "":
        inputs.pop()  # the file ends with a separator
    lines = Path(f"{gguf}.out").read_text().splitlines()
    assert len(inputs) == len(lines), f"{gguf.name}: {len(inputs)} inputs, {len(lines)} outputs"
    return [(text, [int(i) for i in ids.split()]) for text, ids in zip(inputs, lines, strict=True)]


def test_the_installed_engine_came_with_the_tokenizer_test_data() -> None:
    # At least the families arbiterd's own models are: SentencePiece (gemma, llama) and
    # byte-level BPE (SmolLM2, qwen, gpt-2).
    names = {gguf.name for gguf in vocabularies()}
    assert {"ggml-vocab-llama-spm.gguf", "ggml-vocab-gpt-2.gguf"} <= names, SETUP_HINT


@pytest.fixture
def vocab(request: pytest.FixtureRequest) -> Iterator[ctypes.c_void_p]:
    import llama_cpp  # noqa: PLC0415  (the engine: only the tests that tokenize load it)

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(request.param).encode(), params)
    assert model, f"the engine cannot load {request.param}"
    yield llama_cpp.llama_model_get_vocab(model)
    llama_cpp.llama_model_free(model)


def tokenize(vocab: ctypes.c_void_p, text: str) -> list[int]:
    """As test-tokenizer-0 does: no BOS/EOS added, special tokens' texts taken as text."""
    import llama_cpp  # noqa: PLC0415

    data = text.encode()
    ids = (llama_cpp.llama_token * (len(data) + 8))()
    count = llama_cpp.llama_tokenize(vocab, data, len(data), ids, len(ids), False, False)
    assert count >= 0, f"{count} ids for {text!r}: more than its bytes"
    return list(ids[:count])


@pytest.mark.parametrize("vocab", vocabularies(), indirect=True, ids=lambda gguf: gguf.stem)
def test_every_tokenizer_gives_the_ids_upstreams_code_gives(
    vocab: ctypes.c_void_p, request: pytest.FixtureRequest
) -> None:
    gguf = request.node.callspec.params["vocab"]
    differ = [
        (text, expected, got)
        for text, expected in cases(gguf)
        if (got := tokenize(vocab, text)) != expected
    ]
    assert not differ, f"{len(differ)} inputs tokenize otherwise, the first: {differ[0]}"
