"""Timeline: the spans (and deep-capture kernels) of the newest steps, a lane per device plus the
link lanes, modeled spans drawn apart from measured ones; zoom, pan, select; the step breakdown."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Input, Label, Static

from console.widgets import Span, Timeline
from profiler.analysis import step_breakdown


def _as_list(column, default, count: int) -> list:
    if column is None:
        return [default] * count
    return column.tolist() if hasattr(column, "tolist") else list(column)


def spans_of(records: list[dict]) -> tuple[list[str], list[Span]]:
    """Timeline spans of consecutive step records, on one time axis from the first step's start."""
    if not records:
        return [], []
    origin = records[0]["t_start"]
    lanes: list[str] = []
    index: dict[str, int] = {}
    out: list[Span] = []

    def lane_id(name: str) -> int:
        if name not in index:
            index[name] = len(lanes)
            lanes.append(name)
        return index[name]

    for rec in records:
        offset = rec["t_start"] - origin
        for key, kind in (("spans", "span"), ("kernels", "kernel")):
            cols = rec.get(key)
            if not cols:
                continue
            names, lane_names = cols["names"], cols["lanes"]
            for name in lane_names:  # the record's lane order: engine, devices, links, then kernels
                lane_id(name)
            # whole columns to Python lists first: indexing numpy arrays element by element is slow
            lane_map = [lane_id(name) for name in lane_names]
            count = len(cols["name"])
            layers = _as_list(cols.get("layer"), -1, count)
            modeled = _as_list(cols.get("modeled"), False, count)
            step = int(rec["step"])
            for lane, name, start, dur, flag, layer in zip(_as_list(cols["lane"], 0, count),
                                                            _as_list(cols["name"], 0, count),
                                                            _as_list(cols["start_s"], 0.0, count),
                                                            _as_list(cols["dur_s"], 0.0, count), modeled, layers):
                out.append(Span(lane_map[lane], names[name], offset + start, dur, bool(flag), layer, step, kind))
    return lanes, out


class TimelinePanel(Vertical):
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

    def show(self, state) -> None:
        if self.frozen or not state.window:
            return
        records = list(state.window)[-self.count:]
        if records[-1]["step"] == self.shown_step:
            return
        self.shown_step = records[-1]["step"]
        lanes, spans = spans_of(records)
        self.query_one(Timeline).set_spans(lanes, spans)
        b = step_breakdown(records)
        parts = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in b["measured_mean_s"].items())
        self.query_one("#tl-breakdown", Static).update(
            f"steps {records[0]['step']}-{records[-1]['step']}, per step (measured): {parts}; "
            f"communication (modeled) {b['communication_modeled_mean_s'] * 1e3:.4f} ms")
        self.query_one("#tl-status", Static).update(
            "kernels from a deep capture shown" if any(r.get("kernels") for r in records) else "")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id != "tl-steps":
            return
        try:
            count = int(event.value)
            if not 1 <= count <= 64:
                raise ValueError
        except ValueError:
            self.query_one("#tl-status", Static).update(f"[red]steps shown: an integer in [1, 64], got {event.value!r}[/]")
            return
        self.count, self.shown_step = count, None
        self.query_one("#tl-status", Static).update("")
        self.app.refresh_panels()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        from .common import ActionRequested

        if event.button.id == "tl-freeze":
            self.frozen = not self.frozen
            event.button.label = "Follow" if self.frozen else "Freeze"
        elif event.button.id == "tl-capture":
            self.post_message(ActionRequested("capture", steps=2))

    def on_timeline_span_selected(self, event: Timeline.SpanSelected) -> None:
        s = event.span
        flag = "[b]modeled[/b] (from bytes and link bandwidth)" if s.modeled else "measured"
        layer = f", layer {s.layer}" if s.layer >= 0 else ""
        self.query_one("#tl-detail", Static).update(
            f"{s.name} ({s.kind}) step {s.step}{layer}: starts {s.start_s * 1e3:.3f} ms, lasts {s.dur_s * 1e3:.3f} ms, {flag}")
