"""The shared vocabulary (arbiterd/states.py): tolerant reading, the two transition tables, and
no module but it and the codec naming a state, op, status, reason or kind as a string to
compare."""

from __future__ import annotations

import ast
import enum
import re
from pathlib import Path
from typing import Any

import pytest

import arbiterd
from arbiterd import states
from arbiterd.states import (
    RESIDENCY_TRANSITIONS,
    SLOT_TRANSITIONS,
    Priority,
    ResidencyState,
    SlotState,
)

# Every Enum of the vocabulary, found rather than listed: a new one is checked from the day it
# lands. Those with an UNKNOWN member read a value they do not know as it.
ENUMS = tuple(
    kind
    for kind in vars(states).values()
    if isinstance(kind, type) and issubclass(kind, enum.Enum) and kind.__module__ == states.__name__
)
TOLERANT = tuple(kind for kind in ENUMS if "UNKNOWN" in kind.__members__)


def test_the_vocabulary_is_found_and_the_inputs_among_it_are_strict() -> None:
    assert {ResidencyState, SlotState, Priority} <= set(ENUMS)
    assert not issubclass(Priority, states._Tolerant)  # a config value or header, refused
    with pytest.raises(ValueError, match="urgent"):
        Priority("urgent")


@pytest.mark.parametrize("kind", TOLERANT)
def test_a_value_this_version_does_not_know_reads_as_unknown(kind: Any) -> None:
    assert kind("a-state-from-a-newer-version") is kind.UNKNOWN


@pytest.mark.parametrize("kind", ENUMS)
def test_every_known_value_reads_as_its_member(kind: Any) -> None:
    for member in kind:
        assert kind(member.value) is member
        assert member == member.value  # StrEnum: serialises as its value


@pytest.mark.parametrize(
    ("table", "kind"), [(RESIDENCY_TRANSITIONS, ResidencyState), (SLOT_TRANSITIONS, SlotState)]
)
def test_the_tables_cover_every_state_and_never_lead_to_or_from_unknown(
    table: dict[Any, frozenset[Any]], kind: Any
) -> None:
    assert set(table) == set(kind)
    assert table[kind.UNKNOWN] == frozenset()
    assert all(kind.UNKNOWN not in targets for targets in table.values())
    assert all(
        kind.STOPPED in targets
        for state, targets in table.items()
        if state not in (kind.STOPPED, kind.UNKNOWN)
    )


# -- no state compared as a string outside the vocabulary and the codecs ------------------------

ARBITERD = Path(arbiterd.__file__).parent
VALUES = frozenset(member.value for kind in ENUMS for member in kind)
STATES = frozenset(member.value for kind in (ResidencyState, SlotState) for member in kind)
# An operand that holds one of these names: a state, a residency, a status or outcome, an op, a
# backend or kind, a reason, a priority, a control command, an event's from and to.
NAMES_A_STATE = re.compile(
    r"state|residency|status|outcome|backend|kind|reason|priority|command"
    r"|\bop\b|\bto\b|\bfrom\b"
)
_COMPARISONS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)
# Where the names are strings by right: the vocabulary, and the codec that reads and writes them.
CODECS = frozenset({"states.py", "events.py", "fields.py"})


def _literals(node: ast.expr) -> frozenset[str]:
    """The strings `node` writes: one string constant, or a tuple, list or set of them (else
    none)."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    strings = set()
    for item in items:
        if not (isinstance(item, ast.Constant) and isinstance(item.value, str)):
            return frozenset()
        strings.add(item.value)
    return frozenset(strings)


def string_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, code) of each comparison of a state, op, status or kind with its name as a string
    literal (`event.to_state == "warm"`, `m.get("state") not in ("failed", "stopped")`), and of
    each tuple, list or set of two or more state names as strings (`s in ("warm", "cold")`,
    `TROUBLE = frozenset({"failed", "restarting"})`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            names = _literals(node)
            if len(names) > 1 and names <= STATES:  # states declared again, as strings
                found.append((node.lineno, ast.unparse(node)))
        if not isinstance(node, ast.Compare):
            continue
        lefts = [node.left, *node.comparators[:-1]]
        for op, left, right in zip(node.ops, lefts, node.comparators, strict=True):
            if not isinstance(op, _COMPARISONS):
                continue
            for literal, other in ((right, left), (left, right)):
                names = _literals(literal)
                if not names & VALUES:
                    continue
                if NAMES_A_STATE.search(ast.unparse(other)):
                    found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def _hits() -> dict[str, list[tuple[int, str]]]:
    hits = {}
    for path in sorted(ARBITERD.rglob("*.py")):
        name = path.relative_to(ARBITERD).as_posix()
        found = string_comparisons(path.read_text())
        if found and name not in CODECS:
            hits[name] = found
    return hits


def test_the_check_sees_each_way_of_comparing_a_state_as_a_string() -> None:
    source = (
        'a = event.to_state == "warm"\n'
        'b = m.get("state") not in ("failed", "stopped")\n'
        'c = all(s in ("warm", "cold") for s in states)\n'
        'd = "ready" != slot.state\n'
        'e = command.op == "generate"\n'
        'f = backend.kind == "in-place"\n'
        'g = event.status != "ok"\n'
        'h = frozenset({"failed", "restarting"})\n'
        'i = kind == "chat"\n'
        'j = event.release_reason != "preempted"\n'
        'k = waiter.priority in ("batch", "normal")\n'
        'l = request.command == "hello"\n'
        # Not states: a key, a state compared as a member, names that are not all states.
        'm = "state" in message\n'
        "n = event.to_state is ResidencyState.WARM\n"
        'o = ("warm", "release", "pin")\n'
    )
    assert sorted({line for line, _ in string_comparisons(source)}) == list(range(1, 13))


def test_no_module_compares_a_state_as_a_string_outside_the_vocabulary_and_its_codec() -> None:
    outside = {f"{name}:{line}: {code}" for name, found in _hits().items() for line, code in found}
    assert not outside, "compare the states.py member instead:\n" + "\n".join(sorted(outside))
