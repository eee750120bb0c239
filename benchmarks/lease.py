"""A GPU lent over RPC and taken back (issue 46), in one run: a lender (`arbiterd rpc-server
--lend`, serving this machine's CPU, with arenas of its own as another machine's) and a borrower
daemon whose model (gemma-3-270m) lives on the lent device.

Each round, the model warm, a program of the lender (`arbiterd run --device cpu` on the
lender's arena) asks for its GPU, and the benchmark measures:
- revoke to freed: from the program's start to the lender's server processes holding under a
  tenth of what they held warm (their resident anonymous memory: the CPU device's "VRAM"), and
  to the program running (it runs only once the lease is returned);
- the re-grant: a request sent while the program runs waits, and is served once it has ended:
  its greedy text against the warm one's, its prompt tokens evaluated (the KV kept on the
  borrower's host), and its latency from the program's end (the restore over RPC);
- the bytes the borrower sent the lender for that restore (the lender's front counts them, and
  says so in its beats), against the weights' bytes.
Twice: the lender without a tensor cache (every restore sends the bytes) and with ggml's
`--cache` and the borrower's `uploads = "hashes"`: the weights are offered by hash first (from
64 KiB up, the residency patch's ggml-rpc.cpp), and the lender's cache learns them at the first
load and the first restore, so a later restore sends hashes for what it has. The KV a restore
uploads is counted apart (its residency event's `kv_bytes`): it is no part of the weights.

Then the link: with `--shape`, the lender runs in a network namespace this benchmark makes,
behind a veth pair shaped with tc's token bucket (tbf) to 1 Gbit/s and 100 Mbit/s, and the lent
model's decode speed is measured on each against the same model on the borrower's own CPU, in
the same run.
It needs root (CAP_NET_ADMIN); without it the section says why it did not run.

    python -m benchmarks.lease [--model GGUF] [--rounds 5] [--shape] [--out F]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai

from benchmarks.common import ratio, report, summary
from tests.support.daemon import Daemon, openai_client
from tests.support.lenders import borrowing, start_lender, write_key

PROMPT = "the quick brown fox jumps over the lazy dog while the cat"
FREED_SHARE = 0.1  # freed: the servers hold under this share of what they held warm
BEAT_WAIT_S = 2.5  # the lender beats every second: a figure this old is the current one
DECODE_TOKENS = 64
DECODE_REPEATS = 3  # this 2-core machine's drift is larger than one answer's spread
SHAPES = ("1gbit", "100mbit")
# A token bucket must hold at least a timer tick's worth of the rate (rate / HZ, 250 here).
BURSTS = {"1gbit": "1mb", "100mbit": "256kb"}


def ask(api: openai.OpenAI, model: str = "lent", max_tokens: int = 8) -> tuple[str, int, float]:
    """The greedy text, the prompt tokens evaluated (not cached), and the seconds it took."""
    started = time.perf_counter()
    done = api.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
    took = time.perf_counter() - started
    usage = done.usage
    assert usage is not None
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens if details else None) or 0
    return done.choices[0].text, usage.prompt_tokens - cached, took


def received_bytes(daemon: Daemon) -> int:
    """What the lender's front has taken from the borrower so far, as its last beat said."""
    time.sleep(BEAT_WAIT_S)
    with daemon.client() as client:
        leases = client.call("status")["leases"]
    return int(leases[0]["received_bytes"] or 0)


def restored_kv_bytes(daemon: Daemon) -> int:
    """The KV bytes the lent model's last restore uploaded (its residency event's): part of
    what a restore sends, and no part of the weights."""
    with daemon.client() as client:
        events = client.call("events", limit=100)["events"]
    warmed = [
        e
        for e in events
        if e.get("event") == "residency" and e.get("to") == "warm" and e.get("model") == "lent"
    ]
    return int(warmed[-1].get("kv_bytes") or 0) if warmed else 0


def revoke_rounds(folder: Path, model: Path, rounds: int, cache: bool) -> dict[str, Any]:
    lender = start_lender(
        folder / ("lender-cached" if cache else "lender"),
        write_key(folder / "lease.key"),
        cache=folder / "tensor-cache" if cache else None,
    )
    freed_s, program_s, restore_s, sent, kv, evaluated, same = [], [], [], [], [], [], []
    try:
        uploads = "hashes" if cache else "bytes"
        with (
            borrowing(lender, model, uploads=uploads) as daemon,
            openai_client(daemon, 600) as api,
        ):
            warm_text, _, _ = ask(api)
            for _ in range(rounds):
                warm = lender.serving_bytes()
                before = received_bytes(daemon)
                marker = folder / "ran"
                marker.unlink(missing_ok=True)
                started = time.monotonic()
                program = lender.run(
                    sys.executable,
                    "-c",
                    f"import time; open({str(marker)!r}, 'w').write(str(time.monotonic())); "
                    "time.sleep(1)",
                )
                while lender.serving_bytes() >= warm * FREED_SHARE:
                    time.sleep(0.005)
                freed_s.append(time.monotonic() - started)
                while not marker.exists() or not marker.read_text():
                    time.sleep(0.005)
                program_s.append(float(marker.read_text()) - started)
                program.wait(60)
                ended = time.monotonic()
                text, tokens, _ = ask(api)
                restore_s.append(time.monotonic() - ended)
                evaluated.append(tokens)
                same.append(text == warm_text)
                sent.append(received_bytes(daemon) - before)
                kv.append(restored_kv_bytes(daemon))
    finally:
        lender.stop()
    weights = model.stat().st_size
    return {
        "cache": cache,
        "revoke_to_freed": summary(freed_s, "s"),
        "revoke_to_program_runs": summary(program_s, "s"),
        "regrant_request_after_program_ends": summary(restore_s, "s"),
        # Each round's: the first of a cached lender sends what its cache has not seen yet.
        "bytes_sent_per_round": sent,
        "kv_bytes_per_round": kv,
        "bytes_sent_less_kv": summary(
            [float(b - k) for b, k in zip(sent, kv, strict=True)], "bytes"
        ),
        "weights_bytes": weights,
        "sent_less_kv_share_of_weights": ratio(
            statistics.median(b - k for b, k in zip(sent, kv, strict=True)), weights
        ),
        "prompt_tokens_evaluated_after_regrant": evaluated,
        "greedy_text_identical": all(same),
    }


