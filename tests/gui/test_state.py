"""What the tray derives from statuses and events, without Qt: holder, warnings, history, replay."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from arbiterd import render
from arbiterd.errors import ReplayError
from arbiterd.events import Event, HandoffEvent, WaitEvent, parse_event
from arbiterd.gui import palette
from arbiterd.gui.replay import apply_replay, load_replay
from arbiterd.gui.state import WARNING_HOLD_S, TrayState
from arbiterd.offload import CpuNote, cpu_note
from arbiterd.states import CpuCause, Priority
from arbiterd.status import DaemonStatus, GroupStatus, HostRam, PromptCache
from tests.gui.conftest import SAMPLE_REPLAY
from tests.gui.fakes import GiB, MiB, model, status

T = 1_718_000_000.0


def handoff_json(at: float, source: str, target: str, **fields: Any) -> dict[str, Any]:
    """A handoff as an older daemon sent it (it inferred handoffs; no waited_from)."""
    return {
        "event": "handoff",
        "at": at,
        "from": source,
        "to": target,
        "release_s": 0.4,
        "wait_s": 0.1,
        "restore_s": 0.9,
        **fields,
    }


def handoff(at: float, source: str, target: str, **fields: Any) -> Event:
    return parse_event(handoff_json(at, source, target, **fields))


def residency(at: float, name: str, source: str, target: str, **fields: Any) -> Event:
    return parse_event(
        {"event": "residency", "at": at, "model": name, "from": source, "to": target, **fields}
    )


def request(at: float, name: str, evaluated: int) -> Event:
    return parse_event(
        {
            "event": "request",
            "at": at,
            "model": name,
            "prompt_tokens": 900,
            "prompt_tokens_evaluated": evaluated,
            "status": "ok",
        }
    )


def event(**fields: Any) -> Event:
    return parse_event(fields)


# -- status ------------------------------------------------------------------------------------


def test_a_status_with_missing_or_odd_keys_still_reads() -> None:
    read = DaemonStatus.from_json(
        {"models": [{"name": "a", "resident_bytes": "lots"}, 7], "holder": 3}
    )
    assert [m.name for m in read.models] == ["a"]
    assert read.models[0].resident_bytes == 0
    assert read.models[0].state == "unknown"
    assert read.holder is None
    assert read.total_bytes is None


def test_devices_and_others_from_telemetry_are_used_when_present() -> None:
    read = DaemonStatus.from_json(
        status(
            model("a", "warm", resident_bytes=2 * GiB),
            holder="a",
            devices=[{"device": "gpu0", "used_bytes": 5 * GiB, "total_bytes": 8 * GiB}],
            others=[{"name": "firefox", "pid": 9, "used_bytes": 1 * GiB, "device": "gpu0"}],
        )
    )
    assert read.total_bytes == 8 * GiB
    assert read.used_bytes == 5 * GiB
    # The device counts 3 GiB that are not the model's: the listed 1 GiB and 2 GiB unnamed.
    assert read.others_bytes == 3 * GiB
    assert read.holder_model == "a"


def test_host_ram_is_read_per_model_and_in_all_and_none_when_not_said() -> None:
    read = DaemonStatus.from_json(
        status(model("a", host_ram_bytes=GiB), model("b"), host_ram_bytes=GiB + 5)
    )
    assert [m.host_ram_bytes for m in read.models] == [GiB, None]
    assert read.host_ram_bytes == GiB + 5
    older = DaemonStatus.from_json(
        {"models": [{"name": "a", "host_ram_bytes": "lots"}]}
    )  # no key, odd key
    assert (older.models[0].host_ram_bytes, older.host_ram_bytes) == (None, None)


def test_without_devices_the_models_own_count_is_the_vram_in_use() -> None:
    read = DaemonStatus.from_json(status(model("a", "warm", resident_bytes=GiB), model("b")))
    assert read.used_bytes == GiB
    assert read.total_bytes is None


# -- the tray state ------------------------------------------------------------------------------


def test_the_holder_colour_is_the_models_grey_for_others_free_when_none() -> None:
    state = TrayState()
    state.apply_status(status(model("b"), model("a", "warm"), holder="a"), T)
    assert state.holder_colour() == palette.model_colours(["b", "a"]).of("a")
    state.apply_status(status(model("a", "cold"), holder="steam"), T + 1)
    assert state.holder_colour() == palette.OTHER
    state.apply_status(status(model("a", "cold")), T + 2)
    assert state.holder_colour() == palette.FREE


def test_an_unreachable_daemon_is_red_whatever_it_said_before() -> None:
    state = TrayState()
    state.apply_status(status(model("a", "warm"), holder="a"), T)
    state.set_unreachable("arbiterd is not running")
    look = state.icon_look(T)
    assert look.unreachable
    assert look.frame == palette.RED
    assert "daemon not running" in state.tooltip(T)


def test_a_restarting_worker_is_a_warning_while_it_lasts() -> None:
    state = TrayState()
    state.apply_status(status(model("a", "restarting", last_error="worker exited")), T)
    assert state.icon_look(T).frame == palette.AMBER
    assert state.warnings(T) == ["a is restarting: worker exited"]
    state.apply_status(status(model("a", "cold")), T + 1)
    assert state.icon_look(T + 1).frame == palette.FREE


def test_vram_not_freed_warns_until_the_model_is_warm_again() -> None:
    state = TrayState()
    state.apply_status(status(model("a", "cold"), model("b", "warm"), holder="b"), T)
    state.apply_event(event(event="vram_not_freed", at=T, model="a", bytes_after=GiB))
    assert state.icon_look(T + 1).warning
    assert "a released the GPU but 1.0 GiB are still in use" in state.tooltip(T + 1)
    state.apply_event(residency(T + 2, "a", "warming", "warm"))
    assert not state.icon_look(T + 3).warning


def test_a_silent_holder_is_amber_while_the_status_says_so_and_its_event_notifies() -> None:
    state = TrayState()
    state.apply_status(status(model("a", "warm", silent_s=31.0, stale_s=30.5), holder="a"), T)
    look = state.icon_look(T)
    assert look.frame == palette.AMBER
    assert state.warnings(T) == ["a holds the GPU and has shown no sign of life for 31 s"]
    state.apply_status(status(model("a", "warm", silent_s=None, stale_s=None), holder="a"), T + 1)
    assert not state.icon_look(T + 1).warning  # it answers again
    state.apply_event(event(event="holder_silent", at=T + 2, model="a", silent_s=60, killed=True))
    assert state.icon_look(T + 3).warning
    assert "GPU holder killed: a holds the GPU" in state.tooltip(T + 3)
    state.apply_event(residency(T + 9, "a", "loading", "warm"))  # restarted and serving
    assert not state.icon_look(T + 10).warning


def test_a_warning_from_an_event_expires() -> None:
    state = TrayState()
    state.apply_status(status(model("a", "warm"), holder="a"), T)
    state.apply_event(event(event="worker", at=T, model="b", code=-9, reason="killed"))
    assert state.icon_look(T + 1).warning
    assert not state.icon_look(T + WARNING_HOLD_S + 1).warning


def test_the_tooltip_names_holder_vram_and_waiters() -> None:
    state = TrayState()
    state.apply_status(
        status(
            model("a", "warm", resident_bytes=3 * GiB),
            model("b"),
            holder="a",
            waiters=[{"pid": 7, "name": "b"}],
            devices=[{"device": "gpu0", "used_bytes": 4 * GiB, "total_bytes": 8 * GiB}],
        ),
        T,
    )
    assert state.tooltip(T).splitlines() == [
        "arbiterd — GPU: a",
        "VRAM: 4.0 GiB / 8.0 GiB",
        "waiting: b (pid 7)",
    ]
    assert state.fill(T) == pytest.approx(0.5)


def test_the_tooltip_names_the_host_ram_when_the_daemon_says_it() -> None:
    state = TrayState()
    state.apply_status(status(model("a", "warm"), holder="a", host_ram_bytes=5 * GiB), T)
    assert state.tooltip(T).splitlines() == [
        "arbiterd — GPU: a",
        "memory: 0 B (models' own count)",  # no engine or device said: not called VRAM
        "host RAM: 5.0 GiB",
        "waiting: nobody",
    ]


# -- history -------------------------------------------------------------------------------------


def test_a_handoff_shows_what_its_model_measured_and_the_tokens_of_the_next_request() -> None:
    state = TrayState()
    measured = HandoffEvent(
        at=T,
        from_model="a",
        to_model="b",
        holder_pid=4242,
        waited_from=T - 2,
        wait_s=0.6,
        release_s=0.4,
        restore_s=0.9,
        restored_bytes=GiB + 5,
    )
    state.apply_event(measured)
    state.apply_event(request(T + 3, "a", 700))  # another model's request does not count
    state.apply_event(request(T + 4, "b", 12))
    state.apply_event(request(T + 9, "b", 300))  # only the first request after the handoff
    (record,) = state.history.handoffs
    assert (record.from_model, record.to_model, record.title) == ("a", "b", "a → b")
    assert record.bytes_ == GiB + 5
    assert record.tokens_evaluated == 12
    assert record.total_s == pytest.approx(1.5)  # the release lies within the wait
    assert record.started_at == T - 2


def test_a_handoff_from_an_older_daemon_adds_up_its_parts_and_has_no_bytes() -> None:
    state = TrayState()
    state.apply_event(residency(T - 0.01, "b", "warming", "warm", weights_bytes=GiB))
    state.apply_event(handoff(T, "a", "b"))
    (record,) = state.history.handoffs
    assert record.bytes_ is None  # no longer matched to a residency event by its time
    assert record.total_s == pytest.approx(1.4)
    assert record.started_at == pytest.approx(T - 1.4)


def test_no_handoff_is_inferred_from_a_release_and_a_warm_up() -> None:
    state = TrayState()
    state.apply_event(residency(T, "a", "cooling", "cold", reason="wanted", duration_s=0.4))
    state.apply_event(residency(T + 1, "b", "warming", "warm", weights_bytes=GiB))
    assert state.history.handoffs == []
    assert [dict(s.models) for s in state.history.samples] == [{"a": 0}, {"a": 0, "b": GiB}]


def test_a_wait_behind_another_program_is_not_a_handoff_between_models() -> None:
    state = TrayState()
    state.apply_event(
        WaitEvent(
            at=T, model="b", holder_pid=9, holder_name="steam", waited_from=T - 30, wait_s=29.5
        )
    )
    state.apply_event(request(T + 2, "b", 40))
    (record,) = state.history.handoffs
    assert (record.from_model, record.to_model) == (None, "b")
    assert record.title == "b waited behind steam (pid 9)"
    assert (record.wait_s, record.release_s, record.restore_s) == (29.5, None, None)
    assert (record.total_s, record.started_at) == (29.5, T - 30)
    assert record.tokens_evaluated == 40


def test_an_event_seen_in_the_journal_and_live_counts_once() -> None:
    state = TrayState()
    assert state.apply_event(handoff(T, "a", "b"))
    assert not state.apply_event(handoff(T, "a", "b"))
    assert state.apply_event(handoff(T, "a", "b", wait_s=0.2))  # another one at the same time
    assert len(state.history.handoffs) == 2


def test_residency_events_move_the_bytes_between_snapshots() -> None:
    state = TrayState()
    state.apply_event(residency(T, "a", "loading", "warm", weights_bytes=2 * GiB))
    state.apply_event(residency(T + 10, "a", "cooling", "cold", weights_bytes=2 * GiB))
    samples = state.history.visible(T + 20)
    assert [dict(s.models)["a"] for s in samples] == [2 * GiB, 0]


def test_residency_events_book_what_the_worker_holds_not_what_moved() -> None:
    # Issue 40: a CPU model's restore moved 877 B, and the timeline drew it at that while warm.
    state = TrayState()
    state.apply_event(residency(T, "a", "warming", "warm", kv_bytes=877, resident_bytes=300 * MiB))
    state.apply_event(residency(T + 10, "a", "cooling", "cold", resident_bytes=64 * MiB))
    state.apply_event(residency(T + 20, "a", "cold", "stopped", resident_bytes=64 * MiB))
    samples = state.history.visible(T + 30)
    assert [dict(s.models)["a"] for s in samples] == [300 * MiB, 64 * MiB, 0]


def test_history_keeps_the_window_and_the_sample_before_it() -> None:
    state = TrayState(window_s=60)
    for second in range(0, 200, 10):
        state.apply_status(status(model("a", "warm", resident_bytes=second)), T + second)
    state.history.trim(T + 195)  # the window starts at 135: the sample at 130 covers it
    assert [s.at - T for s in state.history.samples][:2] == [130, 140]


def test_hold_spans_come_from_events_and_statuses() -> None:
    state = TrayState()
    state.apply_event(event(event="hold", at=T, held=True))
    state.apply_event(event(event="hold", at=T + 30, held=False))
    state.apply_status(status(model("a"), hold=True), T + 40)
    spans = [(s.start - T, None if s.end is None else s.end - T) for s in state.history.holds]
    assert spans == [(0, 30), (40, None)]


# -- replay ----------------------------------------------------------------------------------------


def test_the_sample_replay_ends_with_a_holder_and_handoffs() -> None:
    state = TrayState()
    now = apply_replay(state, load_replay(SAMPLE_REPLAY))
    assert state.status is not None
    assert state.status.holder_model == "qwen-coder"
    assert len(state.history.handoffs_in_window(now)) >= 4
    assert all(h.tokens_evaluated is not None for h in state.history.handoffs)


def test_a_replay_takes_bare_events_too(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    lines = [
        {"at": T, "status": status(model("a", "warm"), holder="a")},
        handoff_json(T + 1, "b", "a"),
        {"event": handoff_json(T + 2, "a", "b")},
        {},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines[:3]) + "\n\n")
    state = TrayState()
    assert apply_replay(state, load_replay(path)) == T + 2
    assert len(state.history.handoffs) == 2


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("not json\n", "log.jsonl:1: Expecting value"),
        ('{"status": {}}\n', 'log.jsonl:1: a status line needs "at"'),
        ('{"at": 1}\n{"foo": 1}\n', 'log.jsonl:1: a line needs "status" or "event"'),
        ('{"event": {"event": "hold"}}\n', 'an event needs "at"'),
        ("\n", "holds no status and no event"),
    ],
)
def test_a_bad_replay_names_the_file_and_line(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "log.jsonl"
    path.write_text(text)
    with pytest.raises(ReplayError, match=problem.replace("(", r"\(")):
        load_replay(path)


def test_owners_stack_in_the_daemons_order_whatever_came_first() -> None:
    state = TrayState()
    state.apply_event(residency(T, "beta", "loading", "warm", weights_bytes=GiB))
    state.apply_event(residency(T + 1, "gamma", "loading", "warm", weights_bytes=GiB))
    state.apply_status(status(model("alpha"), model("beta")), T + 2)
    assert state.history.models == ["alpha", "beta", "gamma"]


# -- what runs each model (issue 15) -------------------------------------------------------------

CPU_ENGINE = {"offload": False, "devices": ["CPU: test cpu"]}


def note_of(nodes: tuple[str, ...]) -> CpuNote:
    note = cpu_note(nodes, False, None)
    assert note is not None
    return note


NO_GPU = note_of(())
UNUSED_GPU = note_of(("/dev/nvidia0",))


def engine_with(note: CpuNote) -> dict[str, object]:
    return {**CPU_ENGINE, "cpu_cause": str(note.cause), "cpu_note": note.text}


def test_backend_cpu_note_and_engine_are_read_and_absent_from_an_older_daemon() -> None:
    read = DaemonStatus.from_json(
        status(
            model("a", backend="reload", fallback_reason="a stock build"),
            engine=engine_with(UNUSED_GPU),
        )
    )
    a = read.models[0]
    assert (a.backend, a.fallback_reason) == ("reload", "a stock build")
    assert read.engine is not None
    assert (read.engine.offload, read.engine.devices) == (False, ("CPU: test cpu",))
    assert (read.engine.cpu_cause, read.engine.cpu_warning) == (CpuCause.ENGINE, UNUSED_GPU.text)
    older = DaemonStatus.from_json({"models": [{"name": "a", "backend": 3}], "engine": "gpu"})
    assert (older.models[0].backend, older.engine) == (None, None)
    engine = DaemonStatus.from_json(status(engine=CPU_ENGINE)).engine
    assert engine is not None
    assert (engine.cpu_cause, engine.cpu_warning) == (None, "")  # before issue 30


def test_an_unused_gpu_is_in_the_tooltip_once_for_all_and_leaves_the_icon_alone() -> None:
    state = TrayState()
    state.apply_status(
        status(
            model("a", "warm", backend="reload"),
            model("b", backend="reload"),
            holder="a",
            engine=engine_with(UNUSED_GPU),
        ),
        T,
    )
    assert state.notices() == [UNUSED_GPU.text]
    assert state.tooltip(T).splitlines()[-1] == f"⚠ {UNUSED_GPU.text}"
    assert state.engine_text() == "engine: CPU only (this engine cannot offload to a GPU)"
    look = state.icon_look(T)
    assert (look.frame, look.warning) == (state.colours().of("a"), False)


def test_a_machine_without_a_gpu_is_said_on_the_engine_line_and_its_memory_is_ram() -> None:
    state = TrayState()
    state.apply_status(
        status(model("a", "warm", resident_bytes=GiB), holder="a", engine=engine_with(NO_GPU)),
        T,
    )
    assert state.notices() == []  # nothing would help: not a warning
    assert state.engine_text() == f"engine: {NO_GPU.text}"
    assert state.vram_text() == "RAM: 1.0 GiB (models' own count)"
    assert not [line for line in state.tooltip(T).splitlines() if "VRAM" in line or "⚠" in line]


def test_vram_is_said_only_of_a_gpus_memory() -> None:
    def said(**fields: Any) -> str:
        state = TrayState()
        state.apply_status(status(model("a", "warm", resident_bytes=GiB), **fields), T)
        return state.vram_text()

    assert said(engine={"offload": True, "devices": ["CUDA0: x"]}).startswith("VRAM: ")
    assert said(engine=CPU_ENGINE).startswith("RAM: ")
    assert said().startswith("memory: ")  # no worker said, no device read: not known
    device = {"device": "gpu0", "used_bytes": GiB, "total_bytes": 8 * GiB}
    assert said(devices=[device]) == "VRAM: 1.0 GiB / 8.0 GiB"


# -- memory over a day (issue 14) and vision (issue 12) ------------------------------------------

RAG = {"name": "rag", "models": ["qwen", "nomic"], "priority": "normal", "holds_token": True,
       "handoffs": 2, "failure": ""}  # fmt: skip


def encoder(at: float, name: str, request_id: str, action: str, **fields: Any) -> Event:
    return event(event="encoder", at=at, model=name, id=request_id, action=action, **fields)


def unload(at: float, name: str, **fields: Any) -> Event:
    return event(event="unload", at=at, model=name, pid=9, reason="idle", **fields)


def test_budgets_and_groups_are_read_and_an_older_daemon_has_none() -> None:
    read = DaemonStatus.from_json(
        status(
            model("qwen"),
            host_ram={
                "host_copies_bytes": 3 * GiB,
                "host_kv_bytes": GiB,
                "host_weights_bytes": 2 * GiB,
                "budget_bytes": 8 * GiB,
            },
            prompt_cache={"bytes": 12 * MiB, "files": 2, "budget_bytes": 4 * GiB},
            groups=[RAG, {"name": "odd", "models": "qwen", "holds_token": "yes"}, 3],
        )
    )
    assert read.host_ram == HostRam(
        host_copies_bytes=3 * GiB,
        host_kv_bytes=GiB,
        budget_bytes=8 * GiB,
        host_weights_bytes=2 * GiB,
    )
    assert read.prompt_cache == PromptCache(bytes_=12 * MiB, files=2, budget_bytes=4 * GiB)
    assert read.groups == (  # from a daemon before issue 44: no device, budget or members warm
        GroupStatus(
            "rag", ("qwen", "nomic"), Priority.NORMAL, holds_token=True, handoffs=2, failure=""
        ),
        GroupStatus("odd", (), None, holds_token=False, handoffs=0, failure=""),
    )
    older = DaemonStatus.from_json({"models": [], "host_ram": 5, "prompt_cache": None})
    assert (older.host_ram, older.prompt_cache, older.groups) == (None, None, ())


def test_a_group_holding_the_gpu_is_its_members_warm_together() -> None:
    state = TrayState()
    state.apply_status(
        status(
            model("qwen", "warm", resident_bytes=4 * GiB),
            model("nomic", "warm", resident_bytes=GiB),
            model("eye"),
            holder="group rag",
            groups=[RAG],
        ),
        T,
    )
    assert state.status is not None
    assert state.status.holder_model is None  # "group rag" is no model's name
    assert state.holder_text() == "GPU: group rag — qwen, nomic"
    assert state.tooltip(T).splitlines()[0] == "arbiterd — GPU: group rag — qwen, nomic"
    # Our own models hold it, not another program: the first member's colour, not grey.
    assert state.icon_look(T).frame == state.colours().of("qwen")
    qwen, nomic, eye = state.status.models
    assert state.holding_text(qwen) == "holds the GPU with nomic (group rag)"
    assert state.holding_text(nomic) == "holds the GPU with qwen (group rag)"
    assert state.holding_text(eye) is None


def test_a_fitting_set_shows_who_is_warm_together_and_the_room_they_take() -> None:
    state = TrayState()
    fitting = {
        "name": "fitting",
        "models": ["qwen", "nomic", "task"],
        "priority": "normal",
        "holds_token": True,
        "device": "gpu0",
        "fitting": True,
        "budget_bytes": 8 * GiB,
        "warm": ["qwen", "nomic"],
        "used_bytes": 5 * GiB,
        "withdrawals": 1,
        "size_bytes": 12 * GiB,
        "size_source": "nvml",
        "reserve_bytes": GiB,
        "others_bytes": 3 * GiB,
    }
    models = (model("qwen", "warm"), model("nomic", "warm"), model("task"))
    state.apply_status(status(*models, holder="group fitting", groups=[fitting]), T)
    assert state.status is not None
    assert state.holder_text() == "GPU: qwen, nomic warm together (they fit)"
    shown = (
        "gpu0: qwen, nomic warm · 5.0 GiB of 8.0 GiB (12.0 GiB by nvml - 1.0 GiB reserve - "
        "3.0 GiB others)"
    )
    assert state.fitting_texts() == [shown]
    assert shown in state.tooltip(T).splitlines()
    qwen, nomic, task = state.status.models
    assert state.holding_text(qwen) == "holds the GPU with nomic (they fit on gpu0)"
    assert state.holding_text(nomic) == "holds the GPU with qwen (they fit on gpu0)"
    assert state.holding_text(task) is None  # a member, but not warm in it now


def test_a_group_that_does_not_hold_the_gpu_leaves_its_members_alone() -> None:
    state = TrayState()
    idle = {**RAG, "holds_token": False}
    state.apply_status(status(model("qwen"), model("eye", "warm"), holder="eye", groups=[idle]), T)
    assert state.status is not None
    assert state.holder_text() == "GPU: eye"
    assert state.holding_text(state.status.models[0]) is None
    assert state.holding_text(state.status.models[1]) == "holds the GPU"


def test_a_group_whose_keeper_stopped_is_a_warning() -> None:
    state = TrayState()
    stopped = {**RAG, "holds_token": False, "failure": "arena folder gone"}
    state.apply_status(status(model("qwen"), groups=[stopped]), T)
    assert state.warnings(T) == ["group rag: its keeper stopped: arena folder gone"]
    assert state.icon_look(T).warning


def test_host_ram_and_the_prompt_cache_are_shown_against_their_budgets() -> None:
    state = TrayState()
    state.apply_status(
        status(
            model("a", "warm"),
            holder="a",
            host_ram_bytes=5 * GiB,
            host_ram={"host_copies_bytes": 4 * GiB, "host_kv_bytes": GiB, "budget_bytes": 8 * GiB},
            prompt_cache={"bytes": 12 * MiB, "files": 1, "budget_bytes": 4 * GiB},
        ),
        T,
    )
    assert state.tooltip(T).splitlines() == [
        "arbiterd — GPU: a",
        "memory: 0 B (models' own count)",  # no engine or device said: not called VRAM
        "host RAM: 5.0 GiB of 8.0 GiB budget",
        "prompt cache on disk: 12.0 MiB in 1 file of 4.0 GiB budget",
        "waiting: nobody",
    ]
    no_budget = {"host_copies_bytes": 4 * GiB, "host_kv_bytes": 0, "budget_bytes": 0}
    state.apply_status(status(model("a"), host_ram_bytes=4 * GiB, host_ram=no_budget), T + 1)
    assert state.host_ram_text() == "host RAM: 4.0 GiB (no budget)"
    assert state.prompt_cache_text() is None


def test_an_unloaded_model_says_whether_its_prompt_cache_is_on_disk() -> None:
    state = TrayState()
    state.apply_status(status(model("a", "unloaded"), model("b", "cold")), T)
    assert state.status is not None
    a, b = state.status.models
    assert (a.unloaded, b.unloaded) == (True, False)
    assert state.unloaded_text(b) is None  # cold keeps its worker and host copy
    # Loaded on demand and not started yet: nothing was saved, and nothing is claimed.
    assert state.unloaded_text(a) == "unloaded — starts on its next request"
    state.apply_event(unload(T + 1, "a", kv_bytes=12 * MiB, tokens=1310))
    assert state.unloaded_text(a) == "unloaded — prompt cache on disk (1310 tokens, 12.0 MiB)"
    evict = event(event="prompt_cache_evict", at=T + 2, model="b", evicted=["a"],
                  evicted_bytes=12 * MiB, used_bytes=20 * MiB, budget_bytes=24 * MiB)  # fmt: skip
    state.apply_event(evict)
    assert state.unloaded_text(a) == "unloaded — prompt cache evicted for room on disk"
    state.apply_event(unload(T + 3, "a", error="disk full"))  # a later unload: its own fate
    assert state.unloaded_text(a) == "unloaded — prompt cache not kept: disk full"
    state.apply_status(status(model("a", "unloading")), T + 4)
    assert state.status is not None
    assert state.unloaded_text(state.status.models[0]) == "unloading — saving its prompt cache"


def test_an_unload_empties_its_models_vram_between_snapshots() -> None:
    state = TrayState()
    state.apply_event(residency(T, "a", "warming", "warm", weights_bytes=GiB))
    assert state.history.samples[-1].models == (("a", GiB),)
    state.apply_event(unload(T + 5, "a", kv_bytes=MiB, tokens=9))
    assert state.history.samples[-1].models == (("a", 0),)


def test_a_vision_requests_projector_steps_are_one_record() -> None:
    state = TrayState()
    state.apply_event(encoder(T, "eye", "r1", "load", duration_s=0.0023, bytes=155 * 1024))
    state.apply_event(encoder(T + 0.01, "eye", "r1", "encode", duration_s=0.0004, images=1))
    state.apply_event(encoder(T + 0.02, "eye", "r1", "free", duration_s=0.0001))
    [record] = state.history.encoder
    assert record.title == "eye: projector loaded, encoded 1 image, freed"
    assert record.total_s == pytest.approx(0.0028)
    assert record.loaded_bytes == 155 * 1024
    assert state.encoder_text("eye") == (
        "projector loaded in 2.3 ms, encoded 1 image in 0.4 ms, freed in 0.1 ms"
        f" (at {render.clock(T)})"
    )
    assert state.encoder_text("other") is None
    # A resident projector only encodes: its own record, and the card's latest.
    state.apply_event(encoder(T + 60, "eye", "r2", "encode", duration_s=0.0005, images=2))
    assert [r.request_id for r in state.history.encoder] == ["r1", "r2"]
    assert (
        state.encoder_text("eye")
        == f"projector encoded 2 images in 0.5 ms (at {render.clock(T + 60)})"
    )
    # The journal's older record, coming after the live one, does not replace it on the card.
    state.apply_event(encoder(T - 60, "eye", "r0", "encode", duration_s=0.0009, images=1))
    assert [r.request_id for r in state.history.encoder] == ["r0", "r1", "r2"]
    assert state.history.last_encoder["eye"].request_id == "r2"


def test_a_projector_step_the_journal_sends_again_after_the_window_counts_once() -> None:
    state = TrayState(window_s=60)
    steps = [encoder(T + i / 100, "eye", "r1", a, duration_s=0.001) for i, a in enumerate(
        ("load", "encode", "free"))]  # fmt: skip
    for step in steps:
        state.apply_event(step)
    state.history.trim(T + 3600)  # the window forgets them; the card still shows them
    for step in steps:  # a window opens: the journal's last hour comes again
        state.apply_event(step)
    assert [s.action for s in state.history.last_encoder["eye"].steps] == ["load", "encode", "free"]


def test_a_step_aside_says_for_which_program_and_what_it_holds() -> None:
    """Issue 45: the headline names the program the models stepped aside for, with its device
    memory where a reader measures it, whoever holds the token at this instant."""
    state = TrayState()
    aside = {"program": "blender", "pid": 5151, "reason": "named", "used_bytes": 3 * GiB}
    holder = "blender (pid 5151; arbiterd stepped aside)"
    state.apply_status(status(model("qwen"), holder=holder, stepped_aside=aside), T)
    assert state.holder_text() == "stepped aside for blender (3.0 GiB)"
    unmeasured = {**aside, "used_bytes": None}
    state.apply_status(status(model("qwen"), holder=None, stepped_aside=unmeasured), T)
    assert state.holder_text() == "stepped aside for blender"
