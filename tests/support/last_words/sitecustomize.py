"""Makes an arbiterd worker die as a native crash does — a line on stderr, then SIGABRT — for the
tests of a worker's last words. Python imports this module at start-up when this folder is on
PYTHONPATH; it acts only in a worker (`python -m arbiterd.worker`) and only while
ARBITERD_TEST_LAST_WORDS names a file: at once if the file exists, else as soon as it appears.
ARBITERD_TEST_LAST_WORDS_MODEL, when set, narrows it to the worker of that model (the name in
the config on its command line), so that the other models of a daemon live on.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

WORDS = b"GGML_ASSERT(buf != NULL) failed: the last words of a test's worker\n"


def _die() -> None:
    os.write(2, WORDS)
    os.abort()


def _die_when(trigger: str) -> None:
    while not os.path.exists(trigger):
        time.sleep(0.01)
    _die()


def _model() -> str | None:
    """The model this worker serves, from `--config JSON` on its command line."""
    argv = sys.orig_argv
    try:
        name = json.loads(argv[argv.index("--config") + 1])["spec"]["name"]
    except (ValueError, IndexError, KeyError, TypeError):
        return None
    return name if isinstance(name, str) else None


_trigger = os.environ.get("ARBITERD_TEST_LAST_WORDS")
_only = os.environ.get("ARBITERD_TEST_LAST_WORDS_MODEL")
if _trigger and "arbiterd.worker" in sys.orig_argv and (not _only or _model() == _only):
    if os.path.exists(_trigger):
        _die()
    threading.Thread(target=_die_when, args=(_trigger,), name="last-words", daemon=True).start()