@contextlib.contextmanager
def shaped_link(name: str) -> Iterator[tuple[str, str, str]]:
    """A network namespace `name` and a veth pair into it: (host address, namespace address,
    host-side interface). Removed after, with its interfaces."""
    octet = os.getpid() % 200 + 20
    host, inside = f"10.231.{octet}.1", f"10.231.{octet}.2"
    outer, inner = f"vh{os.getpid() % 100000}", f"vn{os.getpid() % 100000}"
    steps = [
        ["ip", "netns", "add", name],
        ["ip", "link", "add", outer, "type", "veth", "peer", "name", inner],
        ["ip", "link", "set", inner, "netns", name],
        ["ip", "addr", "add", f"{host}/24", "dev", outer],
        ["ip", "link", "set", outer, "up"],
        ["ip", "netns", "exec", name, "ip", "addr", "add", f"{inside}/24", "dev", inner],
        ["ip", "netns", "exec", name, "ip", "link", "set", inner, "up"],
        ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
    ]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True, text=True)
        yield host, inside, outer
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def shape(name: str, outer: str, rate: str | None) -> None:
    """Both directions of the veth pair at `rate` (tc's token bucket filter, tbf: this
    machine's kernel has no netem), or unshaped."""
    inner = "vn" + outer[2:]
    for prefix, device in ((), outer), (("ip", "netns", "exec", name), inner):
        subprocess.run(
            [*prefix, "tc", "qdisc", "del", "dev", device, "root"], capture_output=True, check=False
        )
        if rate is not None:
            tbf = ["rate", rate, "burst", BURSTS[rate], "latency", "50ms"]
            subprocess.run(
                [*prefix, "tc", "qdisc", "add", "dev", device, "root", "tbf", *tbf],
                check=True,
                capture_output=True,
                text=True,
            )


def decode_rate(api: openai.OpenAI, model: str) -> float:
    """Generated tokens per second of a greedy DECODE_TOKENS-token answer, the median of
    DECODE_REPEATS (its prompt cached: asked once before)."""
    ask(api, model, DECODE_TOKENS)
    took = [ask(api, model, DECODE_TOKENS)[2] for _ in range(DECODE_REPEATS)]
    return DECODE_TOKENS / statistics.median(took)


def link_section(folder: Path, model: Path) -> dict[str, Any]:
    if os.geteuid() != 0:
        return {"ran": False, "why": "shaping a link needs root (ip netns, tc netem)"}
    name = f"arbiterd-lease-{os.getpid()}"
    try:
        with shaped_link(name) as (_, inside, outer):
            lender = start_lender(
                folder / "lender-shaped", write_key(folder / "lease.key"), inside, netns=name
            )
            try:
                with (
                    borrowing(lender, model, local=True) as daemon,
                    openai_client(daemon, 600) as api,
                ):
                    ask(api)
                    rates: dict[str, Any] = {"unshaped": decode_rate(api, "lent")}
                    for rate in SHAPES:
                        shape(name, outer, rate)
                        rates[rate] = decode_rate(api, "lent")
                    shape(name, outer, None)
                    local = decode_rate(api, "local")
            finally:
                lender.stop()
    except subprocess.CalledProcessError as exc:
        return {"ran": False, "why": f"{' '.join(exc.cmd)}: {exc.stderr.strip()}"}
    return {
        "ran": True,
        "decode_tokens": DECODE_TOKENS,
        "decode_repeats": DECODE_REPEATS,
        "local_tokens_per_s": round(local, 2),
        "lent_tokens_per_s": {k: round(v, 2) for k, v in rates.items()},
        "ratio_to_local": {k: ratio(v, local) for k, v in rates.items()},
        "shaping": "tc tbf rate on both ends of a veth pair (burst 1mb / 256kb, latency 50ms), "
        "no added delay",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a GGUF (default: the demo's gemma-3-270m)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shape", action="store_true", help="also the shaped-link section")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model: Path | None = args.model
    if model is None:
        from arbiterd.config import embedded_model_path  # noqa: PLC0415 (253 MB, on demand)

        model = embedded_model_path()
    with tempfile.TemporaryDirectory(prefix="lease-") as temp:
        folder = Path(temp)
        result: dict[str, Any] = {
            "benchmark": "lease",
            "model": model.name,
            "rounds": args.rounds,
            "bytes": revoke_rounds(folder, model, args.rounds, cache=False),
            "hashes": revoke_rounds(folder, model, args.rounds, cache=True),
        }
        no_cache = result["bytes"]["regrant_request_after_program_ends"]["median_s"]
        cached = result["hashes"]["regrant_request_after_program_ends"]["median_s"]
        result["regrant_cached_over_uncached"] = ratio(cached, no_cache)
        result["link"] = (
            link_section(folder, model) if args.shape else {"ran": False, "why": "no --shape"}
        )
    report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
