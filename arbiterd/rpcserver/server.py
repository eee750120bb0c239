"""`arbiterd rpc-server`: this machine's devices served to other engines through ggml's own RPC
server (ggml_backend_rpc_start_server, arbiterd/native/rpc.py's `serve`; issue 27).

An engine process, serving devices, not a client of the daemon: the one command that loads
llama.cpp, and only once it runs (`arbiterd --help` and every other command load nothing; the
command line registers it from arbiterd/cli/main.py). Owns which local devices a server serves
(by their arbiterd ids), the refusal of a listen address beyond this machine, the process's
malloc tuning, and how the process ends: ggml's server runs in a thread of its own and never
returns while it serves, so SIGTERM or SIGINT ends the process from the main thread with
`os._exit(0)`. With `--clients N` the process is a front instead (front.py), which serves each
client with such a process of its own; with `--lend` too, and the lender's side of a lease
(arbiterd/lease/lender.py) runs in it: the devices served only to the borrower that proves the
key, and only while this machine's own programs do not want them (issue 46). `start_local`
runs one as a child process serving the CPU (the devices demo, the tests).

The RPC protocol has no authentication: whoever reaches the port can allocate memory on the
device and run graphs on it. So the server listens on loopback unless `--allow-remote` says
otherwise; across machines, use a trusted link or an SSH tunnel (docs/devices.md, "RPC servers").
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from arbiterd.arena import device_arenas
from arbiterd.errors import (
    BadValueError,
    DeviceUnreachableError,
    EngineError,
    ListenError,
    UsageError,
)
from arbiterd.lease.channel import DEFAULT_TIMEOUT_S, read_key
from arbiterd.lease.lender import Lender
from arbiterd.native import ggml, libllama, rpc
from arbiterd.paths import DeviceKind, default_arena, parse_device_id
from arbiterd.rpcserver import front

DEFAULT_LISTEN = "127.0.0.1:50052"  # llama.cpp's own rpc-server listens there by default
EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# mallopt(3): M_MMAP_THRESHOLD is -3 in glibc's malloc.h. Setting it fixes the threshold, which
# also turns off glibc's dynamic threshold: a buffer freed from an mmap raises the threshold
# to its size (up to 32 MiB on 64-bit), so after a client disconnects the next buffers of that
# size come from the heap, and freeing them does not give the pages back: the server's RSS
# would not drop on a release (issue 27's figure: >= 90 % of a model's share freed).
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 20
_IOLBF = 1  # setvbuf(3)'s line-buffered mode in glibc's stdio.h
PR_SET_PDEATHSIG = 1  # prctl(2), linux/prctl.h
REMOTE_REFUSAL = (
    "the llama.cpp RPC protocol has no authentication: whoever reaches the port can use the "
    "device's memory and compute, so arbiterd rpc-server listens on a loopback address "
    "(127.0.0.1) unless --allow-remote is given; across machines, use a trusted link or an SSH "
    "tunnel (ssh -L 50052:127.0.0.1:50052 HOST)"
)


def add_command(parser: argparse.ArgumentParser) -> None:
    """The options of `arbiterd rpc-server` (the parser main.py made for it)."""
    parser.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"the IPv4 address and port to listen on (default: {DEFAULT_LISTEN}; an address "
        "beyond this machine needs --allow-remote)",
    )
    parser.add_argument(
        "--device",
        action="append",
        metavar="ID",
        help="a device of this machine to serve: gpu0, gpu1, ... (the local GPUs in ggml's "
        "order) or cpu; repeat it to serve several, which clients name rpc:HOST:PORT/N in "
        "this order (default: gpu0, or cpu on a machine without a GPU)",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        metavar="DIR",
        help="ggml's local cache of tensors clients sent, kept across clients (default: none)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="CPU threads of a CPU device's computations (default: half the CPUs this process "
        "may run on)",
    )
    parser.add_argument(
        "--clients",
        type=int,
        default=1,
        metavar="N",
        help="clients served at once, each by a server process of its own, so that several "
        "models are on the devices together (a daemon's fitting set); 1, the default, is ggml's "
        "own server, which serves one client at a time",
    )
    parser.add_argument(
        "--lend",
        action="store_true",
        help="lend the devices on a lease (issue 46): served only to the borrower that proves "
        "the key, and only while this machine's own programs do not want them; when one does, "
        "the borrower is told to give them back (needs --device and --key-file)",
    )
    parser.add_argument(
        "--lease",
        metavar="HOST:PORT",
        help="where the lease channel listens (default: the --listen address, its port + 1)",
    )
    parser.add_argument(
        "--key-file",
        type=Path,
        metavar="FILE",
        help="the lease key, shared with the borrower (a file only you can read: chmod 600)",
    )
    parser.add_argument(
        "--lease-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help="a borrower silent this long loses its lease, and one that does not give the "
        f"devices back this long after a revoke has its connections closed (default: "
        f"{DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--allow-remote",
        action="store_true",
        help="listen on an address other machines reach (the protocol has no authentication)",
    )
    parser.set_defaults(handler=serve_command)


@dataclass(frozen=True)
class Listen:
    host: str  # a dotted IPv4 address: ggml's server binds nothing else (inet_addr)
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_listen(text: str, *, allow_remote: bool) -> Listen:
    """`--listen HOST:PORT`, checked before the engine loads: an IPv4 address (ggml's server
    parses the host with inet_addr: no names, no IPv6), a port, and loopback unless
    `allow_remote` (UsageError saying why otherwise)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadValueError(f"--listen {text!r}: expected HOST:PORT, e.g. {DEFAULT_LISTEN}")
    try:
        address = ipaddress.IPv4Address(host)
    except ValueError:
        raise BadValueError(
            f"--listen {text!r}: HOST must be an IPv4 address (ggml's RPC server listens on "
            "nothing else), e.g. 127.0.0.1 or 0.0.0.0"
        ) from None
    if not address.is_loopback and not allow_remote:
        raise UsageError(f"refusing to listen on {text}: {REMOTE_REFUSAL}")
    return Listen(str(address), int(port))


