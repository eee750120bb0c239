"""Which members of a fitting set may be warm together (issue 44): the keeper's pure policy.

A fitting set is a group (groups.py) with a budget: the device bytes its members may hold at
once. A member that wants the GPU and fits beside the members admitted is admitted at once,
nobody releasing; one that does not fit has the members used least lately (`Use`: the requests
each began, the older counting less; then the least recently used) withdrawn until it does,
and is admitted once they have left (their bytes count while they are still warm). How long a
member told to leave stays is its own turn policy's (worker/policy.py), as for a waiter on the
arena's token: an idle one goes at once, a busy one finishes its turn, so two busy members that
do not fit together take turns, not a token each. A member larger than the whole budget is
admitted alone, and so is every member while the budget is 0 (not known yet, or no room left).
When the budget shrinks under what the admitted members hold, by more than a `tolerance`
(another program grew on the device; the daemon tolerates half the device's reserve, so that a
budget that wavers around what the members hold does not make them come and go), the least used
leave until it holds again; the last one stays. Without a budget (a
static group), every member that waits is admitted, as groups always were.

`plan` only decides; the keeper applies it (locks and unlocks each member's admit lock) and
calls it again whenever a member starts waiting or leaves the gate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# How fast a member's use is forgotten: a request it began counts half after this long.
USE_HALF_LIFE_S = 30.0
# Its text ("weight at", Use.to_text), as a member writes it into its in.lock.
USE_TEXT_MAX_BYTES = 49


@dataclass(frozen=True)
class Use:
    """How much a member was used lately: the requests it began, each counting less the older
    it is (halved every USE_HALF_LIFE_S), summed as of `at` (epoch s). A member that is asked
    for often stays; one asked for now and then leaves first, however recently."""

    weight: float = 0.0
    at: float = 0.0

    def weight_at(self, now: float) -> float:
        decay: float = 0.5 ** (max(0.0, now - self.at) / USE_HALF_LIFE_S)
        return self.weight * decay

    def began(self, now: float) -> Use:
        """After one more request began at `now`."""
        return Use(self.weight_at(now) + 1.0, now)

    def to_text(self) -> bytes:
        """Of one width always: written over the last in place, never cut short first (a
        reader between a truncate and the write would read no use at all)."""
        return f"{self.weight:24.6e} {self.at:24.6f}".encode()

    @classmethod
    def from_text(cls, text: bytes) -> Use:
        """As `to_text` wrote it; none (Use()) when it cannot be read."""
        try:
            weight, at = (float(part) for part in text.split())
        except ValueError:
            return cls()
        return cls(weight, at)


@dataclass(frozen=True)
class Member:
    """One member as the keeper sees it now."""

    name: str
    footprint: int | None  # the device bytes it holds warm, as it says; None: not known yet
    warm: bool  # inside the gate now
    waiting: bool  # waits to be warm
    admitted: bool  # the keeper holds its admit.lock
    waiting_since: float = 0.0  # when the keeper first saw it waiting: first come, first in
    use: Use = Use()  # how much it was used lately: the least used leaves first


@dataclass(frozen=True)
class Plan:
    admit: frozenset[str] = frozenset()
    withdraw: frozenset[str] = frozenset()


def plan(budget: int | None, members: list[Member], now: float, *, tolerance: int = 0) -> Plan:
    """What to change at `now` (epoch s): who is admitted, whose admission is withdrawn (see
    the module); the admitted may hold up to `tolerance` bytes past the budget before any is
    made to leave for it (not for a waiter: a waiter comes in only within the budget)."""
    if budget is None:
        return Plan(admit=frozenset(m.name for m in members if m.waiting and not m.admitted))
    if budget <= 0:  # each alone: every member takes the whole of a budget of one byte
        budget, tolerance = 1, 0
        members = [dataclasses.replace(m, footprint=None) for m in members]
    admitted = {m.name: m for m in members if m.admitted}
    # Bytes held or promised: every admitted member's, and a warm one's whose admission is
    # already withdrawn (until it has left: `leaving`, room that is coming).
    leaving = sum(_size(m, budget) for m in members if not m.admitted and m.warm)
    held = sum(_size(m, budget) for m in admitted.values())
    withdraw: set[str] = set()
    # The least used lately first, then the least recently used.
    by_use = sorted(admitted.values(), key=lambda m: (m.use.weight_at(now), m.use.at, m.name))
    for member in by_use[:-1]:  # the budget shrank: the last one admitted stays whatever it is
        if held <= budget + tolerance:
            break
        withdraw.add(member.name)
        held -= _size(member, budget)
        leaving += _size(member, budget)  # held until it has left
    used = leaving + held
    admit: set[str] = set()
    queue = sorted(
        (m for m in members if m.waiting and not m.admitted),
        key=lambda m: (m.waiting_since, m.name),
    )
    for member in queue:
        need = _size(member, budget)
        if used + need <= budget:
            admit.add(member.name)
            used += need
            continue
        # Make room, in the same order.
        room = budget - used + leaving
        for candidate in by_use:
            if room >= need:
                break
            if candidate.name not in withdraw:
                withdraw.add(candidate.name)
                room += _size(candidate, budget)
        break  # first come, first in: nobody passes the first that must wait
    return Plan(frozenset(admit), frozenset(withdraw))


def _size(member: Member, budget: int) -> int:
    """A member's bytes; unknown, or larger than the budget, it takes the whole budget."""
    if member.footprint is None:
        return budget
    return min(member.footprint, budget)
