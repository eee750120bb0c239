"""The answer to the control socket's `devices` request (issue 27): this machine's devices as
the workers' engine lists them and every `[daemon] rpc_servers` server's, each with its arena
and who holds it. Owns that listing and nothing else.

Never loads llama.cpp (the daemon never does): the local devices are those the workers' engine
listed in its hello (`EngineReport.devices`: ggml's labels, "NAME: DESCRIPTION", in ggml's
order; none before a worker said hello), the RPC servers' are asked over ggml's wire protocol,
in Python (arbiterd/native/rpc.py's `probe`). Never blocks the event loop: the probes and the
arenas' reads run in threads, all at once, so an answer takes about PROBE_TIMEOUT_S at most.
The probes have threads of their own (MAX_PROBES_AT_ONCE): a probe is bounded in time (rpc.py),
but a burst of `devices` requests must not take the default executor's few threads, which
`status` and `reload` wait on (issue 40: they stopped answering behind seven probes).

A ggml RPC server serves one client at a time, and a worker that holds a device's token is
connected to its server: such a server answers no probe (it waits in the server's queue until
the timeout). So a server whose probe failed while someone holds its arena, and which still
takes connections, is reported reachable, its holder named and its memory unknown (None); a
server that refuses connections, or whose probe failed while nobody holds its arena, is
unreachable, with the probe's reason.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from arbiterd.arena import Arena
from arbiterd.control import DeviceEntry
from arbiterd.errors import ArbiterError
from arbiterd.native import rpc
from arbiterd.native.rpc import ServerInfo
from arbiterd.paths import DeviceId, DeviceKind, device_arena_of, parse_device_id
from arbiterd.procs import holder_name

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0
# ggml's RPC client connects to at most GGML_RPC_MAX_SERVERS (16) servers; the threads start as
# probes come, and a probe beyond them waits its turn.
MAX_PROBES_AT_ONCE = 16
_probing = ThreadPoolExecutor(MAX_PROBES_AT_ONCE, thread_name_prefix="rpc-probe")
_Answer = TypeVar("_Answer")
CPU_NAME = "CPU"  # ggml's name of the CPU device
# ggml's local devices that are neither the CPU nor a GPU (kind "accel": ggml-blas,
# ggml-zendnn, ggml-zdnn); an RPC server's devices (RPC0, RPC1, ...) are listed from the probes.
NOT_GPU_NAMES = frozenset({"BLAS", "ZenDNN", "zDNN"})
RPC_NAME_PREFIX = "RPC"
# ggml's RPC client gives every remote device the kind gpu (ggml-rpc.cpp, get_type's TODO).
RPC_KIND = "gpu"


@dataclass(frozen=True)
class LocalDevice:
    """A device of the engine's list, read from its label."""

    device: DeviceId
    ggml: str
    description: str
    kind: str


def local_devices(labels: Iterable[str]) -> list[LocalDevice]:
    """The devices of the engine's `labels` (ggml's order) by arbiterd id: the CPU as `cpu`,
    every other device that is no accelerator and no RPC server's as gpu0, gpu1, ... in that
    order (as the workers' placement counts them). A label tells no kind: a local GPU's is
    given as "gpu", an integrated one's too."""
    found, gpus = [], 0
    for label in labels:
        name, _, description = label.partition(": ")
        if name == CPU_NAME:
            found.append(LocalDevice(DeviceId(DeviceKind.CPU), name, description, "cpu"))
        elif name not in NOT_GPU_NAMES and not name.startswith(RPC_NAME_PREFIX):
            found.append(LocalDevice(DeviceId(DeviceKind.GPU, gpus), name, description, "gpu"))
            gpus += 1
    return found


@dataclass(frozen=True)
class Probed:
    """What asking one RPC server gave: its devices, or why it did not answer, and (asked only
    when it did not answer and someone holds its arena) why it refuses connections (None: it
    takes them, so it serves another client)."""

    server: DeviceId  # device 0 of the server: rpc:HOST:PORT
    endpoint: str  # HOST:PORT as configured
    info: ServerInfo | None = None
    failure: str = ""
    refuses: str | None = None


def entries(
    labels: Iterable[str],
    probed: Sequence[Probed],
    arenas: Mapping[str, str],
    holders: Mapping[str, str | None],
) -> list[DeviceEntry]:
    """The `devices` reply, pure: the local devices of `labels`, then each server's devices
    (from its probe; device 0 alone for one that did not answer), with each device's arena
    folder (`arenas`, by id) and holder (`holders`, by id)."""
    listed = [
        DeviceEntry(
            id=str(local.device),
            ggml=local.ggml,
            description=local.description,
            kind=local.kind,
            arena=arenas.get(str(local.device), ""),
            holder=holders.get(str(local.device)),
            reachable=True,
        )
        for local in local_devices(labels)
    ]
    for server in probed:
        listed += _server_entries(server, arenas, holders)
    return listed


