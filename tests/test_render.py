"""Human output: figures, processes, the engine, one line per event, and failure notices."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest

from arbiterd import render
from arbiterd.events import (
    KINDS,
    EncoderEvent,
    Event,
    HandoffEvent,
    OtherEvent,
    WaitEvent,
    parse_event,
)
from arbiterd.states import ReleaseReason
from tests.test_events import SAMPLES

AT = 1_718_020_803.12  # a time with milliseconds that binary floats cannot hold exactly
GiB = 1 << 30


@pytest.mark.parametrize(
    ("count", "said"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.5 KiB"),
        (300 << 20, "300.0 MiB"),
        (3 * GiB, "3.0 GiB"),
        (2048 * GiB, "2048.0 GiB"),
        (-1536, "-1.5 KiB"),
    ],
)
def test_bytes_in_binary_units(count: int, said: str) -> None:
    assert render.format_bytes(count) == said


def test_seconds_and_how_long_ago() -> None:
    assert render.format_seconds(0.4213) == "0.42 s"
    assert render.format_seconds(None) == "—"
    assert [render.format_ago(s) for s in (12, 300, 9000)] == [
        "12 s ago",
        "5 min ago",
        "2.5 h ago",
    ]


def test_clock_rounds_to_the_millisecond_once() -> None:
    assert render.clock_ms(AT) == time.strftime("%H:%M:%S", time.localtime(int(AT))) + ".120"


@pytest.mark.parametrize(
    ("name", "pid", "said"),
    [("steam", 9, "steam (pid 9)"), (None, 9, "pid 9"), ("", 9, "pid 9"), ("x", None, "x")],
)
def test_a_process_by_name_and_pid(name: str | None, pid: int | None, said: str) -> None:
    assert render.process(name, pid) == said


def test_the_waiters_line() -> None:
    assert render.waiters_line([]) == "waiting: nobody"
    assert render.waiters_line([("beta", 77), (None, 78)]) == "waiting: beta (pid 77), pid 78"


@pytest.mark.parametrize(
    ("offload", "devices", "said"),
    [
        (False, ["CPU: x"], "CPU only (this engine cannot offload to a GPU)"),
        (True, ["CPU: x", "CUDA0: a", "CUDA1: b"], "CUDA0: a, CUDA1: b (GPU offload)"),
        (True, [], "GPU offload"),
    ],
)
def test_the_engine_in_a_few_words(offload: bool, devices: list[str], said: str) -> None:
    assert render.describe_engine(offload, devices) == said


def test_the_same_text_for_several_names_is_said_once() -> None:
    pairs = [("a", "slow"), ("b", ""), ("c", "slow"), ("d", "odd")]
    assert render.grouped(pairs) == [(["a", "c"], "slow"), (["d"], "odd")]


# -- one line per event ------------------------------------------------------------------------


def line(body: dict[str, Any]) -> str:
    """event_line's line without its local-time prefix, after checking that prefix."""
    text = render.event_line(parse_event({"at": AT, **body}))
    stamp = time.strftime("%H:%M:%S", time.localtime(int(AT))) + ".120  "
    assert text.startswith(stamp)
    return text.removeprefix(stamp)


def test_a_handoff_line_from_an_older_and_a_measuring_daemon() -> None:
    old = {
        "event": "handoff",
        "from": "gemma",
        "to": "tiny",
        "release_s": 0.11,
        "wait_s": 0.02,
        "restore_s": 0.92,
    }
    assert line(old) == "handoff   gemma → tiny  release 0.11 s  wait 0.02 s  restore 0.92 s"
    measured = {
        **old,
        "release_s": None,
        "holder_pid": 42,
        "waited_from": AT - 1,
        "restored_bytes": GiB,
    }
    assert line(measured) == "handoff   gemma → tiny  wait 0.02 s  restore 0.92 s  restored 1.0 GiB"
    assert line({"event": "handoff", "from": None, "to": "tiny", "restore_s": 1.5}) == (
        "handoff   — → tiny  restore 1.50 s"
    )


def test_a_handoff_or_wait_names_its_devices_unless_they_are_the_one_gpu() -> None:
    split = {"event": "handoff", "from": "a", "to": "b", "restore_s": 0.5,
             "devices": ["rpc:127.0.0.1:50052", "rpc:127.0.0.1:50053"]}  # fmt: skip
    assert line(split) == (
        "handoff   a → b  restore 0.50 s  on rpc:127.0.0.1:50052 + rpc:127.0.0.1:50053"
    )
    assert line({**split, "devices": ["gpu0"]}) == "handoff   a → b  restore 0.50 s"
    wait = {"event": "wait", "model": "b", "holder_name": "game", "devices": ["gpu1"]}
    assert line(wait) == "wait      b waited behind game  on gpu1"


