"""Ollama's API, translated: what an app that only speaks Ollama sends, as the OpenAI request the
daemon serves, and the answers back in Ollama's shapes. Pure functions; app.py serves them.

    POST /api/chat      {model, messages, tools, stream (default true), options, format,
                         keep_alive}
    POST /api/generate  {model, prompt, system, raw, stream, options, format, keep_alive}
    POST /api/embed     {model, input, truncate, dimensions, options, keep_alive}
    POST /api/show      {model}: details, model_info, capabilities, template, parameters
    GET  /api/tags, /api/ps, /api/version

/api/tags lists each model and each of its aliases as its own entry (apps pick a name from it),
/api/ps each loaded model once, under its own name (`ollama ps` counts what is loaded), both
named as Ollama names models: NAME:TAG, a name without a tag as NAME:latest (a request may say
either).
Each entry, and /api/show, names the model's capabilities as status does (chat, completion,
tools, vision, embedding; Ollama's own names but for "chat", which it leaves implied).
/api/show's model_info has `general.architecture` and `<architecture>.context_length`, the
context the GGUF says it was trained for (the configured n_ctx when it says none), and its
parameters `num_ctx`, the context arbiterd serves it with; `template` is the Jinja chat
template its chats are rendered with (Ollama writes Go templates; arbiterd has none).
A streamed answer is NDJSON, one object per line, the last with "done": true and the counts.
Tools are OpenAI's (Ollama takes the same objects); a call comes back as Ollama writes it,
`message.tool_calls: [{"function": {"name", "arguments": {...}}}]`, in a streamed answer on
one line of its own before the last.
`options` maps to the sampling parameters the engine runs (num_predict → max_tokens); `format`
"json" or a JSON schema constrains the output as response_format does; `keep_alive` is accepted
and changes nothing (arbiterd keeps every model resident; the memory issue will map it).
An embedding is never truncated: an input longer than the context is refused, as Ollama refuses
it with `truncate: false`; `truncate` itself is accepted and changes nothing.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from arbiterd.config import DEFAULT_TAG
from arbiterd.errors import BadValueError
from arbiterd.states import RequestKind, ResidencyState, SlotState
from arbiterd.status import ModelStatus

# Ollama's option name → the OpenAI parameter the engine runs.
OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repeat_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "num_predict": "max_tokens",
}
# Options that size or place the model, which the daemon's config owns: accepted, unchanged.
CONFIG_OPTIONS = frozenset({"num_ctx", "num_gpu", "num_thread", "num_batch", "use_mmap"})
# What Ollama's version check wants from a server: a version it knows to have these routes.
VERSION = "0.6.3"


def chat_request(payload: object) -> tuple[RequestKind, dict[str, Any], bool]:
    """/api/chat's body as (kind, OpenAI payload, stream)."""
    body = _object(payload)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise BadValueError("'messages' must be a list of {role, content} objects")
    openai: dict[str, Any] = {
        "model": body.get("model"),
        "messages": [_message(m) for m in messages if isinstance(m, dict)],
    }
    if body.get("tools"):
        openai["tools"] = body["tools"]
    return RequestKind.CHAT, _with_common(body, openai), _stream(body)


def _message(message: dict[str, Any]) -> dict[str, Any]:
    """An Ollama chat message as OpenAI's: calls with ids and their arguments as JSON text, a
    tool result's `tool_name` as its name, its `images` (base64) as image parts after its text,
    which the HTTP edge checks as it checks OpenAI's (a vision model's, issue 12)."""
    openai: dict[str, Any] = {"role": message.get("role"), "content": message.get("content", "")}
    images = message.get("images")
    if images:
        if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
            raise BadValueError("'images' must be a list of base64 strings")
        openai["content"] = [
            {"type": "text", "text": openai["content"]},
            *(
                {"type": "image_url", "image_url": {"url": f"data:image;base64,{image}"}}
                for image in images
            ),
        ]
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls:
        openai["tool_calls"] = [_openai_call(index, call) for index, call in enumerate(calls)]
    if isinstance(message.get("tool_name"), str):
        openai["name"] = message["tool_name"]
    return openai


def _openai_call(index: int, call: object) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadValueError(
            'each of a message\'s \'tool_calls\' must be {"function": {"name": ...}}'
        )
    arguments = function.get("arguments", {})
    return {
        "id": f"call_{index}",
        "type": "function",
        "function": {
            "name": function["name"],
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
        },
    }


