"""Making a model's Llama (worker/engine/loading.py): the footprint predicted before it is made,
or none, with the reason logged, when its file cannot be read for one."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from arbiterd.errors import ModelLoadError
from arbiterd.spec import ModelSpec
from arbiterd.worker.engine.loading import predict_footprint


def test_a_model_whose_file_is_read_has_a_footprint_predicted(tiny_model: Path) -> None:
    spec = ModelSpec(name="tiny", path=tiny_model)
    predicted = predict_footprint(spec, lambda: str(tiny_model))
    assert predicted
    assert sum(f.total_bytes for f in predicted) > 0


def test_a_model_without_its_file_has_none_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    def missing() -> str:
        raise ModelLoadError("model file not found: /nowhere.gguf")

    spec = ModelSpec(name="gone", path=Path("/nowhere.gguf"))
    with caplog.at_level(logging.WARNING):
        assert predict_footprint(spec, missing) == ()
    assert "gone: no footprint predicted: model file not found" in caplog.text
