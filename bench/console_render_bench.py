"""Render cost of the console's two big widgets at the largest layout, per full frame.

    python bench/console_render_bench.py              # 50 frames per case, 250 x 70 terminal
    python bench/console_render_bench.py --reps 200 --json

Cases (each in its own headless Textual app, `App.run_test(size=(250, 70))`, the widget filling
the screen):

* heatmap: HeatMap of a synthetic [61, 384] routing matrix (top-8 routing of 2,048 tokens,
  expert popularity Zipf-like and different per layer), 1 character per expert, so the grid
  scrolls horizontally; frames alternate between the home view and the far corner (cursor on
  layer 60, expert 383).
* timeline: Timeline with 129 lanes (engine, 64 devices, 64 modeled links) and ~5,000 spans of
  one 61-layer step; frames alternate between "fit all" (every span on screen) and a 16x zoom.
  "new record" frames alternate between two such steps (other expert durations), each set with
  Timeline.set_columns inside the timed frame, as the Timeline panel does for a new record.

A frame is `render_line(y)` for every visible row of the widget (the widget's whole cost: Textual
calls exactly this for each dirty line); "segments" is how many a frame of the first view draws,
what Textual's own cost per frame follows. "compositor" frames add Textual's part: the widget's
line cache is cleared and the screen's compositor renders all strips (`_compositor.render_strips`,
a private API, skipped if it is missing). Figures are the median and the max over the frames, in
ms, against a 16 ms budget per frame (60 fps) for both widgets together (the heat map alone should use
well under it). The load average is recorded: on a busy shared box the figures rise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from textual.app import App, ComposeResult  # noqa: E402

from moectl.console.widgets import HeatMap, Span, Timeline  # noqa: E402

LAYERS, EXPERTS, TOP_K, TOKENS, DEVICES = 61, 384, 8, 2048, 64
TARGET_MS = 16.0


def routing_matrix(seed: int = 0) -> np.ndarray:
    """[61, 384] token counts: top-8 routing of 2,048 tokens, a few hot experts per layer."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / (np.arange(EXPERTS) + 10.0)
    weights /= weights.sum()
    out = np.zeros((LAYERS, EXPERTS), dtype=np.int64)
    for layer in range(LAYERS):
        perm = rng.permutation(EXPERTS)
        out[layer, perm] = rng.multinomial(TOKENS * TOP_K, weights)
    return out


def timeline_spans(seed: int = 0) -> tuple[list[str], list[Span]]:
    """129 lanes, ~5,000 spans: one decode step of a 61-layer model on 64 devices."""
    rng = np.random.default_rng(seed)
    lanes = ["engine"] + [f"gpu{d}" for d in range(DEVICES)]
    lanes += [f"link{d}->{(d + 1) % DEVICES}" for d in range(DEVICES)]
    layer_s = 200e-6
    spans: list[Span] = [Span(0, "step", 0.0, LAYERS * layer_s, step=0)]
    for layer in range(LAYERS):
        t = layer * layer_s
        spans.append(Span(0, "attn", t, 0.40 * layer_s, layer=layer, step=0))
        spans.append(Span(0, "router", t + 0.40 * layer_s, 0.05 * layer_s, layer=layer, step=0, kind="kernel"))
        for d in range(DEVICES):
            dur = 0.25 * layer_s * float(rng.uniform(0.6, 1.0))
            spans.append(Span(1 + d, "moe_expert", t + 0.60 * layer_s, dur, layer=layer, step=0, kind="kernel"))
        if layer % 8 == 0:  # link transfers are modeled, drawn for every 8th layer
            for d in range(DEVICES):
                lane = 1 + DEVICES + d
                for name, at in (("dispatch", 0.45), ("combine", 0.85)):
                    spans.append(Span(lane, name, t + at * layer_s, 0.15 * layer_s, modeled=True, layer=layer, step=0))
    return lanes, spans


class OneWidget(App):
    def __init__(self, widget) -> None:
        super().__init__()
        self._widget = widget

    def compose(self) -> ComposeResult:
        yield self._widget


def _stats(samples_s: list[float]) -> dict:
    ms = [s * 1e3 for s in samples_s]
    return {
        "median_ms": round(statistics.median(ms), 3),
        "max_ms": round(max(ms), 3),
        "frames": len(ms),
    }


async def _measure(widget, setup, views, reps: int, size: tuple[int, int], timed_views: bool = False) -> dict:
    """timed_views: the view change (a new record) is part of the timed frame."""
    app = OneWidget(widget)
    async with app.run_test(size=size) as pilot:
        setup(widget)
        await pilot.pause()
        height = widget.size.height
        line_samples: list[float] = []
        comp_samples: list[float] = []
        compositor = getattr(app.screen, "_compositor", None)
        for i in range(reps):
            t0 = time.perf_counter()
            if not timed_views:
                views[i % len(views)](widget)
                t0 = time.perf_counter()
            else:
                views[i % len(views)](widget)
            for y in range(height):
                widget.render_line(y)
            line_samples.append(time.perf_counter() - t0)
        views[0](widget)
        segments = sum(len(widget.render_line(y)) for y in range(height))
        if compositor is not None and hasattr(compositor, "render_strips"):
            for i in range(reps):
                views[i % len(views)](widget)
                t0 = time.perf_counter()
                widget._styles_cache.clear()
                compositor.render_strips()
                comp_samples.append(time.perf_counter() - t0)
        result = {"widget_size": [widget.size.width, height], "render_line": _stats(line_samples),
                  "segments": segments}
        result["compositor"] = _stats(comp_samples) if comp_samples else None
        return result


