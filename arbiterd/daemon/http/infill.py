"""llama-server's `/infill`, for the editors that call it (llama.vscode, llama.vim): its body as
the completion request it asks for, and the engine's answer in llama-server's shape.

Owns the translation only, as ollama.py does for Ollama's API: the body's fields to an OpenAI
completion body (which openai_requests.py then checks as any other) plus the fill-in-the-middle
parts, and the answer's `content` with its counts. The fields llama-server takes to tune its own
scheduling (`cache_prompt`, `t_max_*`, `samplers`, ...) change nothing here and are accepted;
any other unknown field is a 400 naming it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from arbiterd.daemon.http.openai_requests import ApiError, ApiRequest, parse_request
from arbiterd.request import Infill
from arbiterd.states import RequestKind

# Passed on as the OpenAI completion field of the same meaning.
_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed", "stop", "repeat_penalty")
# llama-server's own knobs: its prompt cache, time limits, sampler order, the fields its answer
# lists; arbiterd caches prompts always and answers every field.
_ACCEPTED = frozenset(
    {
        "cache_prompt",
        "t_max_prompt_ms",
        "t_max_predict_ms",
        "samplers",
        "response_fields",
        "n_indent",
        "id_slot",
        "n_probs",
    }
)
_FIELDS = frozenset(
    {"model", "input_prefix", "input_suffix", "input_extra", "prompt", "n_predict", "stream"}
)


def infill_request(payload: object, default_model: str | None) -> ApiRequest:
    """An /infill body as the completion it asks for; `default_model` serves a body that names
    none (llama-server serves one model, and editors send no name)."""
    if not isinstance(payload, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(payload) - _FIELDS - _ACCEPTED - set(_SAMPLING))
    if unknown:
        raise ApiError(400, f"/infill does not take: {', '.join(unknown)}", param=unknown[0])
    model = payload.get("model") or default_model
    if model is None:
        raise ApiError(400, "no model can fill in the middle: none has FIM tokens in its GGUF")
    prefix, suffix, middle = (
        _text(payload, key) for key in ("input_prefix", "input_suffix", "prompt")
    )
    body: dict[str, Any] = {"model": model, "prompt": prefix, "stream": payload.get("stream")}
    n_predict = payload.get("n_predict")
    if n_predict is not None and n_predict != -1:  # -1: until the model stops, as llama-server
        body["max_tokens"] = n_predict
    body.update({key: payload[key] for key in _SAMPLING if payload.get(key) is not None})
    parsed = parse_request(RequestKind.COMPLETION, body)
    fill = Infill(suffix, middle, _extra(payload.get("input_extra")))
    return replace(parsed, request=replace(parsed.request, infill=fill))


def _text(payload: dict[str, Any], key: str) -> str:
    value = payload.get(key, "")
    if not isinstance(value, str):
        raise ApiError(400, f"'{key}' must be a string", param=key)
    return value


def _extra(raw: object) -> tuple[tuple[str, str], ...]:
    """`input_extra`: the project's other files, [{"filename", "text"}, ...]."""
    if raw is None:
        return ()
    chunks = raw if isinstance(raw, list) else None
    if chunks is None or not all(
        isinstance(chunk, dict)
        and isinstance(chunk.get("filename", ""), str)
        and isinstance(chunk.get("text"), str)
        for chunk in chunks
    ):
        raise ApiError(
            400, '\'input_extra\' must be a list of {"filename", "text"}', param="input_extra"
        )
    return tuple((chunk.get("filename", ""), chunk["text"]) for chunk in chunks)


def answer(model: str, response: dict[str, Any]) -> dict[str, Any]:
    """A completion's response as /infill answers: the text as `content`, and its counts."""
    choice = (response.get("choices") or [{}])[0]
    return {
        "content": choice.get("text", ""),
        **_last(model, choice.get("finish_reason"), response.get("usage")),
    }


def piece(text: str) -> dict[str, Any]:
    """A streamed piece of the answer."""
    return {"content": text, "stop": False}


def last(model: str, finish_reason: str | None, usage: dict[str, Any] | None) -> dict[str, Any]:
    """A stream's last object: no text, the stop and the counts."""
    return {"content": "", **_last(model, finish_reason, usage)}


def _last(model: str, finish_reason: str | None, usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = usage or {}
    prompt = int(usage.get("prompt_tokens") or 0)
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    predicted = int(usage.get("completion_tokens") or 0)
    return {
        "stop": True,
        "model": model,
        "stop_type": {"stop": "eos", "length": "limit"}.get(finish_reason or "", "none"),
        "tokens_predicted": predicted,
        "tokens_evaluated": prompt,
        "tokens_cached": cached,  # of the prompt, kept from the request before
        "timings": {"prompt_n": prompt - cached, "predicted_n": predicted},
    }
