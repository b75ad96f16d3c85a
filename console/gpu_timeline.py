"""The console on a GPU timeline: PyTorch-profiler (Kineto) traces from vLLM, SGLang or any torch
program, read from the source or from the moectl trace `trace import` wrote (docs/kineto.md).

One lane per rank and stream (a CPU run: per rank and thread), zoomed, panned and searched; each
kernel coloured by its class and labelled with its layer where the trace's annotations place it.
Beside it the figures `trace report` gives: time per class and per layer, GPU idle time,
communication hidden behind computation (Holistic Trace Analysis' definition) and the straggler
rank. Every figure was measured by the profiler; nothing here is modeled.
"""

from __future__ import annotations

import re

import numpy as np
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Footer, Header, Input, Label, Static

from moectl.console.widgets import Timeline
from moectl.console.widgets.timeline import format_duration
from moectl.profiler.kineto import RankTrace, summarise
from moectl.themes import STYLES, THEMES


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f} ms"


def timeline_columns(traces: list[RankTrace]) -> tuple[list[str], dict]:
    """Every rank's events as Timeline.set_columns arguments: lanes "r<rank> <stream>", names
    merged across ranks, kinds the classes, times on one axis from the earliest rank's origin."""
    lanes: list[str] = []
    names: dict[str, int] = {}
    classes: dict[str, int] = {}
    class_of: dict[str, str] = {}  # each name's class: what its colour follows
    parts: dict[str, list] = {k: [] for k in ("lane", "name", "start_s", "dur_s", "layer", "kind")}
    origin = min(t.origin_s for t in traces)
    for t in sorted(traces, key=lambda t: t.rank):
        base = len(lanes)
        lanes += [f"r{t.rank} {lane.split('/', 1)[-1]}" for lane in t.lanes]
        name_map = np.array([names.setdefault(n, len(names)) for n in t.names], dtype=np.int64)
        class_map = np.array([classes.setdefault(c, len(classes)) for c in t.classes], dtype=np.int64)
        class_of.update(zip(t.names, t.classes))
        parts["lane"].append(t.lane.astype(np.int64) + base)
        parts["name"].append(name_map[t.name_id])
        parts["start_s"].append(t.start + (t.origin_s - origin))
        parts["dur_s"].append(t.dur)
        parts["layer"].append(t.layer.astype(np.int64))
        parts["kind"].append(class_map[t.name_id])
    columns = {k: np.concatenate(v) for k, v in parts.items()}
    return lanes, {**columns, "names": list(names), "kinds": list(classes), "colour_keys": [class_of[n] for n in names]}