def choose_devices(devices: Sequence[ggml.Device], ids: Sequence[str] | None) -> list[ggml.Device]:
    """The devices `ids` name among the engine's `devices` (ggml's order): gpuN the Nth local
    GPU, cpu the CPU; by default gpu0, or the CPU when there is no local GPU. BadValueError
    names an id this machine has no device for, and the ids it has."""
    gpus = [d for d in devices if d.local_gpu]
    cpu = next((d for d in devices if d.kind == "cpu"), None)
    if not ids:
        ids = ["gpu0" if gpus or cpu is None else "cpu"]
    chosen: list[ggml.Device] = []
    for text in ids:
        device = parse_device_id(text)
        if device.kind is DeviceKind.RPC:
            raise BadValueError(
                f"--device {text}: an RPC server serves this machine's own devices "
                f"({_offered(gpus, cpu)}), not another server's"
            )
        found = cpu if device.kind is DeviceKind.CPU else _nth(gpus, device.index)
        if found is None:
            raise BadValueError(
                f"--device {text}: this machine has no such device; it has {_offered(gpus, cpu)}"
            )
        if found in chosen:
            raise BadValueError(f"--device {text} is named twice")
        chosen.append(found)
    return chosen


def _nth(gpus: Sequence[ggml.Device], index: int) -> ggml.Device | None:
    return gpus[index] if index < len(gpus) else None


def _offered(gpus: Sequence[ggml.Device], cpu: ggml.Device | None) -> str:
    names = [f"gpu{i} ({d.label})" for i, d in enumerate(gpus)]
    if cpu is not None:
        names.append(f"cpu ({cpu.label})")
    return ", ".join(names) or "none"


