"""/v1/embeddings and Ollama's /api/embed against a Service double, in process: what reaches the
service, the response's shapes, and every refusal in the OpenAI error envelope."""

from __future__ import annotations

import base64
import re
import struct
from typing import Any

import pytest
from fastapi import FastAPI

from arbiterd.daemon.http.app import create_app
from arbiterd.daemon.http.openai_requests import MAX_EMBEDDING_INPUTS
from arbiterd.errors import ContextOverflowError, RequestError
from arbiterd.request import GenerateRequest
from arbiterd.states import RequestKind
from tests.daemon.http.test_app import FakeService, assert_error, call
from tests.support.requests import wire_of


def vector_of(text: str) -> list[float]:
    """The double's embedding of `text`: float32 values, as the engine's are."""
    return [float(len(text)), 0.5, -0.25]


class EmbeddingService(FakeService):
    """The Service double, answering embedding requests as the engine does."""

    async def complete(self, model: str, request: GenerateRequest) -> dict[str, Any]:
        if request.kind is not RequestKind.EMBEDDING:
            return await super().complete(model, request)
        kind, body = wire_of(request)
        self.calls.append((model, kind, body))
        if self.error is not None:
            raise self.error
        data = [
            {"object": "embedding", "index": index, "embedding": vector_of(text)}
            for index, text in enumerate(body["inputs"])
        ]
        usage = {"prompt_tokens": 2 * len(data), "total_tokens": 2 * len(data)}
        return {"object": "list", "data": data, "model": model, "usage": usage}


@pytest.fixture
def service() -> EmbeddingService:
    embedder = EmbeddingService()
    embedder.embedders = {"tiny"}
    return embedder


@pytest.fixture
def app(service: EmbeddingService) -> FastAPI:
    return create_app(service)


def test_a_string_is_one_input_and_the_response_is_openais(
    app: FastAPI, service: EmbeddingService
) -> None:
    response = call(app, "POST", "/v1/embeddings", body={"model": "tiny", "input": "hello"})
    assert response.status_code == 200, response.text
    assert service.calls == [("tiny", "embedding", {"inputs": ["hello"]})]
    assert response.json() == {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": [5.0, 0.5, -0.25]}],
        "model": "tiny",
        "usage": {"prompt_tokens": 2, "total_tokens": 2},
    }
    assert "x-arbiterd-ignored" not in response.headers


def test_a_list_is_passed_on_in_order(app: FastAPI, service: EmbeddingService) -> None:
    texts = ["a", "bb", "ccc"]
    body = {"model": "tiny", "input": texts, "encoding_format": "float", "dimensions": None}
    response = call(app, "POST", "/v1/embeddings", body=body)
    assert response.status_code == 200, response.text
    assert service.calls == [("tiny", "embedding", {"inputs": texts})]
    assert [item["embedding"][0] for item in response.json()["data"]] == [1.0, 2.0, 3.0]


def test_base64_is_each_vectors_little_endian_float32s(app: FastAPI) -> None:
    body = {"model": "tiny", "input": ["a", "bb"], "encoding_format": "base64"}
    response = call(app, "POST", "/v1/embeddings", body=body)
    assert response.status_code == 200, response.text
    for item, text in zip(response.json()["data"], ["a", "bb"], strict=True):
        packed = base64.b64decode(item["embedding"])
        assert list(struct.unpack("<3f", packed)) == vector_of(text)


def test_the_user_field_is_accepted_and_named_as_ignored(app: FastAPI) -> None:
    body = {"model": "tiny", "input": "x", "user": "alice"}
    response = call(app, "POST", "/v1/embeddings", body=body)
    assert response.status_code == 200, response.text
    assert response.headers["x-arbiterd-ignored"] == "user"


M = {"model": "tiny"}
TOO_MANY = ["x"] * (MAX_EMBEDDING_INPUTS + 1)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param(
            {**M, "input": ""}, ("invalid_value", "input", "'input' is an empty string"), id="empty"
        ),
        pytest.param({**M, "input": []}, ("invalid_value", "input", "got an empty array"), id="[]"),
        pytest.param({**M, "input": ["a", ""]}, ("invalid_value", "input[1]", "empty"), id="['']"),
        pytest.param({**M, "input": ["a", 7]}, ("invalid_type", "input[1]", "not tokens"), id="7"),
        pytest.param({**M, "input": [[1]]}, ("invalid_type", "input[0]", "an array"), id="tokens"),
        pytest.param(
            {**M, "input": TOO_MANY}, ("invalid_value", "input", "an array of 2049"), id="too_many"
        ),
        pytest.param(M, ("invalid_type", "input", "got null"), id="no_input"),
        pytest.param({**M, "input": {}}, ("invalid_type", "input", "an object"), id="object"),
        pytest.param({"input": "x"}, ("invalid_type", "model", "'model' must be"), id="no_model"),
        pytest.param(
            {**M, "input": "x", "encoding_format": "hex"},
            ("invalid_value", "encoding_format", '"float" or "base64"'),
            id="encoding",
        ),
        pytest.param(
            {**M, "input": "x", "dimensions": 8},
            ("unsupported_value", "dimensions", "'dimensions' is not supported"),
            id="dimensions",
        ),
        pytest.param(
            {**M, "input": "x", "user": 5}, ("invalid_type", "user", "'user' must be"), id="user"
        ),
        pytest.param(
            {**M, "input": "x", "stream": True}, (None, "stream", "Unrecognized"), id="unknown_key"
        ),
    ],
)
def test_bad_input_is_a_400_naming_the_problem(
    app: FastAPI,
    service: EmbeddingService,
    body: dict[str, Any],
    expected: tuple[str | None, str, str],
) -> None:
    code, param, words = expected
    response = call(app, "POST", "/v1/embeddings", body=body)
    error = assert_error(response, 400, code=code, param=param)
    assert words in error["message"]
    assert service.calls == []  # refused at the edge


