"""The [daemon] table: its keys checked (`daemon_table`), then its defaults resolved against
the environment (`DaemonValues.resolve`: the default socket, arena and journal paths), which may
need a $XDG_RUNTIME_DIR the file or the flags make unnecessary. Owns what is checked of each
key: the HTTP address (and the `--http` flag's), the users and web origins the API serves, the
RPC servers, the turn keys (issue 43).

Every problem is a ConfigError naming the file, the key path and what was expected.
"""

from __future__ import annotations

import ipaddress
import pwd
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from arbiterd.config.records import (
    API_SOCKET_FILE,
    APP_DIR,
    DEFAULT_HTTP,
    HEADER_TIMEOUT_S,
    HOLDER_TIMEOUT_S,
    JOURNAL_FILE,
    PROMPT_CACHE_BUDGET_BYTES,
    QUEUE_NOTICE_S,
    RESPONSES_BUDGET_BYTES,
    SOCKET_FILE,
    DaemonConfig,
)
from arbiterd.errors import BadValueError
from arbiterd.paths import (
    DeviceId,
    default_arena,
    parse_device_id,
    runtime_dir,
)
from arbiterd.spec import (
    DEFAULT_TURNS,
    MAX_TURN_S,
    MAX_WAIT_S,
    MIN_TURN_S,
    SWITCH_OVERHEAD,
    Turns,
)
from arbiterd.states import PRIORITY_CHOICES, Priority
from arbiterd.tomltable import (
    Source,
    Table,
    describe,
)

MAX_UID = 2**32 - 2  # (uid_t)-1 means "no user"

# A web origin as a browser sends it in `Origin` (RFC 6454): a scheme, a host (a name, an IPv4
# address, or an IPv6 one in brackets) and an optional port; "tauri://localhost" and
# "chrome-extension://ID" are origins too.
ORIGIN_RE = re.compile(
    r"[a-z][a-z0-9+.-]*://(?:[a-z0-9_.-]+|\[[0-9a-f:.]+\])(?::[0-9]{1,5})?", re.IGNORECASE
)

DAEMON_KEYS = (
    "http",
    "socket",
    "arena",
    "journal",
    "api_key",
    "allow_users",
    "allow_origins",
    "api_socket",
    "header_timeout_s",
    "holder_timeout_s",
    "vram_budget",
    "host_ram_budget",
    "prompt_cache_budget",
    "responses_budget",
    "watch_config",
    "queue_notice_s",
    "rpc_servers",
    "switch_overhead",
    "min_turn_s",
    "max_turn_s",
    "max_wait_s",
)

HTTP_EXPECTED = f'HOST:PORT with a port from 1 to 65535, e.g. "{DEFAULT_HTTP}"'

_RPC_SERVERS_EXPECTED = (
    'an array of RPC servers, each HOST:PORT with a port from 1 to 65535, e.g. ["127.0.0.1:50052"]'
)

# ggml's RPC client splits its endpoint at the first ':' (ggml-rpc.cpp, parse_endpoint), so no
# IPv6 address can name a server; a host name that resolves to one can.
RPC_IPV6 = (
    "an IPv6 address cannot name an RPC server: ggml's RPC client reads the host up to the first "
    '":"; give the server\'s host name (e.g. one from /etc/hosts) instead'
)

# Origins that stand for pages the owner cannot name: allowing one would let any page in.
_OPEN_ORIGINS = {
    "*": "list each origin; every web page would be one",
    "null": "it is the origin of sandboxed and file:// pages, which any web page can open",
}


@dataclass(frozen=True)
class Overrides:
    http: tuple[str, int] | None
    socket: Path | None
    arena: Path | None


@dataclass(frozen=True)
class DaemonValues:
    """The [daemon] table checked, before its defaults are resolved; None = the default."""

    http: tuple[str, int]
    socket: Path | None
    arena: Path | None
    journal: Path | None
    api_key: str
    allow_uids: frozenset[int]
    allow_origins: frozenset[str]
    api_socket: Path | None
    header_timeout_s: float
    vram_budget: int
    host_ram_budget_bytes: int = 0
    holder_timeout_s: float = HOLDER_TIMEOUT_S
    prompt_cache_budget_bytes: int = PROMPT_CACHE_BUDGET_BYTES
    responses_budget_bytes: int = RESPONSES_BUDGET_BYTES
    watch_config: bool = True
    queue_notice_s: float = QUEUE_NOTICE_S
    rpc_servers: tuple[str, ...] = ()
    turns: Turns = DEFAULT_TURNS

    def resolve(self, env: Mapping[str, str]) -> DaemonConfig:
        # Only defaults in use are resolved: they may need $XDG_RUNTIME_DIR, which the flags
        # or the file can make unnecessary.
        state_dir = xdg_home(env, "XDG_STATE_HOME", ".local/state") / APP_DIR
        socket = self.socket or runtime_dir(env) / SOCKET_FILE
        return DaemonConfig(
            http_host=self.http[0],
            http_port=self.http[1],
            socket=socket,
            arena=self.arena or default_arena(env),
            journal=self.journal or state_dir / JOURNAL_FILE,
            api_key=self.api_key,
            allow_uids=self.allow_uids,
            allow_origins=self.allow_origins,
            api_socket=self.api_socket or socket.parent / API_SOCKET_FILE,
            header_timeout_s=self.header_timeout_s,
            holder_timeout_s=self.holder_timeout_s,
            vram_budget=self.vram_budget,
            host_ram_budget_bytes=self.host_ram_budget_bytes,
            prompt_cache_budget_bytes=self.prompt_cache_budget_bytes,
            responses_budget_bytes=self.responses_budget_bytes,
            watch_config=self.watch_config,
            queue_notice_s=self.queue_notice_s,
            rpc_servers=self.rpc_servers,
            turns=self.turns,
        )