def tool_calls(openai_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's calls as Ollama writes them: the arguments as an object."""
    return [
        {
            "function": {
                "name": call["function"]["name"],
                "arguments": json.loads(call["function"]["arguments"] or "{}"),
            }
        }
        for call in openai_calls
    ]


def collect_calls(openai_chunk: dict[str, Any], calls: dict[int, dict[str, Any]]) -> None:
    """Add a streamed chunk's tool-call deltas to `calls` (by index), as OpenAI clients do."""
    for choice in openai_chunk.get("choices") or []:
        for delta in (choice.get("delta") or {}).get("tool_calls") or []:
            call = calls.setdefault(delta["index"], {"function": {"name": "", "arguments": ""}})
            function = delta.get("function") or {}
            call["function"]["name"] += function.get("name") or ""
            call["function"]["arguments"] += function.get("arguments") or ""


def calls_line(model: str, calls: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The line of a streamed chat that carries its calls."""
    line = _piece("chat", model, "")
    line["message"]["tool_calls"] = tool_calls([calls[index] for index in sorted(calls)])
    return line


def generate_request(payload: object) -> tuple[RequestKind, dict[str, Any], bool]:
    """/api/generate's body as (kind, OpenAI payload, stream): a raw prompt is a completion,
    any other goes through the model's chat template, as Ollama does (a model without one
    completes `plain_prompt` instead)."""
    body = _object(payload)
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise BadValueError("'prompt' must be a string")
    if body.get("images"):
        raise BadValueError("images are taken by /api/chat, not /api/generate, for now")
    if body.get("raw") is True:
        return (
            RequestKind.COMPLETION,
            _with_common(body, {"model": body.get("model"), "prompt": prompt}),
            (_stream(body)),
        )
    messages = []
    system = body.get("system")
    if isinstance(system, str) and system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": prompt})
    openai = {"model": body.get("model"), "messages": messages}
    return RequestKind.CHAT, _with_common(body, openai), _stream(body)


def plain_prompt(payload: object) -> str:
    """/api/generate's text for a model without a chat template (issue 40), which completes
    it as it is, as Ollama's default template (`{{ .Prompt }}`) does: the prompt, after its
    system (which that template drops) and a blank line when one is given. Call it on a body
    generate_request took."""
    body = _object(payload)
    system, prompt = body.get("system"), body.get("prompt", "")
    return f"{system}\n\n{prompt}" if isinstance(system, str) and system else prompt


def show_model(payload: object) -> str:
    """The model /api/show's body asks about: `model`, or `name` as older clients send it."""
    body = _object(payload)
    model = body.get("model") or body.get("name")
    if not isinstance(model, str) or not model:
        raise BadValueError("'model' must name a model")
    return model


def embed_request(payload: object) -> dict[str, Any]:
    """/api/embed's body as the OpenAI /v1/embeddings payload."""
    body = _object(payload)
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise BadValueError("'options' must be an object")
    for name in options:
        if name not in CONFIG_OPTIONS:
            raise BadValueError(f"option {name!r} does not apply to embeddings")
    if not isinstance(body.get("truncate", True), bool):
        raise BadValueError("'truncate' must be a boolean")
    return {key: body[key] for key in ("model", "input", "dimensions") if key in body}


def embed_answer(response: dict[str, Any], total_s: float) -> dict[str, Any]:
    """An OpenAI embedding response as /api/embed's. load_duration is 0: the model stays
    loaded; a warm-up the request waited for is part of total_duration."""
    return {
        "model": response["model"],
        "embeddings": [item["embedding"] for item in response["data"]],
        "total_duration": int(total_s * 1e9),
        "load_duration": 0,
        "prompt_eval_count": response["usage"]["prompt_tokens"],
    }


def answer(
    kind: RequestKind, route: str, response: dict[str, Any], total_s: float
) -> dict[str, Any]:
    """A whole OpenAI response as Ollama's final object for `route` ("chat" or "generate")."""
    choice = response["choices"][0]
    text = choice["message"]["content"] if kind is RequestKind.CHAT else choice["text"]
    whole = {
        **_piece(route, response["model"], text or ""),
        **_done(choice.get("finish_reason"), response.get("usage"), total_s),
    }
    if kind is RequestKind.CHAT and choice["message"].get("tool_calls"):
        whole["message"]["tool_calls"] = tool_calls(choice["message"]["tool_calls"])
    return whole


def chunk(kind: RequestKind, route: str, openai_chunk: dict[str, Any]) -> dict[str, Any] | None:
    """One streamed OpenAI chunk as an Ollama line; None for a chunk without text (a role, or
    the usage chunk, whose figures go into the last line instead)."""
    choices = openai_chunk.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    delta = choice.get("delta") or {}
    text = delta.get("content") if kind is RequestKind.CHAT else choice.get("text")
    if not text:
        return None
    return _piece(route, str(openai_chunk.get("model", "")), text)


def last_line(
    route: str,
    model: str,
    finish_reason: str | None,
    usage: dict[str, Any] | None,
    total_s: float,
) -> dict[str, Any]:
    """The stream's closing line: no text, "done": true, the counts."""
    return {**_piece(route, model, ""), **_done(finish_reason, usage, total_s)}


def tags(models: tuple[ModelStatus, ...]) -> dict[str, Any]:
    """/api/tags from the daemon's status models."""
    return {"models": [entry for m in models for entry in _entries(m)]}


# A model in one of these has nothing loaded (its worker failed, or the daemon stopped it).
_NOT_LOADED = frozenset({ResidencyState.FAILED, SlotState.FAILED, SlotState.STOPPED})


def ps(models: tuple[ModelStatus, ...]) -> dict[str, Any]:
    """/api/ps: every model is loaded (resident in RAM); size_vram is what holds the GPU now."""
    return {
        "models": [
            {**entry, "size_vram": m.vram_bytes or 0, "expires_at": None}
            for m in models
            if m.state not in _NOT_LOADED
            for entry in _entries(m)[:1]  # the model, not its aliases: one model loaded
        ]
    }


def show(status: ModelStatus) -> dict[str, Any]:
    """/api/show for the model `status` reports, as Ollama's clients read it."""
    architecture = status.architecture
    info: dict[str, Any] = {"general.architecture": architecture}
    if architecture:
        info[f"{architecture}.context_length"] = status.trained_context or status.n_ctx
    return {
        "modelfile": "",
        "parameters": f"num_ctx {status.n_ctx}",
        "template": status.chat_template,
        "details": _details(status),
        "model_info": info,
        # Ollama names fill-in-the-middle "insert".
        "capabilities": ["insert" if c == "fim" else c for c in status.capabilities],
    }


def _details(status: ModelStatus) -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": "gguf",
        "family": status.architecture,
        "families": [status.architecture] if status.architecture else None,
        "parameter_size": "",
        "quantization_level": "",
    }


