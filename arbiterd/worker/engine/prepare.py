"""Request preparation: a completion, chat or embedding request (arbiterd.request.GenerateRequest,
whose every field the HTTP edge checked) rendered and tokenized into a `Prepared`, checked only
for what needs the model: the kind it serves, its vocabulary's token ids, a schema's grammar, a
model that takes tools (by its template, or the generic rendering of arbiterd/chattemplate.py
when the template has no place for them), a chat template (without one, a chat is refused
unless it carries a plain prompt, completed as it is), the context. It reads the model's
vocabulary and chat format alone, never its weights or its context, so a cold model prepares
as well as a warm one (issue 10). Part of the engine (arbiterd/worker/engine/): it calls
llama_cpp's chat handlers and grammar converter; it touches no device state.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import llama_cpp
from llama_cpp import llama_chat_format
from llama_cpp.llama_grammar import JSON_GBNF, LlamaGrammar

from arbiterd.chattemplate import generic_tool_messages
from arbiterd.errors import ContextOverflowError, RequestError
from arbiterd.request import GenerateRequest, ResponseFormat, ToolChoice
from arbiterd.spec import Capability, ModelSpec, capabilities, kind_refusal
from arbiterd.states import RequestKind
from arbiterd.worker.engine.records import Cancelled, Prepared
from arbiterd.worker.engine.vocab import Vocab
from arbiterd.worker.toolcalls import call_schema
from arbiterd.worker.vision import MARKER, decode_image

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

    def prepare(self, request: GenerateRequest, cancelled: Cancelled) -> Prepared:
        """Render and tokenize one completion, chat or embedding request, with the vocabulary
        alone: no device state is touched, so a cold model prepares as well as a warm one. Only
        what needs the model is checked here (the HTTP edge checked every field): the kind it
        serves (a RequestError), its vocabulary's token ids, the grammar of a schema, a template
        a model that takes tools, and the context.

        Sizes are checked before any native call: more messages than the context has tokens,
        or more characters than n_ctx of the longest tokens could cover, cannot fit. The
        tokenizer stops as soon as the context is full, and when `cancelled` says so between
        two of its pieces (RequestError)."""
        vocab = self.vocab
        refusal = kind_refusal(self.spec.name, request.kind, self.spec.embedding)
        if refusal:
            raise RequestError(refusal)
        if request.kind is RequestKind.EMBEDDING:
            return self._prepare_embedding(vocab, request.inputs, cancelled)
        n_ctx = self.spec.n_ctx
        kwargs = request.sampling.kwargs()
        if request.logit_bias:
            _check_bias_tokens(request.logit_bias, vocab.n_tokens)
            kwargs["logit_bias"] = dict(request.logit_bias)
        images: tuple[bytes, ...] = ()
        image_at: tuple[int, ...] = ()
        if request.kind is RequestKind.CHAT and not self._chats():
            completion = self._prepare_plain(vocab, request, kwargs, cancelled)
        elif request.kind is RequestKind.CHAT:
            images = self._images(request.images)
            completion, image_at = self._prepare_chat(
                vocab, request, kwargs, cancelled, len(images)
            )
        else:
            _check_characters(len(request.prompt), vocab.max_text_bytes(n_ctx))
            fill = request.infill
            if fill is None:
                tokens = vocab.completion_prompt(request.prompt, limit=n_ctx, cancelled=cancelled)
            else:  # fill in the middle, between the prompt and the suffix
                parts = (fill.suffix, fill.middle, *(text for _, text in fill.extra))
                _check_characters(sum(map(len, parts)), vocab.max_text_bytes(n_ctx))
                tokens = vocab.infill_prompt(request.prompt, fill, limit=n_ctx, cancelled=cancelled)
            completion = {"prompt": tokens, "stream": True, **kwargs}
        prepared = Prepared(
            request.kind,
            completion,
            include_usage=request.include_usage,
            n=request.n,
            top_logprobs=request.logprobs,
            tools=tuple(tool.name for tool in request.tools),
            forced_call=request.tool_choice is not ToolChoice.AUTO,
            parallel_calls=request.parallel_tool_calls,
            images=images,
            image_at=image_at,
        )
        if len(prepared.prompt_tokens) >= n_ctx:  # the test create_completion makes, made early
            raise ContextOverflowError(
                f"Requested tokens ({len(prepared.prompt_tokens)}) exceed context window of {n_ctx}"
            )
        return prepared

    def _images(self, given: tuple[str, ...]) -> tuple[bytes, ...]:
        """A chat request's images (base64, one per marker in its messages, as the HTTP edge
        made them), checked to be images this model can take."""
        if given and not self.takes_images:
            raise RequestError(
                f"{self.spec.name} takes no images: its config names no mmproj (a projector)"
            )
        return tuple(decode_image(index, data) for index, data in enumerate(given))

    def _prepare_chat(
        self,
        vocab: Vocab,
        request: GenerateRequest,
        kwargs: dict[str, Any],
        cancelled: Cancelled,
        n_images: int = 0,
    ) -> tuple[dict[str, Any], tuple[int, ...]]:
        """A chat request's completion arguments, and where its `n_images` images go among the
        prompt's tokens."""
        n_ctx = self.spec.n_ctx
        messages = list(request.messages)
        # Chat templates put at least a role marker around every message: each takes a
        # token at least, so more messages than the context has tokens cannot fit.
        if len(messages) > n_ctx:
            raise ContextOverflowError(
                f"{len(messages)} messages exceed the context window of {n_ctx} tokens"
            )
        _check_characters(_characters(messages), vocab.max_text_bytes(n_ctx))
        response_format = _handler_format(request.response_format, vocab)
        if response_format is not None:  # the chat handler turns it into a grammar
            kwargs = {**kwargs, "response_format": response_format}
        call_grammar = _call_grammar(request, vocab, shaped=response_format is not None)
        tools = [tool.template_form() for tool in request.tools]
        if tools and self._template_takes_tools():
            kwargs["tools"] = tools  # for the template; the choice is ours to enforce
            shaped = _template_messages(messages)
        elif tools:  # the template has no place for them: the generic rendering
            shaped = generic_tool_messages(messages, tools)
        else:
            shaped = _template_messages(messages)
        completion, image_at = self._chat_completion(vocab, shaped, kwargs, cancelled, n_images)
        if call_grammar is not None:
            completion["grammar"] = call_grammar
        return completion, image_at

    def _chats(self) -> bool:
        """Whether the model has a chat template: its GGUF's, a chat_format or the config's."""
        has_template = bool(self.vocab.chat_template)
        return Capability.CHAT in capabilities(self.spec, has_chat_template=has_template)

    def _prepare_plain(
        self,
        vocab: Vocab,
        request: GenerateRequest,
        kwargs: dict[str, Any],
        cancelled: Cancelled,
    ) -> dict[str, Any]:
        """A chat for a model without a chat template (issue 40): its plain_prompt completed as
        it is (Ollama's /api/generate), answered as a chat; a RequestError naming the fix when
        it has none. llama-cpp-python would render it as Llama 2's [INST] turns, which a model
        not trained on them (a base model) answers with nothing: no guess of a format is right
        for every such model, so the user picks one."""
        if not request.plain_prompt:
            raise RequestError(
                f"{self.spec.name} has no chat template: its GGUF holds none and its config "
                "sets neither chat_format nor chat_template. Set one in its [models] table "
                '(chat_format = "chatml", say, or chat_template = "..." with the Jinja template '
                "it was trained on), or send the text as it is to /v1/completions"
            )
        _check_characters(len(request.plain_prompt), vocab.max_text_bytes(self.spec.n_ctx))
        tokens = vocab.completion_prompt(
            request.plain_prompt, limit=self.spec.n_ctx, cancelled=cancelled
        )
        completion = {"prompt": tokens, "stream": True, **kwargs}
        grammar = _format_grammar(request.response_format, vocab)
        if grammar is not None:
            completion["grammar"] = grammar
        return completion

    def _prepare_embedding(
        self, vocab: Vocab, texts: tuple[str, ...], cancelled: Cancelled
    ) -> Prepared:
        """Tokenize each text as `Llama.embed` does: with the vocabulary's BOS/EOS (BERT's
        CLS/SEP), special tokens taken as plain text. Each input is embedded in one decode, so
        each must fit the context on its own."""
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
        return Prepared(RequestKind.EMBEDDING, {}, inputs=tuple(inputs))

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

    def _template_takes_tools(self) -> bool:
        """Whether the chat template renders the tools itself (False: they go in the system
        turn, chattemplate.generic_tool_messages); RequestError when the model's config
        refuses tools (`tools = "refuse"`)."""
        if not self.spec.tools:
            raise RequestError(
                f'{self.spec.name} cannot be offered tools: its config says tools = "refuse"'
            )
        if self.chat is None:
            raise RequestError(f"{self.spec.name} has not been loaded yet")
        return self.chat.takes_tools


