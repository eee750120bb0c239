"""Snapshots as Prometheus series: `arbiterd_vram_bytes{device,owner}`.

Owns the labelling: `owner` is the model's name for arbiterd's own models and the process's name
for everyone else (processes of one name on one device are summed: two "firefox" rows would
otherwise overwrite each other). Never creates a metric or a registry: metrics.py owns those and
passes its Gauge in.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Gauge

from arbiterd.daemon.observe.telemetry.sampler import TelemetrySnapshot

UNKNOWN_OWNER = "unknown"  # a process that ended before its name was read


@dataclass(frozen=True)
class VramSeries:
    device: str
    owner: str
    bytes_: int

    def labels(self) -> dict[str, str]:
        return {"device": self.device, "owner": self.owner}


def vram_series(snapshot: TelemetrySnapshot) -> list[VramSeries]:
    """One series per (device, owner). Every model has one on each measured device — 0 when
    cold and empty — so a release shows as a fall to 0, not as a series that vanishes. Figures
    the driver would not give (None) are left out rather than reported as 0."""
    totals: dict[tuple[str, str], int] = {}
    for device in sorted(snapshot.measured):
        for model in snapshot.model_pids:
            totals[(device, model)] = 0
    for row in snapshot.models:
        if row.used_bytes is not None:
            key = (row.device, row.model)
            totals[key] = totals.get(key, 0) + row.used_bytes
    for process in snapshot.others:
        if process.used_bytes is not None and process.device is not None:
            key = (process.device, process.name or UNKNOWN_OWNER)
            totals[key] = totals.get(key, 0) + process.used_bytes
    return [VramSeries(device, owner, value) for (device, owner), value in sorted(totals.items())]


class VramGauge:
    """Keeps a `Gauge(..., ["device", "owner"])` equal to the latest snapshot: sets every series
    and removes those of processes that are gone (a browser's pid churn would otherwise leave
    series behind forever)."""

    def __init__(self, gauge: Gauge) -> None:
        self._gauge = gauge
        self._written: set[tuple[str, str]] = set()

    def update(self, snapshot: TelemetrySnapshot) -> None:
        now: set[tuple[str, str]] = set()
        for series in vram_series(snapshot):
            self._gauge.labels(**series.labels()).set(series.bytes_)
            now.add((series.device, series.owner))
        for device, owner in self._written - now:
            self._gauge.remove(device, owner)
        self._written = now
