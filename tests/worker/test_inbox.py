"""The io side's inbox (worker/inbox.py): which commands run alone, what waits, and the cancels
the io thread records for the engine thread."""

from __future__ import annotations

import queue
import socket
import threading

import pytest

from arbiterd.arena.doorbell import Doorbell
from arbiterd.reply import WorkerStatus
from arbiterd.states import WorkerOp
from arbiterd.wire import LineReader, LineWriter
from arbiterd.worker.inbox import Command, Inbox


@pytest.mark.parametrize(
    ("request_", "alone"),
    [
        ({"kind": "completion", "prompt": "x"}, False),
        ({"kind": "embedding", "input": ["x"]}, True),
        ({"kind": "chat", "messages": [], "images": ["png"]}, True),
        ("not an object", False),  # joins the batch, and fails when it is read
    ],
)
def test_a_generate_with_images_or_embeddings_runs_alone(request_: object, alone: bool) -> None:
    assert Command(WorkerOp.GENERATE, "g", request=request_).runs_alone is alone


def test_what_waits_counts_the_deferred_command_and_the_deferred_goes_first() -> None:
    ours, theirs = socket.socketpair()
    try:
        doorbell = Doorbell()
        inbox = Inbox(
            LineReader(theirs), LineWriter(theirs), doorbell, lambda: WorkerStatus().to_json()
        )
        assert (inbox.waiting(), inbox.empty(), inbox.deferred) == (0, True, False)
        inbox.defer(Command(WorkerOp.WARM, "w"))
        inbox.request_stop()  # queues a shutdown, as a closed socket does
        assert inbox.waiting() == 2
        assert inbox.stopping.is_set()
        assert inbox.get().op is WorkerOp.WARM
        assert inbox.get().op is WorkerOp.SHUTDOWN
        with pytest.raises(queue.Empty):
            inbox.get(0.0)
        doorbell.close()
    finally:
        ours.close()
        theirs.close()


def test_the_io_thread_records_a_cancel_at_once_and_stops_the_worker_when_the_daemon_goes() -> None:
    ours, theirs = socket.socketpair()
    try:
        doorbell = Doorbell()
        inbox = Inbox(
            LineReader(theirs), LineWriter(theirs), doorbell, lambda: WorkerStatus().to_json()
        )
        io = threading.Thread(target=inbox.serve, name="worker-io", daemon=True)
        io.start()
        LineWriter(ours).send({"op": "cancel", "id": "c1", "target": "r1"})
        assert LineReader(ours).read() == {"id": "c1", "result": {"cancelled": "r1"}}
        assert inbox.is_cancelled("r1")  # recorded before it answered
        assert inbox.wake.is_set()
        inbox.forget_cancel("r1")
        assert not inbox.is_cancelled("r1")
        ours.close()  # the daemon is gone
        io.join(timeout=10)
        assert not io.is_alive()
        assert inbox.orphaned.is_set()
        assert inbox.get(0.0).op is WorkerOp.SHUTDOWN
        doorbell.close()
    finally:
        theirs.close()
