"""A fuzz of the request fields through the HTTP edge into real workers (issue 24): strings of
every class of code point, huge numbers, deep nesting and wrong types, on the OpenAI routes and
Ollama's. Every answer must be below 500, and no worker may die (its pid unchanged, no `worker`
event in the journal). A seeded generator: ARBITERD_FUZZ_SEED picks another run,
ARBITERD_FUZZ_REQUESTS a longer one; the counts are recorded (the summary's "counts" section,
tests/conftest.py) whether the test passes or not."""

from __future__ import annotations

import collections
import json
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import RecordProperty
from tests.support.daemon import Daemon, serving
from tests.support.daemon import tiny as tiny_table
from tests.support.tiny_gguf import TOOLS_CHAT_TEMPLATE, TinyModelSpec, write_tiny_llama

SEED = int(os.environ.get("ARBITERD_FUZZ_SEED", "24"))
REQUESTS = int(os.environ.get("ARBITERD_FUZZ_REQUESTS", "600"))
REQUEST_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Raw:
    """JSON text sent as it is: what json.dumps cannot write (a 5,000-digit integer, 1e400) or
    should not build (a value nested 5,000 deep)."""

    text: str


def dumps(value: object) -> str:
    """`value` as JSON text; a str with its surrogates as \\u escapes, as a client sends them."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    return json.dumps(value)


# -- what the generator writes --------------------------------------------------------------------


def _one_of(*ranges: tuple[int, int]) -> Callable[[random.Random], str]:
    def pick(rng: random.Random) -> str:
        low, high = rng.choice(ranges)
        return chr(rng.randrange(low, high))

    return pick


NONCHARACTERS = [
    *range(0xFDD0, 0xFDF0),
    *(p * 0x10000 + e for p in range(17) for e in (0xFFFE, 0xFFFF)),
]
# Each class of code point, as a function of the generator that picks one.
CODE_POINTS: dict[str, Callable[[random.Random], str]] = {
    "ascii": _one_of((0x20, 0x7F)),
    "control": _one_of((0x00, 0x20), (0x7F, 0xA0)),  # NUL among them
    "surrogate": _one_of((0xD800, 0xDC00), (0xDC00, 0xE000)),  # lone, high or low
    "private-use": _one_of((0xE000, 0xF900), (0xF0000, 0xFFFFE), (0x100000, 0x10FFFE)),
    "noncharacter": lambda rng: chr(rng.choice(NONCHARACTERS)),
    "combining": _one_of((0x300, 0x370), (0x1AB0, 0x1B00), (0x20D0, 0x2100)),
    "rtl": _one_of((0x590, 0x900), (0x200E, 0x2010), (0x202A, 0x202F), (0x2066, 0x206A)),
    "emoji": lambda rng: (
        rng.choice(
            ["\U0001f600", "\U0001f469\u200d\U0001f4bb", "\U0001f1fa\U0001f1f8", "\u2764\ufe0f"]
        )
        + chr(rng.randrange(0x1F300, 0x1FB00))
    ),
    "cjk": _one_of((0x4E00, 0xA000), (0x20000, 0x2A6E0)),
    "max": lambda rng: "\U0010ffff",
}
# Texts that mean something to a layer behind the edge: the engine's image marker, special
# tokens of the tiny vocabulary and of others, template syntax, a data: URL.
MEANINGFUL = [
    "<__media__>",
    "<s>",
    "</s>",
    "<|user|>",
    "<|im_start|>",
    "{{ bos_token }}",
    "{% endfor %}",
    "<tool_call>",
    '{"name": "f", "arguments": {}}',
    "\\",
    '"',
    "data:image/png;base64,iVBORw0KGgo=",
]
INTEGERS = [0, 1, -1, 2, 16, 17, 511, 512, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1]


def text(rng: random.Random, *, valid: bool = False) -> str:
    """A string of a few classes of code point (none a lone surrogate when `valid`)."""
    classes = [c for c in CODE_POINTS if not (valid and c == "surrogate")]
    chosen = rng.sample(classes, rng.randint(1, 3))
    length = rng.choice([0, 1, 3, 12, 60, 2000])
    pieces = [CODE_POINTS[rng.choice(chosen)](rng) for _ in range(length)]
    if rng.random() < 0.3:
        pieces.insert(rng.randint(0, len(pieces)), rng.choice(MEANINGFUL))
    return "".join(pieces)


def number(rng: random.Random) -> object:
    kind = rng.randrange(4)
    if kind == 0:
        return rng.choice(INTEGERS)
    if kind == 1:  # more digits than any field takes, and than int() reads
        digits = rng.choice([21, 101, 4300, 4301, 20_000])
        return Raw(rng.choice(["", "-"]) + "9" * digits)
    if kind == 2:
        return rng.choice([0.5, -0.0, 1e-320, 1.7976931348623157e308, -2.5, 100.0, 100.5])
    return Raw(rng.choice(["1e400", "-1e400", "1e-400", "1E+2", "0.0000000000000000000001"]))


def nested(rng: random.Random) -> Raw:
    depth = rng.choice([63, 64, 65, 200, 5000])
    if rng.random() < 0.5:
        return Raw("[" * depth + "1" + "]" * depth)
    return Raw('{"a":' * depth + '"x"' + "}" * depth)


def value(rng: random.Random, depth: int = 0) -> object:
    """Any JSON value, most often the wrong type for the field it lands in."""
    kinds: list[Callable[[], object]] = [
        lambda: text(rng),
        lambda: number(rng),
        lambda: rng.choice([True, False, None]),
        lambda: nested(rng),
    ]
    if depth < 3:
        kinds.append(lambda: [value(rng, depth + 1) for _ in range(rng.randint(0, 3))])
        kinds.append(lambda: {text(rng): value(rng, depth + 1) for _ in range(rng.randint(0, 3))})
    return rng.choice(kinds)()


def schema(rng: random.Random) -> dict[str, object]:
    """A JSON schema for structured output, not always one the grammar converter can follow."""
    made: dict[str, object] = {
        "type": rng.choice(["object", "string", "integer", "array", text(rng)])
    }
    if rng.random() < 0.5:
        made["properties"] = {text(rng, valid=True): {"type": "string"}}
    if rng.random() < 0.3:
        made["maximum"] = number(rng)
    return made


def messages(rng: random.Random) -> list[dict[str, object]]:
    role = rng.choice(["user", "system", "assistant", "tool", "developer"])
    parts: list[dict[str, object]] = [{"type": "text", "text": text(rng, valid=True)}]
    if rng.random() < 0.3:
        parts.append({"type": "image_url", "image_url": {"url": text(rng, valid=True)}})
    return [{"role": role, "content": rng.choice([text(rng, valid=True), parts])}]


def tools(rng: random.Random) -> list[dict[str, object]]:
    name = rng.choice(["f", "get_weather", text(rng, valid=True)])
    return [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}]


def _valid_text(rng: random.Random) -> object:
    return text(rng, valid=True)


# By field name: a value that may well pass the edge, so the fuzz reaches the worker's
# tokenizer, its sampler, grammars and templates.
PLAUSIBLE: dict[str, Callable[[random.Random], object]] = {
    **dict.fromkeys(("prompt", "content", "text", "input", "system", "name", "user"), _valid_text),
    **dict.fromkeys(
        ("max_tokens", "max_completion_tokens", "num_predict"),
        lambda rng: rng.choice([1, 2, 3, 8, 0, -1]),
    ),
    **dict.fromkeys(
        ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"),
        lambda rng: rng.choice([0, 0.5, 1, 2, -2]),
    ),
    **dict.fromkeys(
        ("top_k", "n", "seed", "top_logprobs", "logprobs"),
        lambda rng: rng.choice([0, 1, 2, 3, 20, 2**40]),
    ),
    "stop": lambda rng: [text(rng, valid=True) for _ in range(rng.randint(0, 4))],
    # Token ids, and keys int() cannot read or that no vocabulary has.
    "logit_bias": lambda rng: {
        rng.choice(["5", "300", "511", "0", "007", "512", "1" * 5000, "\u00b2", "-1"]): rng.choice(
            [-100, 0, 50, 100]
        )
    },
    "response_format": lambda rng: {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": schema(rng)},
    },
    "format": lambda rng: rng.choice(["json", schema(rng)]),
    "tools": tools,
    "tool_choice": lambda rng: rng.choice(
        ["auto", "none", "required", {"type": "function", "function": {"name": "f"}}]
    ),
    "messages": messages,
    "stream": lambda rng: rng.choice([True, False]),
}


# Each route: its body when nothing is wrong, and the fields the fuzz changes (a path of keys
# and indexes into the body).
Path_ = tuple[str | int, ...]
CHAT_FIELDS: list[Path_] = [
    ("model",),
    ("messages",),
    ("messages", 0),
    ("messages", 0, "content"),
    ("messages", 0, "content", 0),
    ("messages", 0, "content", 0, "text"),
    ("messages", 0, "role"),
    ("messages", 0, "name"),
    ("messages", 0, "tool_calls"),
    ("max_tokens",),
    ("max_completion_tokens",),
    ("temperature",),
    ("top_p",),
    ("top_k",),
    ("min_p",),
    ("seed",),
    ("stop",),
    ("n",),
    ("logit_bias",),
    ("logprobs",),
    ("top_logprobs",),
    ("response_format",),
    ("tools",),
    ("tool_choice",),
    ("stream",),
    ("stream_options",),
    ("metadata",),
    ("user",),
    ("presence_penalty",),
    ("frequency_penalty",),
    ("repeat_penalty",),
]
COMPLETION_FIELDS: list[Path_] = [
    ("model",),
    ("prompt",),
    *(
        f
        for f in CHAT_FIELDS
        if f[0] not in ("messages", "tools", "tool_choice", "response_format")
    ),
]
EMBEDDING_FIELDS: list[Path_] = [
    ("model",),
    ("input",),
    ("input", 0),
    ("encoding_format",),
    ("user",),
]
OLLAMA_OPTIONS: list[Path_] = [
    ("options",),
    *(("options", o) for o in ("num_predict", "temperature", "top_k", "seed", "stop", "num_ctx")),
    ("format",),
    ("stream",),
    ("keep_alive",),
    ("model",),
]
ROUTES: dict[str, tuple[dict[str, Any], list[Path_]]] = {
    "/v1/chat/completions": (
        {"model": "m", "messages": [{"role": "user", "content": "the fox"}], "max_tokens": 2},
        CHAT_FIELDS,
    ),
    "/v1/completions": ({"model": "m", "prompt": "the fox", "max_tokens": 2}, COMPLETION_FIELDS),
    "/v1/embeddings": ({"model": "e", "input": "the fox"}, EMBEDDING_FIELDS),
    "/api/chat": (
        {
            "model": "m",
            "messages": [{"role": "user", "content": "the fox"}],
            "stream": False,
            "options": {"num_predict": 2},
        },
        [
            ("messages",),
            ("messages", 0, "content"),
            ("messages", 0, "images"),
            ("tools",),
            *OLLAMA_OPTIONS,
        ],
    ),
    "/api/generate": (
        {"model": "m", "prompt": "the fox", "stream": False, "options": {"num_predict": 2}},
        [("prompt",), ("system",), ("raw",), ("images",), *OLLAMA_OPTIONS],
    ),
    "/api/embed": (
        {"model": "e", "input": "the fox"},
        [("input",), ("truncate",), ("options",), ("model",)],
    ),
}


def put(body: Any, path: Path_, new: object) -> None:
    """Set `path` in `body` to `new`, making what leads there as it goes (a field that was a
    string becomes an object, a short array grows)."""
    *lead, last = path
    for at, step in enumerate(lead):
        missing: Any = [] if isinstance(path[at + 1], int) else {}
        if isinstance(step, int):
            while len(body) <= step:
                body.append(missing)
            if not isinstance(body[step], type(missing)):
                body[step] = missing
        elif not isinstance(body.get(step), type(missing)):
            body[step] = missing
        body = body[step]
    if isinstance(last, int):
        while len(body) <= last:
            body.append(None)
    body[last] = new


# Each route's main text: two requests in five change it to a text of any classes of code point
# (lone surrogates among them), so every class reaches the tokenizer or the edge's check often.
MAIN_TEXT: dict[str, Path_] = {
    "/v1/chat/completions": ("messages", 0, "content"),
    "/v1/completions": ("prompt",),
    "/v1/embeddings": ("input",),
    "/api/chat": ("messages", 0, "content"),
    "/api/generate": ("prompt",),
    "/api/embed": ("input",),
}


def request(rng: random.Random) -> tuple[str, bytes]:
    """A route and a body for it: its good body, often with its main text changed, and up to
    three fields changed; now and then a field it does not know."""
    route = rng.choice(list(ROUTES))
    good, fields = ROUTES[route]
    body = json.loads(json.dumps(good))
    if rng.random() < 0.4:
        put(body, MAIN_TEXT[route], text(rng))
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):  # few: most of a body stays good
        field = rng.choice(fields)
        name = next((step for step in reversed(field) if isinstance(step, str)), "")
        new = PLAUSIBLE[name](rng) if name in PLAUSIBLE and rng.random() < 0.5 else value(rng)
        put(body, field, new)
    if rng.random() < 0.1:
        body[text(rng)] = value(rng)
    if rng.random() < 0.05:
        return route, dumps(value(rng)).encode()  # not an object at all
    return route, dumps(body).encode()


# -- the run --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a template that renders tools, so tool requests reach the engine."""
    spec = TinyModelSpec(chat_template=TOOLS_CHAT_TEMPLATE)
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-tools.gguf", spec)


