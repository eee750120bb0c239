"""The tables of how models share: [groups.NAME] (models that hold the GPU together,
arena/groups.py), [devices.ID] (a device's fitting set, issue 44: the models placed on it alone,
in no group; and the lease of an RPC server's device, issue 46) and [yield] (the programs the
daemon steps aside for, issue 45). Each is read after [models], whose names it refers to.

Every problem is a ConfigError naming the file, the key path and what was expected.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from arbiterd.config.modeltable import (
    priority_of,
)
from arbiterd.config.records import (
    DEFAULT_DEVICE_RESERVE,
    FITTING_GROUP,
    YIELD_GRACE_S,
    YIELD_IGNORE,
    YIELD_MIN_BYTES,
    YIELD_PROGRAMS,
    YIELD_SCAN_S,
    Config,
    DeviceConfig,
    GroupConfig,
    LeaseConfig,
    ModelConfig,
    YieldRules,
)
from arbiterd.errors import BadValueError
from arbiterd.lease.channel import split_address
from arbiterd.paths import (
    DEFAULT_DEVICE,
    DEVICE_ID_SHAPES,
    DeviceId,
    DeviceKind,
    parse_device_id,
)
from arbiterd.render import format_bytes
from arbiterd.tomltable import (
    MISSING,
    SIZE_EXPECTED,
    Keys,
    Source,
    Table,
    describe,
    dotted,
    toml_string,
)

GROUP_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

GROUP_NAME_EXPECTED = "a name of 1 to 64 characters from A-Z a-z 0-9 . _ -, not starting with . _ -"

GROUP_KEYS = ("models", "priority")

DEVICE_KEYS = ("memory", "reserve", "lease", "lease_key_file", "uploads")
UPLOADS = ("bytes", "hashes")

YIELD_KEYS = ("enabled", "programs", "ignore", "min_bytes", "grace_s", "scan_s", "nodes")


def yield_table(src: Source, raw: object) -> YieldRules:
    if not isinstance(raw, dict):
        raise src.expected(("yield",), "a table ([yield])", raw)
    table = Table(src, ("yield",), raw)
    table.check_keys(YIELD_KEYS, lambda key, value: "")
    scan_s = table.seconds("scan_s", YIELD_SCAN_S)
    if scan_s < 0.1:
        raise src.expected(table.keys("scan_s"), "at least 0.1 seconds", scan_s)
    return YieldRules(
        enabled=table.boolean("enabled", True),
        programs=_globs(table, "programs", YIELD_PROGRAMS),
        ignore=_globs(table, "ignore", YIELD_IGNORE),
        min_bytes=table.size("min_bytes", YIELD_MIN_BYTES),
        grace_s=table.seconds("grace_s", YIELD_GRACE_S),
        scan_s=scan_s,
        nodes=_nodes(table),
    )


def _nodes(table: Table) -> tuple[Path, ...]:
    value = table.values.get("nodes", [])
    expected = 'a list of device node paths (e.g. ["/dev/dri/renderD128"])'
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise table.src.expected(table.keys("nodes"), expected, value)
    return tuple(table.src.path(table.keys("nodes"), v, expected) for v in value)


def _globs(table: Table, key: str, default: tuple[str, ...]) -> tuple[str, ...]:
    value = table.values.get(key, list(default))
    expected = 'a list of program names or globs (e.g. ["blender", "*comfyui*"])'
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise table.src.expected(table.keys(key), expected, value)
    return tuple(value)


def group_tables(
    src: Source, raw: object, models: Mapping[str, ModelConfig]
) -> dict[str, GroupConfig]:
    if not isinstance(raw, dict):
        raise src.expected(("groups",), "tables ([groups.NAME] with models = [...])", raw)
    groups: dict[str, GroupConfig] = {}
    member_of: dict[str, str] = {}
    for name, values in raw.items():
        where: Keys = ("groups", name)
        if not GROUP_NAME_RE.fullmatch(name):
            raise src.expected(where, GROUP_NAME_EXPECTED, name)
        if name == FITTING_GROUP:
            raise src.fail(
                where, f"{describe(name)} is the name of a device's fitting set ([devices.ID])"
            )
        if not isinstance(values, dict):
            raise src.expected(where, 'a table ([groups.NAME] with models = ["a", "b"])', values)
        table = Table(src, where, values)
        table.check_keys(GROUP_KEYS, lambda key, value: "")
        expected = "an array of two or more names from [models]"
        members = values.get("models", MISSING)
        if (
            not isinstance(members, list)
            or len(members) < 2
            or not all(isinstance(m, str) for m in members)
        ):
            raise src.expected(table.keys("models"), expected, members)
        for member in members:
            if member not in models:
                known = ", ".join(models)
                raise src.fail(
                    table.keys("models"), f"{describe(member)} is no model (models: {known})"
                )
            if member in member_of:
                other = member_of[member]
                where_else = "this group" if other == name else dotted(("groups", other))
                raise src.fail(
                    table.keys("models"),
                    f"{describe(member)} is already in {where_else}; "
                    "a model belongs to one group at most",
                )
            member_of[member] = name
            placed = models[member].devices
            if placed != (DEFAULT_DEVICE,):
                shown = ", ".join(toml_string(device) for device in placed)
                raise src.fail(
                    table.keys("models"),
                    f"{describe(member)} is placed on devices = [{shown}]; a group's models "
                    f'must be on "{DEFAULT_DEVICE}" (the default): groups across devices are '
                    "not built yet",
                )
        highest = min((models[m].priority for m in members), key=lambda p: p.rank)
        priority = priority_of(table) if "priority" in values else highest
        groups[name] = GroupConfig(name, tuple(members), priority)
    return groups


def device_tables(
    src: Source, raw: object, models: Mapping[str, ModelConfig]
) -> dict[str, DeviceConfig]:
    """The [devices.ID] tables, each with its fitting set's members: the models placed on that
    device alone, in no [groups] table."""
    if not isinstance(raw, dict):
        raise src.expected(("devices",), 'tables ([devices.gpu0] memory = "8GiB")', raw)
    devices: dict[str, DeviceConfig] = {}
    for text, values in raw.items():
        where: Keys = ("devices", text)
        try:
            parsed = parse_device_id(text)
        except BadValueError:
            raise src.expected(where, f"a device id ({DEVICE_ID_SHAPES})", text) from None
        device = str(parsed)
        if not isinstance(values, dict):
            raise src.expected(where, 'a table ([devices.gpu0] memory = "8GiB")', values)
        table = Table(src, where, values)
        table.check_keys(DEVICE_KEYS, lambda key, value: "")
        memory = None
        if "memory" in values:
            memory = table.size("memory")
            if memory <= 0:
                raise src.expected(table.keys("memory"), f"more than 0: {SIZE_EXPECTED}", memory)
        reserve = table.size("reserve", DEFAULT_DEVICE_RESERVE)
        if memory is not None and reserve >= memory:
            raise src.fail(
                table.keys("reserve"),
                f"{format_bytes(reserve)} is not less than the device's memory "
                f"({format_bytes(memory)}): nothing would be left for its models",
            )
        members = tuple(
            name for name, model in models.items() if model.devices == (device,) and not model.group
        )
        lease = _lease(src, table, parsed)
        uploads = table.string("uploads", "bytes", '"bytes" or "hashes"', ok=UPLOADS.__contains__)
        if uploads == "hashes" and parsed.kind is not DeviceKind.RPC:
            raise src.fail(
                table.keys("uploads"),
                f"{device} is this machine's own device: only an RPC server is sent weights "
                "by hash",
            )
        devices[device] = DeviceConfig(
            device, memory, members, reserve, lease, hash_uploads=uploads == "hashes"
        )
    return devices


def hashed_servers(config: Config, model: ModelConfig) -> tuple[str, ...]:
    """The RPC servers of `model`'s devices that are sent weights by hash first (`[devices.ID]
    uploads = "hashes"`), as HOST:PORT: the worker's ARBITERD_RPC_HASH_UPLOADS."""
    return tuple(
        endpoint
        for device in model.devices
        if (table := config.devices.get(device)) is not None
        and table.hash_uploads
        and (endpoint := table.endpoint) is not None
    )


def _lease(src: Source, table: Table, device: DeviceId) -> LeaseConfig | None:
    """`lease` and `lease_key_file`: both or neither, on an rpc: device."""
    if "lease" not in table.values:
        if "lease_key_file" in table.values:
            raise src.fail(table.keys("lease_key_file"), "is given without lease")
        return None
    lender = table.string("lease", "", "HOST:PORT, the lender's lease channel")
    try:
        split_address(lender, "lease")
    except BadValueError:
        raise src.expected(
            table.keys("lease"), "HOST:PORT (the lender's --lease)", lender
        ) from None
    if device.kind is not DeviceKind.RPC:
        raise src.fail(
            table.keys("lease"),
            f"{device} is this machine's own device: only an RPC server's (rpc:HOST:PORT) is lent",
        )
    if "lease_key_file" not in table.values:
        raise src.fail(
            table.keys("lease_key_file"),
            "is required with lease: the file of the key the lender's --key-file holds",
        )
    text = table.string("lease_key_file", "", "a path")
    return LeaseConfig(lender, src.path(table.keys("lease_key_file"), text, "a path"))
