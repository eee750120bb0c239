"""Stock llama.cpp's `llama-server` (CPU), the peer the contention and parallel benchmarks measure
arbiterd against: built once from the llama.cpp vendored in the pinned llama-cpp-python's source
distribution (the version pyproject.toml pins for the engine, unpatched) and cached under
$XDG_CACHE_HOME/arbiterd/llama-server/VERSION-KEY/, KEY a hash of the build flags.

    python -m benchmarks.llama_server [--print-path]

Builds the binary when it is not cached (15 min measured on 2 cores shared with other work),
printing cmake's progress, and prints its path. The source distribution is taken from pip's
download (which reads pip's own cache first); nothing else comes from the network: the server's
web UI is neither built nor downloaded (LLAMA_BUILD_UI, LLAMA_USE_PREBUILT_UI off), and the
build has no HTTPS (no OpenSSL): the benchmark talks to it on the loopback. The libraries are
linked in statically (BUILD_SHARED_LIBS off), so the one file is the whole server, and its
router mode (--models-preset, --models-max), which starts copies of its own binary per model,
works from the cache folder.

Owns the cache folder's llama-server entries and the servers a benchmark starts from them
(`serve`); nothing in arbiterd uses them.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.support.daemon import free_port

ROOT = Path(__file__).resolve().parent.parent
BUILD_JOBS = 2  # the machine this runs on has 2 cores, shared with other work
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
# As scripts/setup.sh builds the engine: ggml's AMX matrix multiply segfaults on Q4_K weights
# (llama.cpp issue 20824), so a native build on a CPU with AMX leaves it out where the compiler
# can say so; both sides of the benchmark then run the same kernels.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
READY_TIMEOUT_S = 120.0
READY_POLL_S = 0.2
STOP_TIMEOUT_S = 30.0


def engine_version() -> str:
    """The llama-cpp-python version pyproject.toml pins for the engine."""
    found = re.search(r"llama-cpp-python==([0-9.]+)", (ROOT / "pyproject.toml").read_text())
    if found is None:
        raise RuntimeError("pyproject.toml pins no llama-cpp-python version")
    return found.group(1)


def compiler_takes(flags: str) -> bool:
    """Whether the C compiler accepts `flags` (compiling an empty unit)."""
    cc = shutil.which("cc")
    if cc is None:
        return False
    done = subprocess.run(
        [cc, *flags.split(), "-x", "c", "-c", "-o", os.devnull, "-"],
        input=b"int x;",
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


def cmake_flags() -> list[str]:
    flags = list(CMAKE_FLAGS)
    if platform.machine() == "x86_64" and compiler_takes(NO_AMX):
        flags += [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    return flags


def cache_dir(version: str) -> Path:
    """Where the binary built from `version` with today's flags is kept."""
    key = hashlib.sha256("\n".join([version, *cmake_flags(), platform.machine()]).encode())
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "arbiterd" / "llama-server" / f"{version}-{key.hexdigest()[:16]}"


def cached_binary() -> Path | None:
    """The cached llama-server for the pinned version, or None when it has not been built."""
    binary = cache_dir(engine_version()) / "llama-server"
    return binary if binary.is_file() and os.access(binary, os.X_OK) else None


def say(message: str) -> None:
    print(f"llama-server: {message}", file=sys.stderr, flush=True)


def fetch_source(version: str, into: Path) -> Path:
    """Downloads (or takes from pip's cache) the sdist and unpacks it; its vendored llama.cpp."""
    say(f"fetching the llama-cpp-python {version} source distribution")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--progress-bar",
            "off",
            "--no-binary",
            ":all:",
            "--no-deps",
            "-d",
            str(into),
            f"llama-cpp-python=={version}",
        ],
        check=True,
        stdout=sys.stderr,
    )
    (sdist,) = into.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        archive.extractall(into / "src", filter="data")
    (tree,) = (into / "src").iterdir()
    return tree / "vendor" / "llama.cpp"


def build() -> Path:
    """Builds llama-server from the pinned version's vendored llama.cpp into the cache."""
    version = engine_version()
    target = cache_dir(version)
    with tempfile.TemporaryDirectory(prefix="arbiterd-llama-server.") as tmp:
        source = fetch_source(version, Path(tmp))
        build_dir = Path(tmp) / "build"
        say(f"configuring ({' '.join(cmake_flags())})")
        subprocess.run(
            ["cmake", "-S", str(source), "-B", str(build_dir), *cmake_flags()],
            check=True,
            stdout=sys.stderr,
        )
        say(f"building the llama-server target with {BUILD_JOBS} jobs (~15 min on 2 cores)")
        # cmake's own "[ NN%] Building ..." lines are the progress.
        subprocess.run(
            [
                "cmake",
                "--build",
                str(build_dir),
                "--target",
                "llama-server",
                "-j",
                str(BUILD_JOBS),
            ],
            check=True,
            stdout=sys.stderr,
        )
        target.mkdir(parents=True, exist_ok=True)
        # Copied under a temporary name and renamed: a cached binary is always a whole one.
        partial = target / "llama-server.partial"
        shutil.copy2(build_dir / "bin" / "llama-server", partial)
        partial.rename(target / "llama-server")
    say(f"built {target / 'llama-server'}")
    return target / "llama-server"


def ensure() -> Path:
    """The cached llama-server, built first when it is not there."""
    return cached_binary() or build()


@contextmanager
def serve(args: list[str], folder: Path) -> Iterator[str]:
    """llama-server with `args` on a free loopback port, once /health answers 200: its /v1 URL.
    It runs in a process group of its own (the router's model servers are its children), which
    is ended with it; its output goes to folder/llama-server.log."""
    port = free_port()
    log = folder / "llama-server.log"
    # The router looks for models in llama.cpp's download cache too: an empty one here.
    env = {**os.environ, "LLAMA_CACHE": str(folder / "llama-cache")}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*args, "--host", "127.0.0.1", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not healthy(port):
            try:
                # The wait between two polls, which also notices a server that exited.
                code = process.wait(timeout=READY_POLL_S)
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"llama-server not ready in {READY_TIMEOUT_S} s") from None
            else:
                raise RuntimeError(f"llama-server exited {code}:\n{log.read_text()[-3000:]}")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--print-path",
        action="store_true",
        help="print the cached binary's path, or exit 1 when it is not built (builds nothing)",
    )
    args = parser.parse_args(argv)
    if args.print_path:
        binary = cached_binary()
        if binary is None:
            say(f"not built yet ({cache_dir(engine_version())})")
            return 1
        print(binary)
        return 0
    print(ensure())
    return 0


if __name__ == "__main__":
    sys.exit(main())
