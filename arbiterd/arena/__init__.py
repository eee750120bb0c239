"""The arena: one GPU's token, held with flock(2), and "someone wants it" kept as kernel lock state.

Owns the files of an arena directory and every lock taken on them. Its modules:

    records     what is read and written: QueuedWaiter, HolderInfo, ArenaState, and the
                protocols of a way to the GPU (Gateway, Place, Hold); a waiter's class
                (Priority) is the shared vocabulary's, arbiterd/states.py
    token       Arena (the directory, its queue, observing it), Ticket and Token
    groups      models that hold the GPU together: a group's gate inside an arena (issue 14)
    fitting     which members of a fitting set may be warm together: the keeper's pure policy
                (issue 44)
    devices     a model on several devices: their arenas taken in one order, held together
                (issue 27; paths.py names the devices and finds each one's arena)
    doorbell    sleeping until the arena's files say someone may want the GPU (inotify,
                issue 29), instead of probing the locks on a timer
    locks       the flock(2) calls: the only module of arbiterd that imports `fcntl`
    procfs      reading /proc/locks, /proc/PID/fdinfo and /proc/PID/stat

The protocol is specified in docs/arena-protocol.md; in short:

    token.lock   LOCK_EX by the holder: a program is resident on the GPU iff it holds this
    want.lock    LOCK_SH by every waiter while it waits; dropped only after the token is owned
    holder.json  who holds the token (pid, name, model, since, command_pid); informational,
                 written by rename
    queue/*      one ticket file per queued waiter, PRIORITY.SINCE_NS.PID.THREAD.ticket, held
                 LOCK_EX by it while it waits (its content names the waiter, informational
                 as holder.json is): the token goes to the first live ticket in the
                 order (arrival, put back one aging period per class below interactive). A
                 waiter waits for the ticket just ahead of it to go, and only the first one
                 blocks on token.lock; a waiter ahead that is stopped, or leaves the token free,
                 is passed over (below). Programs that speak only token.lock + want.lock take no
                 ticket and race the first waiter.

Invariants kept here (each one cost a hang in an earlier design):
- Lock files are created once and never unlinked: unlinking splits later lockers across two
  inodes, and then two programs can hold "the" token at once.
- The holder asks "wanted?" with LOCK_EX|LOCK_NB on its *own* open file description of
  want.lock. flock locks belong to open file descriptions; a second flock on a description that
  already holds a lock converts that lock instead of conflicting with it.
- EWOULDBLOCK/EAGAIN is contention, never an error.
- A ticket is locked before it is visible (created under a dot name, locked, renamed) and
  unlinked before it is unlocked: a ticket file that is not locked is a dead waiter's, and any
  waiter may remove it.
- The order of two tickets never changes while both wait (QueuedWaiter.order is fixed by the
  name): a waiter only ever waits on a ticket ahead of it, so no two can wait on each other.
  (Issue 24: when aging reordered tickets as they waited, one that aged past the ticket it was
  blocked on was in turn waited on by that ticket's owner, both for good, the GPU free.)
- A waiter ahead that cannot take the free token does not hold up the ones behind it (issue 40
  item 1: a first waiter stopped with Ctrl-Z or SIGSTOP left the GPU free 45 s, everyone else
  blocked on its ticket). The waiter just behind it looks every STALL_CHECK_S: one whose
  process is stopped (/proc/PID/stat `T`/`t`: the kernel only wakes a flock waiter, which must
  run to take the lock) is passed over at once; one that leaves the token free for PASS_OVER_S
  (its process hangs, or it keeps its ticket while it does something else) is passed over
  then, for the rest of that wait. Passed over, a waiter **keeps its ticket and its place**:
  it did nothing wrong but be slow, so it is served first once it can take (a stopped one that
  runs again is first again: a waiter that passed it gives the token back if it has not
  returned with it yet, and it is next otherwise), and nobody has to queue anew, which a
  kept ticket (Arena.queue) could not do without losing the place it was kept for. Each take
  logs the waiters it passed over once, and the holder gets them (Token.passed_over). A
  stopped waiter also wants nothing: a holder's `wanted()` looks past it, or every holder
  would release for it, for nobody.
- A process that dies holds nothing: the kernel drops its locks, so nothing can go stale except
  holder.json, which readers check against the live lock owner in /proc/locks. (A process it
  shared the locked description with, such as `arbiterd run`'s CMD, keeps the token alive.)
- Whoever can write an arena file can take, block or fake the token (issue 10 item 6). Every
  file is opened with O_NOFOLLOW and checked on the opened descriptor (fstat: no window between
  check and use): ours, regular, not writable by group or others; a refusal names the file and
  the one-line fix. Temp files are created with O_EXCL in the arena folder, which
  paths.ensure_private_dir keeps ours and 0700.
"""

from arbiterd.arena.devices import (
    Devices,
    DevicesHold,
    DevicesPlace,
    canonical_order,
    device_arenas,
    over_devices,
)
from arbiterd.arena.procfs import parse_proc_locks
from arbiterd.arena.records import (
    ArenaState,
    Gateway,
    Hold,
    HolderInfo,
    PassedOver,
    Place,
    QueuedWaiter,
)
from arbiterd.arena.token import QUEUE_DIR, Arena, Ticket, Token

__all__ = [
    "QUEUE_DIR",
    "Arena",
    "ArenaState",
    "Devices",
    "DevicesHold",
    "DevicesPlace",
    "Gateway",
    "Hold",
    "HolderInfo",
    "PassedOver",
    "Place",
    "QueuedWaiter",
    "Ticket",
    "Token",
    "canonical_order",
    "device_arenas",
    "over_devices",
    "parse_proc_locks",
]
