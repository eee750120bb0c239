"""The daemon end to end: the real `openai` SDK, the control socket, the CLI, faults."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from arbiterd.arena import Arena
from arbiterd.daemon.observe.journal import Journal
from tests.support.daemon import Daemon, openai_client, serving, tiny
from tests.support.waiting import wait_until

ALIASES = ["gpt-4o-mini", "qwen2.5:7b"]  # alpha's, as an OpenAI app and an Ollama app ask
PREFIX = " ".join(f"the fox {w} is not a dog" for w in ("one", "two", "three", "four") * 8)
# For tests of what `arbiterd reload` answers: the daemon would otherwise apply the saved file
# itself too, maybe first (tests/daemon/test_serve_configwatch.py tests that).
BY_RELOAD = {"watch_config": False}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Daemon]:
    with serving({"alpha": tiny(tiny_model, aliases=ALIASES), "beta": tiny(tiny_model)}) as running:
        yield running


@pytest.fixture
def api(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai_client(daemon) as client:
        yield client


def arbiterd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "arbiterd", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_models_are_listed(api: openai.OpenAI) -> None:
    assert [m.id for m in api.models.list()] == ["alpha", *ALIASES, "beta"]


def test_models_show_their_state_which_a_request_by_alias_changes(
    daemon: Daemon, api: openai.OpenAI
) -> None:
    def listed() -> dict[str, dict[str, Any]]:
        models = httpx.get(f"{daemon.url}/models", timeout=30).json()["data"]
        return {m["id"]: m for m in models}

    released = arbiterd("release", "qwen2.5:7b", "--socket", str(daemon.socket))
    assert released.stdout.strip() == "alpha: cold"  # the control socket takes aliases too
    cold = listed()
    assert cold["alpha"]["aliases"] == ALIASES
    assert cold["alpha"]["context_length"] == 2048
    assert cold["alpha"]["backend"] in {"in-place", "reload"}
    for alias in ALIASES:
        assert cold[alias]["alias_of"] == "alpha"
        assert cold[alias]["context_length"] == 2048
    assert {cold[name]["state"] for name in ("alpha", *ALIASES)} == {"cold"}

    chat = api.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hello"}], max_tokens=3
    )
    assert chat.model == "gpt-4o-mini"  # the name asked for, which clients compare
    assert chat.choices[0].message.content is not None
    warm = listed()
    assert {warm[name]["state"] for name in ("alpha", *ALIASES)} == {"warm"}
    chunks = list(api.completions.create(model="qwen2.5:7b", prompt="a", max_tokens=2, stream=True))
    assert {chunk.model for chunk in chunks} == {"qwen2.5:7b"}
    assert api.models.retrieve("qwen2.5:7b").model_dump()["alias_of"] == "alpha"


def test_chat_and_completions_through_the_openai_sdk(api: openai.OpenAI) -> None:
    chat = api.chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "hello"}], max_tokens=5
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None
    assert chat.usage.completion_tokens >= 1
    text = api.completions.create(model="beta", prompt="the fox", max_tokens=5, temperature=0)
    assert text.choices[0].text
    pieces = [
        chunk.choices[0].delta.content or ""
        for chunk in api.chat.completions.create(
            model="beta",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=6,
            stream=True,
        )
        if chunk.choices
    ]
    assert "".join(pieces)


def test_the_openai_sdk_gets_the_usage_of_a_stream_and_the_prompt_cache_hit(
    api: openai.OpenAI,
) -> None:
    chunks = list(
        api.completions.create(
            model="alpha",
            prompt="the fox jumps over the lazy dog and",
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.completion_tokens == 4
    assert usage.total_tokens == usage.prompt_tokens + 4
    again = api.completions.create(
        model="alpha", prompt="the fox jumps over the lazy dog and then", max_tokens=1
    )
    assert again.usage is not None
    details = again.usage.prompt_tokens_details
    assert details is not None
    assert details.cached_tokens is not None
    assert details.cached_tokens >= usage.prompt_tokens - 1  # the earlier prompt, kept


def test_the_openai_sdk_gets_json_that_follows_its_schema(api: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"type": "integer"}},
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    chat = api.chat.completions.create(
        model="beta",
        messages=[{"role": "user", "content": "Which city is first?"}],
        max_tokens=60,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True},
        },
    )
    answer = json.loads(chat.choices[0].message.content or "")
    assert set(answer) == {"city", "rank"}
    assert isinstance(answer["rank"], int)


@pytest.fixture
def ollama_client(daemon: Daemon) -> Iterator[ollama.Client]:
    client = ollama.Client(host=daemon.url.removesuffix("/v1"), timeout=60)
    try:
        yield client
    finally:
        client.close()  # type: ignore[no-untyped-call]  # ollama leaves it unannotated


def test_an_app_that_speaks_only_ollama_works_through_the_ollama_client(
    daemon: Daemon, ollama_client: ollama.Client
) -> None:
    client = ollama_client
    names = {"alpha:latest", "gpt-4o-mini:latest", "qwen2.5:7b", "beta:latest"}
    assert {m.model for m in client.list().models} == names
    assert {m.model for m in client.ps().models} == {"alpha:latest", "beta:latest"}  # resident
    messages = [{"role": "user", "content": "hello"}]
    whole = client.chat(model="alpha", messages=messages, options={"num_predict": 5, "seed": 1})
    assert whole.done
    assert whole.message.role == "assistant"
    assert whole.message.content
    assert (whole.eval_count, whole.done_reason) == (5, "length")
    assert whole.prompt_eval_count is not None
    assert whole.prompt_eval_count > 0
    lines = list(
        client.chat(model="beta", messages=messages, stream=True, options={"num_predict": 4})
    )
    assert [line.done for line in lines] == [False] * (len(lines) - 1) + [True]
    assert "".join(line.message.content or "" for line in lines)
    assert lines[-1].eval_count == 4  # the counts come in the last line
    generated = list(
        client.generate(
            model="alpha", prompt="the fox", raw=True, stream=True, options={"num_predict": 3}
        )
    )
    assert generated[-1].done
    assert "".join(g.response or "" for g in generated)
    schema = {
        "type": "object",
        "properties": {"rank": {"type": "integer"}},
        "required": ["rank"],
    }
    shaped = client.chat(
        model="beta", messages=messages, format=schema, options={"num_predict": 40}
    )
    assert isinstance(json.loads(shaped.message.content or "")["rank"], int)
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="gamma", messages=messages)
    assert missing.value.status_code == 404
    # An app set up for Ollama asks by its own names, as it lists them or not.
    for asked in ("qwen2.5:7b", "gpt-4o-mini:latest", "gpt-4o-mini", "beta:latest"):
        answer = client.chat(model=asked, messages=messages, options={"num_predict": 2})
        assert answer.model == asked
    pieces = list(
        client.generate(model="qwen2.5:7b", prompt="a", stream=True, options={"num_predict": 2})
    )
    assert {piece.model for piece in pieces} == {"qwen2.5:7b"}
    assert httpx.get(daemon.url.removesuffix("/v1") + "/api/version").json()["version"]


def test_alternating_requests_hand_the_gpu_over_and_keep_the_prompt_cache(
    daemon: Daemon, api: openai.OpenAI
) -> None:
    with daemon.client() as listener:
        listener.call("subscribe")
        for i in range(6):
            model = ("alpha", "beta")[i % 2]
            api.completions.create(model=model, prompt=f"{PREFIX} {model}", max_tokens=2)
        events = []
        for event in listener.events(timeout_s=30):
            events.append(event)
            if sum(e["event"] == "request" for e in events) == 6:
                break
    handoffs = [e for e in events if e["event"] == "handoff"]
    assert len(handoffs) >= 4
    assert all({"from", "to", "release_s", "wait_s", "restore_s"} <= h.keys() for h in handoffs)
    requests = [e for e in events if e["event"] == "request"]
    assert all(r["prompt_tokens_evaluated"] <= 2 for r in requests[2:])
    metrics = httpx.get(daemon.url.removesuffix("/v1") + "/metrics").text
    assert "arbiterd_handoffs_total" in metrics
    assert 'arbiterd_model_resident{model="alpha"}' in metrics
    assert 'arbiterd_requests_total{model="alpha",status="ok"}' in metrics
    assert "arbiterd_handoff_seconds_bucket" in metrics
    assert 'arbiterd_prompt_tokens_evaluated_total{model="beta"}' in metrics
    backends = {
        sample.labels["model"]: sample.labels["backend"]
        for family in text_string_to_metric_families(metrics)
        if family.name == "arbiterd_backend"
        for sample in family.samples
        if sample.value == 1
    }
    assert set(backends) == {"alpha", "beta"}
    assert set(backends.values()) <= {"in-place", "reload"}


def test_unknown_model_is_a_404_listing_the_models(api: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        api.completions.create(model="gamma", prompt="x", max_tokens=1)
    assert "alpha" in str(caught.value)
    assert "beta" in str(caught.value)


def test_a_prompt_longer_than_the_context_is_a_400(api: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="context"):
        api.completions.create(model="alpha", prompt=PREFIX * 20, max_tokens=1)


def test_cli_status_and_commands(daemon: Daemon) -> None:
    socket_arg = ["--socket", str(daemon.socket)]
    status = arbiterd("status", *socket_arg)
    assert status.returncode == 0, status.stderr
    assert "alpha" in status.stdout
    assert "STATE" in status.stdout
    report = json.loads(arbiterd("status", "--json", *socket_arg).stdout)
    assert [m["name"] for m in report["models"]] == ["alpha", "beta"]
    # What runs each model, as its worker said; they ask for no GPU layers: no CPU note.
    backends = {m["name"]: (m["backend"],) for m in report["models"]}
    assert backends["alpha"] == backends["beta"]
    assert backends["alpha"][0] in {"in-place", "reload"}
    assert set(report["engine"]) == {"offload", "devices", "cpu_cause", "cpu_note"}
    assert (report["engine"]["cpu_cause"], report["engine"]["cpu_note"]) == (None, "")
    lines = status.stdout.splitlines()
    assert lines[0].split()[:3] == ["MODEL", "STATE", "BACKEND"]
    name, _state, backend = lines[1].split()[:3]
    assert (name, backend) == ("alpha", backends["alpha"][0])
    assert any(line.startswith("engine: ") for line in lines)
    assert not any(line.startswith("warning") for line in lines)
    assert arbiterd("warm", "alpha", *socket_arg).stdout.strip() == "alpha: warm"
    assert arbiterd("release", "alpha", *socket_arg).stdout.strip() == "alpha: cold"
    assert "pinned" in arbiterd("pin", "beta", *socket_arg).stdout
    assert "unpinned" in arbiterd("unpin", "beta", *socket_arg).stdout
    held = arbiterd("hold", *socket_arg)
    assert held.returncode == 0, held.stderr
    arena = Arena(daemon.arena).observe()
    assert arena.holder_pid == daemon.process.pid
    states = {
        m["name"]: m["state"]
        for m in json.loads(arbiterd("status", "--json", *socket_arg).stdout)["models"]
    }
    assert set(states.values()) == {"cold"}
    assert arbiterd("unhold", *socket_arg).returncode == 0
    unknown = arbiterd("warm", "gamma", *socket_arg)
    assert unknown.returncode != 0
    assert unknown.stderr.count("\n") == 1
    events = arbiterd("events", "--journal", str(daemon.journal))
    assert "handoff" in events.stdout or "residency" in events.stdout
    lines = arbiterd("events", "--json", "--journal", str(daemon.journal)).stdout.splitlines()
    assert all("event" in json.loads(line) for line in lines)


def test_a_daemon_that_is_not_running_is_one_clear_line(tmp_path: Path) -> None:
    done = arbiterd("status", "--socket", str(tmp_path / "nothing.sock"))
    assert done.returncode == 69
    assert done.stderr.count("\n") == 1
    assert "not running" in done.stderr


def test_a_worker_killed_mid_stream_errors_promptly_and_comes_back(
    daemon: Daemon, api: openai.OpenAI
) -> None:
    with daemon.client() as client:
        pid = {m["name"]: m["pid"] for m in client.call("status")["models"]}["alpha"]
    stream = api.completions.create(model="alpha", prompt="the fox", max_tokens=5000, stream=True)
    started = time.monotonic()

    def consume() -> None:
        with stream:
            for received, _chunk in enumerate(stream, start=1):
                if received == 3:
                    os.kill(pid, signal.SIGKILL)

    with pytest.raises(openai.APIError):
        consume()
    assert time.monotonic() - started < 30, "the stream hung after the worker died"
    answer = api.completions.create(model="alpha", prompt="the fox", max_tokens=2)
    assert answer.choices[0].text is not None
    journal = Journal.open_readonly(daemon.journal)
    try:
        exits = [e for e in journal.read(kinds=["worker"]) if e.body.get("pid") == pid]
    finally:
        journal.close()
    assert exits
    assert exits[0].body["code"] == -signal.SIGKILL


def test_a_client_that_disconnects_cancels_its_request(daemon: Daemon) -> None:
    body = {"model": "beta", "prompt": "the fox", "max_tokens": 5000, "stream": True}
    with daemon.client() as listener:
        listener.call("subscribe")
        with httpx.stream("POST", daemon.url + "/completions", json=body, timeout=30) as reply:
            for _line in reply.iter_lines():
                break  # hang up after the first chunk
        ended = next(
            (
                e
                for e in listener.events(timeout_s=30)
                if e["event"] == "request" and e.get("model") == "beta"
            ),
            None,
        )
    assert ended is not None, "no request event within 30 s"
    assert ended["cancelled"]
    assert ended["completion_tokens"] < 5000


def test_a_model_that_fails_to_load_is_shown_and_the_others_serve(
    tiny_model: Path, tmp_path: Path
) -> None:
    # A GGUF whose header is fine but whose tensors are cut off passes the config check and
    # fails in llama.cpp: the message names the user's file, not the worker's memfd.
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(tiny_model.read_bytes()[: tiny_model.stat().st_size // 2])
    running = Daemon({"good": tiny(tiny_model), "bad": tiny(broken)})
    try:
        status = running.wait_ready()
        states = {m["name"]: (m["state"], m["last_error"]) for m in status["models"]}
        assert states["good"][0] in ("warm", "cold")
        assert states["bad"][0] == "failed"
        assert str(broken) in states["bad"][1]
        assert "/proc/self/fd" not in states["bad"][1]
        with openai.OpenAI(base_url=running.url, api_key="x", max_retries=0) as api:
            assert api.completions.create(model="good", prompt="the fox", max_tokens=2).choices
            with pytest.raises(openai.InternalServerError) as caught:
                api.completions.create(model="bad", prompt="the fox", max_tokens=2)
        assert caught.value.status_code == 503
    finally:
        running.cleanup()


def test_a_missing_model_file_stops_the_daemon_before_anything_loads(
    tiny_model: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "missing.gguf"
    running = Daemon({"good": tiny(tiny_model), "bad": tiny(missing)})
    try:
        assert running.process.wait(timeout=60) == 78  # EX_CONFIG
        log = running.log.read_text()
        assert f"{running.config}: models.bad.path: {missing} does not exist" in log
        assert "Traceback" not in log
        assert not running.socket.exists()
        assert not running.journal.exists()  # nothing was started, not even the journal
    finally:
        running.cleanup()


def test_a_taken_port_is_one_line_before_any_model_loads(tiny_model: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        running = Daemon({"m": tiny(tiny_model)}, port=port)
        try:
            assert running.process.wait(timeout=60) == 71
            lines = running.log.read_text().strip().splitlines()
            assert lines == [
                f"arbiterd daemon: 127.0.0.1:{port} is already in use (another arbiterd or "
                "server?); pick a free port with http = HOST:PORT in the config's [daemon] "
                "table or --http HOST:PORT"
            ]
            assert not running.socket.exists()  # no stale control socket left behind
        finally:
            running.cleanup()


def test_api_key_guards_the_api(tiny_model: Path) -> None:
    running = Daemon({"m": tiny(tiny_model)}, api_key="s3cret")
    try:
        running.wait_ready()
        bad = openai.OpenAI(base_url=running.url, api_key="wrong", max_retries=0)
        with bad, pytest.raises(openai.AuthenticationError):
            bad.models.list()
        with openai.OpenAI(base_url=running.url, api_key="s3cret", max_retries=0) as good:
            assert [m.id for m in good.models.list()] == ["m"]
    finally:
        running.cleanup()


def test_sigterm_stops_gracefully_and_frees_the_gpu(tiny_model: Path) -> None:
    running = Daemon({"a": tiny(tiny_model), "b": tiny(tiny_model)})
    try:
        status = running.wait_ready()
        pids = [m["pid"] for m in status["models"]]
        assert running.stop() == 0
        assert Arena(running.arena).observe().holder_pid is None
        wait_until(
            lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids), 10, "workers reaped"
        )
        assert not running.socket.exists()
    finally:
        running.cleanup()


def test_readiness_is_notified_and_workers_do_not_inherit_the_socket(tiny_model: Path) -> None:
    path = Path(f"/tmp/ad-notify-{os.getpid()}.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(path))
        try:
            env = dict(os.environ, NOTIFY_SOCKET=str(path))
            running = Daemon({"m": tiny(tiny_model)}, env=env)
            try:
                notify.settimeout(60)
                message = notify.recv(4096).decode()
                assert "READY=1" in message
                status = running.wait_ready()
                worker_pid = status["models"][0]["pid"]
                environ = Path(f"/proc/{worker_pid}/environ").read_bytes().split(b"\0")
                assert not any(item.startswith(b"NOTIFY_SOCKET=") for item in environ)
            finally:
                running.cleanup()
        finally:
            path.unlink()


def test_two_clients_at_once_are_both_served(api: openai.OpenAI) -> None:
    answers: list[str] = []

    def ask(model: str) -> None:
        reply = api.completions.create(model=model, prompt="the fox", max_tokens=3)
        answers.append(reply.choices[0].text)

    threads = [threading.Thread(target=ask, args=(m,)) for m in ("alpha", "beta", "alpha")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(answers) == 3


def test_vram_is_measured_and_every_release_is_verified(daemon: Daemon, api: openai.OpenAI) -> None:
    for model in ("alpha", "beta", "alpha"):
        api.completions.create(model=model, prompt="the fox", max_tokens=1)

    def verified() -> bool:
        with daemon.client() as client:
            models = {m["name"]: m for m in client.call("status")["models"]}
        return bool(models["beta"]["cold_footprint_bytes"] == 0)

    wait_until(verified, 30, "beta's release to be verified")
    with daemon.client() as client:
        status = client.call("status")
    telemetry = status["telemetry"]
    assert telemetry["source"] == "accounting"  # no GPU here: the engines' own figures
    assert telemetry["device"] == "gpu0"
    models = {m["name"]: m for m in status["models"]}
    assert models["alpha"]["vram_bytes"] > 0  # warm
    assert models["beta"]["vram_bytes"] == 0  # released, and verified so
    metrics = httpx.get(daemon.url.removesuffix("/v1") + "/metrics").text
    # The arena's device id labels the figures, whatever the device is.
    assert 'arbiterd_vram_bytes{device="gpu0",owner="alpha"}' in metrics
    text = arbiterd("status", "--socket", str(daemon.socket)).stdout
    assert "CPU (host RAM): " in text  # the engine runs the models on the CPU here
    assert "(accounting)" in text
    journal = Journal.open_readonly(daemon.journal)
    try:
        assert journal.read(kinds=["vram_not_freed"]) == []
    finally:
        journal.close()


def test_a_scrape_right_after_each_handoff_agrees_with_itself(
    daemon: Daemon, api: openai.OpenAI
) -> None:
    # The VRAM figures are read for the scrape: they name the model that holds the GPU now,
    # never the one that held it before (they lagged up to 5 s behind the residency gauges).
    metrics_url = daemon.url.removesuffix("/v1") + "/metrics"
    for model, other in (("alpha", "beta"), ("beta", "alpha"), ("alpha", "beta")):
        api.completions.create(model=model, prompt="the fox", max_tokens=1)
        samples = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(httpx.get(metrics_url).text)
            for sample in family.samples
        }
        assert samples[("arbiterd_model_resident", (("model", model),))] == 1
        assert samples[("arbiterd_model_resident", (("model", other),))] == 0
        vram = (("device", "gpu0"), ("owner", model))
        assert samples[("arbiterd_vram_bytes", vram)] > 0
        gone = (("device", "gpu0"), ("owner", other))
        assert samples.get(("arbiterd_vram_bytes", gone), 0) == 0


def test_reload_starts_added_models_and_stops_removed_ones(tiny_model: Path) -> None:
    running = Daemon({"keep": tiny(tiny_model), "drop": tiny(tiny_model)}, daemon_keys=BY_RELOAD)
    try:
        running.wait_ready()
        text = running.config.read_text()
        text = text.replace("[models.drop]", "[models.added]")
        running.config.write_text(text)
        done = arbiterd("reload", "--socket", str(running.socket))
        assert done.returncode == 0, done.stderr
        assert "added: added" in done.stdout
        assert "removed: drop" in done.stdout
        status = running.wait_ready()
        assert [m["name"] for m in status["models"]] == ["keep", "added"]
        unchanged = arbiterd("reload", "--socket", str(running.socket))
        assert unchanged.stdout.strip() == "reloaded, nothing changed"
        running.config.write_text(text + "\n[models.bad]\nn_ctx = 1\n")
        refused = arbiterd("reload", "--socket", str(running.socket))
        assert refused.returncode != 0
        assert "models.bad" in refused.stderr  # the config error, named; the daemon goes on
        assert [m["name"] for m in running.wait_ready()["models"]] == ["keep", "added"]
    finally:
        running.cleanup()


def test_a_reload_that_changes_only_aliases_keeps_the_worker(tiny_model: Path) -> None:
    running = Daemon({"m": tiny(tiny_model, aliases=["old"])}, daemon_keys=BY_RELOAD)
    try:
        before = running.wait_ready()
        text = running.config.read_text()
        running.config.write_text(text.replace('aliases = ["old"]', 'aliases = ["new", "x:7b"]'))
        done = arbiterd("reload", "--socket", str(running.socket))
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "reloaded (aliases changed: m)"
        after = running.wait_ready()
        assert after["models"][0]["pid"] == before["models"][0]["pid"]  # not restarted
        assert after["models"][0]["aliases"] == ["new", "x:7b"]
        base = running.url
        assert httpx.get(f"{base}/models/new").json()["alias_of"] == "m"
        assert httpx.get(f"{base}/models/old").status_code == 404
        with openai.OpenAI(base_url=base, api_key="x", max_retries=0) as api:
            done_by_alias = api.completions.create(model="x:7b", prompt="the fox", max_tokens=2)
            assert done_by_alias.model == "x:7b"
    finally:
        running.cleanup()


def test_reload_keeps_serving_a_model_whose_file_vanished(tiny_model: Path, tmp_path: Path) -> None:
    own = tmp_path / "own.gguf"
    own.write_bytes(tiny_model.read_bytes())
    running = Daemon({"kept": tiny(own), "other": tiny(tiny_model)}, daemon_keys=BY_RELOAD)
    try:
        running.wait_ready()
        own.unlink()
        done = arbiterd("reload", "--socket", str(running.socket))
        assert done.returncode == 0, done.stderr
        assert "nothing changed" in done.stdout
        assert f"{own} is gone from disk; kept keeps serving from its copy" in done.stdout
        # A changed model restarts from the copy too: its file is still gone.
        running.config.write_text(
            running.config.read_text().replace("n_ctx = 2048", "n_ctx = 1024", 1)
        )
        changed = arbiterd("reload", "--socket", str(running.socket))
        assert changed.returncode == 0, changed.stderr
        assert "changed: kept" in changed.stdout
        status = running.wait_ready()
        assert {m["name"]: m["state"] for m in status["models"]}["kept"] in ("warm", "cold")
        with openai.OpenAI(base_url=running.url, api_key="x", max_retries=0) as api:
            assert api.completions.create(model="kept", prompt="the fox", max_tokens=2).choices
    finally:
        running.cleanup()


def test_a_reload_with_a_bad_model_file_applies_nothing(tiny_model: Path, tmp_path: Path) -> None:
    running = Daemon({"a": tiny(tiny_model)})
    try:
        running.wait_ready()
        text = running.config.read_text()
        running.config.write_text(text + f'\n[models.b]\npath = "{tmp_path}"\n')
        refused = arbiterd("reload", "--socket", str(running.socket))
        assert refused.returncode != 0
        assert f"models.b.path: {tmp_path} is a directory" in refused.stderr
        assert [m["name"] for m in running.wait_ready()["models"]] == ["a"]
    finally:
        running.cleanup()


def test_models_on_one_file_share_one_host_copy(tiny_model: Path) -> None:
    running = Daemon({"a": tiny(tiny_model), "b": tiny(tiny_model)})
    try:
        status = running.wait_ready()
        size = tiny_model.stat().st_size
        models = {m["name"]: m for m in status["models"]}
        assert models["a"]["host_copy_bytes"] == models["b"]["host_copy_bytes"] == size
        assert models["a"]["host_copy_shared_with"] == ["b"]
        own = sum(m["host_kv_bytes"] + m["host_weights_bytes"] for m in models.values())
        assert status["host_ram_bytes"] == size + own  # the copy counted once
        # The one that let the GPU go keeps no weights of its own: they are the host copy's
        # pages, mapped (issue 28: the copy is the only one).
        (cold,) = [m for m in models.values() if m["state"] == "cold"]
        assert cold["backend"] == "in-place"
        assert cold["host_weights_bytes"] == 0
        assert sum(m["host_ram_bytes"] for m in models.values()) == status["host_ram_bytes"]
        shown = arbiterd("status", "--socket", str(running.socket))
        assert "HOST RAM" in shown.stdout
    finally:
        running.cleanup()


# -- issue 14: load on demand, unload, the prompt cache on disk ----------------------------------


def completion(client: openai.OpenAI, model: str, prompt: str) -> tuple[str, int, int]:
    """Greedy text, prompt tokens, and how many of them came from the prompt cache."""
    done = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    usage = done.usage
    assert usage is not None
    assert usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0
    return done.choices[0].text, usage.prompt_tokens, cached


def model_status(daemon: Daemon, name: str) -> dict[str, Any]:
    with daemon.client() as client:
        models: list[dict[str, Any]] = client.call("status")["models"]
    return next(m for m in models if m["name"] == name)


def test_a_demand_model_starts_when_wanted_and_unloads_keeping_its_prompt_cache(
    tiny_model: Path,
) -> None:
    running = Daemon({"eager": tiny(tiny_model), "lazy": tiny(tiny_model, load="demand")})
    try:
        running.wait_ready(("warm", "cold", "unloaded"))
        lazy = model_status(running, "lazy")
        assert (lazy["state"], lazy["pid"], lazy["backend"]) == ("unloaded", None, None)
        warmed = arbiterd("warm", "lazy", "--socket", str(running.socket))
        assert warmed.returncode == 0, warmed.stderr
        assert warmed.stdout.strip() == "lazy: warm"  # started, and waited for
        assert model_status(running, "lazy")["pid"] is not None
        with openai.OpenAI(base_url=running.url, api_key="-", max_retries=0, timeout=60) as api:
            completion(api, "lazy", PREFIX)
            done = arbiterd("unload", "lazy", "--socket", str(running.socket))
            assert done.returncode == 0, done.stderr
            assert "lazy: unloaded (" in done.stdout
            assert "tokens of prompt cache kept on disk" in done.stdout
            lazy = model_status(running, "lazy")
            assert (lazy["state"], lazy["pid"], lazy["host_ram_bytes"]) == ("unloaded", None, None)
            assert (running.dir / "prompt-cache" / "lazy.kv").is_file()

            text, prompt_tokens, cached = completion(api, "lazy", PREFIX + " and the cat is quick")
            expected, _, _ = completion(api, "eager", PREFIX + " and the cat is quick")
        assert text == expected
        # Evaluated: the suffix (" and the cat is quick": under 10 tokens in any vocabulary)
        # and the last token of the kept cache, decoded again for its logits.
        assert 0 < prompt_tokens - cached <= 10 + 1
        assert not (running.dir / "prompt-cache" / "lazy.kv").exists()  # used once
    finally:
        running.cleanup()


def test_a_model_cold_and_idle_for_unload_after_s_unloads_and_a_damaged_cache_is_discarded(
    tiny_model: Path,
) -> None:
    running = Daemon({"m": tiny(tiny_model, idle_release_s=0.2, unload_after_s=1)})
    kv_file = running.dir / "prompt-cache" / "m.kv"
    try:
        running.wait_ready()
        with openai.OpenAI(base_url=running.url, api_key="-", max_retries=0, timeout=60) as api:
            first, _, _ = completion(api, "m", PREFIX)
            wait_until(lambda: model_status(running, "m")["state"] == "unloaded", 30, "unloaded")
            blob = bytearray(kv_file.read_bytes())
            blob[-100] ^= 0xFF
            kv_file.write_bytes(bytes(blob))
            again, prompt_tokens, cached = completion(api, "m", PREFIX)
        assert (again, cached) == (first, 0)  # a full prefill, and the right answer
        assert prompt_tokens > 0
        assert "discarding the kept prompt cache" in running.log.read_text()
        journal = Journal.open_readonly(running.journal)
        try:
            unloads = [e.body for e in journal.read(kinds=["unload"])]
        finally:
            journal.close()
        assert [e["reason"] for e in unloads] == ["idle"]
        assert unloads[0]["kv_bytes"] > 0
    finally:
        running.cleanup()
