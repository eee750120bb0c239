"""The daemon's Prometheus metrics, derived from its events and the workers' hellos.

Owns a private CollectorRegistry (so several daemons in one test process do not collide) and
the meaning of each figure; the event bus feeds it every event published, the supervisor the
backend each worker says it uses and a fresh VRAM reading at each scrape.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from arbiterd.daemon.observe.telemetry import TelemetrySnapshot, VramGauge
from arbiterd.events import (
    EncoderEvent,
    Event,
    HandoffEvent,
    RequestEvent,
    ResidencyEvent,
    StepAsideEvent,
    WorkerEvent,
)
from arbiterd.states import RequestStatus, ResidencyState

# Handoffs on a desktop GPU: from ~1 ms (in place) to tens of seconds (a large reload).
HANDOFF_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# A projector's load, encode or free: ~0.05 ms (a tiny one freed) to seconds (a 1 GB one loaded).
# Requests a turn served before its release (issue 43): 0 (released with nothing run) upward.
TURN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128)
ENCODER_BUCKETS_S = (0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.handoffs = Counter(
            "arbiterd_handoffs", "GPU handoffs between models", registry=self.registry
        )
        self.handoff_seconds = Histogram(
            "arbiterd_handoff_seconds",
            "From the moment a model asked for the GPU held by another to it being warm",
            buckets=HANDOFF_BUCKETS_S,
            registry=self.registry,
        )
        self.turn_requests = Histogram(
            "arbiterd_turn_requests",
            "Requests a model served in the turn each of its releases ended (issue 43)",
            ["model"],
            buckets=TURN_BUCKETS,
            registry=self.registry,
        )
        self.resident = Gauge(
            "arbiterd_model_resident",
            "1 while the model is warm (holds the GPU), else 0",
            ["model"],
            registry=self.registry,
        )
        self.prompt_tokens_evaluated = Counter(
            "arbiterd_prompt_tokens_evaluated",
            "Prompt tokens run through llama_decode (prompt-cache hits excluded)",
            ["model"],
            registry=self.registry,
        )
        self.completion_tokens = Counter(
            "arbiterd_completion_tokens",
            "Tokens generated (its rate: a model's tokens per second, its batch's together)",
            ["model"],
            registry=self.registry,
        )
        self.requests = Counter(
            "arbiterd_requests", "Requests by outcome", ["model", "status"], registry=self.registry
        )
        self.vram = VramGauge(
            Gauge(
                "arbiterd_vram_bytes",
                "Device memory by owner: a model's name, or another process's name",
                ["device", "owner"],  # this order: VramGauge removes series by it
                registry=self.registry,
            )
        )
        self.backend = Gauge(
            "arbiterd_backend",
            "1 for the residency backend the model's worker uses (in-place or reload)",
            ["model", "backend"],
            registry=self.registry,
        )
        self._backends: dict[str, str] = {}  # model -> the backend label it has a series for
        self.model_device = Gauge(
            "arbiterd_model_device",
            "1 for each device the model is placed on, by arbiterd's device id (issue 27)",
            ["model", "device"],
            registry=self.registry,
        )
        self._devices: dict[str, tuple[str, ...]] = {}  # model -> the ids it has series for
        self.worker_restarts = Counter(
            "arbiterd_worker_restarts",
            "Worker processes restarted",
            ["model"],
            registry=self.registry,
        )

        self.encoder_loads = Counter(
            "arbiterd_encoder_loads",
            "Times a vision model's projector (mmproj) was loaded",
            ["model"],
            registry=self.registry,
        )
        self.encoder_seconds = Histogram(
            "arbiterd_encoder_seconds",
            "How long a vision model's projector took to load, encode an image, or be freed",
            ["model", "action"],
            buckets=ENCODER_BUCKETS_S,
            registry=self.registry,
        )

        self.stepped_aside = Gauge(
            "arbiterd_stepped_aside",
            "1 while the daemon holds the GPU for a program that does not take part (issue 45)",
            registry=self.registry,
        )
        self.steps_aside = Counter(
            "arbiterd_steps_aside",
            "Times the daemon stepped aside for a program that does not take part",
            registry=self.registry,
        )

    def add_model(self, model: str, devices: Sequence[str]) -> None:
        """Make a model's series exist (at 0) before its first event, and name its devices
        (a model configured again on other devices loses the old ones' series)."""
        self.resident.labels(model=model).set(0)
        self.prompt_tokens_evaluated.labels(model=model)
        for device in set(self._devices.get(model, ())) - set(devices):
            self.model_device.remove(model, device)
        self._devices[model] = tuple(devices)
        for device in devices:
            self.model_device.labels(model=model, device=device).set(1)

    def set_backend(self, model: str, backend: str) -> None:
        """The model's worker uses `backend`: one series per model, at 1."""
        previous = self._backends.get(model)
        if previous is not None and previous != backend:
            self.backend.remove(model, previous)
        self._backends[model] = backend
        self.backend.labels(model=model, backend=backend).set(1)

    def observe(self, event: Event) -> None:
        if isinstance(event, ResidencyEvent) and event.model is not None:
            warm = event.to_state is ResidencyState.WARM
            self.resident.labels(model=event.model).set(1 if warm else 0)
            if event.turn_served is not None:
                self.turn_requests.labels(model=event.model).observe(event.turn_served)
        elif isinstance(event, RequestEvent) and event.model is not None:
            self.requests.labels(model=event.model, status=event.outcome or RequestStatus.OK).inc()
            evaluated = event.prompt_tokens_evaluated
            if evaluated is not None and evaluated > 0:
                self.prompt_tokens_evaluated.labels(model=event.model).inc(evaluated)
            generated = event.completion_tokens
            if generated is not None and generated > 0:
                self.completion_tokens.labels(model=event.model).inc(generated)
        elif isinstance(event, EncoderEvent) and event.model is not None:
            if event.action == "load":
                self.encoder_loads.labels(model=event.model).inc()
            if event.duration_s is not None:
                self.encoder_seconds.labels(model=event.model, action=event.action).observe(
                    event.duration_s
                )
        elif isinstance(event, StepAsideEvent):
            self.stepped_aside.set(1 if event.aside else 0)
            if event.aside:
                self.steps_aside.inc()
        elif isinstance(event, HandoffEvent):
            self.handoffs.inc()
            self.handoff_seconds.observe(event.total_s)
        elif (
            isinstance(event, WorkerEvent)
            and event.model is not None
            and event.restart_in_s is not None
        ):
            self.worker_restarts.labels(model=event.model).inc()

    def observe_vram(self, snapshot: TelemetrySnapshot) -> None:
        self.vram.update(snapshot)

    def text(self) -> bytes:
        return generate_latest(self.registry)
