"""Memory: HBM over time per device, the categories each device holds now, the host tier, KV
blocks, expert-cache hit rates, and the memory planner's table for this layout."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Static

from moectl.console.panels import gpu
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
        yield Static("HBM by category, now", classes="section-title")
        yield Static(id="mem-categories")
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
        memory = state.memory()
        self.put("#mem-categories", lambda: self._categories(state),
                 key=(tuple(tuple(m.items()) for m in memory[:16]), state.hbm_bytes))
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
