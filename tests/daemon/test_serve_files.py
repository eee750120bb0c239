"""The daemon's own files under faults and other users (issue 24), with real daemons: a damaged
journal is moved aside and the daemon serves; a full disk costs a log line a minute and the
daemon serves; loose state and prompt-cache folders stop it with their fix; the journal and the
prompt caches are 0600 in 0700 folders under umask 022; a model whose file is gone is not
unloaded, and a request for one that cannot start answers at once, until the file is back."""

from __future__ import annotations

import os
import resource
import shutil
import stat
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import openai
import pytest

from arbiterd.daemon.observe.journal import Journal
from arbiterd.errors import ControlError
from tests.support.daemon import Daemon, openai_client, serving
from tests.support.daemon import tiny as tiny_table
from tests.support.waiting import wait_until

tiny = partial(tiny_table, n_ctx=512)
EXIT_TIMEOUT_S = 60


@pytest.fixture(autouse=True)
def umask_022() -> Iterator[None]:
    """The usual umask, which every daemon here inherits: what it would give is never private."""
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.fixture
def model(tiny_model: Path, tmp_path: Path) -> Path:
    """A copy of the tiny model that a test may delete."""
    copy = tmp_path / "models" / "tiny.gguf"
    copy.parent.mkdir()
    shutil.copyfile(tiny_model, copy)
    return copy


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def status_of(daemon: Daemon, name: str) -> dict[str, Any]:
    with daemon.client() as client:
        models: list[dict[str, Any]] = client.call("status")["models"]
    return next(m for m in models if m["name"] == name)


def ask(api: openai.OpenAI, model: str = "m") -> str:
    done = api.completions.create(model=model, prompt="hello", max_tokens=2, temperature=0)
    return done.choices[0].text


def exits_with(daemon: Daemon) -> tuple[int, str]:
    """The exit status of a daemon that is to stop by itself, and its log."""
    code = daemon.process.wait(timeout=EXIT_TIMEOUT_S)
    return code, daemon.log.read_text()


