"""Makes an arbiterd worker die as a native crash does — a line on stderr, then SIGABRT — for the
tests of a worker's last words. Python imports this module at start-up when this folder is on
PYTHONPATH; it acts only in a worker (`python -m arbiterd.worker`) and only while
ARBITERD_TEST_LAST_WORDS names a file: at once if the file exists, else as soon as it appears.
"""

from __future__ import annotations

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


_trigger = os.environ.get("ARBITERD_TEST_LAST_WORDS")
if _trigger and "arbiterd.worker" in sys.orig_argv:
    if os.path.exists(_trigger):
        _die()
    threading.Thread(target=_die_when, args=(_trigger,), name="last-words", daemon=True).start()