def start_local(
    endpoint: str, log: Path, timeout_s: float, clients: int = 1
) -> subprocess.Popen[bytes]:
    """`arbiterd rpc-server --listen ENDPOINT --clients CLIENTS` in a child process serving this
    machine's CPU, its output appended to `log`, returned once it answers a probe (the engine
    loads before it listens). DeviceUnreachableError, with the end of its log, when it exits
    first or does not answer within `timeout_s`; it is killed then. The caller stops and reaps
    it."""
    command = ["rpc-server", "--listen", endpoint, "--clients", str(clients)]
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "arbiterd", *command],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "GGML_VK_VISIBLE_DEVICES": ""},  # the CPU: no Vulkan driver
        )
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            rpc.probe(endpoint, timeout_s=1.0)
            return process
        except DeviceUnreachableError:
            if process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
                continue
        process.kill()
        process.wait()
        raise DeviceUnreachableError(
            f"the RPC server on {endpoint} did not start: {log.read_text()[-2000:]}"
        )


def serving_line(devices: Sequence[ggml.Device], listen: Listen) -> str:
    """The line the server prints before ggml's own: what it serves, where."""
    if len(devices) == 1:
        return f"serving {devices[0].label} on {listen}"
    each = ", ".join(f"{d.label} (device {i})" for i, d in enumerate(devices))
    return f"serving {each} on {listen}"


