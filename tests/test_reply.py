"""The worker's replies as records (arbiterd/reply.py): one definition read and written by the
field codec (arbiterd/fields.py): the daemon reads fields, and a worker's odd line never raises."""

from __future__ import annotations

from arbiterd.events import RequestEvent
from arbiterd.footprint import DeviceFootprint, ModelFootprint
from arbiterd.reply import EngineReport, ModelInfoReport, WorkerResult, WorkerStatus
from arbiterd.states import BackendKind, RequestStatus, ResidencyState
from arbiterd.status import Turn


def test_a_result_reads_back_as_it_was_written_with_its_response_kept_whole() -> None:
    response = {"object": "text_completion", "choices": [{"text": "fox", "index": 0}]}
    result = WorkerResult(
        response=response,
        duration_s=0.25,
        prompt_tokens=5,
        prompt_tokens_evaluated=2,
        completion_tokens=3,
    )
    assert WorkerResult.from_json(result.to_json()) == result
    assert result.to_json()["response"] == response


def test_a_result_makes_the_one_request_event_of_its_request() -> None:
    ok = WorkerResult(duration_s=1.5, prompt_tokens=4, completion_tokens=2)
    assert ok.event(model="m", request_id="r1") == RequestEvent(
        model="m",
        request_id="r1",
        duration_s=1.5,
        prompt_tokens=4,
        prompt_tokens_evaluated=0,
        completion_tokens=2,
        status=RequestStatus.OK,
    )
    stopped = WorkerResult(cancelled=True).event(model="m", request_id="r2")
    assert (stopped.status, stopped.cancelled) == (RequestStatus.CANCELLED, True)


def test_a_status_reads_back_as_it_was_written() -> None:
    measured = (DeviceFootprint("gpu0", weights_bytes=10, kv_bytes=2),)
    status = WorkerStatus(
        model="m",
        pid=42,
        state=ResidencyState.WARM,
        holds_token=True,
        queue=1,
        current="r1",
        running=("r1",),
        sequences=1,
        tokens_per_s=12.5,
        turn=Turn(quantum_s=2.0, handoff_s=0.5, handoff_measured=True, served=3),
        resident_bytes=12,
        footprint=ModelFootprint.of(measured, measured),
        capabilities=("chat", "completion"),
        model_info=ModelInfoReport("llama", 2048, ""),
        backend=BackendKind.IN_PLACE,
        engine=EngineReport(True, ("CUDA0: test gpu",)),
        beat_age_s=0.01,
    )
    assert WorkerStatus.from_json(status.to_json()) == status
    assert not status.idle


def test_an_odd_status_reads_as_what_it_has_right_and_never_raises() -> None:
    odd = WorkerStatus.from_json(
        {"state": "dancing", "pid": "42", "queue": True, "model_info": [], "response": 3}
    )
    assert odd.state is ResidencyState.UNKNOWN
    assert (odd.pid, odd.queue, odd.model_info) == (None, None, None)
    assert WorkerStatus.from_json({}) == WorkerStatus()
    assert WorkerStatus().idle
    assert WorkerResult.from_json({"response": "not an object"}).response == {}
