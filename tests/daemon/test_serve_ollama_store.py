"""A model an Ollama user pulled, served without a copy: an Ollama store made here (manifests and
blobs), found as `arbiterd models` finds it, and a real daemon serving its blob under its Ollama
name to the `ollama` client, which asks for it by that name (issue 30)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import ollama
import pytest

from arbiterd.cli.discovery import find_models
from arbiterd.cli.starter import starter_n_ctx
from tests.support.daemon import Daemon, openai_client, serving, tiny
from tests.support.ollama_store import add_model, model_blob

NAME = "llama3.2:3b"


@pytest.fixture(scope="module")
def blob(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """The model blob of NAME in an Ollama store in a fresh home."""
    store = tmp_path_factory.mktemp("home") / ".ollama/models"
    manifest = add_model(store, NAME, tiny_model)
    add_model(store, "llama3.2:latest", tiny_model)  # the same blob: found once, two names
    return model_blob(manifest)


@pytest.fixture(scope="module")
def store_daemon(blob: Path) -> Iterator[Daemon]:
    """A daemon serving what discovery finds in that home, as the starter config would."""
    (found,) = find_models({"HOME": str(blob.parents[3])}).models
    assert found.path == blob
    model = tiny(found.path, n_ctx=starter_n_ctx(found), aliases=list(found.aliases))
    with serving({found.name: model}) as running:
        yield running


@pytest.fixture
def client(store_daemon: Daemon) -> Iterator[ollama.Client]:
    client = ollama.Client(host=store_daemon.url.removesuffix("/v1"), timeout=60)
    try:
        yield client
    finally:
        client.close()  # type: ignore[no-untyped-call]  # ollama leaves it unannotated


def test_a_model_from_an_ollama_store_is_served_by_its_ollama_name(
    store_daemon: Daemon, client: ollama.Client, blob: Path, tiny_model: Path
) -> None:
    assert [m.model for m in client.list().models] == [NAME, "llama3.2:latest"]
    reply = client.chat(
        model=NAME,
        messages=[{"role": "user", "content": "hello"}],
        options={"num_predict": 4, "seed": 1},
    )
    assert reply.done
    assert reply.message.role == "assistant"
    assert reply.message.content
    assert reply.eval_count == 4
    # As `ollama run llama3.2` asks: its :latest, another manifest of the same blob.
    latest = client.chat(
        model="llama3.2", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 2}
    )
    assert latest.message.content
    with openai_client(store_daemon) as api:  # an OpenAI app may ask for it by that name too
        assert api.models.retrieve(NAME).id == NAME
    with store_daemon.client() as control:
        (served,) = control.call("status")["models"]
    assert served["name"] == NAME
    config = store_daemon.config.read_text()
    assert f'[models."{NAME}"]' in config
    assert f'path = "{blob}"' in config  # the blob itself: no copy on disk
    assert blob.stat().st_ino == tiny_model.stat().st_ino  # hard-linked by the store


def test_ollama_show_answers_for_the_ollama_name(client: ollama.Client) -> None:
    shown = client.show(NAME)
    assert shown.modelinfo is not None
    assert shown.modelinfo["llama.context_length"] == 2048
    assert "completion" in (shown.capabilities or [])


def test_an_ollama_named_model_keeps_its_prompt_cache_in_a_file_of_its_name(
    store_daemon: Daemon, client: ollama.Client
) -> None:
    messages = [{"role": "user", "content": "the quick brown fox"}]
    client.chat(model=NAME, messages=messages, options={"num_predict": 2})
    with store_daemon.client() as control:
        control.timeout_s = 60
        unloaded = control.call("unload", model=NAME)
    assert unloaded["tokens"] > 0, unloaded
    assert unloaded["kv_file"] == str(store_daemon.dir / "prompt-cache" / f"{NAME}.kv")
    assert Path(unloaded["kv_file"]).is_file()
    again = client.chat(model=NAME, messages=messages, options={"num_predict": 2})  # restored
    assert again.message.content