def test_a_wait_behind_another_program_is_not_a_handoff() -> None:
    body = {"event": "wait", "model": "tiny", "holder_pid": 777, "holder_name": "steam",
            "waited_from": AT - 30, "wait_s": 29.5}  # fmt: skip
    assert line(body) == "wait      tiny waited behind steam (pid 777)  wait 29.50 s"
    assert line({"event": "wait", "model": "tiny", "holder_name": "render"}) == (
        "wait      tiny waited behind render"
    )


def test_a_residency_line() -> None:
    body = {
        "event": "residency",
        "model": "gemma",
        "from": "warm",
        "to": "cooling",
        "duration_s": 12.5,
        "weights_bytes": 300 * 2**20,
        "kv_bytes": 12 * 2**20,
        "disk_read_bytes": 0,
        "reason": "wanted",
    }
    assert line(body) == (
        "residency gemma warm → cooling (wanted)  warm for 12.50 s  weights 300.0 MiB  kv 12.0 MiB"
    )
    body.update({"from": "cold", "to": "warming", "reason": "", "disk_read_bytes": 3 * 2**30})
    assert line(body) == (
        "residency gemma cold → warming  cold for 12.50 s  weights 300.0 MiB  kv 12.0 MiB"
        "  read 3.0 GiB"
    )


def test_a_request_line() -> None:
    body = {
        "event": "request",
        "model": "gemma",
        "id": "cmpl-1",
        "duration_s": 0.531,
        "prompt_tokens": 212,
        "prompt_tokens_evaluated": 12,
        "completion_tokens": 40,
        "cancelled": False,
        "status": "ok",
    }
    assert line(body) == "request   gemma 212 tokens (12 evaluated), 40 generated 0.53 s ok  cmpl-1"
    body.update({"status": None, "cancelled": True, "id": None})
    assert line(body).endswith("0.53 s cancelled")
    failed = {"event": "request", "model": "gemma", "id": "r2", "status": "error", "error": "busy"}
    assert line(failed) == "request   gemma error: busy  r2"


def test_a_worker_line() -> None:
    body = {
        "event": "worker",
        "model": "gemma",
        "pid": 4242,
        "code": -9,
        "reason": "out of memory",
        "restart_in_s": 1.0,
    }
    assert line(body) == (
        "worker    gemma pid 4242 exited code -9 (SIGKILL): out of memory, restarting in 1.0 s"
    )
    assert line({"event": "worker", "model": "gemma", "pid": 4243, "code": None}) == (
        "worker    gemma pid 4243 started"
    )
    assert line({"event": "worker", "model": "gemma", "code": 3}) == "worker    gemma exited code 3"
    crashed = {**body, "code": -6, "reason": "killed by signal 6"}
    crashed["last_words"] = ["ggml_vulkan: device lost", "corrupted double-linked list"]
    assert line(crashed) == (
        "worker    gemma pid 4242 exited code -6 (SIGABRT): killed by signal 6, restarting in"
        " 1.0 s; its last words: corrupted double-linked list"
    )


def test_unload_lines_say_what_was_kept() -> None:
    kept = {"event": "unload", "model": "a", "reason": "idle", "kv_bytes": 3 << 20, "tokens": 9}
    assert line(kept) == "unload    a unloaded (idle), 9 tokens of prompt cache kept (3.0 MiB)"
    failed = {"event": "unload", "model": "a", "reason": "command", "error": "disk full"}
    assert line(failed) == "unload    a unloaded (command): disk full"


def test_budget_lines_say_who_goes_and_the_numbers() -> None:
    over = {"event": "host_ram_budget", "used_bytes": 9 * GiB, "budget_bytes": 8 * GiB,
            "unload": ["a", "b"], "after_bytes": 7 * GiB}  # fmt: skip
    assert line(over) == (
        "host_ram_budget host RAM 9.0 GiB over its budget 8.0 GiB: unloading a, b (then 7.0 GiB)"
    )
    evicted = {"event": "prompt_cache_evict", "model": "a", "evicted": ["b", "c"],
               "evicted_bytes": 3 << 20, "used_bytes": 5 << 20,
               "budget_bytes": 8 << 20}  # fmt: skip
    assert line(evicted) == (
        "prompt_cache_evict prompt cache of b, c removed (3.0 MiB) to keep a's: 5.0 MiB on disk"
        " of 8.0 MiB"
    )


