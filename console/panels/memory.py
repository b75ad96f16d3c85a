"""Memory: HBM over time per device, the categories each device holds now, KV retention per
device (and, once a budget has been in force, what it saves over time), the activations' headroom
to their dtype's limit (and to fp16's) per layer, the host tier, KV blocks, expert-cache hit rates,
and the memory planner's table for this layout."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Static

from moectl.console.panels import gpu, numerics
from moectl.console.panels.common import ShowsOnChange, absent_in_import, fmt_bytes
from moectl.console.widgets.chart import Chart

# derived from each step's shapes with the planner's formulas, not read from an allocator
MODELED_CATEGORIES = ("activations", "comm_buffers")


class MemoryPanel(ShowsOnChange, VerticalScroll):
    def compose(self) -> ComposeResult:
        yield Static("HBM over time per device (MiB, accounted; activations and buffers modeled)",
                     classes="section-title", id="mem-title")
        yield Chart(id="mem-plot")
        yield Static("HBM over time by category, all devices (MiB)", classes="section-title")
        yield Chart(id="mem-cat-plot")
        # only once a retention policy other than full has been in force: the gap is what it saves
        kv_box = Vertical(Static(classes="section-title", id="mem-kv-title"), Chart(id="mem-kv-plot"), id="mem-kv-box")
        kv_box.display = False
        yield kv_box
        yield Static("HBM by category, now", classes="section-title")
        yield Static(id="mem-categories")
        yield Static("KV retention (full-attention layers), now: tokens the running sequences hold of their context "
                     "(what full retention holds), tokens evicted so far", classes="section-title")
        yield Static(id="mem-retention")
        yield Static(numerics.TITLE, classes="section-title", id="mem-numerics-title")
        yield Static(id="mem-numerics")
        with Vertical(id="mem-gpu-box"):  # only with a GPU: hidden, it takes no room
            yield Static(gpu.TITLE + ", beside the engine's accounting above", classes="section-title")
            yield Static(id="mem-gpu")
        yield Static(id="mem-tiers")
        yield Static("Memory plan for this layout (moectl plan memory)", classes="section-title")
        yield Static(id="mem-plan")

    def on_mount(self) -> None:
        self._plan_text: str | None = None

    def show(self, state) -> None:
        absent = absent_in_import(state, "memory accounting and the devices' HBM")
        if absent is not None:
            self.put("#mem-categories", absent)
            return
        if state.simulated:
            self.put("#mem-title", "HBM over time per device (MiB, simulated: weights, KV blocks in use, the memory "
                                   "plan's activations and buffers)")
        history = [h for h in state.history if h["memory"]]
        steps = [h["step"] for h in history]
        shown = min(len(history[-1]["memory"]), 8) if history else 0  # beyond 8 lines a plot is unreadable
        curves = [[h["memory"][d] / 2**20 if d < len(h["memory"]) else 0 for h in history] for d in range(shown)]
        peak = max(max(h["memory"]) for h in history) if history else 0
        # else the capacity line flattens the curves
        capacity = state.hbm_bytes / 2**20 if history and state.hbm_bytes and peak > 0.25 * state.hbm_bytes else None

        self.query_one("#mem-plot", Chart).plot_lines(steps, [(f"d{d}", curve) for d, curve in enumerate(curves)],
                                                      hline=capacity)
        latest = history[-1]["categories"] if history else {}
        categories = sorted(latest, key=lambda c: -latest[c])[:6]  # the six largest stay readable
        cat_curves = [[h["categories"].get(c, 0) / 2**20 for h in history] for c in categories]
        self.query_one("#mem-cat-plot", Chart).plot_lines(steps, list(zip(categories, cat_curves)))
        self._kv_curves(state)
        memory = state.memory()
        self.put("#mem-categories", lambda: self._categories(state),
                 key=(tuple(tuple(m.items()) for m in memory[:16]), state.hbm_bytes))
        retention = state.kv_retention()
        self.put("#mem-retention", lambda: self._retention(state, retention),
                 key=(repr(retention), state.simulated, state.num_devices, _retention_knobs(state.knobs)))
        # built per new state version only (the app draws on change), put only when its text changed
        self.put("#mem-numerics", numerics.render(state.numerics(), state.simulated))
        sample = gpu.gpu_sample(state)
        self.query_one("#mem-gpu-box").display = sample is not None
        if sample is not None:
            notes = self._gpu_notes(state, sample)
            self.put("#mem-gpu", lambda: Group(gpu.table(sample), Text.from_markup("[dim]" + "\n".join(notes) + "[/]")),
                     key=(repr(sample["devices"]), notes))
        self.put("#mem-tiers", self._tiers(state))
        if self._plan_text is None:
            self._plan_text = self._plan(state)
        self.put("#mem-plan", self._plan_text)

    @staticmethod
    def _categories(state) -> Text | str:
        """A text grid: a Rich Table measured and laid out every cell on every step."""
        memory = state.memory()
        if not memory:
            return "[dim]no per-device accounting (start with --devices N)[/]"
        shown = memory[:16]
        categories = sorted({c for m in shown for c in m}, key=lambda c: -sum(m.get(c, 0) for m in shown))
        rows = [(f"{c} (modeled)" if c in MODELED_CATEGORIES else c, [fmt_bytes(m.get(c, 0)) for m in shown])
                for c in categories]
        rows.append(("total", [fmt_bytes(sum(m.values())) for m in shown]))
        rows.append(("HBM", [fmt_bytes(state.hbm_bytes) for _ in shown]))
        header = ("category", [f"d{d}" for d in range(len(shown))])
        label_w = max(len(label) for label, _ in [header, *rows])
        cell_w = max(len(cell) for _, cells in [header, *rows] for cell in cells)
        text = Text(no_wrap=True, overflow="crop")
        for label, cells in [header, *rows]:
            line = label.ljust(label_w) + "".join(" " + cell.rjust(cell_w) for cell in cells) + "\n"
            text.append(line, style="bold" if label in ("category", "total") else "")
        text.rstrip()
        return text

    def _kv_curves(self, state) -> None:
        """What full retention would hold against what the policy keeps, over time (all pools);
        hidden while every step shown ran full retention (the two curves would be one)."""
        history = state.kv_retention_history()
        self.query_one("#mem-kv-box").display = bool(history)
        if not history:
            return
        peak = max(h["kv_full_bytes"] for h in history)
        unit, scale = ("MiB", 2**20) if peak >= 2**20 else ("KiB", 2**10)
        policy = history[-1]["kv_policy"]
        self.put("#mem-kv-title", f"KV of the full-attention layers over time, all devices ({unit}): held under "
                                  f"{policy} vs what full retention would hold; the gap is the saving")
        steps = [h["step"] for h in history]
        self.query_one("#mem-kv-plot", Chart).plot_lines(steps, [
            ("full retention would hold", [h["kv_full_bytes"] / scale for h in history]),
            (f"held ({policy})", [h["kv_held_bytes"] / scale for h in history])], y_range=(0, None))

    @staticmethod
    def _retention(state, retention: dict | None) -> Text | str:
        """The policy in force, then per device the tokens held of the running sequences' context
        tokens (what full retention would hold), the tokens evicted so far, and their bytes."""
        if retention is None:
            if state.simulated:
                return ("[dim]not modeled: the simulated backend keeps every token's KV "
                        "(`moectl plan memory --kv-budget` prices a budget)[/]")
            return "[dim]not recorded: these steps carry no KV retention figures (recorded before the engine sent them)[/]"
        text = Text(no_wrap=True, overflow="crop")
        text.append(f"policy {_describe_policy(retention, state.knobs)}\n", style="bold")
        held, context, evicted = retention["held_tokens"], retention["context_tokens"], retention["evicted_tokens"]
        token_bytes = retention["token_bytes"]
        named = state.num_devices > 0 or len(held) > 1
        rows = [(f"d{d}" if named else "engine", h, c, e) for d, (h, c, e) in enumerate(zip(held, context, evicted))]
        if len(rows) > 1:
            rows.append(("all", sum(held), sum(context), sum(evicted)))
        header = ("device", "held tok", "context tok", "evicted tok", "KV held", "full retention", "saved")
        cells = [header] + [(label, f"{h:,}", f"{c:,}", f"{e:,}", fmt_bytes(h * token_bytes),
                             fmt_bytes(c * token_bytes), f"{1 - h / c:.0%}" if c else "-")
                             for label, h, c, e in rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
        for row in cells:
            line = row[0].ljust(widths[0]) + "".join("  " + cell.rjust(w) for cell, w in zip(row[1:], widths[1:]))
            text.append(line + "\n", style="bold" if row is header or row[0] == "all" else "")
        text.rstrip()
        return text

    @staticmethod
    def _gpu_notes(state, sample: dict) -> tuple[str, ...]:
        """Under the driver's table: the sample's age, then the engine's own figures for the same
        memory (what the HBM accounting above adds up to, the torch allocator's counters)."""
        lines = [gpu.age(sample, state.latest)]
        accounted = state.memory()
        if accounted:
            lines.append(f"engine accounted HBM (table above): {fmt_bytes(sum(sum(m.values()) for m in accounted))} over "
                         f"{len(accounted)} device(s)")
        cuda = (state.latest.get("process") or {}).get("cuda")
        if cuda:
            lines.append(f"torch allocator (this process, current device): allocated {fmt_bytes(cuda.get('allocated'))}, "
                         f"reserved {fmt_bytes(cuda.get('reserved'))}, peak {fmt_bytes(cuda.get('max_allocated'))}")
        return tuple(lines)

    @staticmethod
    def _tiers(state) -> str:
        devices = (state.latest or {}).get("devices") or {}
        tiers = devices.get("tiers") or {}
        host = tiers.get("host") or {}
        cache = state.cache()
        traffic = state.tier_traffic()
        if traffic is None:
            lines = [f"host tier: {', '.join(f'{k} {fmt_bytes(v)}' for k, v in host.items()) or '-'}   "
                     f"experts tiered: {devices.get('tiered_experts', 'off')}"]
        else:  # three tiers: HBM caches (below) in front of host memory in front of the checkpoint's files
            h, d = traffic["host"], traffic["disk"]
            looked = h["hits"] + h["misses"]
            lines = [f"host tier: experts {fmt_bytes(host.get('expert_weights'))} of {fmt_bytes(host.get('capacity'))}"
                     f", hit rate (window) {h['hits'] / looked if looked else 0:.0%} of {looked} lookups",
                     f"disk tier: experts {fmt_bytes(tiers['disk'].get('expert_weights'))} in the checkpoint's files, "
                     f"{d['reads']} reads of {fmt_bytes(d['bytes_read'])} in {traffic['steps']} steps, "
                     f"waited {d['wait_s'] * 1e3:.1f} ms (measured)"]
        lines.append(f"KV blocks: {cache['kv_used']} used, {cache['kv_total'] - cache['kv_used']} free of "
                     f"{cache['kv_total']} ({cache['kv_usage']:.0%})   prefix hit rate {cache['prefix_hit_rate']:.0%}")
        rates = state.expert_cache_hit_rate()
        if rates is not None:
            tier = "HBM tier: " if traffic is not None else ""
            lines.append(tier + "expert cache hit rate (window): "
                         + "  ".join(f"d{d} {r:.0%}" for d, r in enumerate(rates)))
        proc = (state.latest or {}).get("process") or {}
        if proc:
            lines.append(f"process RSS {fmt_bytes(proc.get('rss_bytes'))}, system {fmt_bytes(proc.get('sys_used_bytes'))}"
                         f" of {fmt_bytes(proc.get('sys_total_bytes'))}"
                         + (f", CUDA allocated {fmt_bytes(proc['cuda']['allocated'])}" if proc.get("cuda") else ""))
        return "\n".join(lines)

    @staticmethod
    def _plan(state) -> str:
        """The plan the engine computed (its header's memory_plan; `moectl replay` fills it in for a
        trace recorded before engines put it there: profiler/recorder.py with_memory_plan)."""
        plan = state.header.get("memory_plan")
        if not isinstance(plan, dict):
            return "[dim]not available: the engine sent no memory plan[/]"
        return plan["table"] if "table" in plan else f"[dim]not available: {plan.get('absent')}[/]"


def _retention_knobs(knobs: dict) -> tuple:
    return tuple(knobs.get(k) for k in ("kv_sink_tokens", "kv_recent_tokens"))


def _describe_policy(retention: dict, knobs: dict) -> str:
    """E.g. "snapkv: a sequence keeps at most 64 tokens; sinks 4, recent 64 tokens always kept"."""
    policy = retention["policy"]
    if policy == "full":
        return "full (every token kept, no budget)"
    tokens, fraction = retention["budget_tokens"], retention["budget_fraction"]
    caps = ([f"{tokens:,} tokens"] if tokens else []) + ([f"{fraction * 100:g}% of its context"] if fraction < 1 else [])
    kept = [f"sinks {knobs['kv_sink_tokens']}"] if knobs.get("kv_sink_tokens") is not None else []
    if policy in ("snapkv", "h2o") and knobs.get("kv_recent_tokens") is not None:
        kept.append(f"recent {knobs['kv_recent_tokens']}")
    budget = f"a sequence keeps at most {' and '.join(caps)}" if caps else "no budget"
    return (f"{policy}: {budget}"
            + (f"; {', '.join(kept)} tokens always kept" if kept else ""))
