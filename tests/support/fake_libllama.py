"""A fake libllama exporting the in-place residency API, built with gcc, that records its calls."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

FAKE_SOURCE = r"""
#include <stdbool.h>
#include <stdint.h>

static void *last_ctx;
static int last_keep_kv = -1;
static int release_calls;
static int restore_calls;
static int32_t result_code;

#ifndef NO_RELEASE
int32_t llama_context_release_device(void *ctx, bool keep_kv) {
    last_ctx = ctx;
    last_keep_kv = keep_kv;
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

void fake_set_result(int32_t code) { result_code = code; }
void *fake_last_ctx(void) { return last_ctx; }
int fake_last_keep_kv(void) { return last_keep_kv; }
int fake_release_calls(void) { return release_calls; }
int fake_restore_calls(void) { return restore_calls; }
"""

# A pointer with bits set in both halves: truncation to a C int would show.
CTX = 0x7F12_3456_789A_BCD0


class Fake:
    """A compiled fake libllama and a handle on its recording getters."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))  # the same dlopen instance as the probe's
        self._lib.fake_set_result.argtypes = [ctypes.c_int32]
        self._lib.fake_last_ctx.restype = ctypes.c_void_p

    def set_result(self, code: int) -> None:
        self._lib.fake_set_result(code)

    @property
    def last_ctx(self) -> int | None:
        value: int | None = self._lib.fake_last_ctx()
        return value

    @property
    def last_keep_kv(self) -> int:
        return int(self._lib.fake_last_keep_kv())

    @property
    def release_calls(self) -> int:
        return int(self._lib.fake_release_calls())

    @property
    def restore_calls(self) -> int:
        return int(self._lib.fake_restore_calls())


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
