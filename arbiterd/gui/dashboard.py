"""The dashboard window: who holds the GPU, VRAM by owner over time, every handoff, each model.

    header     holder (a group: its members) · VRAM used/total · waiters · engine
               host RAM of its budget · prompt cache on disk of its budget
               [Hold GPU (game mode)] [Start daemon]
    banners    warnings and the setup's notices, each once (amber), daemon unreachable (red), the
               last command's error
    timeline   timeline.TimelineWidget
    cards      one per model: state (how it holds the GPU, alone or with its group, and its
               turn), VRAM (RAM where the engine runs on the CPU), host RAM, queue, the batch it
               decodes, pinned, group, backend, its projector's last steps and last error;
               Warm / Release / Pin; dimmed while unloaded, saying whether its prompt cache is
               on disk; "unknown" while the daemon cannot be reached
    table      handoffs, waits behind other programs and vision requests' projector steps:
               time, from → to (or what the projector did), release / wait / restore / total,
               bytes, tokens; a model the daemon does not serve now (another daemon's, in a
               journal both wrote) is marked "(NAME not served now)", and has no band

Owns the window's widgets and how a `TrayState` shows in them. It sends nothing itself: its
buttons emit `command_requested(command, model)` and `start_daemon_requested()`, and the tray
app decides (so without a system tray the dashboard still steers the daemon).
"""

from __future__ import annotations

import time

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtGui import QCloseEvent
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QSizePolicy,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from arbiterd import render
from arbiterd.gui import palette
from arbiterd.gui.history import EncoderRecord, HandoffRecord
from arbiterd.gui.palette import RGB, hex_colour
from arbiterd.gui.state import TrayState
from arbiterd.gui.timeline import TimelineWidget
from arbiterd.status import ModelStatus

CARD_COLUMNS = 4
SCREENSHOT_SIZE = QSize(1120, 820)
TABLE_COLUMNS = (
    "Time",
    "Handoff",
    "Release",
    "Wait",
    "Restore",
    "Total",
    "Bytes",
    "Tokens evaluated",
)

_STYLE = f"""
QWidget#dashboard, QWidget#cards {{ background: {hex_colour(palette.PANEL)}; }}
QWidget#dashboard QLabel {{ color: {hex_colour(palette.TEXT)}; }}
QLabel#headline {{ font-size: 15pt; font-weight: bold; }}
QLabel#warning {{ background: {hex_colour(palette.AMBER)}; color: #1b1b1b; padding: 4px 8px;
                  border-radius: 4px; }}
QLabel#unreachable {{ background: {hex_colour(palette.RED)}; color: white; padding: 4px 8px;
                      border-radius: 4px; }}
QLabel#message {{ background: #3a3f47; padding: 4px 8px; border-radius: 4px; }}
QFrame#card {{ background: #26292e; border-radius: 6px; }}
QLabel#cardError {{ color: #ff8a80; }}
QFrame#card[dimmed="true"] {{ background: #222428; }}
QFrame#card[dimmed="true"] QLabel {{ color: #80858d; }}
QPushButton {{ background: #3a3f47; color: {hex_colour(palette.TEXT)}; border: 1px solid #4b5058;
               border-radius: 4px; padding: 3px 10px; }}
QPushButton:checked {{ background: #5c6470; }}
QPushButton:disabled {{ color: #777; }}
QTableWidget {{ background: #26292e; color: {hex_colour(palette.TEXT)};
                gridline-color: #3a3f47; border: none; }}
QHeaderView::section {{ background: #3a3f47; color: {hex_colour(palette.TEXT)}; border: none;
                        padding: 3px; }}
"""


