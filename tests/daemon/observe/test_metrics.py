"""The daemon's Prometheus figures, as its events and its workers' hellos make them."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from arbiterd.daemon.observe.metrics import Metrics
from arbiterd.events import (
    EncoderEvent,
    HandoffEvent,
    HoldEvent,
    RequestEvent,
    ResidencyEvent,
    StepAsideEvent,
    WorkerEvent,
)
from arbiterd.states import RequestStatus, ResidencyState

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(metrics: Metrics) -> Samples:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(metrics.text().decode())
        for sample in family.samples
    }


def test_a_model_has_its_series_at_zero_before_its_first_event() -> None:
    metrics = Metrics()
    metrics.add_model("m", ("gpu0",))
    figures = samples(metrics)
    assert figures[("arbiterd_model_resident", (("model", "m"),))] == 0
    assert figures[("arbiterd_prompt_tokens_evaluated_total", (("model", "m"),))] == 0


def devices_of(metrics: Metrics, model: str) -> set[str]:
    return {
        dict(labels)["device"]
        for (name, labels), value in samples(metrics).items()
        if name == "arbiterd_model_device" and dict(labels)["model"] == model and value == 1
    }


def test_each_model_names_its_devices_by_id_and_a_new_placement_replaces_the_old() -> None:
    metrics = Metrics()
    metrics.add_model("split", ("rpc:127.0.0.1:50052", "rpc:127.0.0.1:50053"))
    metrics.add_model("m", ("gpu0",))
    assert devices_of(metrics, "split") == {"rpc:127.0.0.1:50052", "rpc:127.0.0.1:50053"}
    metrics.add_model("split", ("gpu0", "rpc:127.0.0.1:50053"))  # configured again
    assert devices_of(metrics, "split") == {"gpu0", "rpc:127.0.0.1:50053"}
    assert devices_of(metrics, "m") == {"gpu0"}


def test_residency_sets_the_resident_gauge_by_the_state_it_reaches() -> None:
    metrics = Metrics()
    metrics.observe(
        ResidencyEvent(model="m", from_state=ResidencyState.WARMING, to_state=ResidencyState.WARM)
    )
    assert samples(metrics)[("arbiterd_model_resident", (("model", "m"),))] == 1
    metrics.observe(
        ResidencyEvent(model="m", from_state=ResidencyState.COOLING, to_state=ResidencyState.COLD)
    )
    assert samples(metrics)[("arbiterd_model_resident", (("model", "m"),))] == 0


def test_requests_count_by_outcome_and_only_evaluated_prompt_tokens_add_up() -> None:
    metrics = Metrics()
    metrics.observe(
        RequestEvent(
            model="m", status=RequestStatus.OK, prompt_tokens_evaluated=40, completion_tokens=7
        )
    )
    metrics.observe(
        RequestEvent(model="m", cancelled=True, prompt_tokens_evaluated=2, completion_tokens=3)
    )
    metrics.observe(RequestEvent(model="m", status=RequestStatus.ERROR))
    figures = samples(metrics)
    for status in ("ok", "cancelled", "error"):
        assert figures[("arbiterd_requests_total", (("model", "m"), ("status", status)))] == 1
    assert figures[("arbiterd_prompt_tokens_evaluated_total", (("model", "m"),))] == 42
    assert figures[("arbiterd_completion_tokens_total", (("model", "m"),))] == 10


def test_a_projector_counts_its_loads_and_times_each_step() -> None:
    metrics = Metrics()
    for action, took in (("load", 0.002), ("encode", 0.0004), ("free", 0.00005)):
        metrics.observe(EncoderEvent(model="eye", action=action, duration_s=took, bytes_=9))
    figures = samples(metrics)
    assert figures[("arbiterd_encoder_loads_total", (("model", "eye"),))] == 1
    for action in ("load", "encode", "free"):
        labels = (("action", action), ("model", "eye"))
        assert figures[("arbiterd_encoder_seconds_count", labels)] == 1
    encode = (("action", "encode"), ("model", "eye"))
    assert figures[("arbiterd_encoder_seconds_sum", encode)] == 0.0004


def test_a_handoff_is_counted_with_its_measured_total() -> None:
    metrics = Metrics()
    handoff = HandoffEvent(
        from_model="a", to_model="b", waited_from=100.0, wait_s=0.2, release_s=0.15, restore_s=0.3
    )
    metrics.observe(handoff)
    figures = samples(metrics)
    assert figures[("arbiterd_handoffs_total", ())] == 1
    # wait + restore: the release happened within the wait, so it is not added again
    assert figures[("arbiterd_handoff_seconds_sum", ())] == handoff.total_s == 0.5
    assert figures[("arbiterd_handoff_seconds_bucket", (("le", "0.5"),))] == 1


def test_only_a_worker_that_restarts_counts_as_a_restart() -> None:
    metrics = Metrics()
    metrics.observe(WorkerEvent(model="m", code=-9, reason="killed", restart_in_s=1.0))
    metrics.observe(WorkerEvent(model="m", reason="could not start: bad config"))
    metrics.observe(HoldEvent(held=True))  # not a figure of any kind
    assert samples(metrics)[("arbiterd_worker_restarts_total", (("model", "m"),))] == 1


def test_a_models_backend_series_follows_its_latest_worker() -> None:
    metrics = Metrics()
    metrics.set_backend("m", "reload")
    metrics.set_backend("m", "in-place")
    backends = {
        labels: value
        for (name, labels), value in samples(metrics).items()
        if name == "arbiterd_backend"
    }
    assert backends == {(("backend", "in-place"), ("model", "m")): 1}


def test_each_release_counts_the_requests_its_turn_served() -> None:
    metrics = Metrics()
    for served in (6, 1):
        metrics.observe(
            ResidencyEvent(
                model="m",
                from_state=ResidencyState.COOLING,
                to_state=ResidencyState.COLD,
                reason="wanted",
                turn_served=served,
            )
        )
    figures = samples(metrics)
    assert figures[("arbiterd_turn_requests_count", (("model", "m"),))] == 2
    assert figures[("arbiterd_turn_requests_sum", (("model", "m"),))] == 7
    assert figures[("arbiterd_turn_requests_bucket", (("le", "4.0"), ("model", "m")))] == 1


def test_stepping_aside_sets_the_gauge_and_counts_each_program_stepped_aside_for() -> None:
    metrics = Metrics()
    assert samples(metrics)[("arbiterd_stepped_aside", ())] == 0
    metrics.observe(StepAsideEvent(aside=True, program="blender", pid=10))
    assert samples(metrics)[("arbiterd_stepped_aside", ())] == 1
    # Handed from one program to the next: it stays stepped aside, and counts both.
    metrics.observe(StepAsideEvent(aside=False, program="blender", pid=10, why="it exited"))
    metrics.observe(StepAsideEvent(aside=True, program="fakegame", pid=11))
    figures = samples(metrics)
    assert figures[("arbiterd_stepped_aside", ())] == 1
    assert figures[("arbiterd_steps_aside_total", ())] == 2
    metrics.observe(StepAsideEvent(aside=False, program="fakegame", pid=11, why="it exited"))
    assert samples(metrics)[("arbiterd_stepped_aside", ())] == 0
