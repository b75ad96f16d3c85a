"""Responsiveness of the whole console (MoectlApp), against the issue's targets.

    python bench/console_bench.py                  # all three measures, a table
    python bench/console_bench.py --json           # one JSON document
    python bench/console_bench.py --skip-live      # the big layout only (no engine)
    python bench/console_bench.py --frames 30 --tabs experts overview timeline memory requests

1. Frame time of the largest layout (target: 16 ms per frame, 60 fps). A synthetic trace is written
   first: 61 layers x 384 experts on 64 devices (contiguous placement, 1 redundant slot), each
   step record following profiler/records.py: routing int32 [61, 384] (top-8 routing of 256-2,048
   tokens, Zipf-like popularity per layer), per-device tokens / busy_s / util / link_s (modeled) /
   a 64 x 64 traffic matrix / HBM by category for 64 devices, and spans on 129 lanes (engine,
   64 devices, 64 links: ~11,800 spans per step, every layer's attention and router, its experts
   on every device, its dispatch and combine on every link). The app replays it headless at
   250 x 70 (`App.run_test`), seeked to the middle, paused (the app's own timer paused too: it
   would only redraw the transport line). For each tab:

     frame  what one new record costs the UI thread, as playback and the live console pay it:
            source.step_forward(); app.tick() (the record read and decoded, ConsoleState.apply,
            the visible panel's show(state)), then Textual's own path to the terminal for what
            that dirtied (messages, idle, the screen's update timer, layout, the compositor's
            render of the dirty lines, with App._display wrapped so the update is also turned
            into the terminal byte string, the step a real terminal pays and headless mode
            skips). Measured as the UI thread's CPU time (time.thread_time) from the tick until
            the screen has been quiet for 40 ms, so the waits in between do not count.
       tick   the first part of it alone.
     full repaint
            every widget on the screen refreshed and repainted at once (a resize, a theme
            switch): Widget.refresh() on each, each put in the screen's dirty set, then
            Screen._refresh_layout, synchronously, wall clock.
     Textual floor
            the same full repaint of an app with one full-screen Line API widget drawing as
            many colour runs (segments) as the tab's composed screen holds, each line a new
            Strip: what Textual itself costs for a screen like it on this machine, with no
            data and no layout. full repaint / floor says how much the console adds.

   median and max over --frames frames per tab. No alerts worker runs during a frame: the first
   computation is waited for (its time is reported on its own: app.compute_alerts runs in a
   thread every 2 s and shares the GIL with the UI).

2. Update rate (target: >= 10 updates per second). The live console on the sample model, its
   engine in a process of its own as `moectl run` starts it (4 emulated devices, the default
   demo workload, 1 torch thread), headless at 160 x 50 on the Overview tab: app.tick is wrapped
   (before mount, so the app's own timer calls the wrapper) and counts ticks, ticks that brought
   at least one new step record into ConsoleState ("updates"), and records, over --live-seconds
   after a warm-up. The same again with the engine on a thread of the console's process (the
   design the engine process replaced), as the baseline.

2b. Engine throughput with a console attached (target: >= 95% of the same run without one). The
   engine process flat out (--load-rate); a client that only counts reads its step records, and
   throughput is prompt + output tokens over the engine's own wall clock. --rounds rounds without
   and with a headless console drawing the Overview, interleaved; the ratio of the medians.

3. Keypress latency under load (target: median 50 ms, p95 100 ms). The live engine process flat
   out (and the in-process baseline; demo workload at
   --load-rate requests/s), headless at 160 x 50. A key ("2" then "1": Experts, Overview, ...) is
   handed to the driver exactly as terminal input is (driver.send_message(events.Key), not
   Pilot.press, whose wait-for-idle never returns early while the engine keeps the CPU busy);
   latency = from then until the first frame the app renders (App._display, wrapped to stamp it)
   with TabbedContent.active == the new tab. --presses presses, spaced 150-450 ms apart so they
   land at different points of the 200 ms tick. The same is then measured on the synthetic big
   layout (replay, paused, 250 x 70; --big-presses), where no engine runs and the cost is the
   panels' own: the app's 5 Hz tick re-renders the visible panel even when no record arrived.

The figures depend on the machine and on what else runs on it (the load average is recorded).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LAYERS, EXPERTS, DEVICES, TOP_K = 61, 384, 64, 8
STEPS_PER_S = 10.0
FRAME_TARGET_MS = 16.0  # issue 13: 60 fps
UPDATE_TARGET_HZ = 10.0  # issue 21
KEY_TARGET_MS = 50.0  # median
KEY_P95_TARGET_MS = 100.0
THROUGHPUT_TARGET = 0.95  # engine throughput with a console attached / without
BIG_SIZE = (250, 70)
LIVE_SIZE = (160, 50)
TABS = ("experts", "overview", "timeline", "memory", "requests")
SPAN_NAMES = ["attention", "router", "experts", "all_to_all dispatch", "all_to_all combine", "sampler"]


# -- 1. the synthetic trace ----------------------------------------------------------------------

def synthetic_header(expert_bytes: int = 44 << 20) -> dict:
    from moectl.placement.placement import Placement
    from moectl.placement.topology import Topology

    topology = Topology(num_devices=DEVICES, hbm_bytes=141 << 30)
    return {
        "record_format": 1,
        "clock_origin": {"monotonic": 1000.0, "unix": 1.8e9},
        "model": {"path": "", "name": "synthetic-61x384", "architecture": "synthetic", "num_layers": LAYERS,
                  "num_experts": EXPERTS, "top_k": TOP_K, "hidden_size": 7168, "vocab_size": 129280,
                  "sparse_layers": [True] * LAYERS},
        "engine_config": {"block_size": 16, "max_model_len": 4096},
        "knobs": {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "long_prefill_token_threshold": 2048,
                  "policy": "fcfs"},
        "devices": {"backend": "emulated", "topology": topology.as_dict(),
                    "placement": Placement.contiguous(LAYERS, EXPERTS, DEVICES, 1).to_dict(),
                    "expert_bytes": expert_bytes, "redundant_slots": 1, "routing_policy": "locality",
                    "tiered_experts": False, "expert_cache_slots": None, "link_time": "modeled"},
    }


def _spans(rng: np.random.Generator) -> dict:
    """One step of a 61-layer model on 64 devices: 129 lanes, ~11,800 spans."""
    layer_s = 1.2e-3
    lane, name, layer, start, dur, modeled = [], [], [], [], [], []

    def add(ln, nm, ly, s, d, m=False):
        lane.append(ln), name.append(nm), layer.append(ly), start.append(s), dur.append(d), modeled.append(m)

    for ly in range(LAYERS):
        t = ly * layer_s
        add(0, 0, ly, t, 0.35 * layer_s)
        add(0, 1, ly, t + 0.36 * layer_s, 0.04 * layer_s)
        for d in range(DEVICES):
            add(1 + DEVICES + d, 3, ly, t + 0.41 * layer_s, 0.08 * layer_s, True)
            add(1 + d, 2, ly, t + 0.50 * layer_s, 0.30 * layer_s * float(rng.uniform(0.5, 1.0)))
            add(1 + DEVICES + d, 4, ly, t + 0.85 * layer_s, 0.08 * layer_s, True)
    add(0, 5, -1, LAYERS * layer_s, 2e-4)
    return {"lanes": ["engine"] + [f"device {d}" for d in range(DEVICES)] + [f"link {d}" for d in range(DEVICES)],
            "names": list(SPAN_NAMES), "lane": np.asarray(lane, np.int16), "name": np.asarray(name, np.int16),
            "layer": np.asarray(layer, np.int16), "start_s": np.asarray(start, np.float64),
            "dur_s": np.asarray(dur, np.float64), "modeled": np.asarray(modeled, bool)}


def synthetic_records(n: int, header: dict, seed: int = 0, pool: int = 16) -> list[dict]:
    """n step records (profiler/records.py format 1); `pool` distinct payloads reused round robin."""
    from moectl.placement.placement import Placement

    rng = np.random.default_rng(seed)
    placement = Placement.from_dict(header["devices"]["placement"])
    expert_bytes = header["devices"]["expert_bytes"]
    hbm = header["devices"]["topology"]["hbm_bytes"]
    weights = 1.0 / (np.arange(EXPERTS) + 10.0)
    perms = np.argsort(rng.random((LAYERS, EXPERTS)), axis=1)
    payloads = []
    for k in range(pool):
        for ly in rng.integers(0, LAYERS, 8):  # popularity drifts a little from payload to payload
            i, j = rng.integers(0, EXPERTS, 2)
            perms[ly, [i, j]] = perms[ly, [j, i]]
        p = weights[perms]
        p /= p.sum(axis=1, keepdims=True)
        tokens = int(np.exp(rng.uniform(np.log(256), np.log(2048))))
        routing = rng.multinomial(tokens * TOP_K, p).astype(np.int32)
        dev_tokens = placement.device_loads(routing).sum(axis=0)
        step_s = 0.08
        busy = dev_tokens * 2.0e-6 * rng.uniform(0.9, 1.1, DEVICES)
        link = dev_tokens * 7168 * 2 / 400e9
        share = rng.dirichlet(np.ones(DEVICES) * 20)
        traffic = (np.floor(np.outer(share, dev_tokens)) * 7168 * 2).astype(np.int64)
        kv = [int(x) for x in rng.integers(20, 60, DEVICES) << 30]
        memory = [{"attention_weights": 1 << 30, "embedding_weights": 2 << 30, "norm_router_weights": 64 << 20,
                   "expert_weights": int((placement.slots_per_device - 1) * LAYERS * expert_bytes),
                   "kv_blocks": kv[d], "activations": int(rng.integers(1, 4)) << 30, "comm_buffers": 512 << 20}
                  for d in range(DEVICES)]
        decode = int(min(tokens, rng.integers(64, 256)))
        payloads.append({
            "batch": {"prefill_tokens": tokens - decode, "decode_tokens": decode, "num_seqs": decode + 1,
                      "request_ids": [f"req-{i}" for i in range(decode + 1)], "preempted": []},
            "routing": routing,
            "knobs": dict(header["knobs"]),
            "cache": {"kv_blocks_used": 40_000, "kv_blocks_total": 131_072, "prefix_queries": 1000 * k,
                      "prefix_hits": 400 * k, "preemptions": 0},
            "process": {"rss_bytes": 30 << 30, "sys_used_bytes": 200 << 30, "sys_total_bytes": 2 << 40,
                        "sampled_at": 0.0, "cuda": None},
            "spans": _spans(rng),
            "devices": {"backend": "emulated", "tokens": dev_tokens.astype(int).tolist(),
                        "busy_s": busy.tolist(), "util": (busy / step_s).tolist(),
                        "link_s": link.tolist(), "link_s_modeled": True, "traffic_bytes": traffic,
                        "memory": memory, "memory_capacity": {"hbm": hbm, "kv_blocks": [64 << 30] * DEVICES},
                        "tiers": {"host": {}}, "tiered_experts": "off"},
        })
    records = []
    for i in range(n):
        t = 1000.0 + i / STEPS_PER_S
        events = []
        if i % 4 == 0:  # a request stream: arrive, first token, finish 8 steps later
            rid = f"req-{i // 4}"
            events.append({"id": rid, "event": "arrived", "t": t, "prompt_tokens": 512})
            events.append({"id": rid, "event": "scheduled", "t": t + 0.001})
            events.append({"id": rid, "event": "first_token", "t": t + 0.05})
        if i % 4 == 0 and i >= 32:
            events.append({"id": f"req-{i // 4 - 8}", "event": "finished", "t": t + 0.07, "reason": "length",
                           "prompt_tokens": 512, "output_tokens": 32, "ttft_s": 0.05, "tpot_s": 0.1})
        rec = dict(payloads[i % pool])
        rec.update(step=i + 1, t_start=t, t_end=t + 0.08, requests=events)
        rec["process"] = dict(rec["process"], sampled_at=t)
        records.append(rec)
    return records


def write_synthetic_trace(path: Path, steps: int, seed: int = 0) -> dict:
    from moectl.profiler.trace_store import TraceWriter

    header = synthetic_header()
    t0 = time.perf_counter()
    records = synthetic_records(steps, header, seed)
    gen_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    # paced to the writer: at 256 devices a record is megabytes, and a backlog past the writer's
    # byte limit is dropped (as an engine's would be); the frames need every step
    with TraceWriter(path, header, queue_size=steps + 16) as writer:
        for rec in records:
            while writer.pending > 8:
                time.sleep(0.005)
            writer.write_step(rec)
    dropped = writer.dropped
    if dropped:
        raise SystemExit(f"console_bench: the synthetic trace lost {dropped} of {steps} steps; the frames need all")
    return {"steps": steps, "spans_per_step": int(len(records[0]["spans"]["name"])),
            "lanes": len(records[0]["spans"]["lanes"]), "file_mb": round(os.path.getsize(path) / 1e6, 1),
            "generate_s": round(gen_s, 2), "write_s": round(time.perf_counter() - t0, 2), "dropped": dropped}


# -- shared helpers ------------------------------------------------------------------------------

def _stats_ms(samples_s: list[float]) -> dict:
    ms = [s * 1e3 for s in samples_s]
    if not ms:
        return {"median_ms": None, "max_ms": None, "p95_ms": None, "n": 0}
    p95 = float(np.percentile(ms, 95)) if len(ms) > 1 else ms[0]
    return {"median_ms": round(statistics.median(ms), 2), "max_ms": round(max(ms), 2), "p95_ms": round(p95, 2),
            "n": len(ms)}


def _wrap_display(app, stamps: list | None = None):
    """App._display also renders the terminal byte string (as a real terminal needs; headless
    skips it) and, given a list, stamps (time, active tab) for every frame."""
    from textual._compositor import CompositorUpdate
    from textual.widgets import TabbedContent

    original = app._display
    console = app.console

    def display(screen, renderable):
        if isinstance(renderable, CompositorUpdate):
            renderable.render_segments(console)
            if stamps is not None:
                try:
                    active = app.query_one(TabbedContent).active
                except Exception:  # noqa: BLE001 - a modal screen on top
                    active = None
                stamps.append((time.perf_counter(), active))
        return original(screen, renderable)

    app._display = display


async def _until(condition, timeout_s: float, poll_s: float = 0.01) -> bool:
    end = time.perf_counter() + timeout_s
    while time.perf_counter() < end:
        if condition():
            return True
        await asyncio.sleep(poll_s)
    return condition()


# -- 1. frame time -------------------------------------------------------------------------------

async def _settle(app, displays: list, quiet_s: float = 0.04, timeout_s: float = 1.0) -> None:
    """Until Textual has painted what is pending: a frame after `displays` had its current length,
    then `quiet_s` without another (or `timeout_s`: nothing was dirty)."""
    n0 = len(displays)
    end = time.perf_counter() + timeout_s
    while time.perf_counter() < end:
        await asyncio.sleep(0.005)
        if len(displays) > n0 and time.perf_counter() - displays[-1][0] >= quiet_s:
            return


def _screen_runs(app) -> int:
    """Colour runs (segments) on the composed screen: what the terminal is sent on a full repaint."""
    return sum(len(strip) for strip in app.screen._compositor.render_strips())


async def _frames(path: Path, frames: int, size: tuple[int, int], tabs: tuple[str, ...]) -> dict:
    from textual.widgets import TabbedContent

    from moectl.console.app import MoectlApp
    from moectl.console.sources import ReplaySource

    source = ReplaySource(path)
    app = MoectlApp(source)
    out: dict = {"size": list(size), "tabs": {}}
    displays: list = []
    async with app.run_test(size=size) as pilot:
        _wrap_display(app, displays)
        await pilot.pause()
        start = source.first_step + (source.last_step - source.first_step) // 3
        t0 = time.perf_counter()
        source.seek_step(start)
        app.tick()  # refills the 64-step window: 64 records read and decoded, then the panel
        out["seek_fill_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        t0 = time.perf_counter()
        done = await _until(lambda: not app._alerts_running, 300.0)
        out["alerts_s"] = round(time.perf_counter() - t0, 2) if done else None
        out["alerts"] = len(app.state.alerts)
        # the app's own 15 Hz tick stays out of the measured frames (paused replay: it only redraws the
        # transport line); the frames below call app.tick themselves
        for timer in list(app._timers):
            timer.pause()
        screen = app.screen
        for tab in tabs:
            app.action_tab(tab)
            await pilot.pause(0.2)
            assert app.query_one(TabbedContent).active == tab
            ticks, updates, fulls = [], [], []
            for i in range(frames + 2):
                app._alerts_at = time.monotonic()  # no alerts worker starts inside a measured frame
                await _settle(app, displays, timeout_s=0.2)
                c0 = time.thread_time()
                source.step_forward()
                app.tick()
                c1 = time.thread_time()
                await _settle(app, displays)  # Textual's own path: messages, idle, the screen's update timer
                c2 = time.thread_time()
                widgets = list(screen.walk_children(with_self=True))
                t0 = time.perf_counter()
                for widget in widgets:
                    widget.refresh()
                screen._dirty_widgets.update(widgets)
                screen._refresh_layout()
                t1 = time.perf_counter()
                if i >= 2:  # two warm-up frames (first layout of the tab, caches)
                    ticks.append(c1 - c0)
                    updates.append(c2 - c0)
                    fulls.append(t1 - t0)
            runs = _screen_runs(app)
            out["tabs"][tab] = {"frame": _stats_ms(updates), "tick": _stats_ms(ticks), "full_repaint": _stats_ms(fulls),
                                "screen_runs": runs}
        out["position"] = source.position
    return out


async def _textual_floor(size: tuple[int, int], runs: int, frames: int = 30) -> dict:
    """Textual's own cost of a full repaint with `runs` colour runs: one full-screen Line API widget,
    every line a new Strip of equal runs (no data, no layout beyond one widget), the same
    measure as the tabs' full repaint. What this machine and Textual allow for a screen like it."""
    from rich.segment import Segment
    from rich.style import Style
    from textual.app import App
    from textual.geometry import Size
    from textual.scroll_view import ScrollView
    from textual.strip import Strip

    width, height = size
    per_line = max(1, min(width, -(-runs // height)))
    cell = width // per_line
    styles = [Style(bgcolor=f"#{(37 * k) % 256:02x}{(91 * k) % 256:02x}{(53 * k) % 256:02x}") for k in range(16)]

    class Runs(ScrollView):
        generation = 0

        def render_line(self, y: int) -> Strip:
            g = self.generation
            segments = [Segment(" " * cell, styles[(y + k + g) % 16]) for k in range(per_line)]
            return Strip(segments, cell * per_line).adjust_cell_length(self.size.width)

    class Floor(App):
        def compose(self):
            yield Runs()

    app = Floor()
    samples = []
    async with app.run_test(size=size) as pilot:
        _wrap_display(app)
        await pilot.pause()
        widget = app.query_one(Runs)
        widget.virtual_size = Size(0, height)
        for i in range(frames + 2):
            widget.generation += 1
            widgets = list(app.screen.walk_children(with_self=True))
            t0 = time.perf_counter()
            for w in widgets:
                w.refresh()
            app.screen._dirty_widgets.update(widgets)
            app.screen._refresh_layout()
            if i >= 2:
                samples.append(time.perf_counter() - t0)
            await asyncio.sleep(0.01)
        runs_drawn = _screen_runs(app)
    return {"runs": runs_drawn, **_stats_ms(samples)}


# -- 2. update rate ------------------------------------------------------------------------------

LIVE_OPTIONS = ["--devices", "4", "--redundant", "1", "--threads", "1"]
LIVE_MODEL: str | None = None  # --model: a checkpoint or a shipped model's name (default: sample)


def _live_options() -> list[str]:
    return [*LIVE_OPTIONS, *(["--model", LIVE_MODEL] if LIVE_MODEL else [])]


class _OwnedEngine:
    """The console's source on an engine process this bench started (what `moectl run` does);
    in_process: the engine on a thread of this process instead (console/live_source.py), the
    design the engine process replaced, measured as the baseline."""

    def __init__(self, rate: float, in_process: bool = False):
        workload = f"rate={rate:g},prompt=32-256,output=32-128"
        self.process = None
        if in_process:
            from moectl.cli.console import live_source
            from moectl.cli.engine_options import EngineOptions

            model = Path(LIVE_MODEL) if LIVE_MODEL is not None else None
            self.source = live_source(EngineOptions(model=model, devices=4, redundant=1, threads="1"), workload)
            return
        from moectl.cli.engine_process import EngineProcess
        from moectl.console.engine_client import EngineSource

        self.process = EngineProcess([*_live_options(), "--workload", workload])
        self.process.wait_ready()
        self.source = EngineSource(self.process.dir, owner=True)
        closed = self.source.close

        def close():
            closed()
            self.process.stop()
        self.source.close = close


def _live_source(rate: float, in_process: bool = False):
    return _OwnedEngine(rate, in_process).source


async def _update_rate(rate: float, seconds: float, warmup_s: float, in_process: bool = False) -> dict:
    return {**await measure_ticks(_live_source(rate, in_process), seconds, warmup_s, LIVE_SIZE), "workload_rate": rate}


async def measure_ticks(source, seconds: float, warmup_s: float, size: tuple[int, int]) -> dict:
    """The console on `source`, headless at `size`: its ticks, the ticks that brought new step
    records ("updates") and the records, per second over `seconds` after `warmup_s`."""
    from moectl.console.app import MoectlApp

    app = MoectlApp(source)
    events: list[tuple[float, int, float]] = []  # (time, new records, tick seconds)
    original_tick = app.tick

    def tick():
        before = app.state.steps_seen
        t0 = time.perf_counter()
        original_tick()
        events.append((t0, app.state.steps_seen - before, time.perf_counter() - t0))

    app.tick = tick  # before mount: the app's set_interval takes this one
    async with app.run_test(size=size):
        await asyncio.sleep(warmup_s)
        t_start = time.perf_counter()
        first = len(events)
        await asyncio.sleep(seconds)
        t_end = time.perf_counter()
        window = [e for e in events[first:] if e[0] < t_end]
    span = t_end - t_start
    updates = [e for e in window if e[1] > 0]
    buckets = [0] * max(int(span), 1)
    for t, n, _ in updates:
        b = int(t - t_start)
        if b < len(buckets):
            buckets[b] += 1
    return {"seconds": round(span, 2), "ticks_per_s": round(len(window) / span, 2),
            "updates_per_s": round(len(updates) / span, 2), "min_updates_in_a_second": min(buckets),
            "records_per_s": round(sum(e[1] for e in window) / span, 1),
            "tick": _stats_ms([e[2] for e in window])}


# -- 2a. first screen ---------------------------------------------------------------------------------

async def _first_screen() -> dict:
    """From the engine process being ready (its ready line) to the console's first frame with the
    engine's records on it (target: 1 s): what `moectl run` does once its engine is up."""
    from moectl.cli.engine_process import EngineProcess
    from moectl.console.app import MoectlApp
    from moectl.console.engine_client import EngineSource

    engine = EngineProcess([*_live_options(), "--workload", "rate=4,prompt=32-256,output=32-128"])
    try:
        engine.wait_ready()
        t0 = time.perf_counter()
        source = EngineSource(engine.dir, owner=True)
        app = MoectlApp(source)
        stamps: list = []
        _wrap_display(app, stamps)
        async with app.run_test(size=LIVE_SIZE):
            await _until(lambda: bool(stamps), 30.0, poll_s=0.001)
            await _until(lambda: app.state.steps_seen > 0, 30.0, poll_s=0.001)
            drawn = len(stamps)
            await _until(lambda: len(stamps) > drawn, 30.0, poll_s=0.001)  # the next frame shows them
        return {"first_frame_s": round(stamps[0][0] - t0, 3),
                "first_frame_with_records_s": round(stamps[drawn][0] - t0, 3) if len(stamps) > drawn else None,
                "target_s": 1.0}
    finally:
        engine.stop()


# -- 2b. engine throughput with a console attached -------------------------------------------------

def _tokens(records: list[dict]) -> tuple[int, float, float]:
    """(prompt + output tokens, first t_start, last t_end) of step records, on the engine's clock."""
    tokens = sum(r["batch"]["prefill_tokens"] + r["batch"]["decode_tokens"] for r in records)
    return tokens, min(r["t_start"] for r in records), max(r["t_end"] for r in records)


async def _throughput(rate: float, seconds: float, warmup_s: float, with_console: bool) -> dict:
    """The engine process flat out (demo workload at `rate`), its throughput read from its own
    step records (prompt + output tokens over the engine's wall clock) by a client that only
    counts; with_console: the console drawing the same engine meanwhile (Overview, headless)."""
    from moectl.console.app import MoectlApp
    from moectl.console.engine_client import EngineSource

    owned = _OwnedEngine(rate)
    counter = EngineSource(owned.process.dir)
    app = MoectlApp(EngineSource(owned.process.dir)) if with_console else None
    try:
        async def window() -> list[dict]:
            await asyncio.sleep(warmup_s)
            counter.poll()
            await asyncio.sleep(seconds)
            return counter.poll()[0]
        if app is not None:
            async with app.run_test(size=LIVE_SIZE):
                records = await window()
        else:
            records = await window()
    finally:
        counter.close()
        owned.source.close()
    tokens, t0, t1 = _tokens(records)
    return {"tok_per_s": round(tokens / (t1 - t0), 1), "steps": len(records), "seconds": round(t1 - t0, 2),
            "console": with_console, "workload_rate": rate}


# -- 3. keypress latency -------------------------------------------------------------------------

async def _key_latency(make_app, size: tuple[int, int], presses: int, seed: int, ready=None) -> dict:
    """Alternate "2" / "1" (Experts / Overview); latency from the key reaching the driver to the
    first frame rendered with the new tab active."""
    from textual import events
    from textual.widgets import TabbedContent

    app = make_app()
    stamps: list[tuple[float, str | None]] = []
    rng = np.random.default_rng(seed)
    latencies: dict[str, list[float]] = {"experts": [], "overview": []}
    state_latencies, missed = [], 0
    async with app.run_test(size=size) as pilot:
        _wrap_display(app, stamps)
        if ready is not None:
            await ready(app, pilot)
        steps0, t_load = app.state.steps_seen, time.perf_counter()
        tabbed = app.query_one(TabbedContent)
        for i in range(presses):
            key, target = ("2", "experts") if tabbed.active != "experts" else ("1", "overview")
            await asyncio.sleep(float(rng.uniform(0.15, 0.45)))
            n0 = len(stamps)
            t0 = time.perf_counter()
            app._driver.send_message(events.Key(key, key))
            t_state = None

            def shown():
                nonlocal t_state
                if t_state is None and tabbed.active == target:
                    t_state = time.perf_counter()
                return any(active == target for _, active in stamps[n0:])

            if await _until(shown, 10.0, poll_s=0.001):
                t_frame = next(t for t, active in stamps[n0:] if active == target)
                latencies[target].append(t_frame - t0)
                if t_state is not None:
                    state_latencies.append(t_state - t0)
            else:
                missed += 1
        steps_per_s = (app.state.steps_seen - steps0) / (time.perf_counter() - t_load)
    every = latencies["experts"] + latencies["overview"]
    return {"presses": presses, "missed": missed, "frame": _stats_ms(every),
            "to_experts": _stats_ms(latencies["experts"]), "to_overview": _stats_ms(latencies["overview"]),
            "state": _stats_ms(state_latencies), "steps_per_s": round(steps_per_s, 1),
            "samples_ms": [round(x * 1e3, 1) for x in every]}


async def _live_keys(rate: float, presses: int, seed: int, in_process: bool = False) -> dict:
    from moectl.console.app import MoectlApp

    async def ready(app, pilot):
        await _until(lambda: app.state.steps_seen > 20, 60.0)

    res = await _key_latency(lambda: MoectlApp(_live_source(rate, in_process)), LIVE_SIZE, presses, seed, ready)
    res["workload_rate"] = rate
    return res


async def _big_keys(path: Path, presses: int, seed: int) -> dict:
    """The same on the synthetic 61x384 / 64-device trace, paused (no engine): what the panels'
    own refresh costs do to the keyboard. The app's 5 Hz tick re-renders the visible panel even
    when no record arrived."""
    from moectl.console.app import MoectlApp
    from moectl.console.sources import ReplaySource

    async def ready(app, pilot):
        await pilot.pause()
        source = app.source
        source.seek_step(source.first_step + (source.last_step - source.first_step) // 2)
        app.tick()
        await _until(lambda: not app._alerts_running, 300.0)

    return await _key_latency(lambda: MoectlApp(ReplaySource(path)), BIG_SIZE, presses, seed, ready)


# -- report --------------------------------------------------------------------------------------

def run(args) -> dict:
    res: dict = {"load_avg_before": [round(x, 2) for x in os.getloadavg()]}
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.trace"
        log(f"writing a synthetic {LAYERS}x{EXPERTS}, {DEVICES}-device trace of {args.steps} steps ...")
        res["trace"] = write_synthetic_trace(path, args.steps, args.seed)
        log(f"frames at {BIG_SIZE[0]}x{BIG_SIZE[1]} ...")
        res["frames"] = asyncio.run(_frames(path, args.frames, BIG_SIZE, tuple(args.tabs)))
        log("Textual's floor for each tab's screen ...")
        for tab in res["frames"]["tabs"].values():
            tab["textual_floor"] = asyncio.run(_textual_floor(BIG_SIZE, tab["screen_runs"], args.frames))
        if args.big_presses:
            log(f"keypress latency on the big layout ({args.big_presses} presses) ...")
            res["big_keys"] = asyncio.run(_big_keys(path, args.big_presses, args.seed))
    if not args.skip_live:
        log(f"live update rate over {args.live_seconds:g} s (engine process, then in-process baseline) ...")
        res["update_rate"] = asyncio.run(_update_rate(4.0, args.live_seconds, 3.0))
        res["update_rate_in_process"] = asyncio.run(_update_rate(4.0, args.live_seconds, 3.0, in_process=True))
        log("first screen after the engine is ready ...")
        res["first_screen"] = asyncio.run(_first_screen())
        log(f"keypress latency under load ({args.presses} presses; engine process, then in-process) ...")
        res["keys"] = asyncio.run(_live_keys(args.load_rate, args.presses, args.seed))
        res["keys_in_process"] = asyncio.run(_live_keys(args.load_rate, args.presses, args.seed, in_process=True))
        log(f"engine throughput without, then with a console ({args.rounds} rounds of {args.live_seconds:g} s) ...")
        alone, attached = [], []
        for _ in range(args.rounds):  # interleaved: the machine's other load falls on both alike
            alone.append(asyncio.run(_throughput(args.load_rate, args.live_seconds, 3.0, False)))
            attached.append(asyncio.run(_throughput(args.load_rate, args.live_seconds, 3.0, True)))
        a = statistics.median(r["tok_per_s"] for r in alone)
        b = statistics.median(r["tok_per_s"] for r in attached)
        res["throughput"] = {"alone_tok_per_s": a, "with_console_tok_per_s": b, "ratio": round(b / a, 3),
                             "rounds": args.rounds, "alone": alone, "with_console": attached}
    res["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    res["targets"] = {"frame_ms": FRAME_TARGET_MS, "updates_per_s": UPDATE_TARGET_HZ, "key_ms": KEY_TARGET_MS,
                      "key_p95_ms": KEY_P95_TARGET_MS, "throughput_ratio": THROUGHPUT_TARGET}
    return res


def report(res: dict) -> None:
    tr, fr = res["trace"], res["frames"]
    print(f"synthetic trace: {tr['steps']} steps, {LAYERS}x{EXPERTS} routing, {DEVICES} devices, {tr['lanes']} lanes, "
          f"{tr['spans_per_step']:,} spans/step, {tr['file_mb']} MB (written in {tr['write_s']} s)")
    print(f"seek + window fill (64 records) {fr['seek_fill_ms']} ms; alerts worker {fr['alerts_s']} s "
          f"({fr['alerts']} alerts) at this size")
    print()
    print(f"{'measure':<34} {'median':>10} {'max':>10} {'target':>10} {'median/target':>14} {'max/target':>11}")
    print("-" * 93)

    def row(name, median, worst, target, unit="ms", higher_is_better=False):
        if median is None:
            print(f"{name:<34} {'-':>10} {'-':>10}")
            return
        r_med = (target / median if median else float("inf")) if higher_is_better else median / target
        if worst is None:
            r_max = ""
        else:
            r_max = f"{(target / worst if worst else float('inf')) if higher_is_better else worst / target:.2f}"
        print(f"{name:<34} {median:>8.1f}{unit:>2} {'' if worst is None else f'{worst:>8.1f}{unit:>2}':>10} "
              f"{target:>8.0f}{unit:>2} {r_med:>14.2f} {r_max:>11}")

    for tab, s in fr["tabs"].items():
        floor = s["textual_floor"]
        row(f"frame {tab} {fr['size'][0]}x{fr['size'][1]}", s["frame"]["median_ms"], s["frame"]["max_ms"], FRAME_TARGET_MS)
        row("  of which tick (record + panel)", s["tick"]["median_ms"], s["tick"]["max_ms"], FRAME_TARGET_MS)
        row("  full repaint (resize, theme)", s["full_repaint"]["median_ms"], s["full_repaint"]["max_ms"],
            FRAME_TARGET_MS)
        row(f"  Textual floor, {floor['runs']:,} runs", floor["median_ms"], floor["max_ms"], FRAME_TARGET_MS)
        print(f"  {s['screen_runs']:,} colour runs on screen; full repaint / Textual floor: "
              f"{s['full_repaint']['median_ms'] / floor['median_ms']:.2f}")
    for name, label in (("update_rate", "engine process"), ("update_rate_in_process", "in-process baseline")):
        if name not in res:
            continue
        u = res[name]
        row(f"live updates/s ({label})", u["updates_per_s"], float(u["min_updates_in_a_second"]), UPDATE_TARGET_HZ,
            unit="Hz", higher_is_better=True)
        print(f"  ticks {u['ticks_per_s']}/s, records {u['records_per_s']}/s over {u['seconds']} s; "
              f"tick median {u['tick']['median_ms']} ms, max {u['tick']['max_ms']} ms "
              f"(max column: the fewest updates in any one second)")
    if "first_screen" in res:
        f = res["first_screen"]
        print(f"first screen: {f['first_frame_s']} s from the engine's ready line to the console's first frame, "
              f"{f['first_frame_with_records_s']} s to one drawn with its records (target {f['target_s']} s)")
    if "throughput" in res:
        t = res["throughput"]
        print(f"engine throughput (prompt + output tok/s, engine wall clock, median of {t['rounds']}): "
              f"{t['alone_tok_per_s']:,.0f} alone, {t['with_console_tok_per_s']:,.0f} with a console attached: "
              f"ratio {t['ratio']:.3f} (target >= {THROUGHPUT_TARGET})")
    labels = (("keys", "live, engine process flat out"), ("keys_in_process", "live, in-process baseline"),
              ("big_keys", f"big layout {BIG_SIZE[0]}x{BIG_SIZE[1]}, replay paused"))
    for name, label in labels:
        if name not in res:
            continue
        k = res[name]
        print(f"keypress ({label}):")
        row("  key -> frame, any tab", k["frame"]["median_ms"], k["frame"]["max_ms"], KEY_TARGET_MS)
        row("  key -> frame, p95", k["frame"]["p95_ms"], None, KEY_P95_TARGET_MS)
        row("  key -> frame, to Experts", k["to_experts"]["median_ms"], k["to_experts"]["max_ms"], KEY_TARGET_MS)
        row("  key -> frame, to Overview", k["to_overview"]["median_ms"], k["to_overview"]["max_ms"], KEY_TARGET_MS)
        row("  key -> tab state changed", k["state"]["median_ms"], k["state"]["max_ms"], KEY_TARGET_MS)
        extra = (f"; engine at {k['steps_per_s']} steps/s (workload rate={k['workload_rate']:g} req/s)"
                 if "workload_rate" in k else "")
        print(f"  {k['presses']} presses, {k['missed']} missed{extra}; samples (ms): "
              + " ".join(f"{x:g}" for x in k["samples_ms"]))
    print(f"load average before {res['load_avg_before']}, after {res['load_avg_after']}")
    print("ratios: time / target (< 1 meets it); for updates, target / rate (< 1 meets it)")


def main(argv=None) -> int:
    global DEVICES, FRAME_TARGET_MS, LIVE_MODEL
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=160, help="steps in the synthetic trace (default 160)")
    ap.add_argument("--big-devices", type=int, default=DEVICES, choices=(64, 256),
                    help="devices of the synthetic trace (default 64; 256: the 33 ms target)")
    ap.add_argument("--frames", type=int, default=15, help="measured frames per tab (default 15)")
    ap.add_argument("--tabs", nargs="+", default=list(TABS[:3]), choices=TABS,
                    help="tabs to time (default: experts overview timeline)")
    ap.add_argument("--live-seconds", type=float, default=5.0)
    ap.add_argument("--presses", type=int, default=20)
    ap.add_argument("--big-presses", type=int, default=10,
                    help="presses on the big synthetic layout (0: skip; default 10)")
    ap.add_argument("--load-rate", type=float, default=50.0, help="demo workload rate while pressing keys")
    ap.add_argument("--model", default=None, help="the live measures' model: a checkpoint or a shipped model's name "
                                                  "(default: sample)")
    ap.add_argument("--rounds", type=int, default=3, help="throughput rounds, alone and with a console (default 3)")
    ap.add_argument("--skip-live", action="store_true", help="frame times only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    DEVICES = args.big_devices  # read by the synthetic trace's writers and the report
    LIVE_MODEL = args.model
    FRAME_TARGET_MS = 16.0 if DEVICES <= 64 else 33.0  # issue 21: 60 fps at 64 devices, 30 at 256
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        report(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
