"""Desktop notifications: one bubble at a time, each replacing the last; the real D-Bus call."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pytestqt.qtbot import QtBot

from arbiterd.events import HandoffEvent, ResidencyEvent, VramNotFreedEvent, WorkerEvent
from arbiterd.gui.notify import (
    SIGNATURE,
    BusNotifications,
    FailureNotifier,
    notify_command,
    parse_notify_reply,
    session_bus_available,
)
from arbiterd.states import ResidencyState
from tests.gui.fakes import RecordingSink
from tests.support.waiting import wait_until

SERVER = Path(__file__).parent / "notification_server.py"
CRASH = WorkerEvent(at=1.0, model="a", code=1, reason="exited with code 1")
NOT_FREED = VramNotFreedEvent(at=2.0, model="b")


def test_the_first_failure_replaces_nothing_the_next_replaces_it() -> None:
    sink = RecordingSink()
    notifier = FailureNotifier(sink)
    assert notifier.event(CRASH)
    assert notifier.event(NOT_FREED)
    assert [replaces for _, _, replaces in sink.calls] == [0, 101]


def test_ordinary_events_do_not_notify() -> None:
    sink = RecordingSink()
    notifier = FailureNotifier(sink)
    assert not notifier.event(HandoffEvent(at=1.0, from_model="a", to_model="b"))
    assert not notifier.event(ResidencyEvent(at=1.0, model="a", to_state=ResidencyState.COLD))
    assert sink.calls == []


def test_failures_during_a_call_fold_into_one_that_replaces_it() -> None:
    sink = RecordingSink(manual=True)
    notifier = FailureNotifier(sink)
    notifier.event(CRASH)
    notifier.event(NOT_FREED)  # the first call has no id yet: this one waits for it
    notifier.event(replace(CRASH, model="c"))
    assert len(sink.calls) == 1
    sink.answer(41)
    summary, body, replaces = sink.calls[1]
    assert (summary, replaces) == ("2 failures", 41)
    assert body.splitlines() == [
        "VRAM not freed: b released the GPU but its memory is still in use",
        "Worker crashed: c: exited with code 1",
    ]


def test_a_call_that_failed_keeps_the_last_id() -> None:
    sink = RecordingSink(manual=True)
    notifier = FailureNotifier(sink)
    notifier.event(CRASH)
    sink.answer(5)
    notifier.event(CRASH)
    sink.answer(0)  # the server could not be reached: no new id
    notifier.event(CRASH)
    assert sink.calls[-1][2] == 5


def test_without_a_sink_failures_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    assert FailureNotifier(None).event(CRASH)
    assert "Worker crashed: a: exited with code 1" in caplog.text


def test_the_busctl_call_states_the_signature() -> None:
    argv = notify_command("/usr/bin/busctl", "Model failed", "a -1 b", 9)
    assert argv[:5] == ["/usr/bin/busctl", "--user", "--timeout=5", "call", "--"]
    assert argv[5:10] == [
        "org.freedesktop.Notifications",
        "/org/freedesktop/Notifications",
        "org.freedesktop.Notifications",
        "Notify",
        SIGNATURE,
    ]
    assert argv[10:] == ["arbiterd", "9", "arbiterd", "Model failed", "a -1 b", "0", "0", "-1"]


def test_the_gdbus_call_quotes_every_string() -> None:
    argv = notify_command("gdbus", 'say "hi"', "line\nnext \\ end", 0)
    assert argv[-8:] == [
        '"arbiterd"',
        "uint32 0",
        '"arbiterd"',
        '"say \\"hi\\""',
        '"line\\nnext \\\\ end"',
        "@as []",
        "@a{sv} {}",
        "int32 -1",
    ]


@pytest.mark.parametrize(("output", "expected"), [("u 42\n", 42), ("(uint32 7,)\n", 7), ("", None)])
def test_the_id_is_read_from_either_tool(output: str, expected: int | None) -> None:
    assert parse_notify_reply(output) == expected


def test_a_session_bus_is_found_by_address_or_in_the_runtime_dir(tmp_path: Path) -> None:
    assert session_bus_available({"DBUS_SESSION_BUS_ADDRESS": "unix:path=/x"})
    assert not session_bus_available({"XDG_RUNTIME_DIR": str(tmp_path)})
    (tmp_path / "bus").touch()
    assert session_bus_available({"XDG_RUNTIME_DIR": str(tmp_path)})


# -- against a real bus ----------------------------------------------------------------------------


class Bus:
    """A private dbus-daemon with the stand-in notification server on it."""

    def __init__(self, directory: Path) -> None:
        self.socket = directory / "bus"
        self.address = f"unix:path={self.socket}"
        config = directory / "bus.conf"
        config.write_text(
            '<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"'
            ' "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">'
            f"<busconfig><type>session</type><listen>{self.address}</listen>"
            '<policy context="default"><allow send_destination="*"/><allow receive_sender="*"/>'
            '<allow own="*"/>'
            "</policy></busconfig>"
        )
        self.daemon = subprocess.Popen(
            ["dbus-daemon", f"--config-file={config}", "--nofork", "--nopidfile"],
            stdout=subprocess.DEVNULL,
        )
        self.server: subprocess.Popen[str] | None = None
        try:
            wait_until(self.socket.exists, 10, "dbus-daemon's socket")
            env = {**os.environ, "DBUS_SESSION_BUS_ADDRESS": self.address}
            self.server = subprocess.Popen(
                [sys.executable, str(SERVER)], stdout=subprocess.PIPE, text=True, env=env
            )
            assert self.server.stdout is not None
            assert json.loads(self.server.stdout.readline()) == {"ready": True}
        except BaseException:
            self.close()
            raise

    def calls(self, count: int) -> list[dict[str, Any]]:
        assert self.server is not None
        assert self.server.stdout is not None
        return [json.loads(self.server.stdout.readline()) for _ in range(count)]

    def close(self) -> None:
        for process in (self.server, self.daemon):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
            if process is not None:
                process.wait(timeout=10)
        if self.server is not None and self.server.stdout is not None:
            self.server.stdout.close()


@pytest.fixture
def bus(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Bus]:
    if shutil.which("dbus-daemon") is None:
        pytest.skip("no dbus-daemon to run a private bus")
    private = Bus(short_dir)
    monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", private.address)
    yield private
    private.close()


@pytest.mark.parametrize("tool", ["busctl", "gdbus"])
def test_a_real_notification_server_gets_the_spec_signature_and_replaces(
    qtbot: QtBot, bus: Bus, tool: str
) -> None:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"no {tool}")
    sink = BusNotifications(path)
    notifier = FailureNotifier(sink)
    notifier.event(CRASH)
    qtbot.waitUntil(lambda: notifier.last_id == 7, timeout=10_000)
    notifier.event(NOT_FREED)
    first, second = bus.calls(2)
    assert first["signature"] == second["signature"] == SIGNATURE
    assert (first["replaces_id"], first["summary"]) == (0, "Worker crashed")
    assert (second["replaces_id"], second["summary"]) == (7, "VRAM not freed")
    qtbot.waitUntil(lambda: not notifier.busy, timeout=10_000)
    assert notifier.last_id == 7  # the server kept the bubble's id
    sink.close()
