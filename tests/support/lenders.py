"""`arbiterd rpc-server --lend` for tests and benchmarks (issue 46): a lender serving this
machine's CPU with folders of its own, as another machine's would be (its arenas under its own
folder, its key in a file), started on 127.0.0.1 or, with `netns`, inside a network namespace
the caller made (benchmarks.lease shapes its link)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arbiterd.arena import Arena
from arbiterd.errors import DeviceUnreachableError
from arbiterd.native import rpc
from tests.support.daemon import Daemon, free_port, serving, tiny

START_S = 60.0  # the engine loads in each server process before it listens


def write_key(path: Path, text: str = "a shared secret") -> Path:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


@dataclass
class Lender:
    folder: Path
    rpc: str
    lease: str
    key_file: Path
    timeout_s: float = 3.0  # --lease-timeout
    cache: Path | None = None  # --cache: ggml's tensor cache, kept across clients
    netns: str | None = None  # run inside this network namespace (`ip netns exec`)
    clients: int = 2
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def device(self) -> str:
        return f"rpc:{self.rpc}"

    @property
    def env(self) -> dict[str, str]:
        """The lender machine's: its own arenas, and the CPU as the device lent."""
        return {
            **os.environ,
            "ARBITERD_ARENA": str(self.folder / "arena" / "gpu0"),
            "GGML_VK_VISIBLE_DEVICES": "",
        }

    @property
    def log(self) -> Path:
        return self.folder / "lender.log"

    def start(self) -> None:
        command = [
            *(sys.executable, "-m", "arbiterd", "rpc-server", "--lend", "--device", "cpu"),
            *("--listen", self.rpc, "--lease", self.lease, "--clients", str(self.clients)),
            *("--key-file", str(self.key_file), "--lease-timeout", str(self.timeout_s)),
        ]
        if self.cache is not None:
            command += ["--cache", str(self.cache)]
        if self.netns is not None:
            command = ["ip", "netns", "exec", self.netns, *command, "--allow-remote"]
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=self.env
            )
        deadline = time.monotonic() + START_S
        for endpoint in (self.lease, self.rpc):
            while True:
                try:
                    rpc.check_listening(endpoint, timeout_s=1.0)
                    break
                except DeviceUnreachableError:
                    assert self.process.poll() is None, self.log.read_text()
                    assert time.monotonic() < deadline, self.log.read_text()
                    time.sleep(0.1)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)

    def holder(self) -> str | None:
        """Who holds the lender's lent device, by its arena's holder.json."""
        state = Arena(self.folder / "arena" / "cpu").observe()
        return state.holder.name if state.holder else None

    def serving_bytes(self) -> int:
        """The resident anonymous memory of the lender's server processes: what the lent
        device holds for its borrower (the CPU's "VRAM")."""
        total = 0
        for pid in self._server_pids():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except FileNotFoundError:
                continue
            for line in status.splitlines():
                if line.startswith("RssAnon:"):
                    total += int(line.split()[1]) * 1024
        return total

    def _server_pids(self) -> list[str]:
        """The front's server processes (children of any of its threads; under `ip netns
        exec`, the front is that command's child)."""
        assert self.process is not None
        fronts = [str(self.process.pid)]
        if self.netns is not None:
            fronts = _children(str(self.process.pid)) or fronts
        return [pid for front in fronts for pid in _children(front)]

    def run(self, *command: str) -> subprocess.Popen[bytes]:
        """`arbiterd run --device cpu -- COMMAND` on the lender: a program of its own."""
        return subprocess.Popen(
            [sys.executable, "-m", "arbiterd", "run", "--device", "cpu", "--", *command],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )


def _children(pid: str) -> list[str]:
    found: list[str] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return found
    for task in tasks:
        try:
            found += (task / "children").read_text().split()
        except FileNotFoundError:
            continue
    return found


def start_lender(folder: Path, key_file: Path, host: str = "127.0.0.1", **options: Any) -> Lender:
    """A lender in `folder` (made now), on two free ports of `host`, once both listen;
    `options` are Lender's (timeout_s, cache, netns, clients)."""
    lender = Lender(folder, f"{host}:{free_port()}", f"{host}:{free_port()}", key_file, **options)
    folder.mkdir(mode=0o700)
    lender.start()
    return lender


@contextmanager
def borrowing(
    lender: Lender,
    model: Path,
    *,
    key_file: Path | None = None,
    uploads: str = "bytes",
    local: bool = False,
) -> Iterator[Daemon]:
    """A borrower daemon whose model "lent" (`model`, in place) is on the lender's device, on
    its lease (`key_file`: another key than the lender's; `uploads`: its device table's); with
    `local`, the same model on the daemon's own CPU too, as "local"."""
    on: dict[str, Any] = {"n_gpu_layers": -1, "residency": "in-place"}
    models = {"lent": tiny(model, n_ctx=512, devices=[lender.device], **on)}
    if local:
        models["local"] = tiny(model, n_ctx=512)
    pasted = (
        f'\n[devices."{lender.device}"]\nlease = "{lender.lease}"\n'
        f'lease_key_file = "{key_file or lender.key_file}"\nuploads = "{uploads}"\n'
    )
    with serving(models, daemon_keys={"rpc_servers": [lender.rpc]}, pasted=pasted) as daemon:
        yield daemon