def bench_heatmap(reps: int, size: tuple[int, int]) -> dict:
    matrix = routing_matrix()
    heat = HeatMap(cell_width=1)

    def setup(w: HeatMap) -> None:
        w.set_data(matrix)

    def home(w: HeatMap) -> None:
        w.set_reactive(HeatMap.cursor, (0, 0))
        w.scroll_to(0, 0, animate=False, immediate=True)

    def far(w: HeatMap) -> None:
        w.set_reactive(HeatMap.cursor, (LAYERS - 1, EXPERTS - 1))
        w.scroll_to_cursor()

    result = asyncio.run(_measure(heat, setup, [home, far], reps, size))
    result["grid"] = [LAYERS, EXPERTS]
    return result


def timeline_columns(spans: list[Span]) -> dict:
    """The spans as Timeline.set_columns arguments (what the Timeline panel passes)."""
    names = sorted({s.name for s in spans})
    index = {name: i for i, name in enumerate(names)}
    return {"lane": np.array([s.lane for s in spans]), "name": np.array([index[s.name] for s in spans]),
            "names": names, "start_s": np.array([s.start_s for s in spans]), "dur_s": np.array([s.dur_s for s in spans]),
            "modeled": np.array([s.modeled for s in spans]), "layer": np.array([s.layer for s in spans])}


def bench_timeline(reps: int, size: tuple[int, int]) -> dict:
    lanes, spans = timeline_spans()
    timeline = Timeline()
    records = [timeline_columns(timeline_spans(seed)[1]) for seed in (1, 2)]

    def setup(w: Timeline) -> None:
        w.set_spans(lanes, spans)

    def fit(w: Timeline) -> None:
        w.fit()

    def zoomed(w: Timeline) -> None:
        w.fit()
        w.zoom(16.0)

    def record(k: int):
        return lambda w: w.set_columns(lanes, **records[k])

    result = asyncio.run(_measure(timeline, setup, [fit, zoomed], reps, size))
    new_record = asyncio.run(_measure(Timeline(), setup, [record(0), record(1)], reps, size, timed_views=True))
    result["new_record"] = new_record["render_line"]
    result["lanes"] = len(lanes)
    result["spans"] = len(spans)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=50, help="frames per case (default 50)")
    parser.add_argument("--size", default="250x70", help="terminal WIDTHxHEIGHT (default 250x70)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    width, height = (int(v) for v in args.size.lower().split("x"))
    size = (width, height)

    load_before = os.getloadavg()[0]
    heat = bench_heatmap(args.reps, size)
    timeline = bench_timeline(args.reps, size)
    load_after = os.getloadavg()[0]
    both = heat["render_line"]["median_ms"] + timeline["render_line"]["median_ms"]
    report = {
        "terminal": list(size),
        "target_ms": TARGET_MS,
        "heatmap": heat,
        "timeline": timeline,
        "both_median_ms": round(both, 3),
        "heatmap_ratio_to_target": round(heat["render_line"]["median_ms"] / TARGET_MS, 3),
        "both_ratio_to_target": round(both / TARGET_MS, 3),
        "loadavg_1m": [load_before, load_after],
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"terminal {width}x{height}, {args.reps} frames per case, target {TARGET_MS:.0f} ms/frame")
    for name, res in (("heatmap", heat), ("timeline", timeline)):
        if name == "heatmap":
            what = f"{res['grid'][0]}x{res['grid'][1]} grid"
        else:
            what = f"{res['lanes']} lanes, {res['spans']} spans"
        line = res["render_line"]
        print(
            f"  {name:<9} {what:<26} widget {res['widget_size'][0]}x{res['widget_size'][1]}: "
            f"render_line median {line['median_ms']:.2f} ms, max {line['max_ms']:.2f} ms "
            f"({line['median_ms'] / TARGET_MS:.2f} x target), {res['segments']:,} segments"
        )
        if "new_record" in res:
            rec = res["new_record"]
            print(f"  {'':<9} {'':<26} new record (set_columns + render_line): median {rec['median_ms']:.2f} ms, "
                  f"max {rec['max_ms']:.2f} ms")
        if res["compositor"]:
            comp = res["compositor"]
            print(
                f"  {'':<9} {'':<26} with compositor: median {comp['median_ms']:.2f} ms, "
                f"max {comp['max_ms']:.2f} ms"
            )
    print(f"  both widgets: {both:.2f} ms per frame ({both / TARGET_MS:.2f} x target)")
    print(f"  load average (1 min) before/after: {load_before:.2f} / {load_after:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
