"""The config watch on a real inotify, in a real directory: one apply per settled save, whatever
way the editor saves; nothing for unchanged bytes; a gone file or directory said once; no inotify
to be had said once. `apply` here records the file as it is when called, as the reload reads it."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from inotify_simple import Event, INotify, flags

from arbiterd.daemon import configwatch
from arbiterd.daemon.configwatch import ConfigWatch, Noticed, notice, why_not
from arbiterd.errors import ConfigError
from tests.support import waiting

DEADLINE_S = 10.0


async def until(condition: Callable[[], object], what: str) -> None:
    """Let the loop run until `condition` holds; fail after DEADLINE_S."""
    await waiting.until(condition, DEADLINE_S, what)


class Applies:
    """A stand-in for the supervisor's reload: what the file held at each call."""

    def __init__(self, path: Path, error: Exception | None = None) -> None:
        self.path = path
        self.seen: list[str | None] = []
        self.error = error

    async def __call__(self) -> dict[str, object]:
        self.seen.append(self.path.read_text() if self.path.exists() else None)
        if self.error is not None:
            raise self.error
        return {}


@contextlib.asynccontextmanager
async def watching(config: Path, applies: Applies) -> AsyncIterator[ConfigWatch]:
    watch = ConfigWatch(config, applies)
    watch.start()
    try:
        yield watch
    finally:
        await watch.close()


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "etc" / "config.toml"
    path.parent.mkdir()
    path.write_text("first\n")
    return path


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture) -> Callable[[str], list[str]]:
    """The watch's log lines that contain a text."""
    caplog.set_level(logging.DEBUG, logger=configwatch.__name__)

    def messages(part: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if part in r.getMessage()]

    return messages


def test_only_events_on_the_files_name_or_on_the_directory_count() -> None:
    other = [Event(1, flags.CLOSE_WRITE, 0, "journal.sqlite3"), Event(1, flags.CREATE, 0, "x~")]
    assert notice(other, "config.toml") is Noticed.NOTHING
    saved = [*other, Event(1, flags.MOVED_TO, 7, "config.toml")]
    assert notice(saved, "config.toml") is Noticed.FILE
    assert notice([Event(-1, flags.Q_OVERFLOW, 0, "")], "config.toml") is Noticed.FILE
    for gone in (flags.DELETE_SELF, flags.MOVE_SELF, flags.IGNORED, flags.UNMOUNT):
        assert notice([*saved, Event(1, gone, 0, "")], "config.toml") is Noticed.DIRECTORY_GONE


def test_the_inotify_limits_are_named_by_their_sysctl() -> None:
    watches = why_not(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    assert "fs.inotify.max_user_watches" in watches
    instances = why_not(OSError(errno.EMFILE, os.strerror(errno.EMFILE)))
    assert "fs.inotify.max_user_instances" in instances
    assert "unavailable" in why_not(OSError(errno.ENOSYS, os.strerror(errno.ENOSYS)))


def test_a_burst_of_writes_is_one_apply_of_the_last(config: Path) -> None:
    applies = Applies(config)

    async def scenario() -> None:
        async with watching(config, applies):
            for n in range(3):  # well within the debounce of each other
                config.write_text(f"burst {n}\n")
            await until(lambda: applies.seen, "the burst applied")
            config.write_text("later\n")
            await until(lambda: len(applies.seen) == 2, "the later save applied")

    asyncio.run(scenario())
    assert applies.seen == ["burst 2\n", "later\n"]


def test_a_file_renamed_over_or_deleted_and_created_again_is_followed(
    config: Path, logged: Callable[[str], list[str]]
) -> None:
    applies = Applies(config)

    async def scenario() -> None:
        async with watching(config, applies):
            temporary = config.with_name(".config.toml.swp")
            temporary.write_text("renamed over\n")
            os.replace(temporary, config)
            await until(lambda: applies.seen, "the rename applied")
            config.unlink()
            config.write_text("created again\n")
            await until(lambda: len(applies.seen) == 2, "the new file applied")

    asyncio.run(scenario())
    assert applies.seen == ["renamed over\n", "created again\n"]
    assert logged("is gone") == []  # settled with the file there: a save, not a deletion


def test_a_save_of_the_same_bytes_applies_nothing(
    config: Path, logged: Callable[[str], list[str]]
) -> None:
    applies = Applies(config)

    async def scenario() -> None:
        async with watching(config, applies):
            config.write_text("first\n")  # what the daemon started with
            await until(lambda: logged("saved unchanged"), "the unchanged save settled")
            config.write_text("second\n")
            await until(lambda: applies.seen, "the change applied")
            os.utime(config)  # a touch: no event it follows, and no byte changed
            config.write_text("second\n")
            await until(lambda: len(logged("saved unchanged")) == 2, "the second one settled")

    asyncio.run(scenario())
    assert applies.seen == ["second\n"]


def test_a_mistake_is_logged_once_and_the_next_save_applies(
    config: Path, logged: Callable[[str], list[str]]
) -> None:
    applies = Applies(config, error=ConfigError(f"{config}: models.bad.path: expected a path"))

    async def scenario() -> None:
        async with watching(config, applies):
            config.write_text("bad\n")
            await until(lambda: logged("applies nothing"), "the mistake reported")
            config.write_text("bad\n")  # saved again as it was: said once
            await until(lambda: logged("saved unchanged"), "the same save settled")
            applies.error = None
            config.write_text("fixed\n")
            await until(lambda: len(applies.seen) == 2, "the fix applied")

    asyncio.run(scenario())
    assert applies.seen == ["bad\n", "fixed\n"]
    (said,) = logged("applies nothing")
    assert f"the change to {config} applies nothing: {config}: models.bad.path" in said


def test_a_deleted_file_is_said_once_and_followed_again_when_back(
    config: Path, logged: Callable[[str], list[str]]
) -> None:
    applies = Applies(config)

    async def scenario() -> None:
        async with watching(config, applies):
            config.unlink()
            await until(lambda: logged(" is gone"), "the deletion said")
            config.write_text("back\n")
            await until(lambda: applies.seen, "the file applied again")

    asyncio.run(scenario())
    assert applies.seen == ["back\n"]
    (gone,) = logged(" is gone:")
    assert gone.startswith(f"{config} is gone: the daemon keeps running with what it has")
    assert logged(f"{config} is back") == [f"{config} is back"]


def test_a_removed_directory_is_said_and_nothing_more_is_followed(
    config: Path, logged: Callable[[str], list[str]]
) -> None:
    applies = Applies(config)

    async def scenario() -> None:
        async with watching(config, applies) as watch:
            assert watch.following
            config.unlink()
            config.parent.rmdir()
            await until(lambda: not watch.following, "the watch dropped")

    asyncio.run(scenario())
    assert applies.seen == []
    (said,) = logged("was removed or moved")
    assert said.startswith(f"the directory of {config} was removed or moved")
    assert logged("is gone") == []  # the directory says it all


def test_no_inotify_to_be_had_is_one_warning_and_no_watch(
    config: Path, logged: Callable[[str], list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def limit_reached(*args: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(INotify, "add_watch", limit_reached)
    applies = Applies(config)

    async def scenario() -> None:
        async with watching(config, applies) as watch:
            assert not watch.following

    asyncio.run(scenario())
    (said,) = logged("not following")
    assert said.startswith(f"not following {config}: the inotify limit fs.inotify.max_user_watches")
    assert "`arbiterd reload`" in said
