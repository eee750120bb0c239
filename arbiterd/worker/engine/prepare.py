"""Request preparation: a completion, chat or embedding request checked, rendered and tokenized
into a `Prepared`, with the model's vocabulary and chat format alone, never its weights or its
context, so a cold model prepares as well as a warm one (issue 10). Part of the engine
(arbiterd/worker/engine/): it calls llama_cpp's chat handlers and grammar converter; it touches
no device state.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import llama_cpp
from llama_cpp import llama_chat_format
from llama_cpp.llama_grammar import LlamaGrammar

from arbiterd.errors import ContextOverflowError, RequestError
from arbiterd.spec import (
    COMPLETION_PARAMS,
    EMBEDDING,
    MAX_IMAGES,
    ModelSpec,
    kind_refusal,
)
from arbiterd.worker.engine.records import Cancelled, Prepared
from arbiterd.worker.engine.vocab import Vocab
from arbiterd.worker.toolcalls import call_schema
from arbiterd.worker.vision import MARKER, decode_image

# The most choices (`n`) and most likely tokens per place (`top_logprobs`) a request may ask for.
MAX_CHOICES = 16
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # in either direction, as OpenAI
MAX_SHOWN_CHARS = 40  # of a refused value, in an error message
# llama-cpp-python's name for the chat format that renders the GGUF's own Jinja template.
GGUF_TEMPLATE = "chat_template.default"


@dataclass(frozen=True)
class Preparer:
    """What preparing a request reads: the model's spec, its vocabulary, its chat format (None
    until the model is loaded: `Llama.__init__` picks it) and whether it takes images (its
    config names a projector)."""

    spec: ModelSpec
    vocab: Vocab
    chat: ChatFormat | None
    takes_images: bool

    def prepare(self, kind: str, body: dict[str, Any], cancelled: Cancelled) -> Prepared:
        """Check, render and tokenize one completion ("completion": body["prompt"]), chat
        ("chat": body["messages"]) or embedding (EMBEDDING: body["input"]) request, with the
        vocabulary alone: no device state is touched, so a cold model prepares as well as a
        warm one. A kind the model does not serve is a RequestError.

        Sizes are checked before any native call: more messages than the context has tokens,
        or more characters than n_ctx of the longest tokens could cover, cannot fit. The
        tokenizer stops as soon as the context is full, and when `cancelled` says so between
        two of its pieces (RequestError)."""
        vocab = self.vocab
        refusal = kind_refusal(self.spec.name, kind, self.spec.embedding)
        if refusal:
            raise RequestError(refusal)
        if kind == EMBEDDING:
            return self._prepare_embedding(vocab, body, cancelled)
        n_ctx = self.spec.n_ctx
        kwargs = _request_kwargs(body)
        bias = _logit_bias(body, vocab.n_tokens)
        if bias:
            kwargs["logit_bias"] = bias
        max_chars = vocab.max_text_bytes(n_ctx)
        tools: list[dict[str, Any]] = []
        forced: str | None = None
        images: tuple[bytes, ...] = ()
        image_at: tuple[int, ...] = ()
        if kind == "chat":
            images = self._images(body)
            completion, tools, forced, image_at = self._prepare_chat(
                vocab, body, kwargs, cancelled, len(images)
            )
        elif kind == "completion":
            if body.get("images"):
                raise RequestError("images go in chat requests, not completions")
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise RequestError("'prompt' must be a string")
            _check_characters(len(prompt), max_chars)
            tokens = vocab.completion_prompt(prompt, limit=n_ctx, cancelled=cancelled)
            completion = {"prompt": tokens, "stream": True, **kwargs}
        else:
            raise RequestError(f"unknown request kind {kind!r}")
        request = Prepared(
            kind,
            completion,
            include_usage=_include_usage(body),
            n=_choices(body),
            top_logprobs=_top_logprobs(body),
            tools=tuple(tool["function"]["name"] for tool in tools),
            forced_call=forced is not None,
            parallel_calls=body.get("parallel_tool_calls") is not False,
            images=images,
            image_at=image_at,
        )
        if len(request.prompt_tokens) >= n_ctx:  # the test create_completion makes, made early
            raise ContextOverflowError(
                f"Requested tokens ({len(request.prompt_tokens)}) exceed context window of {n_ctx}"
            )
        return request

    def _images(self, body: dict[str, Any]) -> tuple[bytes, ...]:
        """A chat request's images (body["images"], base64, one per marker in its messages, as
        the HTTP edge made them), checked to be images this model can take."""
        given = body.get("images") or []
        if not isinstance(given, list) or not all(isinstance(i, str) for i in given):
            raise RequestError("'images' must be a list of base64 strings")
        if len(given) > MAX_IMAGES:
            raise RequestError(f"a request may carry at most {MAX_IMAGES} images")
        if given and not self.takes_images:
            raise RequestError(
                f"{self.spec.name} takes no images: its config names no mmproj (a projector)"
            )
        return tuple(decode_image(index, data) for index, data in enumerate(given))

    def _prepare_chat(
        self,
        vocab: Vocab,
        body: dict[str, Any],
        kwargs: dict[str, Any],
        cancelled: Cancelled,
        n_images: int = 0,
    ) -> tuple[dict[str, Any], list[dict[str, Any]], str | None, tuple[int, ...]]:
        """A chat request's completion arguments, the tools it offers, the call it forces and
        where its `n_images` images go among the prompt's tokens."""
        n_ctx = self.spec.n_ctx
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list")
        # Chat templates put at least a role marker around every message: each takes a
        # token at least, so more messages than the context has tokens cannot fit.
        if len(messages) > n_ctx:
            raise ContextOverflowError(
                f"{len(messages)} messages exceed the context window of {n_ctx} tokens"
            )
        _check_characters(_characters(messages), vocab.max_text_bytes(n_ctx))
        response_format = _response_format(body, vocab)
        if response_format is not None:  # the chat handler turns it into a grammar
            kwargs = {**kwargs, "response_format": response_format}
        tools, forced = _tools(body)
        call_grammar = _call_grammar(tools, forced, vocab, shaped=response_format is not None)
        if tools:
            self._require_tool_template()
            kwargs["tools"] = tools  # for the template; the choice is ours to enforce
        completion, image_at = self._chat_completion(
            vocab, _template_messages(messages), kwargs, cancelled, n_images
        )
        if call_grammar is not None:
            completion["grammar"] = call_grammar
        return completion, tools, forced, image_at

    def _prepare_embedding(
        self, vocab: Vocab, body: dict[str, Any], cancelled: Cancelled
    ) -> Prepared:
        """Tokenize each text of body["input"] as `Llama.embed` does: with the vocabulary's
        BOS/EOS (BERT's CLS/SEP), special tokens taken as plain text. Each input is embedded
        in one decode, so each must fit the context on its own."""
        texts = body.get("input")
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError("'input' must be a non-empty list of strings")
        n_ctx = self.spec.n_ctx
        inputs = []
        for index, text in enumerate(texts):
            if cancelled():  # between two inputs: a waiter gets the GPU, a cancel is seen
                raise RequestError("cancelled while its input was tokenized")
            try:
                tokens = vocab.tokenize(
                    text.encode(),
                    add_special=True,
                    parse_special=False,
                    limit=n_ctx,
                    cancelled=cancelled,
                )
            except ContextOverflowError as exc:
                raise ContextOverflowError(f"input[{index}]: {exc}") from None
            if len(tokens) > n_ctx:
                raise ContextOverflowError(
                    f"input[{index}] is {len(tokens)} tokens long, more than the context window"
                    f" of {n_ctx}"
                )
            if not tokens:
                raise RequestError(f"input[{index}] makes no tokens: there is nothing to embed")
            inputs.append(tokens)
        return Prepared(EMBEDDING, {}, inputs=tuple(inputs))

    def _chat_completion(
        self,
        vocab: Vocab,
        messages: list[Any],
        kwargs: dict[str, Any],
        cancelled: Cancelled,
        n_images: int = 0,
    ) -> tuple[dict[str, Any], tuple[int, ...]]:
        """The completion arguments the chat handler makes of `messages`, and where each of
        `n_images` images goes among its prompt tokens: the rendered prompt is cut at each
        MARKER and its pieces tokenized one by one, as mtmd tokenizes the text around media."""
        if self.chat is None:
            raise RequestError(f"{self.spec.name} has not been loaded yet")
        image_at: list[int] = []

        def tokenize(text: bytes, add_bos: bool, special: bool) -> list[int]:
            pieces = text.split(MARKER.encode()) if n_images else [text]
            if len(pieces) - 1 != n_images:
                raise RequestError(
                    f"the chat template kept {len(pieces) - 1} of the request's {n_images} "
                    "images; its messages must carry each image where the template prints text"
                )
            tokens: list[int] = []
            image_at.clear()
            for index, piece in enumerate(pieces):
                if index:
                    image_at.append(len(tokens))
                tokens += vocab.tokenize(
                    piece,
                    add_special=add_bos and index == 0,
                    parse_special=special,
                    limit=self.spec.n_ctx,
                    cancelled=cancelled,
                )
            return tokens

        call = _CompletionCall(self.chat, tokenize)
        # Llama.create_chat_completion picks the chat handler and its defaults; the handler
        # renders the template, tokenizes through `call` and hands it the completion to run.
        try:
            llama_cpp.Llama.create_chat_completion(
                cast(llama_cpp.Llama, call), messages=messages, stream=True, **kwargs
            )
        except (ValueError, llama_chat_format.LlamaChatCompletionHandlerNotFoundException) as exc:
            # A template's raise_exception(), or a chat_format llama-cpp-python does not know.
            raise RequestError(str(exc)) from None
        return call.arguments, tuple(image_at)

    def _require_tool_template(self) -> None:
        if self.chat is None:
            raise RequestError(f"{self.spec.name} has not been loaded yet")
        if not self.chat.takes_tools:
            how = (
                f'its chat_format "{self.chat.chat_format}"'
                if self.chat.chat_format != GGUF_TEMPLATE
                else "the chat template in its GGUF"
            )
            raise RequestError(
                f"{self.spec.name} cannot be offered tools: {how} has no place for them"
            )


