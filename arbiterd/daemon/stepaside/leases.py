"""The leases of lent RPC devices (issue 46): one `arbiterd.lease.borrower.Borrower` for each
`[devices."rpc:HOST:PORT"]` table that names a `lease`, holding that device's token on the
lender's behalf whenever the lender has not granted it. Stepping aside, across machines: the
models release for a program of the lender as they do for one of this machine.

Owns the borrowers: started with the daemon, replaced by a reload that changes a lease (or the
models placed on its device), closed with the daemon; each change of a lease logged and
published as a `lease` event.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from arbiterd.arena import Arena
from arbiterd.config import Config, LeaseConfig
from arbiterd.errors import BadValueError, ConfigError
from arbiterd.events import Event, LeaseEvent
from arbiterd.lease.borrower import Borrower, LeaseView
from arbiterd.lease.channel import read_key
from arbiterd.paths import device_arena_of
from arbiterd.render import lease as lease_text
from arbiterd.status import Lease

log = logging.getLogger(__name__)

# How long the daemon's start waits for a new lease to hold its device for the lender (or to
# fail): a connection and a challenge, and a warm model's release on a reload.
SETTLE_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class _Wanted:
    lease: LeaseConfig
    models: tuple[str, ...]  # placed on the device, named to the lender


class Leases:
    def __init__(self, gpu0_arena: Path, publish: Callable[[Event], object]) -> None:
        self._gpu0_arena = gpu0_arena
        self._publish = publish
        self._running: dict[str, tuple[_Wanted, Borrower]] = {}

    async def apply(self, config: Config) -> None:
        """Start the leases `config` names, close those it no longer does, and restart those
        it changed; returns once each new one holds its device for the lender, or failed to
        (SETTLE_TIMEOUT_S at most), so that a model starting next finds the lease open.
        ConfigError for a lease key file that cannot be used; the leases before it are
        applied."""
        wanted = {
            device: _Wanted(
                table.lease,
                tuple(name for name, m in config.models.items() if device in m.devices),
            )
            for device, table in config.devices.items()
            if table.lease is not None
        }
        for device in [d for d, (w, _) in self._running.items() if wanted.get(d) != w]:
            _, borrower = self._running.pop(device)
            await borrower.close()
        started = []
        for device, want in wanted.items():
            if device not in self._running:
                self._running[device] = (want, self._start(device, want))
                started.append(self._running[device][1])
        if started:
            await asyncio.wait(
                [asyncio.create_task(b.settled.wait()) for b in started], timeout=SETTLE_TIMEOUT_S
            )

    def _start(self, device: str, want: _Wanted) -> Borrower:
        try:
            key = read_key(want.lease.key_file)
        except BadValueError as exc:
            raise ConfigError(f'[devices."{device}"] lease_key_file: {exc}') from None
        borrower = Borrower(
            device=device,
            lender=want.lease.lender,
            key=key,
            arena=Arena(device_arena_of(device, self._gpu0_arena)),
            models=want.models,
            name=socket.gethostname(),
            on_change=self._changed,
        )
        borrower.start()
        log.info("lease of %s: asked of %s", device, want.lease.lender)
        return borrower

    def _changed(self, view: LeaseView) -> None:
        log.info(
            "lease of %s: %s",
            view.device,
            lease_text(view.state, view.lender, view.by, view.reason),
        )
        self._publish(
            LeaseEvent(
                device=view.device,
                lender=view.lender,
                state=view.state,
                by=view.by,
                reason=view.reason,
            )
        )

    def status(self) -> tuple[Lease, ...]:
        return tuple(Lease(**asdict(borrower.view)) for _, borrower in self._running.values())

    async def close(self) -> None:
        running, self._running = self._running, {}
        await asyncio.gather(*(borrower.close() for _, borrower in running.values()))
