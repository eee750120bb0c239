"""`arbiterd daemon`: wires config, journal, supervisor, HTTP API and control socket together.

Owns the daemon's lifetime: check every model file, bind the HTTP port, the API's Unix socket and
the control socket, and only then start the workers (a mistake or a taken port costs no model
load); follow the config file unless `[daemon] watch_config = false` (configwatch.py); tell
systemd when serving (READY=1 to $NOTIFY_SOCKET, Type=notify); stop on SIGTERM/SIGINT or the
`shutdown` command, in the order `_stop` gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Callable

from arbiterd.config import Config
from arbiterd.daemon.configwatch import ConfigWatch
from arbiterd.daemon.control.server import ControlServer
from arbiterd.daemon.http.app import create_app
from arbiterd.daemon.http.server import (
    HttpServer,
    UnixListener,
    bind_http,
    connection_limit,
    raise_fd_limit,
)
from arbiterd.daemon.instance import InstanceLock
from arbiterd.daemon.models.modelfile import check_models
from arbiterd.daemon.observe.journal import Journal
from arbiterd.daemon.supervisor import Supervisor
from arbiterd.errors import DaemonError
from arbiterd.states import ControlCommand

log = logging.getLogger(__name__)


def notify_ready(status: str) -> bool:
    """sd_notify(3) without libsystemd: one datagram to $NOTIFY_SOCKET. False if not asked."""
    path = os.environ.get("NOTIFY_SOCKET", "")
    if not path:
        return False
    address = "\0" + path[1:] if path.startswith("@") else path  # '@': abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(address)
        sock.sendall(f"READY=1\nSTATUS={status}\n".encode())
    return True


async def serve(config: Config, reload_config: Callable[[], Config] | None = None) -> None:
    """Run until SIGTERM/SIGINT or the shutdown command."""
    daemon = config.daemon
    where = f"{daemon.http_host}:{daemon.http_port}"
    # First: a second daemon on this socket says who runs before it touches anything.
    instance = InstanceLock.acquire(daemon.socket, {"http": where})
    try:
        for warning in check_models(config):  # raises ConfigError before anything loads
            log.warning("%s", warning)
        with (
            bind_http(daemon.http_host, daemon.http_port) as listening,
            UnixListener.bind(daemon.api_socket) as api_listening,
        ):
            await _serve(config, reload_config, [listening, api_listening.sock])
    finally:
        instance.release()


async def _serve(
    config: Config, reload_config: Callable[[], Config] | None, listeners: list[socket.socket]
) -> None:
    daemon = config.daemon
    fd_limit = raise_fd_limit()  # before any worker starts: they inherit it
    # Named by its control socket (one daemon per socket): a daemon that shares the journal
    # keeps its own history.
    journal = Journal(daemon.journal, daemon=str(daemon.socket))
    supervisor = Supervisor(config, journal, reload_config)
    control = ControlServer(
        supervisor,
        daemon.socket,
        history=journal.own_events,
        # As the config is now: a reload may change the servers.
        rpc_servers=lambda: supervisor.config.daemon.rpc_servers,
    )
    watch = None
    if reload_config is not None and config.source is not None and daemon.watch_config:
        # Applied as the control socket's `reload` is: the supervisor holds any change that
        # comes while it starts until its slots exist.
        watch = ConfigWatch(config.source, lambda: supervisor.command(ControlCommand.RELOAD))
    http = HttpServer(
        create_app(
            supervisor,
            api_key=daemon.api_key,
            responses_budget_bytes=daemon.responses_budget_bytes,
        ),
        listeners,
        allow_uids=daemon.allow_uids,
        api_key=daemon.api_key,
        max_connections=connection_limit(fd_limit),
        header_timeout_s=daemon.header_timeout_s,
        http_host=daemon.http_host,
        allow_origins=daemon.allow_origins,
    )
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, supervisor.stopped.set)
    http_task: asyncio.Task[None] | None = None
    try:
        await control.start()
        if watch is not None:
            watch.start()  # before the workers start: a save while they load is not missed
        await supervisor.start()
        http_task = loop.create_task(http.serve())
        while not http.started:
            if http_task.done():  # the server failed before it started
                await http_task
                raise DaemonError(
                    f"the HTTP API could not listen on {daemon.http_host}:{daemon.http_port}"
                )
            await asyncio.sleep(0.01)
        url = f"http://{daemon.http_host}:{daemon.http_port}/v1"
        log.info(
            "serving %s on %s and %s, control socket %s",
            ", ".join(config.models),
            url,
            daemon.api_socket,
            daemon.socket,
        )
        notify_ready(f"serving {len(config.models)} models on {url}")
        await supervisor.stopped.wait()
        log.info("stopping")
    finally:
        await _stop(supervisor, http, http_task, control, watch)
        journal.close()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


async def _stop(
    supervisor: Supervisor,
    http: HttpServer,
    http_task: asyncio.Task[None] | None,
    control: ControlServer,
    watch: ConfigWatch | None,
) -> None:
    """The daemon's stop, in this order (the one place that orders it):

    1. The supervisor refuses new requests and ends those in flight with ShuttingDownError,
       their decodes cancelled in the workers: a stream ends with an error event, a plain
       request is a 503, each saying that the daemon is shutting down (issue 30). Waiting for
       them instead would hold the stop for as long as a generation runs, and the HTTP
       server would then cut the connections still open at its SHUTDOWN_TIMEOUT_S.
    2. The HTTP server stops accepting, and closes each connection once its response (now
       only the error) is sent.
    3. The control socket and the config watch close: nothing can ask for a change any more.
    4. The workers stop and release the GPU (the journal, closed by the caller, records it)."""
    supervisor.stop_requests()
    http.should_exit = True
    if http_task is not None:
        with contextlib.suppress(Exception):
            await http_task
    await control.close()
    if watch is not None:
        await watch.close()
    await supervisor.stop()
