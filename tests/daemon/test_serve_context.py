"""A model whose table sets no n_ctx, served by a real daemon (issue 47): it runs with the
context its GGUF was trained for where that is under 4096, as status, /v1/models and a prompt
past it tell."""

from __future__ import annotations

from pathlib import Path

import httpx

from arbiterd.status import DaemonStatus
from tests.support.daemon import serving
from tests.support.tiny_gguf import TinyModelSpec, write_tiny_llama

TRAINED = 512


def test_a_model_without_n_ctx_runs_with_the_context_it_was_trained_for(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "short.gguf", TinyModelSpec(n_ctx_train=TRAINED))
    table = {"path": model, "n_gpu_layers": 0, "min_hold_s": 0.05}
    with serving({"short": table}) as daemon:
        with daemon.client() as client:
            (status,) = DaemonStatus.from_json(client.call("status")).models
        assert (status.n_ctx, status.trained_context) == (TRAINED, TRAINED)
        with httpx.Client(base_url=daemon.url, timeout=60) as http:
            listed = http.get("/models/short").json()
            assert listed["context_length"] == TRAINED
            # The worker runs with it too: a prompt past it does not fit.
            body = {"model": "short", "prompt": "a " * (TRAINED + 10), "max_tokens": 1}
            answer = http.post("/completions", json=body)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["code"] == "context_length_exceeded"