def serve_command(args: argparse.Namespace) -> int:
    """`arbiterd rpc-server`: returns only when ggml's server could not start."""
    for signum in EXIT_SIGNALS:  # from now on, also while the engine loads
        signal.signal(signum, _exit_now)
    listen = parse_listen(args.listen, allow_remote=args.allow_remote)
    threads: int | None = args.threads
    if threads is not None and threads < 1:
        raise BadValueError(f"--threads must be 1 or more, got {threads}")
    clients: int = args.clients
    if clients < 1:
        raise BadValueError(f"--clients must be 1 or more, got {clients}")
    _check_free(listen)  # a taken port is said before the engine takes seconds to load
    if args.lend:
        return _lend(args, listen, clients)
    if clients > 1:
        return _serve_several(args, listen, front.Front(str(listen), _server_argv(args), clients))
    _end_with_front()
    library = _load_engine()
    chosen = choose_devices(ggml.devices(library), args.device)
    cache: Path | None = args.cache
    if cache is not None:
        try:
            cache.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BadValueError(f"--cache {cache}: {exc.strerror or exc}") from None
    _return_freed_memory()
    _line_buffer_c_stdout()
    print(serving_line(chosen, listen), flush=True)
    _run_until_signalled(
        lambda: rpc.serve(
            library,
            str(listen),
            [d.handle for d in chosen],
            cache,
            threads or max(1, len(os.sched_getaffinity(0)) // 2),
        )
    )
    raise ListenError(
        f"ggml's RPC server could not serve on {listen} (its line above says why; most often "
        "another process took the port)"
    )


def _server_argv(args: argparse.Namespace) -> list[str]:
    """The command line of a front's server processes: these devices, threads and cache."""
    each = [arg for device in args.device or () for arg in ("--device", device)]
    if args.threads is not None:
        each += ["--threads", str(args.threads)]
    if args.cache is not None:
        each += ["--cache", str(args.cache)]
    return front.server_argv(each)


def _serve_several(args: argparse.Namespace, listen: Listen, spliced: front.Front) -> int:
    """The front (front.py) on `listen`, its server processes on these devices; SIGTERM or
    SIGINT stop them, then the front."""
    for signum in EXIT_SIGNALS:
        signal.signal(signum, _stop_front)
    print(f"serving up to {args.clients} clients at once on {listen}", flush=True)
    try:
        spliced.serve_forever()
    except SystemExit:
        return 0
    return 1


def _lend(args: argparse.Namespace, listen: Listen, clients: int) -> int:
    """`--lend`: the front, admitting only a borrower's connections, and the lease channel
    (arbiterd/lease/lender.py) in a thread of its own."""
    if not args.device:
        raise UsageError(
            "--lend needs --device: the devices lent are those whose arenas it holds on this "
            "machine (gpu0, cpu, ...)"
        )
    if args.key_file is None:
        raise UsageError(
            "--lend needs --key-file FILE: the key a borrower proves it has (the same file on "
            'both machines; docs/devices.md, "Lending a GPU")'
        )
    if not args.lease_timeout > 0:
        raise BadValueError(f"--lease-timeout must be more than 0, got {args.lease_timeout}")
    key = read_key(args.key_file)
    lease = (
        parse_listen(args.lease, allow_remote=args.allow_remote)
        if args.lease
        else Listen(listen.host, listen.port + 1)
    )
    _check_free(lease)
    devices = [str(parse_device_id(text)) for text in args.device]
    gateway = device_arenas(devices, default_arena())
    spliced = front.Front(str(listen), _server_argv(args), clients, lending=True)
    lender = Lender(
        key=key,
        gateway=gateway,
        devices=devices,
        front=spliced,
        timeout_s=args.lease_timeout,
        name=socket.gethostname(),
        say=lambda line: print(line, flush=True),
    )
    listener = socket.create_server((lease.host, lease.port))
    threading.Thread(target=lender.serve, args=(listener,), name="lease", daemon=True).start()
    print(f"lending {', '.join(devices)} on {listen}, leases on {lease}", flush=True)
    return _serve_several(args, listen, spliced)


def _stop_front(_signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(0)  # out of accept(), through the front's stop


def _end_with_front() -> None:
    """A server process of a front (front.FRONT_ENV) ends when the front does, however it
    ends: the kernel sends SIGTERM at its death (PR_SET_PDEATHSIG)."""
    front_pid = os.environ.pop(front.FRONT_ENV, None)
    if front_pid is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != int(front_pid):  # it died before the request: nobody to serve
        os._exit(0)


def _exit_now(_signum: int, _frame: FrameType | None) -> None:
    """SIGTERM or SIGINT: the server stops serving, and the process ends with status 0."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)


def _check_free(listen: Listen) -> None:
    """ListenError when `listen` cannot be bound now, as ggml binds it (SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((listen.host, listen.port))
        except OSError as exc:
            why = (
                "the port is in use (another rpc-server?)"
                if exc.errno == errno.EADDRINUSE
                else exc.strerror or str(exc)
            )
            raise ListenError(f"cannot listen on {listen}: {why}") from None


def _load_engine() -> Path:
    """The engine's libllama, loaded and its backends initialised."""
    try:
        import llama_cpp  # noqa: PLC0415 (only once it serves: module docstring)
    except (ImportError, OSError, RuntimeError) as exc:
        raise EngineError(f"llama_cpp cannot be loaded: {exc}") from None
    llama_cpp.llama_backend_init()
    return libllama.loaded_libllama()


def _return_freed_memory() -> None:
    """Fix glibc's mmap threshold (M_MMAP_THRESHOLD's comment says why); nothing where the
    C library has no mallopt (musl)."""
    libc = ctypes.CDLL(None)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is not None:
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def _line_buffer_c_stdout() -> None:
    """ggml's server prints its start-up lines with printf and flushes only after a client:
    into a pipe or a log file they would wait in C's buffer, and `os._exit` would lose them."""
    libc = ctypes.CDLL(None)
    try:
        stdout = ctypes.c_void_p.in_dll(libc, "stdout")
    except ValueError:
        return
    setvbuf = libc.setvbuf
    setvbuf.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_size_t]
    setvbuf.restype = ctypes.c_int
    setvbuf(stdout, None, _IOLBF, 0)


def _run_until_signalled(serve: Callable[[], None]) -> None:
    """Run `serve` (a callable that returns only on failure) in a thread and return when it
    does; SIGTERM or SIGINT end the process with status 0 meanwhile.

    Why a thread: ggml's server loops inside one C call, and Python runs a signal handler only
    in the main thread, between bytecodes, so a handler would never run while the main thread
    serves. Here the main thread waits on an Event (a lock acquire, which a signal interrupts
    to run the handler). Why os._exit: a normal exit would run the C++ static destructors
    (ggml's backend registry) under the server thread, which still uses them."""
    ended = threading.Event()

    def run() -> None:
        try:
            serve()
        finally:
            ended.set()

    threading.Thread(target=run, name="rpc-server", daemon=True).start()
    ended.wait()