@pytest.fixture(scope="module")
def daemon(tools_model: Path, tiny_embedding_model: Path) -> Iterator[Daemon]:
    models = {
        "m": tiny_table(tools_model, n_ctx=512),
        "e": tiny_table(tiny_embedding_model, n_ctx=64),
    }
    with serving(models) as running:
        yield running


def failure_in_stream(route: str, response: httpx.Response) -> str | None:
    """The error a 200 stream ended with, if it was a server's fault (an SSE error event of
    type server_error, or an Ollama error line saying internal error)."""
    if response.headers.get("content-type", "").startswith("application/json"):
        return None  # a whole answer: its status says it all
    for line in response.text.split("\n"):  # not splitlines(): U+2028 may be in a chunk
        data = line.removeprefix("data: ")
        if not data.startswith("{"):
            continue
        error = json.loads(data).get("error")
        if error is None:
            continue
        if isinstance(error, dict) and error.get("type") == "server_error":
            return str(error)
        if isinstance(error, str) and "internal error" in error:
            return error
    return None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fuzzed_requests_never_kill_a_worker_nor_get_a_5xx(
    daemon: Daemon, record_property: RecordProperty
) -> None:
    rng = random.Random(SEED)
    with daemon.client() as control:
        before = {m["name"]: m for m in control.call("status")["models"]}
        last_seq = max((e["seq"] for e in control.history()), default=0)
    statuses: collections.Counter[int] = collections.Counter()
    by_route: collections.Counter[str] = collections.Counter()
    faults: list[str] = []
    started = time.monotonic()
    with httpx.Client(base_url=daemon.url.removesuffix("/v1"), timeout=REQUEST_TIMEOUT_S) as http:
        for _ in range(REQUESTS):
            route, raw = request(rng)
            response = http.post(route, content=raw, headers={"content-type": "application/json"})
            statuses[response.status_code] += 1
            by_route[route] += 1
            problem = (
                response.text[:300]
                if response.status_code >= 500
                else failure_in_stream(route, response)
            )
            if problem is not None:
                faults.append(f"{route} {raw[:300]!r} -> {response.status_code}: {problem}")
    elapsed_s = time.monotonic() - started
    with daemon.client() as control:
        after = {m["name"]: m for m in control.call("status")["models"]}
        exits = [e for e in control.history(after_seq=last_seq) if e.get("event") == "worker"]
    reached = sum(after[name]["served"] - before[name]["served"] for name in after)
    record_property(
        "counts",
        f"request fuzz (seed {SEED}): {sum(statuses.values())} requests in {elapsed_s:.0f} s;"
        f" by status {dict(sorted(statuses.items()))}; by route {dict(by_route)};"
        f" {reached} served by a worker; {len(exits)} worker exits;"
        f" {sum(n for s, n in statuses.items() if s >= 500)} 5xx, {len(faults)} faults",
    )
    assert faults == []
    assert exits == []
    for name, model in after.items():
        assert model["pid"] == before[name]["pid"], name
        assert model["state"] in ("warm", "cold"), name
    assert reached > REQUESTS // 10  # the fuzz got past the edge, into the engines