def figures_text(report: dict) -> tuple[str, str, str]:
    """The class, rank and layer panels' text from a kineto report."""
    total = sum(report["breakdown"].values()) or 1.0
    lines = ["[b]time by class[/b] (all ranks, measured)"]
    for cls, seconds in sorted(report["breakdown"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {cls:17s} {_ms(seconds):>14s} {seconds / total:6.1%}")
    overlap = report["overlap"]
    idle = "GPU idle" if report["ranks"][0]["source"] == "device" else "idle (no op)"  # a CPU run's ops
    lines.append(f"  {idle:17s} {_ms(report['idle_s']):>14s}")
    lines.append("communication hidden behind computation: " + (
        f"[b]{overlap['fraction']:.1%}[/b] of {_ms(overlap['communication_s'])}" if overlap["fraction"] is not None
        else "no communication events"))
    classes = "\n".join(lines)

    ranks = report["ranks"]
    straggler = report["straggler"]["rank"] if len(ranks) > 1 else None
    lines = ["[b]per rank[/b]: busy, idle, comm hidden"]
    for r in sorted(ranks, key=lambda r: r["rank"]):
        fraction = r["overlap"]["fraction"]
        mark = " [b]◀ straggler[/b]" if r["rank"] == straggler else ""
        lines.append(f"  r{r['rank']:<4d}{_ms(r['busy_s']):>12s}{_ms(r['idle_s']):>12s}"
                     f"{'-' if fraction is None else f'{fraction:.0%}':>6s}{mark}")
    if straggler is not None:
        behind = report["straggler"]["behind_median_s"]
        lines.append(f"straggler r{straggler}: busy {_ms(behind)} beyond the median")
    by_rank = "\n".join(lines)

    layers = report["layers"]
    if layers["by_layer"]:
        placed = layers["placed_s"] / (layers["total_s"] or 1.0)
        lines = [f"[b]per layer[/b] ({placed:.0%} of the time placed by the trace's annotations)"]
        for layer, per_class in layers["by_layer"].items():
            top = max(per_class.items(), key=lambda kv: kv[1])
            lines.append(f"  L{layer:<4s} {_ms(sum(per_class.values())):>12s}  most: {top[0]}")
    else:
        lines = ["[b]per layer[/b]: absent (no layer annotations in the trace: profile with with_stack=True, "
                 "or record_function ranges named like 'layers.N'; kernels replayed from a CUDA graph have no "
                 "per-layer launch)"]
    return classes, by_rank, "\n".join(lines)


def gpu_timeline_app(traces: list[RankTrace], source_name: str, theme: str = "dark") -> GpuTimelineApp:
    """The console on these ranks (read from a Kineto source or its import), with their report."""
    return GpuTimelineApp(traces, summarise(traces, source_name), source_name, theme=theme)


class GpuTimelineApp(App):
    CSS_PATH = str(STYLES)
    TITLE = "moectl"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("slash", "focus_search", "Search"),
        Binding("right_square_bracket", "find(1)", "Next match"),
        Binding("left_square_bracket", "find(-1)", "Previous match"),
        Binding("t", "next_theme", "Theme"),
    ]

    def __init__(self, traces: list[RankTrace], report: dict, source: str, theme: str = "dark"):
        super().__init__()
        self.traces, self.report, self.theme_key = traces, report, theme
        kind = "GPU timeline" if traces[0].source == "device" else "CPU ops (no device events)"
        self.sub_title = f"{kind} · {source} · {len(traces)} rank(s) · measured by the PyTorch profiler"
        self.pattern = ""

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(classes="controls"):
            yield Label("find")
            yield Input(placeholder="kernel name (regular expression); enter: next match", id="gt-search")
            yield Static(id="gt-matches")
        yield Timeline(id="gt-timeline", gutter=18)
        yield Static(id="gt-detail")
        with Horizontal(id="gt-figures"):
            with VerticalScroll():
                yield Static(id="gt-classes")
            with VerticalScroll():
                yield Static(id="gt-ranks")
            with VerticalScroll():
                yield Static(id="gt-layers")
        yield Footer()

    def on_mount(self) -> None:
        for theme in THEMES.values():
            self.register_theme(theme)
        self.theme = THEMES[self.theme_key].name
        lanes, columns = timeline_columns(self.traces)
        timeline = self.query_one(Timeline)
        timeline.shows_modeled = False  # the profiler measured every event
        timeline.set_columns(lanes, **columns)
        for widget_id, text in zip(("#gt-classes", "#gt-ranks", "#gt-layers"), figures_text(self.report)):
            self.query_one(widget_id, Static).update(text)
        events = sum(len(t.dur) for t in self.traces)
        self.query_one("#gt-detail", Static).update(
            f"{events:,} events on {len(lanes)} lanes over {format_duration(timeline.extent[1] - timeline.extent[0])}"
            f"; + / - zoom, arrows pan, 0 fits, n / p next / previous event, / searches")
        timeline.focus()

    def action_focus_search(self) -> None:
        self.query_one("#gt-search", Input).focus()

    def action_next_theme(self) -> None:
        keys = list(THEMES)
        self.theme_key = keys[(keys.index(self.theme_key) + 1) % len(keys)]
        self.theme = THEMES[self.theme_key].name

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.pattern = event.value.strip()
        self.action_find(1)
        self.query_one(Timeline).focus()  # so ] and [ step through the matches

    def action_find(self, direction: int) -> None:
        matches = self.query_one("#gt-matches", Static)
        if not self.pattern:
            matches.update("[dim]type a kernel name first[/]")
            return
        try:
            at, total = self.query_one(Timeline).find(self.pattern, direction)
        except re.error as exc:
            matches.update(f"[red]not a regular expression: {exc}[/]")
            return
        matches.update(f"match {at:,} of {total:,}" if total else f"[red]no event matches {self.pattern!r}[/]")

    def on_timeline_span_selected(self, event: Timeline.SpanSelected) -> None:
        s = event.span
        lane = self.query_one(Timeline).lanes[s.lane]
        layer = f", layer {s.layer}" if s.layer >= 0 else ""
        self.query_one("#gt-detail", Static).update(
            f"[b]{s.name[:160]}[/b] ({s.kind}{layer}) on {lane}: starts {s.start_s * 1e3:.3f} ms, "
            f"lasts {format_duration(s.dur_s)}, measured")
