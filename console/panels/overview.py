"""Overview: the model and devices, the serving figures, per-device load and HBM, and alerts."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Button, Static

from moectl.console.panels import gpu, vllm
from moectl.console.panels.common import ActionRequested, ShowsOnChange, fmt_bytes, fmt_s
from moectl.console.widgets.bars import Bars
from moectl.wire.actions import Action

SIMULATED_HBM = "HBM per device (simulated: weights, KV blocks in use, the memory plan's activations and buffers)"

class OverviewPanel(ShowsOnChange, VerticalScroll):
    def compose(self) -> ComposeResult:
        yield Static(id="ov-title")
        with Horizontal(id="ov-error-box", classes="hidden"):
            yield Static(id="ov-error")
            yield Button("Restart engine", id="ov-restart", variant="error")
        yield Static(id="ov-metrics")
        overlap = Static(id="ov-overlap")  # the ranks' two-batch overlap: shown once a step is split
        overlap.display = False
        yield overlap
        with Horizontal(id="ov-bars"):
            with Vertical():
                yield Static(id="ov-load-title", classes="section-title")
                yield Bars(id="ov-load")
            with Vertical():
                yield Static("HBM per device (accounted; activations and buffers modeled from shapes)",
                             classes="section-title", id="ov-hbm-title")
                yield Bars(id="ov-hbm")
        with Vertical(id="ov-gpu-box"):  # only with a GPU: hidden, it takes no room
            yield Static(gpu.TITLE + ", memory used", id="ov-gpu-title", classes="section-title")
            yield Bars(id="ov-gpu")
        yield Static("Alerts", classes="section-title")
        yield Static(id="ov-alerts")

    def show(self, state, source_error: str | None = None) -> None:
        if state.external is not None:
            self._show_external(state, source_error)
            return
        latest = state.latest or {}
        devices = latest.get("devices") or {}
        backend = devices.get("backend") or state.backend
        kind = {"emulated": "emulated on one torch device", "multi-gpu": "real GPUs in one process",
                "distributed": "distributed, one process per device",
                "simulated": f"SIMULATED on the {state.hardware or '?'} profile"
                             + (f" ({state.sim_pricing})" if state.sim_pricing else "")}.get(backend, backend)
        self.put(
            "#ov-title",
            f"[b]{state.model_name}[/b]  {state.num_layers} layers x {state.num_experts} experts  |  "
            f"{state.num_devices or 1} device(s), {kind}  |  {state.mode}"
            + ("  |  link time and parallel step modeled" if backend == "emulated" else "")
            + ("  |  link time and step measured" if backend == "distributed" else "")
            + ("  |  every figure from the step model, simulated clock" if state.simulated else ""))
        box = self.query_one("#ov-error-box")
        box.set_class(source_error is None, "hidden")
        self.query_one("#ov-restart", Button).display = state.mode == "live"
        if source_error is not None:
            what = "engine failed" if state.mode == "live" else "connection"
            self.put("#ov-error", f"[b red]{what}:[/] {source_error}")
        if state.imported is not None:
            self._show_imported(state)
            return
        lat, cache, counts = state.latency(), state.cache(), state.request_counts()
        clock = "simulated clock" if state.simulated else "wall clock"
        self.put(
            "#ov-metrics",
            f"throughput [b]{state.throughput():.0f}[/b] tok/s (prompt+output, {clock})   "
            f"TTFT p50/p99 {fmt_s(lat['ttft']['p50'])} / {fmt_s(lat['ttft']['p99'])}   "
            f"TPOT p50/p99 {fmt_s(lat['tpot']['p50'])} / {fmt_s(lat['tpot']['p99'])}\n"
            f"queue {counts['waiting']}   running {counts['running']}   "
            f"KV {cache['kv_used']}/{cache['kv_total']} blocks ({cache['kv_usage']:.0%})   "
            f"prefix hits {cache['prefix_hit_rate']:.0%}   preemptions {cache['preemptions']}   "
            f"balancedness {state.balancedness()['overall']:.2f} (routing over placement)")
        if state.simulated:
            self.put("#ov-hbm-title", SIMULATED_HBM)
        loads = state.device_loads()
        window = state.engine_window()
        span = "over the window"
        if window is not None and window.get("device_steps", window["steps"]) < window["steps"]:
            span = f"over the {window['device_steps']} steps since the placement changed"
        overlap = state.micro_batches()
        if overlap is not None:
            self.put("#ov-overlap", f"two-batch overlap: {overlap['split']} of {overlap['steps']} steps as two "
                                    f"micro-batches (last {overlap['last'][0]} + {overlap['last'][1]} tok); per split "
                                    f"step, collectives in flight under the other's compute "
                                    f"{fmt_s(overlap['hidden_s'])}, blocked on {fmt_s(overlap['blocked_s'])} "
                                    f"(busiest rank, measured)")
        self.query_one("#ov-overlap").display = overlap is not None
        self.put(
            "#ov-load-title",
            f"Expert rows per device {span}"
            + (f" (sN: pipeline stage N of {max(stages) + 1})" if (stages := state.device_stages()) else "") + ", "
            + ("simulated" if state.simulated else
               "estimated from routing and placement" if state.loads_estimated else "measured"))
        top = max(float(loads.max()) if len(loads) else 0.0, 1.0)
        util = state.utilisation()
        stages = state.device_stages()  # pipeline stages: each device's stage beside its name
        rows = [(f"d{d}" if stages is None or d >= len(stages) else f"d{d} s{stages[d]}", float(v) / top,
                 f"{v:,.0f} tok  busy {util[d] if d < len(util) else 0:.0%}") for d, v in enumerate(loads)]
        self.query_one("#ov-load", Bars).set_rows(rows, warn=2.0, crit=2.0, empty="no devices")
        memory = state.memory()
        hbm = state.hbm_bytes or 1
        rows = [(f"d{d}", sum(m.values()) / hbm, f"{fmt_bytes(sum(m.values()))} / {fmt_bytes(hbm)}")
                for d, m in enumerate(memory)]
        self.query_one("#ov-hbm", Bars).set_rows(rows, empty="no accounting yet")
        self._show_gpu(state)
        alerts = state.alerts
        self.put(
            "#ov-alerts",
            "\n".join(f"[b]{a['severity']}[/b] {a['message']}  [dim]-> {a['action']}[/]" for a in alerts)
            or "[dim]none[/]")

    def _show_external(self, state, source_error: str | None) -> None:
        self.put("#ov-title", vllm.title(state.external))
        self.query_one("#ov-error-box").set_class(source_error is None, "hidden")
        self.query_one("#ov-restart", Button).display = False
        if source_error is not None:
            self.put("#ov-error", f"[b red]connection:[/] {source_error}")
        self.put("#ov-metrics", vllm.metrics(state.external, state.external_figures))
        self.put("#ov-load-title", "Expert rows per device")
        self.query_one("#ov-load", Bars).set_rows([], empty=f"absent: not exported by {state.external.get('engine')}")
        self.query_one("#ov-hbm", Bars).set_rows([], empty=f"absent: not exported by {state.external.get('engine')}")
        self.query_one("#ov-gpu-box").display = False
        self.put("#ov-alerts", "[dim]none (moectl's alerts read step records)[/]")

    def _show_imported(self, state) -> None:
        imported = state.imported
        source = f"{imported.get('engine', '?')} {imported.get('engine_version') or ''}".strip()
        self.put("#ov-metrics", f"[b]imported[/b] from {source} ({imported.get('mode', '?')}): per-expert load "
                 f"measured by {imported.get('engine', 'that engine')}; throughput, latency, KV cache and step times "
                 f"are absent from its records\nbalancedness {state.balancedness()['overall']:.2f} (routing over "
                 + ("the recorded placement)" if state.recorded_placement is not None else "no placement: absent)"))
        if state.simulated:
            self.put("#ov-hbm-title", SIMULATED_HBM)
        loads = state.device_loads()
        top = max(float(loads.max()) if len(loads) else 0.0, 1.0)
        rows = [(f"d{d}", float(v) / top, f"{v:,.0f} tok") for d, v in enumerate(loads)]
        self.put("#ov-load-title", "Expert rows per device over the window, measured by the source engine")
        self.query_one("#ov-load", Bars).set_rows(rows, warn=2.0, crit=2.0, empty="placement absent")
        self.query_one("#ov-hbm", Bars).set_rows([], empty="absent: the source engine's records hold no memory accounting")
        self._show_gpu(state)
        self.put("#ov-alerts", "\n".join(f"[b]{a['severity']}[/b] {a['message']}" for a in state.alerts)
                 or "[dim]none[/]")

    def _show_gpu(self, state) -> None:
        sample = gpu.gpu_sample(state)
        self.query_one("#ov-gpu-box").display = sample is not None
        if sample is None:
            return
        # a bar only where the driver gave memory figures: an empty bar would read as nothing used
        rows = [(gpu.label(d), gpu.memory_fraction(d), gpu.summary(d)) for d in sample["devices"]]
        self.put("#ov-gpu-title", f"{gpu.TITLE}, memory used  [dim]({gpu.age(sample, state.latest)})[/]")
        self.query_one("#ov-gpu", Bars).set_rows(rows)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "ov-restart":
            self.post_message(ActionRequested(Action.RESTART))
