"""A GPU lent over RPC and taken back (issue 46), as two machines: the lender is `arbiterd
rpc-server --lend` serving its CPU, with an arena folder of its own (its machine's), and the
borrower a daemon with folders of its own whose model lives on the lent device. Loopback only.

- granted: the borrower's model serves, the lender's arena names whom it is lent to;
- revoked by a program of the lender (`arbiterd run` on the lender's arena): the model releases
  in place, the lender's server processes are gone before the program runs, a request meanwhile
  waits, and once the program ends it is served with the same greedy text, its prompt not
  evaluated again (the KV kept on the borrower's host);
- revoked during a decode: the model releases at a step while its answer streams, and the answer
  ends as it would have;
- a lender with a cache (`uploads = "hashes"`): a re-grant sends hashes, not the weights;
- a lender killed: the request fails naming the device, and the model serves again once the
  lender is back;
- a borrower killed: its lease times out, the lender's program gets the GPU;
- a wrong key: refused, said on both sides, nothing served.
"""

from __future__ import annotations

import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.daemon import Daemon, arbiterd_cli, openai_client
from tests.support.lenders import Lender, borrowing, start_lender, write_key
from tests.support.waiting import wait_until

LEASE_TIMEOUT_S = 3.0
START_S = 60.0
WITHIN_S = 30.0
PROMPT = "the quick brown fox"
LONG_TOKENS = 200  # longer than a turn: a waiter ends it mid-decode (docs/scheduling.md)


@pytest.fixture
def lender(tmp_path: Path) -> Iterator[Lender]:
    lent = start_lender(
        tmp_path / "lender", write_key(tmp_path / "lease.key"), timeout_s=LEASE_TIMEOUT_S
    )
    try:
        yield lent
    finally:
        lent.stop()


def ask(api: openai.OpenAI) -> tuple[str, int]:
    """The greedy answer, and how many of its prompt's tokens were evaluated (not cached)."""
    done = api.completions.create(model="lent", prompt=PROMPT, max_tokens=8, temperature=0)
    usage = done.usage
    assert usage is not None
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens if details else None) or 0
    return done.choices[0].text, usage.prompt_tokens - cached


def lease_of(daemon: Daemon) -> dict[str, Any]:
    with daemon.client() as client:
        leases: list[dict[str, Any]] = client.call("status")["leases"]
    assert len(leases) == 1, leases
    return leases[0]


def test_a_program_of_the_lender_takes_its_gpu_back_and_the_borrower_resumes_as_it_was(
    lender: Lender, gemma_model: Path
) -> None:
    with borrowing(lender, gemma_model) as daemon, openai_client(daemon, 120) as api:
        first, _ = ask(api)
        assert lease_of(daemon)["state"] == "granted"
        assert lender.holder() == f"lent to {socket.gethostname()} (lent)"
        # As the lender's own status and tray read its arena: whom its GPU is lent to.
        arena = arbiterd_cli("arena", "status", "--arena", str(lender.folder / "arena" / "cpu"))
        assert f"lent to {socket.gethostname()} (lent)" in arena, arena
        said = arbiterd_cli("status", "--socket", str(daemon.socket))
        assert f"lease of {lender.device}: granted by {lender.lease}" in said, said
        warm_bytes = lender.serving_bytes()
        assert warm_bytes > 50 << 20  # gemma's weights, on the lent device
        marker = lender.folder / "ran"
        program = lender.run(
            sys.executable, "-c", f"open({str(marker)!r}, 'w'); import time; time.sleep(4)"
        )
        wait_until(marker.exists, WITHIN_S, "the lender's program runs")
        # It runs only once the borrower let go: the lender's server processes are gone.
        assert lender.serving_bytes() < warm_bytes * 0.1
        lease = lease_of(daemon)
        assert lease["state"] == "revoked", lease
        assert f"(pid {program.pid})" in (lease["by"] or ""), lease  # `arbiterd run`
        with daemon.client() as client:
            devices = client.call("devices")["devices"]
        shown = next(d for d in devices if d["id"] == lender.device)
        assert shown["lease"].startswith("revoked: the lender's"), shown
        # A request meanwhile waits for the lease, and is served once the program ended.
        started = time.monotonic()
        again, evaluated = ask(api)
        assert program.wait(WITHIN_S) == 0
        assert time.monotonic() - started > 1.0
        assert again == first
        assert evaluated <= 1  # the prompt's KV kept on the borrower: its last token only
        assert lease_of(daemon)["state"] == "granted"
        with daemon.client() as client:
            kinds = [
                e.get("state")
                for e in client.call("events", limit=200)["events"]
                if e.get("event") == "lease"
            ]
        assert "revoked" in kinds, kinds
        assert kinds[-1] == "granted", kinds