def _server_entries(
    server: Probed, arenas: Mapping[str, str], holders: Mapping[str, str | None]
) -> list[DeviceEntry]:
    if server.info is not None:
        return [
            DeviceEntry(
                id=(key := str(_nth(server.server, remote.index))),
                description=server.endpoint,  # ggml's description of a remote device
                kind=RPC_KIND,
                free_bytes=remote.free_bytes,
                total_bytes=remote.total_bytes,
                arena=arenas.get(key, ""),
                holder=holders.get(key),
                reachable=True,
            )
            for remote in server.info.devices
        ]
    key = str(server.server)
    holder = holders.get(key)
    serving = holder is not None and server.refuses is None
    if serving:
        reason = (
            f"serving {holder} (a ggml RPC server serves one client at a time): its memory is "
            "not known meanwhile"
        )
    else:
        reason = server.refuses or server.failure
    return [
        DeviceEntry(
            id=key,
            description=server.endpoint,
            kind=RPC_KIND,
            arena=arenas.get(key, ""),
            holder=holder,
            reachable=serving,
            reason=reason,
        )
    ]


def _nth(server: DeviceId, index: int) -> DeviceId:
    return DeviceId(DeviceKind.RPC, index, server.host, server.port)


async def list_devices(
    labels: Sequence[str],
    gpu0_arena: Path,
    rpc_servers: Sequence[str],
    *,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> list[DeviceEntry]:
    """Every device: the engine's `labels`, the `rpc_servers` ("HOST:PORT") probed, and the
    arenas beside `gpu0_arena` read (paths.device_arena_of), off the event loop."""
    servers = [(parse_device_id(f"rpc:{endpoint}"), endpoint) for endpoint in rpc_servers]
    answers = await asyncio.gather(
        *(_on_probe_thread(_probe, endpoint, timeout_s) for _, endpoint in servers)
    )
    probed = [
        Probed(server, endpoint, info=answer)
        if isinstance(answer, ServerInfo)
        else Probed(server, endpoint, failure=answer)
        for (server, endpoint), answer in zip(servers, answers, strict=True)
    ]
    ids = [str(local.device) for local in local_devices(labels)]
    for server in probed:
        indices = [0] if server.info is None else [d.index for d in server.info.devices]
        ids += [str(_nth(server.server, index)) for index in indices]
    arenas = {device: str(device_arena_of(device, gpu0_arena)) for device in ids}
    holders = await asyncio.to_thread(_holders, arenas)

    async def looked_again(server: Probed) -> Probed:
        """A server that did not answer while its arena is held: does it take connections?"""
        if server.info is not None or holders.get(str(server.server)) is None:
            return server
        refuses = await _on_probe_thread(_refuses, server.endpoint, timeout_s)
        return replace(server, refuses=refuses)

    probed = list(await asyncio.gather(*(looked_again(server) for server in probed)))
    return entries(labels, probed, arenas, holders)


async def _on_probe_thread(
    ask: Callable[[str, float], _Answer], endpoint: str, timeout_s: float
) -> _Answer:
    return await asyncio.get_running_loop().run_in_executor(_probing, ask, endpoint, timeout_s)


def _probe(endpoint: str, timeout_s: float) -> ServerInfo | str:
    """The server's answer, or why it gave none."""
    try:
        return rpc.probe(endpoint, timeout_s)
    except ArbiterError as exc:  # DeviceUnreachableError; EngineError for a bad endpoint
        return str(exc)


def _refuses(endpoint: str, timeout_s: float) -> str | None:
    """Why the server at `endpoint` refuses a connection, or None when it takes it (or the
    connection waits: a server whose queue of connections is full, serving another client)."""
    try:
        host, port = rpc.split_endpoint(endpoint)
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except TimeoutError:
        return None
    except ArbiterError as exc:
        return str(exc)
    except OSError as exc:
        return f"RPC server {endpoint} is not reachable: {exc.strerror or exc}"


def _holders(arenas: Mapping[str, str]) -> dict[str, str | None]:
    """Who holds each arena's token (None: nobody, or an arena that cannot be read: logged)."""
    held: dict[str, str | None] = {}
    for device, path in arenas.items():
        try:
            held[device] = holder_name(Arena(Path(path)).observe())
        except (ArbiterError, OSError) as exc:
            log.warning("devices: the arena of %s cannot be read: %s", device, exc)
            held[device] = None
    return held
