"""A real daemon follows its config file (issue 29): a save applies as `arbiterd reload` does,
written in place or renamed over; a mistake applies nothing and is logged; a deleted file
leaves it serving; `watch_config = false` follows nothing. A file that another user owns or
can write applies nothing, at start, at a save or at `arbiterd reload` (issue 40)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

from arbiterd.daemon.observe.journal import Journal
from tests.daemon.test_serve import arbiterd
from tests.support.daemon import Daemon, free_port, serving, tiny
from tests.support.waiting import wait_until

APPLIED_S = 30.0  # a reload restarts nothing here; models start in a few seconds at worst
NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file away")


def models(daemon: Daemon) -> dict[str, dict[str, Any]]:
    with daemon.client() as client:
        listed: list[dict[str, Any]] = client.call("status")["models"]
    return {m["name"]: m for m in listed}


def watched_directories(pid: int) -> set[int]:
    """The inodes of what the inotify instances of process `pid` watch (proc_pid_fdinfo(5))."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fdinfo"):
        try:
            info = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
        except FileNotFoundError:
            continue  # closed meanwhile
        for line in info.splitlines():
            if line.startswith("inotify wd:"):
                fields = dict(field.split(":", 1) for field in line.split()[1:])
                inodes.add(int(fields["ino"], 16))
    return inodes


def reload_events(daemon: Daemon) -> list[dict[str, Any]]:
    journal = Journal.open_readonly(daemon.journal)
    try:
        return [e.body for e in journal.read(kinds=["reload"])]
    finally:
        journal.close()


def test_a_saved_config_applies_whether_written_in_place_or_renamed_over(
    tiny_model: Path,
) -> None:
    with serving({"m": tiny(tiny_model, aliases=["old"])}) as running:
        pid = models(running)["m"]["pid"]
        assert running.config.parent.stat().st_ino in watched_directories(running.process.pid)
        text = running.config.read_text()
        running.config.write_text(text.replace('aliases = ["old"]', 'aliases = ["new"]'))
        wait_until(lambda: models(running)["m"]["aliases"] == ["new"], APPLIED_S, "new aliases")
        assert models(running)["m"]["pid"] == pid  # applied as reload does: not restarted
        temporary = running.config.with_name("config.toml.tmp")
        temporary.write_text(
            running.config.read_text() + f'\n[models.added]\npath = "{tiny_model}"\n'
        )
        os.replace(temporary, running.config)
        wait_until(lambda: "added" in models(running), APPLIED_S, "the added model")
        wait_until(lambda: len(reload_events(running)) == 2, APPLIED_S, "the reload events")
        events = [
            (e.get("aliases_changed", []), e.get("added", [])) for e in reload_events(running)
        ]
        assert events == [(["m"], []), ([], ["added"])]  # one save, one reload


def test_a_saved_mistake_applies_nothing_and_is_logged(tiny_model: Path) -> None:
    with serving({"m": tiny(tiny_model)}) as running:
        text = running.config.read_text()
        running.config.write_text(text + "\n[models.bad]\nn_ctx = 1\n")
        wait_until(lambda: "applies nothing" in running.log.read_text(), APPLIED_S, "the report")
        (said,) = [line for line in running.log.read_text().splitlines() if "nothing: " in line]
        assert (
            f"the change to {running.config} applies nothing: {running.config}: models.bad" in said
        )
        assert list(models(running)) == ["m"]
        assert reload_events(running) == []
        running.config.write_text(text.replace("[models.m]", "[models.fixed]"))
        wait_until(lambda: list(models(running)) == ["fixed"], APPLIED_S, "the fixed file")


def test_a_deleted_config_leaves_the_daemon_serving_until_it_is_back(tiny_model: Path) -> None:
    with serving({"m": tiny(tiny_model)}) as running:
        text = running.config.read_text()
        running.config.unlink()
        wait_until(lambda: "is gone" in running.log.read_text(), APPLIED_S, "the deletion said")
        with openai.OpenAI(base_url=running.url, api_key="-", max_retries=0, timeout=60) as api:
            assert api.completions.create(model="m", prompt="the fox", max_tokens=2).choices
        running.config.write_text(text.replace("[models.m]", "[models.back]"))
        wait_until(lambda: list(models(running)) == ["back"], APPLIED_S, "the file back")
        assert running.log.read_text().count("is gone") == 1


def test_a_model_given_an_unload_after_s_by_a_save_unloads_once_due(tiny_model: Path) -> None:
    # Cold long before the save: due at once, which only the reload's wake can tell the unload
    # watch, asleep without a deadline while no model had an unload_after_s.
    with serving({"m": tiny(tiny_model, idle_release_s=0.2)}) as running:
        wait_until(lambda: models(running)["m"]["state"] == "cold", APPLIED_S, "m cold")
        text = running.config.read_text()
        running.config.write_text(text + "unload_after_s = 0.5\n")  # m's table is the last
        wait_until(lambda: models(running)["m"]["state"] == "unloaded", APPLIED_S, "m unloaded")


def test_with_watch_config_false_only_reload_applies_a_save(tiny_model: Path) -> None:
    model = {"m": tiny(tiny_model, aliases=["old"])}
    with serving(model, daemon_keys={"watch_config": False}) as running:
        assert running.config.parent.stat().st_ino not in watched_directories(running.process.pid)
        text = running.config.read_text()
        running.config.write_text(text.replace('aliases = ["old"]', 'aliases = ["new"]'))
        done = arbiterd("reload", "--socket", str(running.socket))
        assert done.stdout.strip() == "reloaded (aliases changed: m)", done.stderr
        assert len(reload_events(running)) == 1


@needs_root
def test_a_config_replaced_by_a_link_to_another_users_file_applies_nothing(
    tiny_model: Path,
) -> None:
    with serving({"m": tiny(tiny_model)}) as running:
        theirs = running.dir / "theirs.toml"
        theirs.write_text(running.config.read_text() + f'\n[models.extra]\npath = "{tiny_model}"\n')
        theirs.chmod(0o666)
        os.chown(theirs, NOBODY, NOBODY)
        link = running.config.with_name("config.toml.link")
        link.symlink_to(theirs)
        os.replace(link, running.config)
        refusal = f"{running.config} (a link to {theirs}) is owned by uid {NOBODY}, not by you"
        wait_until(lambda: "applies nothing" in running.log.read_text(), APPLIED_S, "the report")
        (said,) = [line for line in running.log.read_text().splitlines() if "nothing: " in line]
        assert f"the change to {running.config} applies nothing: {refusal}" in said
        done = arbiterd("reload", "--socket", str(running.socket))
        assert done.returncode != 0
        assert refusal in done.stderr
        assert list(models(running)) == ["m"]
        assert reload_events(running) == []


def test_a_daemon_refuses_to_start_on_a_config_others_can_write(
    tiny_model: Path, tmp_path: Path
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        f'[daemon]\nhttp = "127.0.0.1:{free_port()}"\nsocket = "{tmp_path / "c.sock"}"\n'
        f'arena = "{tmp_path / "arena"}"\njournal = "{tmp_path / "journal.sqlite3"}"\n'
        f'[models.m]\npath = "{tiny_model}"\nn_gpu_layers = 0\n'
    )
    config.chmod(0o666)
    done = subprocess.run(
        [sys.executable, "-m", "arbiterd", "daemon", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=APPLIED_S,  # a daemon that started serves until stopped: a failure here
        check=False,
    )
    assert done.returncode != 0
    assert f"{config} has mode 0666, which lets group or others write it" in done.stderr
    assert f"(chmod go-w {config})" in done.stderr
