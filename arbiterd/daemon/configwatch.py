"""Following the config file (issue 29): a saved change to it is applied as `arbiterd reload`
is, once the save has settled (DEBOUNCE_S after its last event), so one save is one reload.

Owns one inotify instance (inotify(7)) with one watch, on the config file's *directory*, not on
the file: an editor that writes a temporary file and renames it over the config, or deletes the
file and creates it again, puts a new inode under the name, and a watch on the old inode would
see nothing after the first save. The events are filtered to the file's name and read through
the asyncio loop's `add_reader` on the inotify fd: no thread, and no timer while nothing happens
(the one timer is the debounce, armed by an event); a config that is a symlink is seen when the
link is replaced, not when its target is edited elsewhere. Once settled, the file is read once and
compared with the bytes last applied: the same bytes (a `touch`, an editor that rewrites the
text it read) apply nothing.

Never applies a change itself: `apply` (the supervisor's reload) does, and checks the whole file
first, so a mistake applies nothing; with no client to answer, the mistake goes to the log.
Never stops the daemon: an inotify it cannot have (a limit reached, none in the kernel), a file
deleted, a directory removed are each one warning, and the daemon serves on with what it has
(`arbiterd reload` still re-reads the file).
"""

from __future__ import annotations

import asyncio
import enum
import errno
import logging
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Protocol

from inotify_simple import INotify, flags

from arbiterd.errors import ArbiterError

log = logging.getLogger(__name__)

# An editor's save is a burst of events (a temporary file written and renamed over, or a
# truncate and a write); this long after the last one, the save is taken as done.
DEBOUNCE_S = 0.3
# What a save, a delete or a create does to a name in the directory. Not IN_MODIFY: every write
# to any file there would wake the daemon, and a write in place ends with IN_CLOSE_WRITE.
NAME_EVENTS = flags.CLOSE_WRITE | flags.MOVED_TO | flags.MOVED_FROM | flags.CREATE | flags.DELETE
# The directory itself deleted or moved away, or its file system unmounted; IN_IGNORED follows
# each (the kernel dropped the watch). IN_UNMOUNT, IN_IGNORED and IN_Q_OVERFLOW come unasked.
GONE_EVENTS = flags.DELETE_SELF | flags.MOVE_SELF | flags.UNMOUNT | flags.IGNORED
# inotify_init1(2) and inotify_add_watch(2): the errors that mean a per-user limit, by its sysctl.
LIMITS = {
    errno.EMFILE: "fs.inotify.max_user_instances",
    errno.ENOSPC: "fs.inotify.max_user_watches",
}


class InotifyEvent(Protocol):
    """What is read of an inotify event here (inotify_simple.Event has these)."""

    @property
    def mask(self) -> int: ...

    @property
    def name(self) -> str: ...


class Noticed(enum.Enum):
    NOTHING = "nothing"  # events on other names in the directory
    FILE = "file"  # the file was written, replaced, created or deleted: look once it settles
    DIRECTORY_GONE = "directory_gone"  # the watch is gone with its directory


def notice(events: Iterable[InotifyEvent], name: str) -> Noticed:
    """What a batch of events from the watch on a directory says about its file `name`."""
    noticed = Noticed.NOTHING
    for event in events:
        if event.mask & GONE_EVENTS:
            return Noticed.DIRECTORY_GONE
        # An overflowed queue lost events, perhaps the file's: look at it.
        if event.name == name or event.mask & flags.Q_OVERFLOW:
            noticed = Noticed.FILE
    return noticed


def why_not(exc: OSError) -> str:
    """Why inotify cannot follow a file, from the error of inotify_init1 or inotify_add_watch."""
    limit = LIMITS.get(exc.errno or 0)
    if limit is not None:
        return f"the inotify limit {limit} is reached (raise it with sysctl)"
    return f"inotify is unavailable: {exc}"


