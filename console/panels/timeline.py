"""Timeline: the spans (and deep-capture kernels) of the newest steps, a lane per device plus the
link lanes, modeled spans drawn apart from measured ones; zoom, pan, select; the step breakdown."""

from __future__ import annotations

import numpy as np
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Input, Label, Static

from moectl.console.panels.common import ShowsOnChange, absent_in_import
from moectl.console.widgets import Timeline
from moectl.profiler.analysis import step_breakdown
from moectl.wire.actions import Action

KINDS = ["span", "kernel"]


def columns_of(records: list[dict]) -> tuple[list[str], dict]:
    """The spans (and deep-capture kernels) of consecutive step records as Timeline.set_columns
    arguments, on one time axis from the first step's start: whole arrays, no per-span objects."""
    lanes: dict[str, int] = {}
    names: dict[str, int] = {}
    parts: dict[str, list] = {k: [] for k in ("lane", "name", "start_s", "dur_s", "modeled", "layer", "step", "kind")}
    origin = records[0]["t_start"] if records else 0.0
    for rec in records:
        offset = rec["t_start"] - origin
        for key, kind in (("spans", 0), ("kernels", 1)):
            cols = rec.get(key)
            if not cols or not len(cols["name"]):
                continue
            count = len(cols["name"])
            lane_map = np.array([lanes.setdefault(name, len(lanes)) for name in cols["lanes"]], dtype=np.int64)
            name_map = np.array([names.setdefault(name, len(names)) for name in cols["names"]], dtype=np.int64)
            parts["lane"].append(lane_map[np.asarray(cols["lane"], dtype=np.int64)])
            parts["name"].append(name_map[np.asarray(cols["name"], dtype=np.int64)])
            parts["start_s"].append(np.asarray(cols["start_s"], dtype=np.float64) + offset)
            parts["dur_s"].append(np.asarray(cols["dur_s"], dtype=np.float64))
            parts["modeled"].append(np.asarray(cols["modeled"], dtype=bool) if cols.get("modeled") is not None
                                    else np.zeros(count, dtype=bool))
            parts["layer"].append(np.asarray(cols["layer"], dtype=np.int64) if cols.get("layer") is not None
                                  else np.full(count, -1, dtype=np.int64))
            parts["step"].append(np.full(count, int(rec["step"]), dtype=np.int64))
            parts["kind"].append(np.full(count, kind, dtype=np.int64))
    columns = {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in parts.items()}
    return list(lanes), {**columns, "names": list(names), "kinds": KINDS}


class TimelinePanel(ShowsOnChange, Vertical):
    def compose(self) -> ComposeResult:
        with Horizontal(classes="controls"):
            yield Label("steps shown")
            yield Input(value="1", id="tl-steps", classes="small")
            yield Button("Freeze", id="tl-freeze")
            yield Button("Capture 2 steps", id="tl-capture")
            yield Static(id="tl-status")
        yield Timeline(id="tl-timeline")
        yield Static(id="tl-detail")
        yield Static(id="tl-breakdown")

    def on_mount(self) -> None:
        self.frozen = False
        self.count = 1
        self.shown_step = None
        self._breakdowns: dict[tuple, dict] = {}  # per shown record: its step_breakdown

    def breakdown(self, records: list[dict]) -> tuple[dict[str, float], float]:
        """Per step over `records`: mean measured seconds by category, mean modeled communication.
        Each record's breakdown is computed once while it stays shown, so a new record costs one
        record's, whatever the number of steps shown (step_breakdown of all of them again is that
        many times more)."""
        keys = [(rec["step"], rec["t_start"]) for rec in records]
        held = self._breakdowns
        self._breakdowns = {key: held.get(key) or step_breakdown([rec]) for key, rec in zip(keys, records)}
        parts = [self._breakdowns[key] for key in keys]
        measured = {k: sum(b["measured_s"][k] for b in parts) / len(parts) for k in parts[0]["measured_s"]}
        return measured, sum(b["communication_modeled_s"] for b in parts) / len(parts)

    def show(self, state) -> None:
        absent = absent_in_import(state, "step times, spans and kernels")
        if absent is not None:
            self.put("#tl-status", absent)
            return
        if self.frozen or not state.window:
            return
        records = list(state.window)[-self.count:]
        if records[-1]["step"] == self.shown_step:
            return
        self.shown_step = records[-1]["step"]
        lanes, columns = columns_of(records)
        self.query_one(Timeline).set_columns(lanes, **columns)
        measured, modeled = self.breakdown(records)
        parts = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in measured.items())
        self.put(
            "#tl-breakdown",
            f"steps {records[0]['step']}-{records[-1]['step']}, per step "
            f"({'simulated' if self.app.state.simulated else 'measured'}): {parts}; "
            f"communication ({'simulated' if self.app.state.simulated else 'modeled'}) "
            f"{modeled * 1e3:.4f} ms")
        self.put(
            "#tl-status",
            "kernels from a deep capture shown" if any(r.get("kernels") for r in records) else "")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id != "tl-steps":
            return
        try:
            count = int(event.value)
            if not 1 <= count <= 64:
                raise ValueError
        except ValueError:
            self.put("#tl-status", f"[red]steps shown: an integer in [1, 64], got {event.value!r}[/]")
            return
        self.count, self.shown_step = count, None
        self.put("#tl-status", "")
        self.app.refresh_panels()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        from moectl.console.panels.common import ActionRequested

        if event.button.id == "tl-freeze":
            self.frozen = not self.frozen
            event.button.label = "Follow" if self.frozen else "Freeze"
        elif event.button.id == "tl-capture":
            self.post_message(ActionRequested(Action.CAPTURE, steps=2))

    def on_timeline_span_selected(self, event: Timeline.SpanSelected) -> None:
        s = event.span
        flag = ("[b]simulated[/b] (the step model)" if self.app.state.simulated else
                "[b]modeled[/b] (from bytes and link bandwidth)" if s.modeled else "measured")
        layer = f", layer {s.layer}" if s.layer >= 0 else ""
        self.put(
            "#tl-detail",
            f"{s.name} ({s.kind}) step {s.step}{layer}: starts {s.start_s * 1e3:.3f} ms, lasts {s.dur_s * 1e3:.3f} ms, {flag}")
