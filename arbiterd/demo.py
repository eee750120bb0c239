"""The demo: several programs share one GPU token through a private arena, and we watch them.

Owns nothing but its temporary arena; every program is a real `arbiterd run` process, and what
is printed comes from the same observer as `arbiterd arena status`.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from arbiterd.arena import Arena
from arbiterd.procs import holder_name

JOBS = (("game", 1.2), ("comfyui", 0.8), ("blender", 0.6))
WATCH_INTERVAL_S = 0.1


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="arbiterd-demo-") as tmp:
        arena = Arena(Path(tmp) / "arena")
        print(f"arena: {arena.path}")
        jobs = []
        for name, seconds in JOBS:
            jobs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "arbiterd",
                        "run",
                        "--arena",
                        str(arena.path),
                        "--name",
                        name,
                        "--",
                        sys.executable,
                        "-c",
                        f"import time; time.sleep({seconds})",
                    ],
                    stderr=subprocess.DEVNULL,
                )
            )
            time.sleep(0.2)  # staggered starts, so the turns are easy to follow
        last = None
        started = time.monotonic()
        while any(job.poll() is None for job in jobs):
            state = arena.observe()
            line = f"holder {holder_name(state) or '-':8} waiting {len(state.waiter_pids)}"
            if line != last:
                print(f"{time.monotonic() - started:6.2f} s  {line}")
                last = line
            time.sleep(WATCH_INTERVAL_S)
        codes = [job.wait() for job in jobs]
        print(
            f"all jobs done, exit statuses {codes}; the token is free: "
            f"{arena.observe().holder_pid is None}"
        )
        return 0 if codes == [0] * len(jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
