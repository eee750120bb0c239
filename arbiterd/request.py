"""One generation request, as every process names it: the record the HTTP edge builds once from
an OpenAI or Ollama body, the daemon routes, and the worker protocol carries to the engine.

Owns `GenerateRequest` and its codec (`to_json`, `from_json`), and the limits a request may ask
for. Holds no OpenAI dialect: the edge (arbiterd/daemon/http/openai_requests.py) checks a body field
by field and answers each bad one with a 400 naming it; what reaches this record is already
what the engine runs. `from_json` reads a record off the wire with a ladder of guard clauses,
each failure a RequestError naming the field, so that a malformed message fails its request
and never the worker (issue 24). The checks that need the model (token ids within its
vocabulary, a schema its grammar compiler follows, a prompt its context holds, a model that
takes tools) are the engine's. Imports nothing heavy: the daemon and the worker share it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any

from arbiterd.errors import BadValueError, RequestError
from arbiterd.spec import COMPLETION_PARAMS, MAX_IMAGES
from arbiterd.states import Priority, RequestKind, parse_priority

# What a request may ask for at most: choices (generated one after the other), alternatives
# per token in logprobs, a bias either way.
MAX_CHOICES = 16
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # in either direction, as OpenAI
MAX_TOKEN_ID = 2**31 - 1  # llama.cpp's llama_token is an int32_t
MAX_SHOWN_CHARS = 40  # of a refused value, in an error message


class ToolChoice(enum.StrEnum):
    """Which call the answer must make, when the request offers tools."""

    AUTO = "auto"  # the model's choice: a call or text
    REQUIRED = "required"  # a call of any tool offered
    FUNCTION = "function"  # a call of the tool named by `tool_name`


@dataclass(frozen=True)
class Sampling:
    """The sampling parameters passed through to llama-cpp-python (spec.COMPLETION_PARAMS
    names them and their types); None: the engine's default."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def kwargs(self) -> dict[str, Any]:
        """The parameters given, as `Llama.create_completion` takes them."""
        given: dict[str, Any] = {}
        for each in fields(self):
            value = getattr(self, each.name)
            if value is not None and value != ():
                given[each.name] = list(value) if each.name == "stop" else value
        return given