def _request_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for key, types in COMPLETION_PARAMS.items():
        if key not in body or body[key] is None:
            continue
        value = body[key]
        if isinstance(value, bool) or not isinstance(value, types):
            expected = " or ".join(t.__name__ for t in types)
            raise RequestError(f"'{key}' must be {expected}, got {type(value).__name__}")
        kwargs[key] = value
    if "max_tokens" in kwargs and kwargs["max_tokens"] < 1:
        raise RequestError("'max_tokens' must be at least 1")
    return kwargs


def _response_format(body: dict[str, Any], vocab: Vocab) -> dict[str, Any] | None:
    """The chat request's structured output, as llama-cpp-python's chat handlers take it:
    {"type": "json_object"}, with the JSON schema the output must follow when there is one
    ("schema"); None for free text."""
    wanted = body.get("response_format")
    if wanted is None:
        return None
    if not isinstance(wanted, dict) or wanted.get("type") != "json_object":
        raise RequestError('\'response_format\' must be {"type": "json_object"}, with a "schema"')
    schema = wanted.get("schema")
    if schema is None:
        return {"type": "json_object"}
    if not isinstance(schema, dict):
        raise RequestError("'response_format.schema' must be a JSON schema (an object)")
    _grammar(schema, "the JSON schema", vocab)
    return {"type": "json_object", "schema": schema}


