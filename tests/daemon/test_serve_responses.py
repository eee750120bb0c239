"""POST /v1/responses answered by a real daemon of a tiny model, as the openai SDK's
`responses.create()` and `responses.stream()` call it: text, tools and their outputs, streaming
events, previous_response_id; and the routes arbiterd does not serve."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.responses import FunctionToolParam

from tests.support.daemon import Daemon, openai_client, serving, tiny
from tests.support.tiny_gguf import TOOLS_CHAT_TEMPLATE, TinyModelSpec, write_tiny_llama

ADD: FunctionToolParam = {
    "type": "function",
    "name": "add",
    "description": "Add two integers",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    spec = TinyModelSpec(chat_template=TOOLS_CHAT_TEMPLATE)
    model = write_tiny_llama(tmp_path_factory.mktemp("models") / "tools.gguf", spec)
    with serving({"tools": tiny(model)}) as running:
        yield running


@pytest.fixture
def api(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai_client(daemon) as client:
        yield client


def test_create_answers_text_with_usage(api: openai.OpenAI) -> None:
    response = api.responses.create(
        model="tools",
        input="Say hello",
        instructions="Be brief.",
        max_output_tokens=8,
        temperature=0,
        top_p=1,
    )
    assert response.object == "response"
    assert response.output_text
    assert response.usage is not None
    assert response.usage.input_tokens > 0
    assert 0 < response.usage.output_tokens <= 8
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.instructions == "Be brief."


def test_a_tool_call_and_its_output_go_on_from_previous_response_id(api: openai.OpenAI) -> None:
    called = api.responses.create(
        model="tools",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "What is 2 + 3?"}]}],
        tools=[ADD],
        tool_choice="required",
        max_output_tokens=150,
    )
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls
    assert calls[0].name == "add"
    assert set(json.loads(calls[0].arguments)) == {"a", "b"}
    after = api.responses.create(
        model="tools",
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"}],
        tools=[ADD],
        max_output_tokens=8,
    )
    assert after.previous_response_id == called.id
    # The same tools and question are in the prompt again, with the call and its output after.
    assert after.usage is not None
    assert called.usage is not None
    assert after.usage.input_tokens > called.usage.input_tokens


def test_stream_events_as_the_sdk_accumulates_them(api: openai.OpenAI) -> None:
    # The SDK checks each event against the snapshot it builds while iterating.
    with api.responses.stream(model="tools", input="Say hello", max_output_tokens=8) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    last = events[-1]
    # Eight tokens are likely to end the answer early: OpenAI says "incomplete" then.
    assert last.type in ("response.completed", "response.incomplete")
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas
    assert last.response.output_text == deltas
    assert last.response.usage is not None
    assert 0 < last.response.usage.output_tokens <= 8
    assert last.response.status == last.type.removeprefix("response.")


def test_a_streamed_tool_call_arrives_whole(api: openai.OpenAI) -> None:
    with api.responses.stream(
        model="tools", input="What is 2 + 3?", tools=[ADD], tool_choice="required"
    ) as stream:
        final = stream.get_final_response()
    calls = [item for item in final.output if item.type == "function_call"]
    assert calls
    assert set(json.loads(calls[0].arguments)) == {"a", "b"}


def test_an_unknown_previous_response_is_404(api: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="resp_nope"):
        api.responses.create(model="tools", input="hi", previous_response_id="resp_nope")


def test_an_item_type_not_served_is_a_400_naming_it(api: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="'reasoning'"):
        api.responses.create(
            model="tools", input=[{"type": "reasoning", "id": "rs_1", "summary": []}]
        )


def test_routes_not_served_say_so_and_pull_says_how_to_add_a_model(daemon: Daemon) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{daemon.port}") as http:
        other = http.post("/v1/assistants", json={})
        pull = http.post("/api/pull", json={"model": "llama3"})
    assert other.status_code == 404
    assert other.json()["error"]["message"] == "arbiterd does not serve POST /v1/assistants"
    assert pull.status_code == 404
    message = pull.json()["error"]["message"]
    assert "[models.NAME]" in message
    assert "arbiterd reload" in message


def test_an_image_part_reaches_the_model_policy_named_as_the_input_part(
    api: openai.OpenAI,
) -> None:
    image = {
        "type": "input_image",
        "image_url": "data:image/png;base64,iVBORw0KGgo=",
        "detail": "auto",
    }
    content = [{"type": "input_text", "text": "What is this?"}, image]
    with pytest.raises(openai.BadRequestError, match="takes no images") as refused:
        api.responses.create(model="tools", input=[{"role": "user", "content": content}])  # type: ignore[misc,list-item]
    assert refused.value.body["param"] == "input[0].content[1]"  # type: ignore[index]