def test_a_lender_killed_fails_the_request_naming_the_device_until_it_is_back(
    lender: Lender, gemma_model: Path
) -> None:
    with borrowing(lender, gemma_model) as daemon, openai_client(daemon, 120) as api:
        first, _ = ask(api)
        lender.kill()
        started = time.monotonic()
        with pytest.raises(openai.APIError) as failed:
            ask(api)
        assert time.monotonic() - started < WITHIN_S
        assert lender.rpc in str(failed.value) or "RPC" in str(failed.value), failed.value
        wait_until(
            lambda: lease_of(daemon)["state"] == "unreachable", WITHIN_S, "the lease unreachable"
        )
        lender.start()
        wait_until(lambda: lease_of(daemon)["state"] != "unreachable", WITHIN_S, "leased again")
        deadline = time.monotonic() + 90
        while True:
            try:
                back, _ = ask(api)
                break
            except openai.APIError:
                assert time.monotonic() < deadline, "the model did not come back"
                time.sleep(1)
        assert back == first


def test_a_borrower_killed_loses_its_lease_and_the_lender_gets_its_gpu(
    lender: Lender, gemma_model: Path
) -> None:
    with borrowing(lender, gemma_model) as daemon, openai_client(daemon, 120) as api:
        ask(api)
        assert lender.holder() is not None
        daemon.process.send_signal(signal.SIGKILL)
        daemon.process.wait(10)
        wait_until(lambda: lender.holder() is None, LEASE_TIMEOUT_S + WITHIN_S, "the lease ended")
        program = lender.run("true")
        assert program.wait(WITHIN_S) == 0
        assert "ended" in lender.log.read_text()


def test_a_wrong_key_is_refused_on_both_sides_and_nothing_is_lent(
    lender: Lender, gemma_model: Path, tmp_path: Path
) -> None:
    wrong = write_key(tmp_path / "wrong.key", "not the secret")
    with borrowing(lender, gemma_model, key_file=wrong) as daemon, openai_client(daemon) as api:
        wait_until(lambda: lease_of(daemon)["state"] == "refused", WITHIN_S, "refused")
        assert lease_of(daemon)["reason"] == "wrong key: no lease"
        assert "refused a lease to 127.0.0.1: wrong key" in lender.log.read_text()
        with pytest.raises(openai.APIError):
            ask(api)
        assert lender.holder() is None


def received_bytes(daemon: Daemon) -> int:
    """What the lender's front has taken from this borrower, by a beat after now."""
    time.sleep(2.5)  # the lender beats every second
    return int(lease_of(daemon)["received_bytes"] or 0)


def test_a_lender_with_a_cache_is_sent_hashes_for_the_weights_it_has(
    lender: Lender, gemma_model: Path, tmp_path: Path
) -> None:
    lender.stop()
    lender.cache = tmp_path / "tensor-cache"
    lender.start()
    with (
        borrowing(lender, gemma_model, uploads="hashes") as daemon,
        openai_client(daemon, 120) as api,
    ):
        first, _ = ask(api)
        sent = []
        for _ in range(2):  # the first re-grant teaches the cache the restore's pieces
            before = received_bytes(daemon)
            program = lender.run("true")
            assert program.wait(WITHIN_S) == 0
            again, evaluated = ask(api)
            assert (again, evaluated) == (first, 1)
            sent.append(received_bytes(daemon) - before)
        weights = gemma_model.stat().st_size
        # The second sends the KV and the weights' hashes: none of the weights' bytes.
        assert sent[1] < 0.1 * weights, sent
        assert sent[0] > 0.5 * weights, sent  # the embedding's pieces, once


def test_a_revoke_during_a_decode_releases_at_a_step_and_the_answer_ends_as_it_would_have(
    lender: Lender, gemma_model: Path
) -> None:
    with borrowing(lender, gemma_model) as daemon, openai_client(daemon, 300) as api:
        whole = (
            api.completions.create(
                model="lent", prompt=PROMPT, max_tokens=LONG_TOKENS, temperature=0
            )
            .choices[0]
            .text
        )
        stream = api.completions.create(
            model="lent", prompt=PROMPT, max_tokens=LONG_TOKENS, temperature=0, stream=True
        )
        pieces: list[str] = []
        program, asked_at = None, 0.0
        for chunk in stream:
            pieces.append(chunk.choices[0].text if chunk.choices else "")
            if program is None and len(pieces) == 4:  # mid-decode
                asked_at = time.time()
                program = lender.run("sleep", "1")
        ended_at = time.time()
        assert program is not None
        assert program.wait(WITHIN_S) == 0
        assert "".join(pieces) == whole  # it went on from the step it paused at
        with daemon.client() as client:
            events = client.call("events", limit=200)["events"]
        # The model released while its answer was still streaming, for the lender's program.
        released = [
            e["at"]
            for e in events
            if e.get("event") == "residency"
            and e.get("to") == "cold"
            and asked_at < e["at"] < ended_at
        ]
        assert released, events[-10:]