def _grammar(schema: dict[str, Any], what: str, vocab: Vocab) -> LlamaGrammar:
    """The grammar whose sentences are the instances of a JSON schema; RequestError naming
    `what` when llama-cpp-python's converter cannot follow the schema, or llama.cpp cannot
    parse what the converter wrote."""
    try:  # the converter reports what it cannot follow in assorted exceptions
        grammar = LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
    except Exception as exc:
        raise RequestError(f"{what} cannot be followed: {exc}") from None
    if not vocab.parses(grammar):
        raise RequestError(
            f"{what} cannot be followed: llama.cpp cannot parse the grammar made of it (a"
            " property name with a form feed, a backspace or a quote, for one)"
        )
    return grammar


def _shown(value: object) -> str:
    """`value` as an error message shows it: its repr (which escapes what UTF-8 cannot
    encode), cut short."""
    shown = repr(value)
    return shown if len(shown) <= MAX_SHOWN_CHARS else shown[: MAX_SHOWN_CHARS - 3] + "..."


def _logit_bias(body: dict[str, Any], n_vocab: int) -> dict[int, float]:
    """OpenAI's logit_bias ({"token id": bias}) as llama-cpp-python takes it."""
    given = body.get("logit_bias")
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise RequestError("'logit_bias' must be an object of token ids to biases")
    bias = {}
    for key, value in given.items():
        # ASCII digits no longer than the largest id, before int(): str.isdigit() also takes
        # digits int() refuses ("²"), and int() refuses more than 4,300 digits (issue 24).
        is_id = isinstance(key, str) and key.isascii() and key.isdigit()
        token = int(key) if is_id and len(key) <= len(str(n_vocab)) else -1
        if not 0 <= token < n_vocab:
            raise RequestError(
                f"'logit_bias' names token {_shown(key)}; this model's ids are 0 to {n_vocab - 1}"
            )
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RequestError(f"'logit_bias.{token}' must be a number")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise RequestError(
                f"'logit_bias.{token}' must be from -{MAX_LOGIT_BIAS:g} to {MAX_LOGIT_BIAS:g}"
            )
        bias[token] = float(value)
    return bias


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """The tools a chat request offers the model (none when tool_choice is "none"), and the call
    it must make: None (its choice), "required" (any tool) or a tool's name."""
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(_is_function_tool(tool) for tool in tools):
        raise RequestError(
            '\'tools\' must be a list of {"type": "function", "function": {"name": ...}}'
        )
    choice = body.get("tool_choice", "auto" if tools else "none")
    if choice == "none" or not tools:
        if choice not in ("none", "auto"):
            raise RequestError("'tool_choice' asks for a call, but the request offers no tools")
        return [], None
    if choice == "auto":
        return tools, None
    if choice == "required":
        return tools, "required"
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    names = [tool["function"]["name"] for tool in tools]
    if name not in names:
        raise RequestError(
            f"'tool_choice' names {name!r}, which is not among the tools: {', '.join(names)}"
        )
    assert isinstance(name, str)
    return tools, name


