"""The decision on a silent holder (issues 24, 40): a pure function of what was heard, whether the
worker holds a token, and a clock."""

from __future__ import annotations

import pytest

from arbiterd.daemon.models.liveness import (
    STATUS_ANSWER_S,
    Heard,
    Verdict,
    holds_token,
    judge,
    kill_reason,
    silent_s,
    stale,
)
from arbiterd.reply import WorkerStatus
from arbiterd.states import ResidencyState

T = 30.0  # holder_timeout_s
START = 1000.0


def answered(at: float, beat_age_s: float = 0.0, heard: Heard | None = None) -> Heard:
    """A worker that answered status at `at`, its engine's beat `beat_age_s` old then."""
    before = heard or Heard.started(START)
    status = WorkerStatus(state=ResidencyState.WARM, beat_age_s=beat_age_s)
    return before.answered(status, at)


PID = 4242


def verdict(heard: Heard, now: float, *, holds: bool = True) -> Verdict:
    return judge(heard, holds=holds, now=now, timeout_s=T)


def test_a_worker_that_answers_with_a_fresh_beat_is_live_however_long_since_it_was_asked() -> None:
    heard = answered(START + 5)
    # The daemon itself stalled for minutes before asking again: not the worker's silence.
    assert verdict(heard, START + 500) is Verdict.LIVE
    assert silent_s(heard, START + 500) == 0.0


def test_a_stopped_worker_is_reported_at_the_timeout_and_killed_at_twice_it() -> None:
    heard = answered(START + 5).asked(START + 10)  # then it stopped answering
    assert verdict(heard, START + 10 + T - 0.1) is Verdict.LIVE
    assert verdict(heard, START + 10 + T) is Verdict.SILENT
    assert silent_s(heard, START + 10 + T) == T  # counted from the question, not the answer
    assert verdict(heard, START + 10 + 2 * T - 0.1) is Verdict.SILENT
    assert verdict(heard, START + 10 + 2 * T) is Verdict.KILL


def test_a_hung_engine_whose_io_thread_still_answers_is_judged_by_its_beat_age() -> None:
    heard = answered(START + 10, beat_age_s=5.0)
    assert verdict(heard, START + 10) is Verdict.LIVE
    heard = answered(START + 40, beat_age_s=T + 1, heard=heard)  # the same beat, older
    assert verdict(heard, START + 40) is Verdict.SILENT
    assert silent_s(heard, START + 40) == pytest.approx(T + 1)
    heard = answered(START + 70, beat_age_s=2 * T + 1, heard=heard)
    assert verdict(heard, START + 70) is Verdict.KILL


def test_an_event_or_a_chunk_is_a_beat() -> None:
    # Asked while loading (one long native call, no beats): its answer says a beat 20 s old.
    heard = answered(START + 20, beat_age_s=20.0)
    heard = heard.asked(START + 25)
    # It goes warm: the residency event, sent by the engine thread, is a sign of life.
    heard = heard.beat(START + 26)
    assert silent_s(heard, START + 26) == 0.0
    # The question asked before that event is still open: silence counts from the event.
    assert silent_s(heard, START + 26 + T) == T
    assert verdict(heard, START + 26 + T) is Verdict.SILENT


def test_a_beat_never_goes_back_in_time() -> None:
    heard = Heard.started(START).beat(START + 10)
    assert heard.beat(START + 5).beat_at == START + 10
    assert answered(START + 11, beat_age_s=9.0, heard=heard).beat_at == START + 10


@pytest.mark.parametrize(
    "state", [ResidencyState.WARM, ResidencyState.WARMING, ResidencyState.COOLING]
)
def test_a_worker_warm_or_in_a_handoff_holds_its_token_whoever_the_kernel_names(
    state: ResidencyState,
) -> None:
    # It takes the token before it leaves cold and lets go of it only once cold again.
    assert holds_token(state, pid=PID, holders=())
    assert holds_token(state, pid=PID, holders={PID + 1})


def test_a_loading_worker_holds_a_token_once_the_kernel_says_it_took_one() -> None:
    assert not holds_token(ResidencyState.LOADING, pid=PID, holders=())  # waiting in line
    assert not holds_token(ResidencyState.LOADING, pid=PID, holders={PID + 1})
    assert holds_token(ResidencyState.LOADING, pid=PID, holders={PID + 1, PID})


@pytest.mark.parametrize(
    "state", [ResidencyState.COLD, ResidencyState.FAILED, ResidencyState.STOPPED, None]
)
def test_a_worker_cold_failed_or_unknown_holds_nothing(state: ResidencyState | None) -> None:
    assert not holds_token(state, pid=PID, holders={PID})


@pytest.mark.parametrize(
    "state",
    [ResidencyState.LOADING, ResidencyState.WARMING, ResidencyState.COOLING, ResidencyState.WARM],
)
def test_a_holder_in_a_handoff_is_reported_then_killed_like_a_warm_one(
    state: ResidencyState,
) -> None:
    heard = answered(START + 5).asked(START + 10)  # then it stopped answering
    holds = holds_token(state, pid=PID, holders={PID})
    assert verdict(heard, START + 10 + T - 0.1, holds=holds) is Verdict.LIVE
    assert verdict(heard, START + 10 + T, holds=holds) is Verdict.SILENT
    assert verdict(heard, START + 10 + 2 * T, holds=holds) is Verdict.KILL


def test_a_worker_that_holds_no_token_is_never_judged() -> None:
    heard = answered(START + 5).asked(START + 10)  # silent for ever after
    # A waiter stopped in line: the queue passes over it (arena/); a cold one holds nothing.
    assert verdict(heard, START + 10 * T, holds=False) is Verdict.LIVE


@pytest.mark.parametrize("age", [None, "old", True, float("nan"), float("inf"), -3.0])
def test_an_answer_without_a_beat_age_it_can_use_is_itself_the_sign_of_life(age: object) -> None:
    said = WorkerStatus.from_json({"beat_age_s": age})  # as the daemon reads the wire
    heard = Heard.started(START).answered(said, START + 50)
    assert silent_s(heard, START + 50) == 0.0
    assert heard.answered_at == START + 50
    assert heard.asked_at is None


def test_a_question_left_unanswered_for_a_second_makes_the_status_stale() -> None:
    heard = answered(START + 1).asked(START + 2)
    assert not stale(heard, START + 2 + STATUS_ANSWER_S - 0.01)
    assert stale(heard, START + 2 + STATUS_ANSWER_S)
    assert not stale(answered(START + 4, heard=heard), START + 100)  # answered: fresh again
    said = WorkerStatus(state=ResidencyState.WARM, beat_age_s=0.0)
    assert heard.status == said  # what it said last, kept


def test_the_kill_reason_names_the_silence_and_the_setting() -> None:
    assert kill_reason(61.04, 30.0, ResidencyState.WARM) == (
        "killed: it held the GPU and showed no sign of life for 61.0 s "
        "(twice [daemon] holder_timeout_s = 30 s)"
    )


def test_the_kill_reason_names_the_handoff_that_hung() -> None:
    assert kill_reason(61.04, 30.0, ResidencyState.COOLING) == (
        "killed: it held the GPU and showed no sign of life for 61.0 s while cooling "
        "(twice [daemon] holder_timeout_s = 30 s)"
    )