def private_state(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    return state


# -- the journal ---------------------------------------------------------------------------------


def test_a_damaged_journal_is_moved_aside_and_the_daemon_serves_and_journals(
    model: Path, tmp_path: Path
) -> None:
    journal = private_state(tmp_path) / "journal.sqlite3"
    damaged = b"\x00garbage where SQLite's header goes" * 50
    journal.write_bytes(damaged)
    with serving({"m": tiny(model)}, journal=journal) as daemon, openai_client(daemon) as api:
        ask(api)
        log = daemon.log.read_text()
        (moved,) = journal.parent.glob("journal.sqlite3.corrupt-*")
        assert moved.read_bytes() == damaged
        assert f"moved aside as {moved}; a fresh journal starts" in log
        with Journal.open_readonly(journal) as fresh:
            assert "residency" in {e.kind for e in fresh.read()}  # it records again
        assert mode_of(journal) == 0o600


def test_a_full_disk_costs_one_log_line_and_the_daemon_keeps_serving(model: Path) -> None:
    with serving({"m": tiny(model)}) as daemon, openai_client(daemon) as api:
        ask(api)
        pid = daemon.process.pid
        files = [daemon.journal, Path(f"{daemon.journal}-wal"), daemon.log]
        # The journal's files may not grow past what they hold now (each write past it fails
        # with EFBIG, as on a full disk), with room left for the log's lines.
        limit = max(f.stat().st_size for f in files if f.exists()) + 64 * 1024
        assert daemon.log.stat().st_size < limit - 32 * 1024
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        wal = Path(f"{daemon.journal}-wal")
        served = 0
        while wal.stat().st_size < limit:  # each request's events grow the WAL a few pages
            ask(api)
            served += 1
            assert served < 500, "the journal's WAL never reached the limit"
        for _ in range(20):  # each of these requests' events fails to be journaled
            ask(api)
        log = daemon.log.read_text()
        said = [line for line in log.splitlines() if "journal" in line and "WARNING" in line]
        assert len(said) == 1, log
        assert "could not journal a " in said[0]
        assert "Traceback" not in log
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
        ask(api)
        wait_until(
            lambda: "the journal writes again" in daemon.log.read_text(), 30, "the journal back"
        )


# -- private folders and files -------------------------------------------------------------------


def test_a_loose_state_folder_stops_the_daemon_with_its_fix(model: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    assert mode_of(state) == 0o755  # as the umask makes it
    daemon = Daemon({"m": tiny(model)}, journal=state / "journal.sqlite3")
    try:
        code, log = exits_with(daemon)
    finally:
        daemon.cleanup()
    assert code == 1
    assert f"{state} has mode 0755; it must be 0700 (chmod 700 {state})" in log
    assert list(state.iterdir()) == []


def test_a_loose_prompt_cache_folder_stops_the_daemon_with_its_fix(
    model: Path, tmp_path: Path
) -> None:
    cache = private_state(tmp_path) / "prompt-cache"
    cache.mkdir()
    daemon = Daemon({"m": tiny(model)}, journal=cache.parent / "journal.sqlite3")
    try:
        code, log = exits_with(daemon)
    finally:
        daemon.cleanup()
    assert code == 1
    assert f"{cache} has mode 0755; it must be 0700 (chmod 700 {cache})" in log


def test_the_journal_and_a_kept_prompt_cache_are_0600_in_0700_folders_under_umask_022(
    model: Path, tmp_path: Path
) -> None:
    state = private_state(tmp_path)
    journal = state / "journal.sqlite3"
    Journal(journal).close()
    journal.chmod(0o644)  # as an older arbiterd left it
    with serving({"m": tiny(model)}, journal=journal) as daemon, openai_client(daemon) as api:
        ask(api)
        for name in ("journal.sqlite3", "journal.sqlite3-wal", "journal.sqlite3-shm"):
            assert mode_of(state / name) == 0o600, name
        with daemon.client() as client:
            saved = client.call("unload", model="m")
        kept = Path(saved["kv_file"])
        assert kept.parent == state / "prompt-cache"
        assert kept.read_bytes()  # a real cache, of the prompt
        assert mode_of(kept) == 0o600
        assert mode_of(kept.parent) == 0o700
        assert f"{journal} had mode 0644: made 0600" in daemon.log.read_text()


# -- a model whose file is gone ------------------------------------------------------------------


def test_a_model_whose_file_is_gone_is_not_unloaded_and_keeps_serving(model: Path) -> None:
    with serving({"m": tiny(model)}) as daemon, openai_client(daemon) as api:
        answer = ask(api)
        model.unlink()
        with daemon.client() as client, pytest.raises(ControlError) as refused:
            client.call("unload", model="m")
        assert f"m's model file {model} is gone from disk" in str(refused.value)
        assert "unloading would drop the only copy of it (the copy in the daemon's memory)" in (
            str(refused.value)
        )
        assert ask(api) == answer  # served from the copy it kept
        assert status_of(daemon, "m")["state"] in ("warm", "cold")


def test_a_request_for_a_model_whose_file_is_gone_is_a_prompt_503_until_the_file_is_back(
    model: Path, tmp_path: Path
) -> None:
    aside = tmp_path / "aside.gguf"
    daemon = Daemon({"m": tiny(model, load="demand")})
    try:
        daemon.wait_ready(("unloaded",))
        model.rename(aside)  # after the daemon checked it: gone before its first request
        with openai_client(daemon) as api:
            started = time.monotonic()
            with pytest.raises(openai.APIStatusError) as refused:
                ask(api)
            took_s = time.monotonic() - started
            assert refused.value.status_code == 503
            assert f"m cannot start: its model file {model} is not on disk" in str(
                refused.value.message
            )
            assert took_s < 5  # not the 120 s a request waits for a restart
            with pytest.raises(openai.APIStatusError, match="is not on disk"):
                ask(api)  # again at once, while its backoff runs
            assert "model file not found" in status_of(daemon, "m")["last_error"]
            aside.rename(model)
            ask(api)  # the request that finds it back starts it
        shown = status_of(daemon, "m")
        assert shown["state"] in ("warm", "cold")
        assert shown["last_error"] == ""  # the note that it was missing is gone
    finally:
        daemon.cleanup()