def _call_grammar(
    tools: list[dict[str, Any]], forced: str | None, vocab: Vocab, *, shaped: bool
) -> LlamaGrammar | None:
    """The grammar that makes the answer the call `forced` asks for (None: the model's choice),
    after checking every tool's parameters, called or not: a bad one is the client's bug."""
    for tool in tools:
        function = tool["function"]
        _grammar(function.get("parameters") or {}, f"tool {function['name']!r}'s parameters", vocab)
    if forced is None:
        return None
    if shaped:
        raise RequestError(
            "'response_format' cannot shape an answer that 'tool_choice' makes a call"
        )
    return _grammar(call_schema(tools, None if forced == "required" else forced), "the call", vocab)


def _is_function_tool(tool: object) -> bool:
    function = tool.get("function") if isinstance(tool, dict) else None
    return (
        isinstance(tool, dict)
        and tool.get("type") == "function"
        and isinstance(function, dict)
        and isinstance(function.get("name"), str)
    )


def _template_messages(messages: list[Any]) -> list[Any]:
    """Messages as chat templates read them (the Hugging Face convention): a call's arguments
    as an object rather than OpenAI's JSON text, and "" for the content of an assistant turn
    that only called tools (templates trim or concatenate it)."""
    shaped = []
    for message in messages:
        if not isinstance(message, dict) or not message.get("tool_calls"):
            shaped.append(message)
            continue
        calls = []
        for call in message["tool_calls"]:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
                calls.append(call)
                continue
            try:
                arguments = json.loads(function["arguments"])
            except json.JSONDecodeError:
                arguments = function["arguments"]
            calls.append({**call, "function": {**function, "arguments": arguments}})
        shaped.append({**message, "content": message.get("content") or "", "tool_calls": calls})
    return shaped


def _choices(body: dict[str, Any]) -> int:
    n = body.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise RequestError(f"'n' must be an integer from 1 to {MAX_CHOICES}")
    return n


def _top_logprobs(body: dict[str, Any]) -> int | None:
    """How many alternatives to report with each token's log-probability; None: none at all."""
    wanted = body.get("logprobs")
    if wanted is None:
        return None
    if isinstance(wanted, bool) or not isinstance(wanted, int):
        raise RequestError("'logprobs' must be the number of alternatives to report")
    if not 0 <= wanted <= MAX_TOP_LOGPROBS:
        raise RequestError(f"'logprobs' must be from 0 to {MAX_TOP_LOGPROBS}")
    return wanted


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise RequestError("'stream_options' must be an object whose include_usage is a boolean")
    return bool(options.get("include_usage", False))


def _characters(messages: list[Any]) -> int:
    """Characters in all the strings of a chat request's messages (what a template renders)."""
    count, pending = 0, list(messages)
    while pending:  # a loop, not recursion: the nesting depth is the client's choice
        value = pending.pop()
        if isinstance(value, str):
            count += len(value)
        elif isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return count


def _check_characters(count: int, limit: int | None) -> None:
    if limit is not None and count > limit:
        raise ContextOverflowError(
            f"{count} characters exceed what the context window can hold ({limit})"
        )


@dataclass(frozen=True)
class ChatFormat:
    """What `Llama.create_chat_completion` picks its chat handler from, as `Llama.__init__` set
    it up from the model's metadata and the spec's chat_format."""

    chat_handler: Any
    _chat_handlers: dict[str, Any]
    chat_format: str | None
    takes_tools: bool = False  # the chat template renders the tools a request offers


class _CompletionCall:
    """Stands in for the `Llama` that `Llama.create_chat_completion` runs on, without weights:
    the chat handler renders the template, tokenizes the prompt through `tokenize` and asks
    `create_completion` to run it, which records the arguments instead (to run them on the
    warm model later) and hands back an empty stream that nobody reads."""

    verbose = False

    def __init__(self, chat: ChatFormat, tokenize: Callable[[bytes, bool, bool], list[int]]):
        self.chat_handler = chat.chat_handler
        self._chat_handlers = chat._chat_handlers
        self.chat_format = chat.chat_format
        self._tokenize = tokenize
        self.arguments: dict[str, Any] = {}

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return self._tokenize(text, add_bos, special)

    def create_completion(self, **arguments: Any) -> Iterator[dict[str, Any]]:
        self.arguments = arguments
        return iter(())