def test_encoder_lines_say_what_the_projector_did() -> None:
    load = {"event": "encoder", "model": "eye", "action": "load", "duration_s": 0.0023,
            "bytes": 159072}  # fmt: skip
    assert line(load) == "encoder   eye: projector loaded in 2.3 ms (155.3 KiB)"
    encode = {"event": "encoder", "model": "eye", "action": "encode", "duration_s": 0.0004,
              "bytes": 1024, "images": 1}  # fmt: skip
    assert line(encode) == "encoder   eye: projector encoded 1 image in 0.4 ms (1.0 KiB)"


def test_encoder_lines_say_which_path_ran_and_its_peak() -> None:
    release = {"event": "encoder", "model": "eye", "action": "release", "duration_s": 0.0002,
               "bytes": 558336, "path": "swap", "peak_bytes": 6728960}  # fmt: skip
    assert line(release) == (
        "encoder   eye: weights released for the projector in 0.2 ms (545.2 KiB), swap,"
        " peak 6.4 MiB"
    )
    load = {"event": "encoder", "model": "eye", "action": "load", "duration_s": 0.0023,
            "bytes": 159072, "path": "swap", "peak_bytes": 6728960,
            "reason": "it did not fit"}  # fmt: skip
    assert line(load) == (
        "encoder   eye: projector loaded in 2.3 ms (155.3 KiB), swap, peak 6.4 MiB: it did not fit"
    )
    restore = {"event": "encoder", "model": "eye", "action": "restore", "duration_s": 0.0011,
               "bytes": 558336, "path": "swap", "peak_bytes": 6728960}  # fmt: skip
    assert line(restore) == (
        "encoder   eye: weights restored after it in 1.1 ms (545.2 KiB), swap, peak 6.4 MiB"
    )


def test_a_requests_projector_steps_read_as_one_phrase() -> None:
    steps = [
        EncoderEvent(model="eye", action="load", duration_s=0.0023, bytes_=159072),
        EncoderEvent(model="eye", action="encode", duration_s=0.0004, images=2),
        EncoderEvent(model="eye", action="free", duration_s=None),
    ]
    assert render.encoder_steps(steps) == (
        "projector loaded in 2.3 ms, encoded 2 images in 0.4 ms, freed in —"
    )
    assert render.encoder_steps(steps, timed=False) == "projector loaded, encoded 2 images, freed"
    assert render.encoder_steps([]) == "projector —"


def test_hold_reload_and_vram_lines() -> None:
    assert line({"event": "hold", "held": True}) == "hold      GPU held by the user"
    assert line({"event": "hold", "held": False}) == "hold      GPU given back by the user"
    reload = {"event": "reload", "added": ["a", "b"], "removed": [], "warnings": ["a: slow"]}
    assert line(reload) == "reload    added a, b  warning: a: slow"
    assert line({"event": "reload"}) == "reload    nothing changed"
    realiased = {"event": "reload", "changed": ["a"], "aliases_changed": ["a", "b"]}
    assert line(realiased) == "reload    changed a  aliases changed a, b"
    not_freed = {"event": "vram_not_freed", "model": "gemma", "pid": 9, "device": "gpu0",
                 "bytes_after": GiB, "expected_bytes": 64 << 20, "waited_s": 2}  # fmt: skip
    assert line(not_freed) == (
        "vram_not_freed gemma pid 9 still holds 1.0 GiB on gpu0 2.00 s after its release"
        " (cold footprint 64.0 MiB)"
    )
    vram = {"event": "vram", "devices": [{"device": "gpu0", "used_bytes": GiB,
            "total_bytes": 8 * GiB}], "models": {"gemma": GiB, "tiny": None}}  # fmt: skip
    assert line(vram) == "vram      gpu0 1.0 GiB used of 8.0 GiB  gemma 1.0 GiB  tiny —"


def test_a_silent_holder_is_said_reported_then_killed() -> None:
    silent = {"event": "holder_silent", "model": "gemma", "pid": 9, "silent_s": 30.5,
              "timeout_s": 30}  # fmt: skip
    assert line(silent) == (
        "holder_silent gemma pid 9 holds the GPU, no sign of life for 30.50 s"
        " (holder_timeout_s 30.00 s): reported"
    )
    assert line({**silent, "silent_s": 60.25, "killed": True}).endswith(
        "60.25 s (holder_timeout_s 30.00 s): killed"
    )
    assert render.stale(3.4) == "stale: no answer for 3 s"


