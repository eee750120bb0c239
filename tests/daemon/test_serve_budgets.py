"""Issue 14's memory parts end to end, through a real daemon and tiny models: the host RAM
budget unloads the least recently used cold model, host_copy = "page-cache" keeps no copy and
still restores the prompt cache, status shows both budgets, and a model removed by a reload
leaves no state file behind."""

from __future__ import annotations

import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import openai

from arbiterd.daemon.observe.journal import Journal
from tests.support.daemon import Daemon
from tests.support.daemon import tiny as tiny_table
from tests.support.waiting import wait_until

PREFIX = " ".join(f"the fox {w} is not a dog" for w in ("one", "two", "three", "four") * 4)


# The tiny model as every test here runs it.
tiny = partial(tiny_table, n_ctx=1024)


def arbiterd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "arbiterd", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def status(daemon: Daemon) -> dict[str, Any]:
    with daemon.client() as client:
        result: dict[str, Any] = client.call("status")
    return result


def states(daemon: Daemon) -> dict[str, str]:
    return {m["name"]: m["state"] for m in status(daemon)["models"]}


def cached_tokens(api: openai.OpenAI, model: str, prompt: str) -> tuple[int, int]:
    """Prompt tokens of a greedy completion, and how many came from the prompt cache."""
    done = api.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    assert done.usage is not None
    assert done.usage.prompt_tokens_details is not None
    return done.usage.prompt_tokens, done.usage.prompt_tokens_details.cached_tokens or 0


def journal_events(daemon: Daemon, *kinds: str) -> list[dict[str, Any]]:
    journal = Journal.open_readonly(daemon.journal)
    try:
        return [e.body for e in journal.read(kinds=list(kinds))]
    finally:
        journal.close()


def test_over_the_host_ram_budget_the_least_recently_used_cold_model_is_unloaded(
    tiny_model: Path, tmp_path: Path
) -> None:
    # Three files (three host copies); room for two and a half. The reload backend: what a
    # cold model keeps is then its saved KV alone.
    files = []
    for name in "abc":
        files.append(tmp_path / f"{name}.gguf")
        shutil.copyfile(tiny_model, files[-1])
    size = tiny_model.stat().st_size
    budget = size * 5 // 2
    running = Daemon(
        {
            name: tiny(path, load="demand", residency="reload")
            for name, path in zip("abc", files, strict=True)
        },
        daemon_keys={"host_ram_budget": budget, "prompt_cache_budget": "64MiB"},
    )
    try:
        running.wait_ready(("unloaded",))
        with openai.OpenAI(base_url=running.url, api_key="-", max_retries=0, timeout=60) as api:
            for name in "abc":  # a, then b (a goes cold), then c (b goes cold)
                cached_tokens(api, name, PREFIX)
            wait_until(lambda: states(running)["a"] == "unloaded", 30, "a unloaded")
            assert states(running)["b"] != "unloaded"
            after = status(running)
            # a's prompt cache waits on disk; the next request to a restores it.
            assert (running.dir / "prompt-cache" / "a.kv").is_file()
            prompt_tokens, cached = cached_tokens(api, "a", PREFIX + " and a cat")
            assert cached > 0
            assert prompt_tokens - cached <= 5 + 1
        ram = after["host_ram"]
        assert ram["budget_bytes"] == budget
        assert ram["host_copies_bytes"] == 2 * size  # b's and c's; a's went with it
        own = ram["host_kv_bytes"] + ram["host_weights_bytes"]
        assert after["host_ram_bytes"] == ram["host_copies_bytes"] + own
        assert after["host_ram_bytes"] <= budget
        assert after["prompt_cache"]["budget_bytes"] == 64 << 20
        assert after["prompt_cache"]["files"] == 1
        decided = journal_events(running, "host_ram_budget")
        assert decided[0]["unload"] == ["a"]
        assert decided[0]["budget_bytes"] == budget
        assert decided[0]["used_bytes"] > budget >= decided[0]["after_bytes"]
        unloads = journal_events(running, "unload")
        assert (unloads[0]["model"], unloads[0]["reason"]) == ("a", "host_ram_budget")
        assert unloads[0]["kv_bytes"] > 0
    finally:
        running.cleanup()


def test_a_page_cache_model_keeps_no_copy_and_status_shows_both_budgets(
    tiny_model: Path,
) -> None:
    running = Daemon(
        {"p": tiny(tiny_model, host_copy="page-cache")},
        daemon_keys={"prompt_cache_budget": "1MiB"},
    )
    try:
        running.wait_ready()
        with openai.OpenAI(base_url=running.url, api_key="-", max_retries=0, timeout=60) as api:
            cached_tokens(api, "p", PREFIX)
            done = arbiterd("unload", "p", "--socket", str(running.socket))
            assert done.returncode == 0, done.stderr
            shown = arbiterd("status", "--socket", str(running.socket))
            prompt_tokens, cached = cached_tokens(api, "p", PREFIX + " and a cat")
        assert cached > 0  # restored from the state file, the weights from the file itself
        assert prompt_tokens - cached <= 5 + 1
        now = status(running)
        model = now["models"][0]
        assert model["host_copy"] == "page-cache"
        assert "host_copy_bytes" not in model  # no copy of the file is held for it
        assert now["host_ram"]["host_copies_bytes"] == 0
        assert now["host_ram"]["budget_bytes"] == 0
        assert shown.returncode == 0, shown.stderr
        assert "host RAM: " in shown.stdout
        assert "; budget none" in shown.stdout
        assert "prompt cache on disk: " in shown.stdout
        assert "in 1 file(s); budget 1.0 MiB" in shown.stdout
    finally:
        running.cleanup()


def test_a_model_removed_by_a_reload_leaves_no_prompt_cache_behind(tiny_model: Path) -> None:
    # What `arbiterd reload` answers is tested: the daemon must not apply the save itself first.
    running = Daemon(
        {"keep": tiny(tiny_model), "drop": tiny(tiny_model)}, daemon_keys={"watch_config": False}
    )
    folder = running.dir / "prompt-cache"
    try:
        running.wait_ready()
        with openai.OpenAI(base_url=running.url, api_key="-", max_retries=0, timeout=60) as api:
            for name in ("keep", "drop"):
                cached_tokens(api, name, PREFIX)
                done = arbiterd("unload", name, "--socket", str(running.socket))
                assert done.returncode == 0, done.stderr
        assert sorted(p.name for p in folder.glob("*.kv")) == ["drop.kv", "keep.kv"]
        text = running.config.read_text()
        running.config.write_text(text[: text.index("[models.drop]")])
        done = arbiterd("reload", "--socket", str(running.socket))
        assert done.returncode == 0, done.stderr
        assert "removed: drop" in done.stdout
        assert sorted(p.name for p in folder.glob("*.kv")) == ["keep.kv"]
    finally:
        running.cleanup()