class ModelCard(QFrame):
    command_requested = Signal(str, object)  # command, model

    def __init__(self, name: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.name = name
        self.setObjectName("card")
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        outer = QHBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        self.stripe = QFrame()
        self.stripe.setFixedWidth(5)
        outer.addWidget(self.stripe)
        layout = QVBoxLayout()
        layout.setContentsMargins(8, 8, 10, 8)
        outer.addLayout(layout, 1)
        title = QLabel(name)
        title.setStyleSheet("font-weight: bold; font-size: 11pt;")
        self.state = QLabel()
        self.vram = QLabel()
        self.host_ram = QLabel()
        self.state.setWordWrap(True)
        self.queue = QLabel()
        self.encoder = QLabel()  # a vision model's projector at its last image (issue 12)
        self.encoder.setWordWrap(True)
        self.encoder.hide()
        self.error = QLabel()
        self.error.setObjectName("cardError")
        self.error.setWordWrap(True)
        widgets = (title, self.state, self.vram, self.host_ram, self.queue, self.encoder)
        for widget in (*widgets, self.error):
            layout.addWidget(widget)
        layout.addStretch(1)
        buttons = QHBoxLayout()
        self.warm = QPushButton("Warm")
        self.release = QPushButton("Release")
        self.pin = QPushButton("Pin")
        self.pin.setCheckable(True)
        for button in (self.warm, self.release, self.pin):
            buttons.addWidget(button)
        layout.addLayout(buttons)
        self.warm.clicked.connect(lambda: self.command_requested.emit("warm", self.name))
        self.release.clicked.connect(lambda: self.command_requested.emit("release", self.name))
        self.pin.clicked.connect(
            lambda checked: self.command_requested.emit("pin" if checked else "unpin", self.name)
        )

    @property
    def dimmed(self) -> bool:
        return self.property("dimmed") is True

    def _set_dimmed(self, dimmed: bool) -> None:
        if self.dimmed == dimmed:
            return
        self.setProperty("dimmed", dimmed)
        # A dynamic property's selector applies only once the style looks again.
        for widget in (self, *self.findChildren(QLabel)):
            widget.style().unpolish(widget)
            widget.style().polish(widget)

    def show_model(self, model: ModelStatus, colour: RGB, state: TrayState) -> None:
        """Show `model` as `state` knows it: how it holds the GPU, its projector's last image,
        whether its prompt cache is on disk while it is unloaded."""
        unloaded = state.unloaded_text(model)
        self._set_dimmed(unloaded is not None)
        # Unloaded, its colour fades with the card: it holds nothing anywhere.
        stripe = (
            f"rgba({colour[0]}, {colour[1]}, {colour[2]}, 90)"
            if unloaded is not None
            else hex_colour(colour)
        )
        self.stripe.setStyleSheet(f"background: {stripe}; border-radius: 2px;")
        holding = state.holding_text(model)
        # While it holds the GPU: how long its turn lasts while another waits (issue 43).
        turn = model.turn
        in_turn = (
            render.turn_text(turn.quantum_s, turn.served)
            if holding is not None and turn is not None
            else None
        )
        stale = None if model.stale_s is None else render.stale(model.stale_s)
        self.state.setText(
            f"state: {unloaded or model.state}"
            + "".join(f" · {part}" for part in (holding, in_turn, stale) if part)
        )
        host_ram = model.host_ram_bytes
        memory = state.memory_name()
        if unloaded is not None:  # no worker, no host copy: nothing, rather than "not reported"
            self.vram.setText(f"{memory}: none")
            self.host_ram.setText("host RAM: none")
        else:
            self.vram.setText(f"{memory}: {render.format_bytes(model.device_bytes)}")
            self.host_ram.setText(
                "host RAM: "
                + ("not reported" if host_ram is None else render.format_bytes(host_ram))
            )
        extra = [f"queue: {model.queue}"]
        if model.sequences:  # decoding now, in one batch (issue 42)
            extra.append(render.decoding(model.sequences, model.parallel, model.tokens_per_s))
        if model.pinned:
            extra.append("pinned")
        group = state.status.group_of(model.name) if state.status is not None else None
        if group is not None:
            extra.append(f"group {group.name}")
        if model.restarts:
            extra.append(f"{model.restarts} restart{'s' if model.restarts != 1 else ''}")
        if model.backend:
            extra.append(f"{model.backend} backend")
        if placed := render.placement(model.devices):
            extra.append(placed)
        if model.capabilities:  # what it can be asked for, once its worker told (issue 30)
            extra.append(render.capabilities_text(model.capabilities))
        self.queue.setText(" · ".join(extra))
        self.queue.setToolTip(model.fallback_reason)
        self._show_encoder(state.history.last_encoder.get(model.name), state)
        problems = []
        if model.silent_s is not None:
            problems.append(f"⚠ {render.silence(model.name, model.silent_s)}")
        if model.last_error:
            problems.append(f"last error: {model.last_error}")
        self.error.setText("\n".join(problems))
        self.error.setVisible(bool(problems))
        self.pin.setChecked(model.pinned)
        self.pin.setText("Pinned" if model.pinned else "Pin")
        for button in (self.warm, self.pin):
            button.setEnabled(True)
        self.release.setEnabled(unloaded is None)  # nothing to release without a worker

    def _show_encoder(self, record: EncoderRecord | None, state: TrayState) -> None:
        text = None if record is None else state.encoder_text(record.model)
        self.encoder.setVisible(text is not None)
        self.encoder.setText(text or "")
        # Each step with its bytes, as `arbiterd events` says it.
        steps = record.steps if record is not None else []
        self.encoder.setToolTip("\n".join(render.event_detail(step) for step in steps))

    def show_unknown(self, colour: RGB, state: TrayState) -> None:
        """The daemon cannot be reached: what it last said may no longer be true."""
        self.stripe.setStyleSheet(f"background: {hex_colour(colour)}; border-radius: 2px;")
        self.state.setText("state: unknown")
        for label, what in ((self.vram, state.memory_name()), (self.host_ram, "host RAM")):
            label.setText(f"{what}: unknown")
        self.queue.setText("")
        self.encoder.hide()
        self._set_dimmed(False)
        self.error.setText("")
        self.error.setVisible(False)
        for button in (self.warm, self.release, self.pin):
            button.setEnabled(False)


class DashboardWindow(QWidget):
    command_requested = Signal(str, object)  # command, model (None for hold/unhold)
    start_daemon_requested = Signal()
    closed = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("dashboard")
        self.setWindowTitle("arbiterd — GPU dashboard")
        self.setStyleSheet(_STYLE)
        self.setAttribute(Qt.WidgetAttribute.WA_StyledBackground)
        self.resize(SCREENSHOT_SIZE)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(14, 12, 14, 12)
        layout.setSpacing(8)

        layout.addLayout(self._build_header())
        self._build_banners(layout)

        self.timeline = TimelineWidget()
        self.timeline.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        layout.addWidget(self.timeline, 3)

        self.cards_widget = QWidget()
        self.cards_widget.setObjectName("cards")
        self.cards_layout = QGridLayout(self.cards_widget)
        self.cards_layout.setContentsMargins(0, 0, 0, 0)
        self.cards_layout.setSpacing(8)
        self.cards: dict[str, ModelCard] = {}
        layout.addWidget(self.cards_widget)

        self.table = self._build_table()
        layout.addWidget(self.table, 2)

    def _build_header(self) -> QHBoxLayout:
        header = QHBoxLayout()
        titles = QVBoxLayout()
        self.headline = QLabel()
        self.headline.setObjectName("headline")
        self.details = QLabel()
        self.memory = QLabel()  # host RAM and the prompt caches on disk, each of its budget
        titles.addWidget(self.headline)
        titles.addWidget(self.details)
        titles.addWidget(self.memory)
        header.addLayout(titles, 1)
        self.hold_button = QPushButton("Hold GPU (game mode)")
        self.hold_button.setCheckable(True)
        self.hold_button.clicked.connect(
            lambda checked: self.command_requested.emit("hold" if checked else "unhold", None)
        )
        self.start_button = QPushButton("Start daemon")
        self.start_button.clicked.connect(self.start_daemon_requested)
        header.addWidget(self.hold_button)
        header.addWidget(self.start_button)
        return header

    def _build_banners(self, layout: QVBoxLayout) -> None:
        self.unreachable = QLabel()
        self.unreachable.setObjectName("unreachable")
        self.warning = QLabel()
        self.warning.setObjectName("warning")
        self.warning.setWordWrap(True)
        self.message = QLabel()
        self.message.setObjectName("message")
        self.message.setWordWrap(True)
        for banner in (self.unreachable, self.warning, self.message):
            banner.hide()
            layout.addWidget(banner)

    def _build_table(self) -> QTableWidget:
        table = QTableWidget(0, len(TABLE_COLUMNS))
        table.setHorizontalHeaderLabels(list(TABLE_COLUMNS))
        table.verticalHeader().hide()
        table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        table.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        table.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        header_view = table.horizontalHeader()
        header_view.setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        header_view.setSectionResizeMode(1, QHeaderView.ResizeMode.ResizeToContents)
        # Its header is the widest word: stretched to an equal share it was clipped.
        header_view.setSectionResizeMode(
            len(TABLE_COLUMNS) - 1, QHeaderView.ResizeMode.ResizeToContents
        )
        return table

    # -- showing a state -----------------------------------------------------------------------

    def refresh(self, state: TrayState, now: float | None = None) -> None:
        now = time.time() if now is None else now
        status = state.status
        self.headline.setText(state.holder_text())
        if status is not None and state.reachable:
            engine = state.engine_text()
            parts = [state.vram_text(), state.waiters_text(), *([engine] if engine else [])]
            self.details.setText("   ·   ".join(parts))
            memory = [
                *state.fitting_texts(),
                *[t for t in (state.host_ram_text(), state.prompt_cache_text()) if t],
            ]
            self.memory.setText("   ·   ".join(memory))
            self.memory.setToolTip(state.host_ram_parts_text() or "")
        else:
            self.details.setText("")
            self.memory.setText("")
        self.memory.setVisible(bool(self.memory.text()))
        self.unreachable.setVisible(not state.reachable)
        self.unreachable.setText(f"daemon not running — {state.unreachable_reason}")
        self.start_button.setVisible(not state.reachable)
        self.hold_button.setEnabled(state.reachable)
        self.hold_button.setChecked(status is not None and status.hold)
        # The setup's notices too, each once here rather than on every card (issue 30).
        warnings = state.warnings(now) + state.notices() if state.reachable else []
        self.warning.setVisible(bool(warnings))
        self.warning.setText("\n".join(f"⚠ {w}" for w in warnings))
        self._refresh_cards(state)
        state.history.trim(now)
        self.timeline.set_state(state, now)
        self._refresh_table(state)

    def show_message(self, text: str) -> None:
        """A line under the header, e.g. a command the daemon refused; empty hides it."""
        self.message.setText(text)
        self.message.setVisible(bool(text))

    def _refresh_cards(self, state: TrayState) -> None:
        status = state.status
        models = list(status.models) if status is not None else []
        names = [m.name for m in models]
        if names != list(self.cards):
            for card in self.cards.values():
                card.setParent(None)
                card.deleteLater()
            self.cards = {}
            for index, name in enumerate(names):
                card = ModelCard(name)
                card.command_requested.connect(self.command_requested)
                self.cards[name] = card
                self.cards_layout.addWidget(card, index // CARD_COLUMNS, index % CARD_COLUMNS)
        colours = state.colours()
        for model in models:
            card, colour = self.cards[model.name], colours.of(model.name)
            if state.reachable:
                card.show_model(model, colour, state)
            else:
                card.show_unknown(colour, state)

    def _refresh_table(self, state: TrayState) -> None:
        history = state.history
        rows: list[HandoffRecord | EncoderRecord] = [*history.handoffs, *history.encoder]
        rows.sort(key=lambda r: r.at, reverse=True)  # newest first
        self.table.setRowCount(len(rows))
        for row, record in enumerate(rows):
            if isinstance(record, HandoffRecord):
                cells = self._handoff_cells(record)
                gone = state.not_served(record.from_model, record.to_model)
            else:
                cells = self._encoder_cells(record)
                gone = state.not_served(record.model)
            if gone:  # kept in the table, though no longer drawn (TrayState.drawn_models)
                cells = (cells[0], f"{cells[1]} ({', '.join(gone)} not served now)", *cells[2:])
            for column, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if column != 1:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignCenter)
                elif isinstance(record, EncoderRecord):  # each step, timed and sized
                    item.setToolTip("\n".join(render.event_detail(s) for s in record.steps))
                self.table.setItem(row, column, item)

    @staticmethod
    def _handoff_cells(record: HandoffRecord) -> tuple[str, ...]:
        return (
            render.clock(record.at),
            record.title,
            render.format_seconds(record.release_s),
            render.format_seconds(record.wait_s),
            render.format_seconds(record.restore_s),
            render.format_seconds(record.total_s),
            render.NONE if record.bytes_ is None else render.format_bytes(record.bytes_),
            render.NONE if record.tokens_evaluated is None else str(record.tokens_evaluated),
        )

    @staticmethod
    def _encoder_cells(record: EncoderRecord) -> tuple[str, ...]:
        """A vision request's projector: no handoff, so no release, wait or restore; its steps
        take milliseconds, so its total is in ms; its bytes are the projector's weights."""
        loaded = record.loaded_bytes
        return (
            render.clock(record.at),
            record.title,
            render.NONE,
            render.NONE,
            render.NONE,
            render.format_ms(record.total_s),
            render.NONE if loaded is None else render.format_bytes(loaded),
            render.NONE,
        )

    def closeEvent(self, event: QCloseEvent) -> None:
        self.closed.emit()
        super().closeEvent(event)