def test_a_waiter_passed_over_is_said_with_why() -> None:
    stopped = {"event": "passed_over", "model": "tiny", "pid": 9, "reason": "stopped",
               "free_s": 0.0, "arena": "/run/a"}  # fmt: skip
    assert line(stopped) == (
        "passed_over tiny went before pid 9, ahead of it in the queue: stopped; it keeps its place"
    )
    hung = {**stopped, "reason": "not_taking", "free_s": 1.5}
    assert line(hung).endswith(": left the free GPU untaken for 1.50 s; it keeps its place")


def test_an_unknown_kind_shows_its_fields() -> None:
    body = {"event": "thermal", "devices": ["gpu0", "gpu1"], "hot": True, "seq": 7}
    assert line(body) == 'thermal   devices=["gpu0", "gpu1"] hot=true'


def test_a_malformed_body_still_gives_a_line() -> None:
    body = {"event": "request", "model": ["not", "a", "name"], "prompt_tokens": "many"}
    assert line(body) == "request   —"


def test_an_event_without_a_time_says_so() -> None:
    assert render.event_line(OtherEvent(name="x")) == "--:--:--.---  x"


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: e.kind)
def test_every_known_kind_has_its_own_words(event: Event) -> None:
    # The generic key=value form is for kinds this arbiterd does not know.
    assert "=" not in render.event_detail(event)
    assert event.kind in KINDS


def test_handoffs_and_waits_as_the_tray_titles_and_labels_them() -> None:
    handoff = HandoffEvent(from_model="a", to_model="b", wait_s=0.5, restore_s=0.9)
    wait = WaitEvent(model="b", holder_name="steam", holder_pid=9, wait_s=3.2)
    assert render.handoff_title(handoff) == "a → b"
    paused = dataclasses.replace(handoff, release_reason=ReleaseReason.PREEMPTED)
    assert render.handoff_title(paused) == "a → b (a paused)"
    assert render.handoff_title(wait) == "b waited behind steam (pid 9)"
    assert render.handoff_label(handoff) == "→ b 1.40 s"
    assert render.handoff_label(wait) == "→ b 3.20 s after steam"
    assert render.handoff_label(WaitEvent(model="b", holder_pid=9)) == "→ b 0.00 s after pid 9"


# -- failures worth a notification -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("event", "summary", "body"),
    [
        (
            {"event": "vram_not_freed", "model": "a", "bytes_after": GiB, "device": "gpu0"},
            "VRAM not freed",
            "a released the GPU but 1.0 GiB are still in use on gpu0",
        ),
        (
            {"event": "vram_not_freed"},
            "VRAM not freed",
            "a model released the GPU but its memory is still in use",
        ),
        (
            {"event": "residency", "model": "a", "to": "failed", "reason": "no file"},
            "Model failed",
            "a failed: no file",
        ),
        (
            {"event": "worker", "model": "a", "code": 1, "reason": "exited", "restart_in_s": 2},
            "Worker crashed",
            "a: exited; restarting in 2 s",
        ),
        (
            {"event": "worker", "model": "a", "code": None, "reason": "no such file"},
            "Worker failed to start",
            "a: no such file",
        ),
        (
            {"event": "holder_silent", "model": "a", "silent_s": 31.2, "killed": False},
            "GPU holder not answering",
            "a holds the GPU and has shown no sign of life for 31 s; killed if it stays silent",
        ),
        (
            {"event": "holder_silent", "model": "a", "silent_s": 60.4, "killed": True},
            "GPU holder killed",
            "a holds the GPU and has shown no sign of life for 60 s: killed, so the GPU moves"
            " on; it restarts",
        ),
    ],
)
def test_failures_worth_a_notification(event: dict[str, Any], summary: str, body: str) -> None:
    assert render.failure(parse_event(event)) == (summary, body)


@pytest.mark.parametrize(
    "event",
    [
        {"event": "residency", "model": "a", "to": "cold"},
        {"event": "handoff", "from": "a", "to": "b"},
        {"event": "wait", "model": "a", "holder_name": "steam", "wait_s": 600},
        {"event": "hold", "held": True},
        {"event": "unload", "model": "a", "reason": "idle"},
        {"event": "request", "model": "a", "status": "error"},
    ],
)
def test_ordinary_events_are_not_failures(event: dict[str, Any]) -> None:
    assert render.failure(parse_event(event)) is None
