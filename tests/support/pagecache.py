"""Evicting a file from the page cache, for tests that show a restore reads nothing from disk."""

from __future__ import annotations

import os
from pathlib import Path


def drop_page_cache(path: Path) -> None:
    """Evict the file from the page cache, so that reading it would have to hit the disk."""
    os.sync()  # dirty pages are not dropped
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
