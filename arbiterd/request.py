"""One generation request, as every process names it: the record the HTTP edge builds once from
an OpenAI or Ollama body, the daemon routes, and the worker protocol carries to the engine.

Owns `GenerateRequest` and its wire form, which is its own fields by name (`to_json`,
`from_json`: arbiterd/fields.py's strict codec), and the limits a request may ask for.
Holds no OpenAI dialect: the edge (arbiterd/daemon/http/openai_requests.py) is the one place that
reads one, checks a body field by field and answers each bad one with a 400 naming it; what
reaches this record is already what the engine runs. `from_json` refuses a message with a field
unknown, missing or of the wrong type (a RequestError naming it), so that a malformed message
fails its request and never the worker (issue 24). The checks that need the model (token ids
within its vocabulary, a schema its grammar compiler follows, a prompt its context holds, a
model that takes tools or images) are the engine's. Imports nothing heavy: the daemon and the
worker share it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any

from arbiterd.errors import RequestError
from arbiterd.fields import FieldError, strict_decode, strict_encode
from arbiterd.states import Priority, RequestKind

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

    def template_form(self) -> dict[str, Any]:
        """As chat templates (and OpenAI) spell a tool: what the engine renders."""
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
        """The record as the worker protocol carries it: its own fields, by name, only those that
        differ from their default (events.strict_encode)."""
        return strict_encode(self)

    @classmethod
    def from_json(cls, wire: object) -> GenerateRequest:
        """The record `to_json` wrote; RequestError naming the first field that is unknown,
        missing or of the wrong type (fields.strict_decode), so that a malformed message fails
        its request and never the worker (issue 24)."""
        if not isinstance(wire, dict):
            raise RequestError("a request must be an object")
        try:
            return strict_decode(cls, wire)
        except FieldError as exc:
            raise RequestError(str(exc)) from None


def shown(value: object) -> str:
    """A refused value as a message shows it: its repr (which escapes what UTF-8 cannot
    encode), cut short."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 3] + "..."