def _tagged(name: str) -> str:
    """A model name or alias as Ollama spells it: NAME:TAG, with its default tag if it has none."""
    return name if ":" in name else f"{name}:{DEFAULT_TAG}"


def _entries(status: ModelStatus) -> list[dict[str, Any]]:
    """One entry for the model and one for each of its aliases: apps pick a name from the list,
    and each name they may ask for is there."""
    return [
        {
            "name": _tagged(name),
            "model": _tagged(name),
            "size": status.host_copy_bytes or 0,
            "digest": "",
            "details": _details(status),
            "capabilities": list(status.capabilities),
            "state": status.state,
            "backend": status.backend,
        }
        for name in (status.name, *status.aliases)
    ]


def _piece(route: str, model: str, text: str) -> dict[str, Any]:
    now = datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")
    if route == "chat":
        return {
            "model": model,
            "created_at": now,
            "message": {"role": "assistant", "content": text},
            "done": False,
        }
    return {"model": model, "created_at": now, "response": text, "done": False}


def _done(
    finish_reason: str | None, usage: dict[str, Any] | None, total_s: float
) -> dict[str, Any]:
    usage = usage or {}
    return {
        "done": True,
        "done_reason": "length" if finish_reason == "length" else "stop",
        "total_duration": int(total_s * 1e9),
        "prompt_eval_count": usage.get("prompt_tokens", 0),
        "eval_count": usage.get("completion_tokens", 0),
    }


def _object(payload: object) -> dict[str, Any]:
    if not isinstance(payload, dict):
        raise BadValueError("the request body must be a JSON object")
    return payload


def _stream(body: dict[str, Any]) -> bool:
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise BadValueError("'stream' must be a boolean")
    return stream


def _with_common(body: dict[str, Any], openai: dict[str, Any]) -> dict[str, Any]:
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise BadValueError("'options' must be an object")
    for name, value in options.items():
        if name in OPTIONS:
            if not (name == "num_predict" and isinstance(value, int) and value < 0):
                openai[OPTIONS[name]] = value  # -1: until the context is full, the default
        elif name not in CONFIG_OPTIONS:
            raise BadValueError(f"option {name!r} is not supported")
    wanted = body.get("format")
    if wanted == "json":
        openai["response_format"] = {"type": "json_object"}
    elif isinstance(wanted, dict):
        openai["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "format", "schema": wanted},
        }
    elif wanted not in (None, ""):
        raise BadValueError("'format' must be \"json\" or a JSON schema")
    return openai