def daemon_table(src: Source, raw: object, overrides: Overrides) -> DaemonValues:
    if not isinstance(raw, dict):
        raise src.expected(("daemon",), "a table ([daemon])", raw)
    table = Table(src, ("daemon",), raw)
    table.check_keys(DAEMON_KEYS, lambda key, value: "")
    # Every key is checked, even one a flag overrides: the file must stay valid without flags.
    text = table.string("http", DEFAULT_HTTP, HTTP_EXPECTED)
    http = split_host_port(text)
    if http is None:
        raise src.expected(table.keys("http"), HTTP_EXPECTED, text)
    api_key = table.string(
        "api_key",
        "",
        'printable ASCII without spaces (a bearer token; "" = none)',
        ok=lambda v: v.isascii() and v.isprintable() and " " not in v,
        secret=True,
    )
    host = (overrides.http or http)[0]
    if not api_key and not is_loopback(host):
        raise src.fail(
            table.keys("api_key"),
            f"expected a key: the HTTP API would listen on {host}, which is not a loopback "
            "address, and the users of clients from other hosts cannot be known; set api_key "
            "(clients send it as a bearer token), or listen on 127.0.0.1",
        )
    header_timeout_s = table.seconds("header_timeout_s", HEADER_TIMEOUT_S)
    if not header_timeout_s:
        raise src.expected(
            table.keys("header_timeout_s"), "a number of seconds above 0", header_timeout_s
        )
    holder_timeout_s = table.seconds("holder_timeout_s", HOLDER_TIMEOUT_S)
    if not holder_timeout_s:
        raise src.expected(
            table.keys("holder_timeout_s"), "a number of seconds above 0", holder_timeout_s
        )
    socket, arena = table.optional_path("socket"), table.optional_path("arena")
    return DaemonValues(
        http=overrides.http or http,
        socket=overrides.socket or socket,
        arena=overrides.arena or arena,
        journal=table.optional_path("journal"),
        api_key=api_key,
        allow_uids=_allow_users(table),
        allow_origins=_allow_origins(table),
        api_socket=table.optional_path("api_socket"),
        header_timeout_s=header_timeout_s,
        vram_budget=table.size("vram_budget"),
        host_ram_budget_bytes=table.size("host_ram_budget"),
        prompt_cache_budget_bytes=table.size("prompt_cache_budget", PROMPT_CACHE_BUDGET_BYTES),
        responses_budget_bytes=table.size("responses_budget", RESPONSES_BUDGET_BYTES),
        holder_timeout_s=holder_timeout_s,
        watch_config=table.boolean("watch_config", True),
        queue_notice_s=table.seconds("queue_notice_s", QUEUE_NOTICE_S),
        rpc_servers=_rpc_servers(table),
        turns=_turns(table),
    )


def _turns(table: Table) -> Turns:
    """[daemon]'s turn keys (issue 43): switch_overhead a share strictly between 0 and 1,
    0 < min_turn_s ≤ max_turn_s, and max_wait_s per class, each above 0 and none shorter than
    max_turn_s (a turn longer than a class's bound would make its waiters wait past it)."""
    src = table.src
    overhead = table.values.get("switch_overhead", SWITCH_OVERHEAD)
    # bool is an int in Python; nan compares false both ways and is refused with the rest.
    if isinstance(overhead, bool) or not isinstance(overhead, int | float) or not 0 < overhead < 1:
        raise src.expected(
            table.keys("switch_overhead"), "a share of the time above 0 and below 1", overhead
        )
    min_turn_s = table.seconds("min_turn_s", MIN_TURN_S)
    if not min_turn_s:
        raise src.expected(table.keys("min_turn_s"), "a number of seconds above 0", min_turn_s)
    max_turn_s = table.seconds("max_turn_s", MAX_TURN_S)
    if max_turn_s < min_turn_s:
        raise src.expected(
            table.keys("max_turn_s"), f"at least min_turn_s ({min_turn_s:g} s)", max_turn_s
        )
    raw = table.values.get("max_wait_s", {})
    if not isinstance(raw, dict):
        raise src.expected(
            table.keys("max_wait_s"), f"a table of seconds by class ({PRIORITY_CHOICES})", raw
        )
    waits = Table(src, table.keys("max_wait_s"), raw)
    waits.check_keys(tuple(p.value for p in Priority), lambda key, value: "")
    bounds = []
    for priority in Priority:
        bound = waits.seconds(priority.value, MAX_WAIT_S[priority.rank])
        if bound < max_turn_s:
            raise src.expected(
                waits.keys(priority.value),
                f"at least max_turn_s ({max_turn_s:g} s): a turn may last that long",
                bound,
            )
        bounds.append(bound)
    return Turns(float(overhead), min_turn_s, max_turn_s, tuple(bounds))


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 without brackets) is this host's loopback."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # a host name: it may resolve to any address
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def _allow_users(table: Table) -> frozenset[int]:
    keys = table.keys("allow_users")
    expected = 'an array of user names or uids, e.g. ["alice", 1001]'
    value = table.values.get("allow_users", [])
    if not isinstance(value, list):
        raise table.src.expected(keys, expected, value)
    uids = set()
    for user in value:
        if isinstance(user, str):
            try:
                uids.add(pwd.getpwnam(user).pw_uid)
            except KeyError:
                raise table.src.fail(
                    keys, f"expected {expected}, got {describe(user)}: no such user"
                ) from None
        elif isinstance(user, int) and not isinstance(user, bool) and 0 <= user <= MAX_UID:
            uids.add(user)
        else:
            raise table.src.expected(keys, expected, user)
    return frozenset(uids)


