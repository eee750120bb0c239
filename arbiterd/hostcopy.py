"""The host copies of model files: owns the memfds the daemon fills once per GGUF and hands to
every worker serving that file (issue 16: one host copy per file, counted once).

A worker loads its weights from the memfd (as /proc/self/fd/N), so a restore reads nothing from
disk, and a model whose file later vanishes keeps serving — and can still be restarted — from
its copy. A CPU model maps its weights from it and the in-place engine uploads a device's
weights from it again at every restore (issue 28: the copy is the only one), so once filled the
memfd is sealed: nobody can write, shrink or grow it, and a mapping of it can never fault. Never
mapped here: the daemon only fills the memfd and passes its descriptor on.
Blocking (a 4 GB copy takes a second or two): the daemon calls it from a thread.
"""

from __future__ import annotations

import fcntl
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from arbiterd.errors import ModelLoadError

COPY_CHUNK_BYTES = 1 << 26


@dataclass(frozen=True)
class _Identity:
    """What tells a new version of a file from the one that was copied."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> _Identity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class HostCopy:
    """One memfd holding one version of a GGUF; closed when its last lease is released."""

    def __init__(self, path: Path, fd: int, size: int, identity: _Identity) -> None:
        self.path = path
        self.fd = fd
        self.size = size
        self.identity = identity
        self.leases: set[Lease] = set()

    def models(self) -> list[str]:
        """The models using this copy, by name, each once."""
        return sorted({lease.model for lease in self.leases})


class Lease:
    """One model slot's use of a copy (a changed model briefly has two: old and new slot)."""

    def __init__(self, copy: HostCopy, model: str) -> None:
        self.copy = copy
        self.model = model


class HostCopies:
    """Every host copy of one daemon, by the file's real path. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._copies: dict[str, HostCopy] = {}  # realpath -> the newest copy of that file
        self._retired: list[HostCopy] = []  # older versions some model still uses

    def acquire(self, path: Path, model: str) -> Lease:
        """A lease on the copy of `path` for `model`: the existing copy when the file is
        unchanged or gone, else a fresh one. Raises ModelLoadError naming `path`."""
        key = os.path.realpath(path)
        with self._lock:
            current = self._copies.get(key)
            try:
                st = os.stat(key)
            except FileNotFoundError:
                if current is None:
                    raise ModelLoadError(f"model file not found: {path}") from None
                st = None  # gone from disk: serve from the copy we have
            except OSError as exc:
                raise ModelLoadError(f"cannot read model file {path}: {exc.strerror}") from None
            if current is None or (st is not None and _Identity.of(st) != current.identity):
                fresh = copy_into_memfd(path)
                if current is not None:
                    self._retired.append(current)
                self._copies[key] = current = fresh
            lease = Lease(current, model)
            current.leases.add(lease)
            return lease

    def holds(self, path: Path) -> bool:
        """Whether a copy of `path` is in memory (so the file may be gone from disk)."""
        with self._lock:
            return os.path.realpath(path) in self._copies

    def release(self, lease: Lease) -> None:
        """The lease's model no longer needs its copy; the last release frees the memory."""
        copy = lease.copy
        with self._lock:
            copy.leases.discard(lease)
            if copy.leases:
                return
            key = os.path.realpath(copy.path)
            if self._copies.get(key) is copy:
                del self._copies[key]
            elif copy in self._retired:
                self._retired.remove(copy)
            os.close(copy.fd)

    def total_bytes(self) -> int:
        """Host RAM of every copy, each counted once however many models share it."""
        with self._lock:
            return sum(c.size for c in [*self._copies.values(), *self._retired])

    def leases(self) -> list[tuple[HostCopy, int]]:
        """Every copy in memory with the number of slots leasing it, read at one instant."""
        with self._lock:
            return [(c, len(c.leases)) for c in [*self._copies.values(), *self._retired]]

    def close(self) -> None:
        with self._lock:
            for copy in [*self._copies.values(), *self._retired]:
                os.close(copy.fd)
            self._copies.clear()
            self._retired.clear()


SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL


def copy_into_memfd(path: Path) -> HostCopy:
    """Copy the file into a new memfd, seal it (SEALS) and drop the file's page cache, so the
    memfd is the only copy in RAM and never changes. The memfd is close-on-exec: a worker gets it
    only through pass_fds."""
    try:
        src = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ModelLoadError(f"cannot open model file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(src)
        memfd = os.memfd_create(f"arbiterd:{path.name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            offset = 0
            while offset < st.st_size:
                count = min(COPY_CHUNK_BYTES, st.st_size - offset)
                sent = os.sendfile(memfd, src, offset, count)
                if sent == 0:
                    raise ModelLoadError(f"{path} shrank while being copied")
                offset += sent
            fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, SEALS)
        except OSError as exc:
            os.close(memfd)
            raise ModelLoadError(f"cannot copy model file {path}: {exc.strerror}") from None
        except BaseException:
            os.close(memfd)
            raise
        os.posix_fadvise(src, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(src)
    return HostCopy(path, memfd, st.st_size, _Identity.of(st))
