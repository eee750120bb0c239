"""The prompt cache kept across an unload (issue 14): saved to its state file (kvfile.py) when a
worker unloads, adopted by the next worker of that model once it has loaded. Never fails the
worker: a cache that cannot be saved or read is said in the log (and in the unload's reply),
and the next request prefills in full.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from arbiterd.errors import RestoreError
from arbiterd.spec import WorkerConfig
from arbiterd.worker import kvfile
from arbiterd.worker.engine import Backend

log = logging.getLogger(__name__)


def save(config: WorkerConfig, backend: Backend) -> dict[str, Any]:
    """On unload: write the prompt cache to the state file (issue 14). A write that fails
    (a full disk) is logged and said in the reply; the unload goes on regardless."""
    path = config.kv_file
    kv = backend.kept_kv() if path is not None else None
    if path is None or kv is None:
        if path is not None:
            remove(path)  # an older cache than the one we had: stale
        return kept()
    try:
        written = kvfile.write(path, key(config), kv)
    except (OSError, kvfile.KvFileError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        error = f"could not save the prompt cache to {path}: {reason}"
        log.warning("%s: %s; unloading without it", config.spec.name, error)
        return kept(error=error)
    log.info(
        "%s: saved %d tokens of prompt cache (%d bytes) to %s",
        config.spec.name,
        len(kv.tokens),
        written,
        path,
    )
    return kept(path, written, len(kv.tokens))


def adopt(config: WorkerConfig, backend: Backend) -> None:
    """After loading: restore the prompt cache an unload kept, if it was made for this
    model file and these params; any other file is discarded with a warning (a full
    prefill, never a wrong answer). The file is used once: it is removed either way."""
    path = config.kv_file
    if path is None or not path.exists():
        return
    try:
        kv = kvfile.read(path, key(config))
        backend.adopt_kv(kv)
    except (OSError, kvfile.KvFileError, RestoreError) as exc:
        log.warning("%s: discarding the kept prompt cache: %s", config.spec.name, exc)
    else:
        log.info(
            "%s: restored %d tokens of prompt cache from %s", config.spec.name, len(kv.tokens), path
        )
    finally:
        remove(path)


def key(config: WorkerConfig) -> kvfile.KvKey:
    """What this worker's prompt cache is made for: the version of the model file it
    loaded (the one the daemon's host copy holds, else the file as it is now) and the
    context params. OSError when the file must be stat'ed and cannot be."""
    spec = config.spec
    version = config.model_version
    if version is None:
        return kvfile.KvKey.of(spec.path, n_ctx=spec.n_ctx, embedding=spec.embedding)
    size, mtime_ns = version
    return kvfile.KvKey(size, mtime_ns, spec.n_ctx, spec.embedding)


def kept(
    kv_file: Path | None = None, kv_bytes: int = 0, tokens: int = 0, error: str = ""
) -> dict[str, Any]:
    """An unload's reply: where the prompt cache was kept, its size, and its tokens; or why
    none was kept when one should have been."""
    return {
        "kv_file": None if kv_file is None else str(kv_file),
        "kv_bytes": kv_bytes,
        "tokens": tokens,
        "error": error,
    }


def remove(path: Path) -> None:
    """Remove a state file that was used or is stale; one that cannot be removed is said (a
    file left behind is checked like any other before a worker uses it)."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc.strerror or exc)