def _allow_origins(table: Table) -> frozenset[str]:
    """Web origins as browsers send them in `Origin` (RFC 6454: lowercase, no path), lowercased
    here so that the file may write "http://LocalHost:3000"."""
    keys = table.keys("allow_origins")
    expected = (
        "an array of web origins, each SCHEME://HOST[:PORT] without a path or a trailing /, "
        'e.g. ["http://localhost:3000"]'
    )
    value = table.values.get("allow_origins", [])
    if not isinstance(value, list):
        raise table.src.expected(keys, expected, value)
    origins = set()
    for origin in value:
        if origin in _OPEN_ORIGINS:
            raise table.src.fail(
                keys, f"expected {expected}, got {describe(origin)}: {_OPEN_ORIGINS[origin]}"
            )
        if not isinstance(origin, str) or not ORIGIN_RE.fullmatch(origin):
            raise table.src.expected(keys, expected, origin)
        origins.add(origin.lower())
    return frozenset(origins)


def _rpc_servers(table: Table) -> tuple[str, ...]:
    """`[daemon] rpc_servers`: each "HOST:PORT" in the spelling an rpc: device id gives its
    server (paths.parse_device_id: the host lower-cased), once each."""
    keys = table.keys("rpc_servers")
    value = table.values.get("rpc_servers", [])
    if not isinstance(value, list):
        raise table.src.expected(keys, _RPC_SERVERS_EXPECTED, value)
    servers: dict[str, str] = {}  # each server as spelled here -> as the file spelled it
    for entry in value:
        if not isinstance(entry, str):
            raise table.src.expected(keys, _RPC_SERVERS_EXPECTED, entry)
        if _is_ipv6(entry.rpartition(":")[0]):
            raise table.src.fail(keys, f"{describe(entry)}: {RPC_IPV6}")
        try:
            device = parse_device_id(f"rpc:{entry}")
        except BadValueError:
            device = None
        if device is None or "/" in entry:
            raise table.src.expected(keys, _RPC_SERVERS_EXPECTED, entry)
        server = server_of(device)
        if server in servers:
            first = servers[server]
            same = "" if first == entry else f" (as {describe(first)})"
            raise table.src.fail(keys, f"{describe(entry)} is listed twice{same}")
        servers[server] = entry
    return tuple(servers)


def _is_ipv6(host: str) -> bool:
    """Whether `host` (of HOST:PORT) is an IPv6 address, bare or in brackets."""
    try:
        ipaddress.IPv6Address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    return True


def server_of(device: DeviceId) -> str:
    """The RPC server an rpc: device is on, as rpc_servers spells it: HOST:PORT."""
    return f"{device.host}:{device.port}"


def flag_http(text: str) -> tuple[str, int]:
    parsed = split_host_port(text)
    if parsed is None:
        raise BadValueError(f"--http: expected {HTTP_EXPECTED}, got {describe(text)}")
    return parsed


def split_host_port(text: str) -> tuple[str, int] | None:
    """("host", port) from "host:port" or "[v6addr]:port"; None when malformed."""
    host, colon, port_text = text.rpartition(":")
    if not colon or not port_text.isascii() or not port_text.isdigit():
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:  # a bare IPv6 address is ambiguous with its port
        return None
    if not host or "[" in host or "]" in host or any(c.isspace() for c in host):
        return None
    port = int(port_text)
    return (host, port) if 1 <= port <= 65535 else None


def home_dir(env: Mapping[str, str]) -> Path:
    raw = env.get("HOME", "")
    return Path(raw) if raw and Path(raw).is_absolute() else Path.home()


def xdg_home(env: Mapping[str, str], var: str, fallback: str) -> Path:
    # XDG Base Directory spec: a relative path in these variables is invalid and ignored.
    raw = env.get(var, "")
    return Path(raw) if raw and Path(raw).is_absolute() else home_dir(env) / fallback