@dataclass(frozen=True)
class Tool:
    """A function the answer may call, as the request offered it."""

    name: str
    parameters: dict[str, Any]  # a JSON schema of its arguments
    description: str | None = None

    def to_json(self) -> dict[str, Any]:
        """As OpenAI and the chat templates spell a tool."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ResponseFormat:
    """Structured output: a JSON object, following `schema` when there is one (a grammar made
    from it constrains the output)."""

    schema: dict[str, Any] | None = None


@dataclass(frozen=True)
class Infill:
    """A completion that fills in the middle: the model writes what goes between the request's
    prompt (the text before the point) and `suffix`, after `middle` (text already there, as
    llama-server's /infill `prompt`), with `extra` files (name, text) of the project before it
    all, as a code model trained on repositories reads them."""

    suffix: str
    middle: str = ""
    extra: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"suffix": self.suffix}
        if self.middle:
            wire["middle"] = self.middle
        if self.extra:
            wire["extra"] = [{"filename": name, "text": text} for name, text in self.extra]
        return wire


@dataclass(frozen=True)
class GenerateRequest:
    """One request to a model: what to make, from what, and how to answer."""

    kind: RequestKind
    prompt: str = ""  # COMPLETION's
    infill: Infill | None = None  # COMPLETION's: fill in the middle; None: complete the prompt
    messages: tuple[dict[str, Any], ...] = ()  # CHAT's, with roles as chat templates name them
    # CHAT's text for a model without a chat template, completed as it is (issue 40: Ollama's
    # /api/generate, whose prompt such a model takes as is); "": such a model refuses the chat.
    plain_prompt: str = ""
    inputs: tuple[str, ...] = ()  # EMBEDDING's texts
    sampling: Sampling = Sampling()
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id → bias
    logprobs: int | None = None  # alternatives reported per token; None: no log-probabilities
    n: int = 1  # choices, generated one after the other
    response_format: ResponseFormat | None = None  # None: free text
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice.AUTO
    tool_name: str = ""  # the tool a FUNCTION choice calls
    parallel_tool_calls: bool = True  # the answer may call several tools; else the first counts
    # A chat request's images, base64 (PNG or JPEG), one for each IMAGE_MARKER in its messages.
    images: tuple[str, ...] = ()
    priority: Priority | None = None  # its class in the GPU queue; None: the model's
    include_usage: bool = False  # a streamed request ends with a chunk of its usage

    def to_json(self) -> dict[str, Any]:
        """The record as the worker protocol carries it: only what differs from the default."""
        wire: dict[str, Any] = {"kind": self.kind.value, **self._text_json()}
        wire.update(self.sampling.kwargs())
        if self.logit_bias:
            wire["logit_bias"] = {str(token): bias for token, bias in self.logit_bias.items()}
        if self.logprobs is not None:
            wire["logprobs"] = self.logprobs
        if self.n != 1:
            wire["n"] = self.n
        if self.response_format is not None:
            wire["response_format"] = {"type": "json_object"}
            if self.response_format.schema is not None:
                wire["response_format"]["schema"] = self.response_format.schema
        wire.update(self._tools_json())
        if self.images:
            wire["images"] = list(self.images)
        if self.priority is not None:
            wire["priority"] = self.priority.value
        if self.include_usage:
            wire["stream_options"] = {"include_usage": True}
        return wire

    def _text_json(self) -> dict[str, Any]:
        """What the model reads: the prompt, the conversation or the texts to embed."""
        if self.kind is RequestKind.COMPLETION:
            fill = {} if self.infill is None else {"infill": self.infill.to_json()}
            return {"prompt": self.prompt, **fill}
        if self.kind is RequestKind.CHAT:
            plain = {"plain_prompt": self.plain_prompt} if self.plain_prompt else {}
            return {"messages": list(self.messages), **plain}
        return {"input": list(self.inputs)}

    def _tools_json(self) -> dict[str, Any]:
        """The tools offered and the call asked for, as OpenAI spells them."""
        wire: dict[str, Any] = {}
        if self.tools:
            wire["tools"] = [tool.to_json() for tool in self.tools]
        if self.tool_choice is ToolChoice.REQUIRED:
            wire["tool_choice"] = "required"
        elif self.tool_choice is ToolChoice.FUNCTION:
            wire["tool_choice"] = {"type": "function", "function": {"name": self.tool_name}}
        if not self.parallel_tool_calls:
            wire["parallel_tool_calls"] = False
        return wire

    @classmethod
    def from_json(cls, wire: object) -> GenerateRequest:
        """The record `to_json` wrote; RequestError naming the first field that is not."""
        if not isinstance(wire, dict):
            raise RequestError("a request must be an object")
        try:
            kind = RequestKind(str(wire.get("kind")))
        except ValueError:
            raise RequestError(f"unknown request kind {shown(wire.get('kind'))}") from None
        if kind is not RequestKind.CHAT and wire.get("images"):
            raise RequestError("images go in chat requests, not completions")
        tools, choice, name = _tools(wire)
        return cls(
            kind=kind,
            prompt=_prompt(wire) if kind is RequestKind.COMPLETION else "",
            infill=_infill(wire.get("infill")) if kind is RequestKind.COMPLETION else None,
            messages=_messages(wire) if kind is RequestKind.CHAT else (),
            plain_prompt=_plain_prompt(wire) if kind is RequestKind.CHAT else "",
            inputs=_inputs(wire) if kind is RequestKind.EMBEDDING else (),
            sampling=_sampling(wire),
            logit_bias=_logit_bias(wire.get("logit_bias")),
            logprobs=_logprobs(wire.get("logprobs")),
            n=_choices(wire.get("n", 1)),
            response_format=_response_format(wire.get("response_format")),
            tools=tools,
            tool_choice=choice,
            tool_name=name,
            parallel_tool_calls=_parallel_calls(wire.get("parallel_tool_calls")),
            images=_images(wire.get("images")),
            priority=_priority(wire.get("priority")),
            include_usage=_include_usage(wire.get("stream_options")),
        )


def shown(value: object) -> str:
    """A refused value as a message shows it: its repr (which escapes what UTF-8 cannot
    encode), cut short."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 3] + "..."


def _prompt(wire: dict[str, Any]) -> str:
    prompt = wire.get("prompt")
    if not isinstance(prompt, str):
        raise RequestError("'prompt' must be a string")
    return prompt


def _infill(raw: object) -> Infill | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise RequestError("'infill' must be an object")
    suffix, middle = raw.get("suffix"), raw.get("middle", "")
    if not isinstance(suffix, str) or not isinstance(middle, str):
        raise RequestError("'infill' must give 'suffix' and 'middle' as strings")
    extra = raw.get("extra", [])
    if not isinstance(extra, list) or not all(
        isinstance(item, dict)
        and isinstance(item.get("filename"), str)
        and isinstance(item.get("text"), str)
        for item in extra
    ):
        raise RequestError("'infill.extra' must be a list of {filename, text} strings")
    return Infill(suffix, middle, tuple((item["filename"], item["text"]) for item in extra))


def _plain_prompt(wire: dict[str, Any]) -> str:
    plain = wire.get("plain_prompt", "")
    if not isinstance(plain, str):
        raise RequestError("'plain_prompt' must be a string")
    return plain


def _messages(wire: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    messages = wire.get("messages")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(message, dict) for message in messages)
    ):
        raise RequestError("'messages' must be a non-empty list")
    return tuple(messages)


def _inputs(wire: dict[str, Any]) -> tuple[str, ...]:
    texts = wire.get("input")
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise RequestError("'input' must be a non-empty list of strings")
    return tuple(texts)


