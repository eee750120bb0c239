"""The daemon with no config file (the embedded default), as a new user first meets it: a chat
is answered by the instruct model, listed first, and a completion can still go to gemma."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from arbiterd.cli.controlclient import ControlClient
from arbiterd.config import EMBEDDED_CHAT_MODEL_NAME, EMBEDDED_MODEL_NAME
from tests.daemon.test_serve import arbiterd
from tests.support.daemon import free_port
from tests.support.waiting import wait_until


@pytest.fixture
def default_daemon() -> Iterator[tuple[str, Path, Path]]:
    """`arbiterd daemon` with no config file at the default path; its URL, its socket and
    the default config path."""
    with tempfile.TemporaryDirectory(prefix="arbd-") as folder:
        base = Path(folder)
        runtime = base / "run"
        runtime.mkdir(mode=0o700)
        env = {
            **os.environ,
            "XDG_CONFIG_HOME": str(base / "config"),  # empty: no config file
            "XDG_STATE_HOME": str(base / "state"),
            "XDG_RUNTIME_DIR": str(runtime),
        }
        env.pop("ARBITERD_ARENA", None)
        port = free_port()
        log = base / "daemon.log"
        with log.open("w") as stderr:
            daemon = subprocess.Popen(
                [sys.executable, "-m", "arbiterd", "daemon", "--http", f"127.0.0.1:{port}"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        socket = runtime / "arbiterd" / "control.sock"
        try:
            wait_until(lambda: _ready(socket, daemon, log), 120, "both default models loaded")
            config = base / "config" / "arbiterd" / "config.toml"
            yield f"http://127.0.0.1:{port}/v1", socket, config
        finally:
            daemon.terminate()
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def _ready(socket: Path, daemon: subprocess.Popen[bytes], log: Path) -> bool:
    if daemon.poll() is not None:
        raise AssertionError(f"the daemon exited: {log.read_text()}")
    if not socket.exists():
        return False
    with ControlClient.connect(socket) as client:
        models = client.call("status")["models"]
    return all(m["state"] not in ("starting", "loading") for m in models)


def test_a_chat_with_no_config_is_answered_by_the_instruct_model(
    default_daemon: tuple[str, Path, Path],
) -> None:
    url, _, _ = default_daemon
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    listed = [m.id for m in client.models.list().data]
    assert listed == [EMBEDDED_CHAT_MODEL_NAME, EMBEDDED_MODEL_NAME]
    reply = client.chat.completions.create(
        model=listed[0],  # what an app that takes the first model offered asks for
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=16,
        temperature=0,
    )
    assert reply.model == EMBEDDED_CHAT_MODEL_NAME
    assert "hello" in (reply.choices[0].message.content or "").lower()
    completion = client.completions.create(
        model=EMBEDDED_MODEL_NAME, prompt="Once upon a time", max_tokens=4, temperature=0
    )
    assert completion.choices[0].text


def test_reload_on_the_embedded_default_takes_the_config_written_since(
    default_daemon: tuple[str, Path, Path], tiny_model: Path
) -> None:
    """A new user's first config: written where the daemon looks, taken by `arbiterd reload`
    without a restart; before it exists, reload says where to write it."""
    url, socket, config = default_daemon
    before = arbiterd("reload", "--socket", str(socket))
    assert before.returncode != 0
    assert f"there is no config file at {config}; write one there" in before.stderr
    config.parent.mkdir(parents=True)
    config.write_text(f'[models.mine]\npath = "{tiny_model}"\nn_ctx = 512\nn_gpu_layers = 0\n')
    after = arbiterd("reload", "--socket", str(socket))
    assert after.returncode == 0, after.stderr
    assert after.stdout.startswith("reloaded (added: mine; removed: ")
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["mine"]
    done = client.completions.create(model="mine", prompt="the fox", max_tokens=2)
    assert done.model == "mine"