def test_an_unknown_model_is_a_404_listing_the_models(app: FastAPI) -> None:
    response = call(app, "POST", "/v1/embeddings", body={"model": "nope", "input": "x"})
    error = assert_error(response, 404, code="model_not_found", param="model")
    assert "tiny" in error["message"]


def test_a_request_of_a_kind_its_model_does_not_serve_never_reaches_the_service(
    app: FastAPI, service: EmbeddingService
) -> None:
    # tiny serves embeddings only (the fixture's), small chat and completions.
    response = call(app, "POST", "/v1/embeddings", body={"model": "small", "input": "the fox"})
    assert "'small' is not an embedding model" in assert_error(response, 400)["message"]
    response = call(app, "POST", "/v1/completions", body={"model": "tiny", "prompt": "x"})
    error = assert_error(response, 400)
    assert re.search(r"'tiny' is an embedding model: .* not completions", error["message"])
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    response = call(app, "POST", "/v1/chat/completions", body=chat)
    assert "not chat completions" in assert_error(response, 400)["message"]
    response = call(app, "POST", "/v1/embeddings", body={"model": "tiny", "input": "the fox"})
    assert response.status_code == 200, response.text
    assert service.calls == [("tiny", "embedding", {"inputs": ["the fox"]})]


def test_the_services_refusals_are_400s_in_the_envelope(
    app: FastAPI, service: EmbeddingService
) -> None:
    service.error = RequestError("'tiny' is not an embedding model: it makes chat completions")
    response = call(app, "POST", "/v1/embeddings", body={"model": "tiny", "input": "x"})
    error = assert_error(response, 400, code="invalid_value")
    assert "'tiny' is not an embedding model" in error["message"]
    service.error = ContextOverflowError("input[0] is 600 tokens long, more than the context")
    response = call(app, "POST", "/v1/embeddings", body={"model": "tiny", "input": "x"})
    assert_error(response, 400, code="context_length_exceeded")


def test_ollamas_embed_answers_in_ollamas_shape(app: FastAPI, service: EmbeddingService) -> None:
    body = {"model": "tiny", "input": ["a", "bb"], "keep_alive": "5m", "truncate": False}
    response = call(app, "POST", "/api/embed", body=body)
    assert response.status_code == 200, response.text
    assert service.calls == [("tiny", "embedding", {"inputs": ["a", "bb"]})]
    answer = response.json()
    assert set(answer) == {
        "model",
        "embeddings",
        "total_duration",
        "load_duration",
        "prompt_eval_count",
    }
    assert answer["model"] == "tiny"
    assert answer["embeddings"] == [vector_of("a"), vector_of("bb")]
    assert answer["prompt_eval_count"] == 4
    assert isinstance(answer["total_duration"], int)
    assert answer["total_duration"] >= 0
    assert answer["load_duration"] == 0
    one = call(app, "POST", "/api/embed", body={"model": "tiny", "input": "a"})
    assert one.json()["embeddings"] == [vector_of("a")]


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"model": "tiny", "input": "x", "options": {"temperature": 1}}, 400, "temperature"),
        ({"model": "tiny", "input": "x", "truncate": "yes"}, 400, "'truncate'"),
        ({"model": "tiny", "input": "x", "dimensions": 8}, 400, "'dimensions'"),
        ({"model": "tiny", "input": []}, 400, "empty array"),
        ({"model": "nope", "input": "x"}, 404, "tiny"),
    ],
    ids=["sampling_option", "truncate_type", "dimensions", "empty", "unknown_model"],
)
def test_ollamas_embed_refuses_in_the_envelope(
    app: FastAPI, service: EmbeddingService, body: dict[str, Any], status: int, words: str
) -> None:
    error = assert_error(call(app, "POST", "/api/embed", body=body), status)
    assert words in error["message"]
    assert service.calls == []


def test_the_num_ctx_option_is_the_configs_and_changes_nothing(
    app: FastAPI, service: EmbeddingService
) -> None:
    body = {"model": "tiny", "input": "x", "options": {"num_ctx": 4096}}
    assert call(app, "POST", "/api/embed", body=body).status_code == 200
    assert service.calls == [("tiny", "embedding", {"inputs": ["x"]})]