def _handler_format(wanted: ResponseFormat | None, vocab: Vocab) -> dict[str, Any] | None:
    """The chat request's structured output, as llama-cpp-python's chat handlers take it:
    {"type": "json_object"}, with the JSON schema the output must follow when there is one
    ("schema"), checked to compile to a grammar; None for free text."""
    if wanted is None:
        return None
    if wanted.schema is None:
        return {"type": "json_object"}
    _grammar(wanted.schema, "the JSON schema", vocab)
    return {"type": "json_object", "schema": wanted.schema}


def _format_grammar(wanted: ResponseFormat | None, vocab: Vocab) -> LlamaGrammar | None:
    """The grammar of a structured output outside a chat handler, as the handlers make it: of
    the schema when there is one, else of any JSON value."""
    if wanted is None:
        return None
    if wanted.schema is None:
        return LlamaGrammar.from_string(JSON_GBNF, verbose=False)
    return _grammar(wanted.schema, "the JSON schema", vocab)


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


def _check_bias_tokens(bias: dict[int, float], n_vocab: int) -> None:
    """A logit bias must name tokens of this model's vocabulary (the edge checked the rest)."""
    for token in bias:
        if not 0 <= token < n_vocab:
            raise RequestError(
                f"'logit_bias' names token {token}; this model's ids are 0 to {n_vocab - 1}"
            )


def _call_grammar(request: GenerateRequest, vocab: Vocab, *, shaped: bool) -> LlamaGrammar | None:
    """The grammar that makes the answer the call the request's tool_choice asks for (None: the
    model's choice), after checking every tool's parameters, called or not: a bad one is the
    client's bug."""
    for tool in request.tools:
        _grammar(tool.parameters or {}, f"tool {tool.name!r}'s parameters", vocab)
    if request.tool_choice is ToolChoice.AUTO:
        return None
    if shaped:
        raise RequestError(
            "'response_format' cannot shape an answer that 'tool_choice' makes a call"
        )
    named = request.tool_name if request.tool_choice is ToolChoice.FUNCTION else None
    tools = [tool.template_form() for tool in request.tools]
    return _grammar(call_schema(tools, named), "the call", vocab)


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
        # The handlers of GGUF templates stop on the GGUF's EOS token id (a Python check of
        # the last token), which the decoder stops on as an end-of-generation token anyway.
        arguments.pop("stopping_criteria", None)
        self.arguments = arguments
        return iter(())
