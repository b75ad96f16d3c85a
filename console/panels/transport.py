"""The replay transport: play / pause, speed, single step, seek by step or time, a scrub bar
with markers at operator actions and alerts."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Button, Input, Label, Static

from moectl.console.panels.common import ShowsOnChange
from moectl.console.widgets import ScrubBar


class TransportBar(ShowsOnChange, Vertical):
    class Command(Message):
        def __init__(self, command: str, value=None):
            super().__init__()
            self.command = command
            self.value = value

    def compose(self) -> ComposeResult:
        yield ScrubBar(id="tr-scrub")
        with Horizontal(classes="controls"):
            yield Button("▶ Play", id="tr-play", variant="primary")
            yield Button("Step", id="tr-step")
            yield Label("speed")
            yield Input(value="1", id="tr-speed", classes="small")
            yield Label("seek step")
            yield Input(id="tr-seek-step", classes="small")
            yield Label("seek s")
            yield Input(id="tr-seek-time", classes="small")
        yield Static(id="tr-status")

    error: str | None = None  # the last refused command's reason, shown until one succeeds

    def setup(self, source) -> None:
        scrub = self.query_one(ScrubBar)
        scrub.set_range(source.first_step, source.last_step)
        scrub.markers = source.markers()

    def show(self, source, message: str | None = None) -> None:
        if message is not None:
            self.error = message
        message = self.error
        scrub = self.query(ScrubBar)
        if not scrub:  # composing, or being torn down at exit: a timer tick can land in between
            return
        scrub.first().position = source.position
        self.query_one("#tr-play", Button).label = "❚❚ Pause" if source.playing else "▶ Play"
        status = f"step {source.position} of {source.first_step}-{source.last_step}, " \
                 f"t+{source.trace_time:.2f} s, x{source.speed:g}"
        self.put("#tr-status", f"[red]{message}[/]" if message else status)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "tr-play":
            self.post_message(self.Command("toggle"))
        elif event.button.id == "tr-step":
            self.post_message(self.Command("step"))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        command = {"tr-speed": "speed", "tr-seek-step": "seek_step", "tr-seek-time": "seek_time"}.get(event.input.id)
        if command is None:
            return
        try:
            value = int(event.value) if command == "seek_step" else float(event.value)
        except ValueError:
            self.error = f"{command}: {event.value!r} is not a number"
            self.put("#tr-status", f"[red]{self.error}[/]")
            return
        self.post_message(self.Command(command, value))

    def on_scrub_bar_seek(self, event: ScrubBar.Seek) -> None:
        self.post_message(self.Command("seek_step", event.step))