def _sampling(wire: dict[str, Any]) -> Sampling:
    given: dict[str, Any] = {}
    for key, types in COMPLETION_PARAMS.items():
        value = wire.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            expected = " or ".join(t.__name__ for t in types)
            raise RequestError(f"'{key}' must be {expected}, got {type(value).__name__}")
        given[key] = value
    if given.get("max_tokens", 1) < 1:  # llama-cpp-python reads 0 as "until the context is full"
        raise RequestError("'max_tokens' must be at least 1")
    stop = given.pop("stop", [])
    stops = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(each, str) and each for each in stops):
        raise RequestError("'stop' must be a list of non-empty strings")
    return Sampling(**given, stop=tuple(stops))


def _logit_bias(given: object) -> dict[int, float]:
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise RequestError("'logit_bias' must be an object of token ids to biases")
    bias = {}
    for key, value in given.items():
        # ASCII digits no longer than the largest id, before int(): str.isdigit() also takes
        # digits int() refuses ("²"), and int() refuses more than 4,300 digits (issue 24).
        is_id = isinstance(key, str) and key.isascii() and key.isdigit()
        if not is_id or len(key) > len(str(MAX_TOKEN_ID)) or int(key) > MAX_TOKEN_ID:
            raise RequestError(f"'logit_bias' names {shown(key)}, which is not a token id")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RequestError(f"'logit_bias.{key}' must be a number")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise RequestError(
                f"'logit_bias.{key}' must be from -{MAX_LOGIT_BIAS:g} to {MAX_LOGIT_BIAS:g}"
            )
        bias[int(key)] = float(value)
    return bias


def _logprobs(wanted: object) -> int | None:
    if wanted is None:
        return None
    if isinstance(wanted, bool) or not isinstance(wanted, int):
        raise RequestError("'logprobs' must be the number of alternatives to report")
    if not 0 <= wanted <= MAX_TOP_LOGPROBS:
        raise RequestError(f"'logprobs' must be from 0 to {MAX_TOP_LOGPROBS}")
    return wanted


def _choices(n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise RequestError(f"'n' must be an integer from 1 to {MAX_CHOICES}")
    return n


def _response_format(wanted: object) -> ResponseFormat | None:
    if wanted is None:
        return None
    if not isinstance(wanted, dict) or wanted.get("type") != "json_object":
        raise RequestError('\'response_format\' must be {"type": "json_object"}, with a "schema"')
    schema = wanted.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise RequestError("'response_format.schema' must be a JSON schema (an object)")
    return ResponseFormat(schema)


def _tools(wire: dict[str, Any]) -> tuple[tuple[Tool, ...], ToolChoice, str]:
    """The tools offered, and the call the answer must make among them."""
    given = wire.get("tools") or []
    if not isinstance(given, list) or not all(_is_function_tool(tool) for tool in given):
        raise RequestError(
            '\'tools\' must be a list of {"type": "function", "function": {"name": ...}}'
        )
    tools = tuple(
        Tool(
            name=tool["function"]["name"],
            parameters=tool["function"].get("parameters") or {},
            description=tool["function"].get("description"),
        )
        for tool in given
    )
    choice = wire.get("tool_choice", "auto")
    if choice in ("auto", "required") and (tools or choice == "auto"):
        return tools, ToolChoice(choice), ""
    if not tools:
        raise RequestError("'tool_choice' asks for a call, but the request offers no tools")
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    names = [tool.name for tool in tools]
    if not isinstance(name, str) or name not in names:
        raise RequestError(
            f"'tool_choice' names {shown(name)}, which is not among the tools: {', '.join(names)}"
        )
    return tools, ToolChoice.FUNCTION, name


def _is_function_tool(tool: object) -> bool:
    function = tool.get("function") if isinstance(tool, dict) else None
    return (
        isinstance(tool, dict)
        and tool.get("type") == "function"
        and isinstance(function, dict)
        and isinstance(function.get("name"), str)
        and isinstance(function.get("parameters") or {}, dict)
        and isinstance(function.get("description", ""), str)
    )


def _parallel_calls(value: object) -> bool:
    if value is None:
        return True
    if not isinstance(value, bool):
        raise RequestError("'parallel_tool_calls' must be a boolean")
    return value


def _images(given: object) -> tuple[str, ...]:
    if given is None:
        return ()
    if not isinstance(given, list) or not all(isinstance(image, str) for image in given):
        raise RequestError("'images' must be a list of base64 strings")
    if len(given) > MAX_IMAGES:
        raise RequestError(f"a request may carry at most {MAX_IMAGES} images")
    return tuple(given)


def _priority(given: object) -> Priority | None:
    if given is None:
        return None
    try:
        return parse_priority(str(given), "'priority'")
    except BadValueError as exc:
        raise RequestError(str(exc)) from None


def _include_usage(options: object) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise RequestError("'stream_options' must be an object whose include_usage is a boolean")
    return bool(options.get("include_usage", False))
