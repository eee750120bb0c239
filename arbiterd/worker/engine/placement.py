"""Where a model's layers go: its `devices` (arbiterd device ids) turned into the engine's ggml
devices, the RPC servers among them registered with the engine (issue 27).

Owns the mapping from ids to ggml devices: `gpuN` is the Nth local GPU in ggml's order (the
devices of kind gpu or igpu that are not an RPC server's), `rpc:HOST:PORT/N` the Nth device of
that server, `cpu` no device at all (every layer on the CPU). A model placed on the default
`gpu0` on an engine without a GPU runs on the CPU, as before devices were named.

Only the worker holding the devices' tokens registers and probes a server: a ggml RPC server
serves one client at a time, so asking one that another model uses would wait for it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path

from arbiterd.errors import BadValueError, ModelLoadError
from arbiterd.footprint import LLVMPIPE_STORAGE_RANGE_BYTES, VULKAN_STORAGE_RANGE_BYTES
from arbiterd.native import ggml, libllama, rpc
from arbiterd.paths import DeviceId, DeviceKind, parse_device_id
from arbiterd.spec import ModelSpec, SplitMode

# llama.cpp's enum llama_split_mode
SPLIT_MODES = {SplitMode.LAYER: 1, SplitMode.ROW: 2, SplitMode.TENSOR: 3}
DEFAULT_DEVICES = ("gpu0",)


@dataclass
class Placement:
    """The ggml devices a model loads onto, in its `devices`' order; None: llama.cpp's own
    choice (the engine has no GPU and the model asked for none in particular)."""

    handles: tuple[int, ...] | None
    endpoints: tuple[str, ...]  # the RPC servers (HOST:PORT) it is placed on
    # The NULL-terminated array llama_model_params.devices points to while a model loads.
    _array: ctypes.Array[ctypes.c_void_p] | None = field(default=None, repr=False)

    @property
    def remote(self) -> bool:
        return bool(self.endpoints)

    def devices_pointer(self) -> ctypes.c_void_p | None:
        """llama_model_params.devices for this placement (kept alive with it)."""
        if self.handles is None:
            return None
        self._array = (ctypes.c_void_p * (len(self.handles) + 1))(*self.handles, None)
        return ctypes.cast(self._array, ctypes.c_void_p)

    def check_reachable(self, timeout_s: float = rpc.PROBE_TIMEOUT_S) -> None:
        """Each RPC server answers, in the engine's protocol (DeviceUnreachableError if not):
        ggml's own client would abort the process instead."""
        for endpoint in self.endpoints:
            rpc.probe(endpoint, timeout_s)


def runs_on_cpu(spec: ModelSpec) -> bool:
    """Whether `spec`'s layers all stay on the CPU: no layer offloaded, placed on `cpu`, or on
    the default gpu0 of an engine without a local GPU. Asks no RPC server."""
    if spec.n_gpu_layers == 0 or tuple(spec.devices) == ("cpu",):
        return True
    if tuple(spec.devices) != DEFAULT_DEVICES:
        return False
    return not _local_gpus(libllama.loaded_libllama())


def largest_weights(spec: ModelSpec, library: Path) -> tuple[tuple[str, int], ...]:
    """(device id, bytes) for each local Vulkan device `spec` names: the largest weight it can
    use, its storage range (footprint.py), llvmpipe's where the driver runs on the CPU. Asks no
    RPC server: their devices take any weight their memory holds."""
    local = _local_gpus(library)
    limits = []
    for text in spec.devices:
        try:
            device = parse_device_id(text)
        except BadValueError:
            continue  # the load says what is wrong with it
        if device.kind is not DeviceKind.GPU or device.index >= len(local):
            continue
        found = local[device.index]
        if found.name.startswith("Vulkan"):
            limit = LLVMPIPE_STORAGE_RANGE_BYTES if found.on_cpu else VULKAN_STORAGE_RANGE_BYTES
            limits.append((text, limit))
    return tuple(limits)


def _local_gpus(library: Path) -> list[ggml.Device]:
    return [d for d in ggml.devices(library) if d.local_gpu]


def rpc_endpoint(device: DeviceId) -> str:
    """The HOST:PORT ggml connects to for an rpc: device. ggml reads the host up to the first
    colon, so an IPv6 address cannot name a server (its name in /etc/hosts can)."""
    if ":" in device.host:
        raise BadValueError(
            f"device {device}: ggml's RPC client cannot reach an IPv6 address; give the"
            " server's host name instead"
        )
    return f"{device.host}:{device.port}"


def place(spec: ModelSpec, library: Path, timeout_s: float = rpc.PROBE_TIMEOUT_S) -> Placement:
    """The devices `spec` names, found in the loaded engine; its RPC servers are probed and
    registered first. ModelLoadError names a device that does not exist and those that do."""
    ids, endpoints = _parsed(spec)
    remote: dict[str, list[int]] = {}
    for endpoint in endpoints:
        rpc.probe(endpoint, timeout_s)
        remote[endpoint] = rpc.register_server(library, endpoint)
    local = _local_gpus(library)
    if not local and tuple(spec.devices) == DEFAULT_DEVICES:
        return Placement(None, ())
    handles: list[int] = []
    for device in ids:
        if device.kind is DeviceKind.CPU:
            continue
        if device.kind is DeviceKind.GPU:
            pool = [d.handle for d in local]
        else:
            pool = remote[rpc_endpoint(device)]
        if device.index >= len(pool):
            raise ModelLoadError(
                f"{spec.name}: devices names {device}, which this engine does not offer;"
                f" it offers {_offered(local, remote)}"
            )
        handles.append(pool[device.index])
    return Placement(tuple(handles), endpoints)


def check_servers_up(spec: ModelSpec, timeout_s: float = rpc.PROBE_TIMEOUT_S) -> None:
    """Each RPC server `spec` is placed on is up: it accepts a connection (DeviceUnreachableError
    naming the first that does not). Asks neither the engine nor the servers anything, so a
    worker may check before it takes any token: a server another model is connected to is busy,
    not down, and answers once that model releases (`place` asks it then)."""
    for endpoint in _parsed(spec)[1]:
        rpc.check_listening(endpoint, timeout_s)


def _parsed(spec: ModelSpec) -> tuple[list[DeviceId], tuple[str, ...]]:
    """`spec`'s devices and its RPC servers' endpoints, each once in the order named."""
    try:
        ids = [parse_device_id(text) for text in spec.devices]
        endpoints = tuple(dict.fromkeys(rpc_endpoint(d) for d in ids if d.kind is DeviceKind.RPC))
    except BadValueError as exc:
        raise ModelLoadError(f"{spec.name}: {exc}") from None
    return ids, endpoints


def _offered(local: list[ggml.Device], remote: dict[str, list[int]]) -> str:
    names = [f"gpu{i} ({d.label})" for i, d in enumerate(local)]
    for endpoint, handles in remote.items():
        names += [f"rpc:{endpoint}" + (f"/{i}" if i else "") for i in range(len(handles))]
    return ", ".join([*names, "cpu"])