class ConfigWatch:
    """Follows the file at `path` from `start` until `close`: each settled change hands over
    to `apply`, which re-reads and applies the file (the supervisor's reload); one at a time,
    and once more after it when the file changed meanwhile."""

    def __init__(
        self,
        path: Path,
        apply: Callable[[], Awaitable[object]],
        *,
        debounce_s: float = DEBOUNCE_S,
    ) -> None:
        self.path = path
        self._apply = apply
        self._debounce_s = debounce_s
        self._inotify: INotify | None = None
        self._settle: asyncio.TimerHandle | None = None
        self._checking: asyncio.Task[None] | None = None
        self._check_again = False
        # The bytes last handed to `apply`, or read at start (what the daemon started with); a
        # mistake's too, so that it is reported once, not again at each touch.
        self._applied: bytes | None = None
        self._gone = False  # the file is not there, and that was said

    @property
    def following(self) -> bool:
        return self._inotify is not None

    def start(self) -> None:
        """Watch the file's directory and read the file as it is now; one warning, and nothing
        followed, when inotify cannot be had."""
        try:
            inotify = INotify()  # close-on-exec: workers inherit nothing of it
        except OSError as exc:
            self._cannot_follow(why_not(exc))
            return
        try:
            inotify.add_watch(self.path.parent, NAME_EVENTS | GONE_EVENTS | flags.ONLYDIR)
        except OSError as exc:
            inotify.close()
            # ENOENT, ENOTDIR, EACCES: the directory itself; else a limit.
            reason = why_not(exc) if exc.errno in LIMITS else f"cannot watch its directory: {exc}"
            self._cannot_follow(reason)
            return
        try:
            self._applied = self.path.read_bytes()
        except OSError:
            self._applied = None  # gone meanwhile, or unreadable: whatever comes next applies
        asyncio.get_running_loop().add_reader(inotify.fileno(), self._readable)
        self._inotify = inotify

    async def close(self) -> None:
        """Stop following; a change being applied is cancelled with the daemon's stop."""
        self._unwatch()
        checking, self._checking = self._checking, None
        if checking is not None:
            checking.cancel()
            await asyncio.gather(checking, return_exceptions=True)

    def _cannot_follow(self, reason: str) -> None:
        log.warning(
            "not following %s: %s; the daemon runs on, and applies changes to it at "
            "`arbiterd reload`",
            self.path,
            reason,
        )

    def _unwatch(self) -> None:
        if self._settle is not None:
            self._settle.cancel()
            self._settle = None
        inotify, self._inotify = self._inotify, None
        if inotify is not None:
            asyncio.get_running_loop().remove_reader(inotify.fileno())
            inotify.close()

    def _readable(self) -> None:
        assert self._inotify is not None  # the reader goes with it
        noticed = notice(self._inotify.read(timeout=0), self.path.name)
        if noticed is Noticed.DIRECTORY_GONE:
            self._unwatch()
            log.warning(
                "the directory of %s was removed or moved: the daemon no longer follows the "
                "file, and keeps running with what it has (`arbiterd reload` reads it again)",
                self.path,
            )
        elif noticed is Noticed.FILE:
            if self._settle is not None:
                self._settle.cancel()
            self._settle = asyncio.get_running_loop().call_later(self._debounce_s, self._settled)

    def _settled(self) -> None:
        self._settle = None
        self._check_again = True
        if self._checking is None or self._checking.done():
            self._checking = asyncio.get_running_loop().create_task(
                self._checks(), name="configwatch"
            )

    async def _checks(self) -> None:
        while self._check_again:
            self._check_again = False
            await self._check()

    async def _check(self) -> None:
        """Apply the file if its bytes changed; say once that it is gone, and when it is back."""
        try:
            content = await asyncio.to_thread(self.path.read_bytes)
        except FileNotFoundError:
            if not self._gone:
                self._gone = True
                log.warning(
                    "%s is gone: the daemon keeps running with what it has, and follows the "
                    "file again when it is back",
                    self.path,
                )
            return
        except OSError:
            content = None  # unreadable (its permissions, say): the reload says why
        if self._gone:
            self._gone = False
            log.info("%s is back", self.path)
        if content is not None and content == self._applied:
            log.debug("%s was saved unchanged: nothing to apply", self.path)
            return
        self._applied = content
        log.info("%s changed: applying it as `arbiterd reload` does", self.path)
        try:
            await self._apply()
        except ArbiterError as exc:
            log.warning("the change to %s applies nothing: %s", self.path, exc)
        except Exception:
            # As the control socket maps a command that fails unexpectedly: said, and the
            # watch goes on.
            log.exception("%s changed, and applying it failed", self.path)
