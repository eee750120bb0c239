"""A fake libllama speaking residency ABI 3, built with gcc, that records its calls.

It exports the four symbols of include/llama-residency.h (llama-residency.patch) with the same C
signatures: release takes uint32 flags, stats fills `struct llama_residency_stats`. Each records
what crossed the ABI in globals that exported getters read back; setters choose what the calls
return. -D switches leave a symbol out (NO_ABI, NO_RELEASE, NO_RESTORE, NO_STATS), for the
probe's misses.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

FAKE_SOURCE = r"""
#include <stdint.h>

struct llama_residency_stats {
    int32_t  released;
    uint64_t weights_bytes;
    uint64_t kv_bytes;
    uint64_t compute_bytes;
    uint64_t host_bytes;
    uint64_t file_bytes;
    uint64_t copied_bytes;
};

static int32_t abi_version = 3;
static int32_t result_code;
static struct llama_residency_stats stats_out;
static const void *last_ctx;
static int64_t last_flags = -1;  /* of the last release: -1 until one is made */
static int64_t last_stats_flags = -1;
static int release_calls;
static int restore_calls;
static int stats_calls;

#ifndef NO_ABI
int32_t llama_residency_abi(void) { return abi_version; }
#endif

#ifndef NO_RELEASE
int32_t llama_context_release_device(void *ctx, uint32_t flags) {
    last_ctx = ctx;
    last_flags = flags;
    release_calls++;
    return result_code;
}
#endif

#ifndef NO_RESTORE
int32_t llama_context_restore_device(void *ctx) {
    last_ctx = ctx;
    restore_calls++;
    return result_code;
}
#endif

#ifndef NO_STATS
int32_t llama_context_residency_stats(const void *ctx, uint32_t flags,
                                      struct llama_residency_stats *out) {
    last_ctx = ctx;
    last_stats_flags = flags;
    stats_calls++;
    *out = stats_out;
    return result_code;
}
#endif

void fake_set_abi(int32_t version) { abi_version = version; }
void fake_set_result(int32_t code) { result_code = code; }
void fake_set_stats(int32_t released, uint64_t weights, uint64_t kv, uint64_t compute,
                    uint64_t host, uint64_t file, uint64_t copied) {
    stats_out.released = released;
    stats_out.weights_bytes = weights;
    stats_out.kv_bytes = kv;
    stats_out.compute_bytes = compute;
    stats_out.host_bytes = host;
    stats_out.file_bytes = file;
    stats_out.copied_bytes = copied;
}
const void *fake_last_ctx(void) { return last_ctx; }
int64_t fake_last_flags(void) { return last_flags; }
int64_t fake_last_stats_flags(void) { return last_stats_flags; }
int fake_release_calls(void) { return release_calls; }
int fake_restore_calls(void) { return restore_calls; }
int fake_stats_calls(void) { return stats_calls; }
"""

# A pointer with bits set in both halves: truncation to a C int would show.
CTX = 0x7F12_3456_789A_BCD0


@dataclass(frozen=True)
class Calls:
    """How often each residency function of the fake was called."""

    release: int
    restore: int
    stats: int


class Fake:
    """A compiled fake libllama and a handle on its setters and recording getters."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))  # the same dlopen instance as the probe's
        self._lib.fake_set_abi.argtypes = [ctypes.c_int32]
        self._lib.fake_set_result.argtypes = [ctypes.c_int32]
        self._lib.fake_set_stats.argtypes = [ctypes.c_int32, *[ctypes.c_uint64] * 6]
        self._lib.fake_last_ctx.restype = ctypes.c_void_p
        self._lib.fake_last_flags.restype = ctypes.c_int64
        self._lib.fake_last_stats_flags.restype = ctypes.c_int64

    def set_abi(self, version: int) -> None:
        """What llama_residency_abi returns from now on (3 at first)."""
        self._lib.fake_set_abi(version)

    def set_result(self, code: int) -> None:
        """What release, restore and stats return from now on (0 at first)."""
        self._lib.fake_set_result(code)

    def set_stats(
        self,
        *,
        released: int,
        weights: int,
        kv: int,
        compute: int,
        host: int,
        file: int = 0,
        copied: int = 0,
    ) -> None:
        """What llama_context_residency_stats writes into its struct from now on."""
        self._lib.fake_set_stats(released, weights, kv, compute, host, file, copied)

    @property
    def last_ctx(self) -> int | None:
        value: int | None = self._lib.fake_last_ctx()
        return value

    @property
    def last_flags(self) -> int:
        """The flags of the last release, -1 before any."""
        return int(self._lib.fake_last_flags())

    @property
    def last_stats_flags(self) -> int:
        """The flags of the last stats call, -1 before any."""
        return int(self._lib.fake_last_stats_flags())

    @property
    def calls(self) -> Calls:
        return Calls(
            release=int(self._lib.fake_release_calls()),
            restore=int(self._lib.fake_restore_calls()),
            stats=int(self._lib.fake_stats_calls()),
        )


def compile_fake(directory: Path, name: str, *defines: str) -> Path:
    """Build the fake with gcc; CI installs gcc, so its absence fails rather than skips."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.fail("gcc is required to build the fake libllama (CI installs it)")
    source = directory / f"{name}.c"
    source.write_text(FAKE_SOURCE)
    output = directory / f"{name}.so"
    flags = [f"-D{define}" for define in defines]
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-O2", "-Wall", "-Werror", *flags, "-o", output, source],
        check=True,
        capture_output=True,
    )
    return output
