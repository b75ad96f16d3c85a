"""Experts: the routing heat map, per-device expert load, balancedness over time, the placement,
and the rebalancing controls (preview / apply, auto mode, single-expert edits)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Button, Input, Label, Select, Static, Switch

from moectl.console.panels.common import ActionRequested, ShowsOnChange, absent_in_import
from moectl.console.widgets import ColourLegend, HeatMap
from moectl.console.widgets.bars import StackedBars
from moectl.console.widgets.chart import Chart
from moectl.profiler.outcome import PART_LABELS
from moectl.wire.actions import Action

EDITS = ("move", "replicate", "drop_replica", "pin", "unpin")
SEGMENT_STYLES = ("bold #4EA8DE", "bold #F4A261", "bold #52B788", "bold #B08BD9", "bold #E5614E", "bold #E9C46A")
SEGMENT_GLYPHS = "█▓▒░▚▞"  # each segment has its own glyph too: the stack reads without colour


class ExpertsPanel(ShowsOnChange, VerticalScroll):
    def compose(self) -> ComposeResult:
        yield Static("Routing heat map (tokens per layer x expert over the window)", classes="section-title")
        yield HeatMap(id="ex-heatmap")
        yield ColourLegend(id="ex-legend")
        yield Static(id="ex-cell")
        with Horizontal(classes="row"):
            with Vertical():
                yield Static("Expert load per device, top experts stacked (routing over placement)",
                             classes="section-title")
                yield StackedBars(SEGMENT_STYLES, SEGMENT_GLYPHS, id="ex-stacked")
            with Vertical():
                yield Static("Balancedness over time", classes="section-title")
                yield Chart(id="ex-balance-plot")
        yield Static(id="ex-placement-title", classes="section-title")
        yield Static(id="ex-placement")
        yield Static("Rebalance", classes="section-title")
        with Horizontal(classes="controls"):
            yield Button("Preview", id="ex-preview", variant="primary")
            yield Button("Apply", id="ex-apply", variant="warning", disabled=True)
            yield Static(id="ex-preview-result")
            yield Static(id="ex-apply-outcome")
        with Horizontal(classes="controls"):
            yield Label("auto")
            yield Switch(id="ex-auto", value=False)
            yield Label("below")
            yield Input(placeholder="0.90", id="ex-threshold", classes="small")
            yield Label("or every")
            yield Input(placeholder="0", id="ex-every", classes="small")
            yield Label("steps")
        with Horizontal(classes="controls"):
            yield Select([(e, e) for e in EDITS], value="move", id="ex-edit", allow_blank=False)
            yield Input(placeholder="layer", id="ex-layer", classes="small")
            yield Input(placeholder="expert", id="ex-expert", classes="small")
            yield Input(placeholder="device", id="ex-device", classes="small")
            yield Input(placeholder="to device", id="ex-to", classes="small")
            yield Button("Do it", id="ex-do")
        yield Static(id="ex-error", classes="error")

    def on_mount(self) -> None:
        self.selected = (0, 0)
        self.plan = None

    def show(self, state) -> None:
        absent = absent_in_import(state, "per-expert loads and the placement") if state.external is not None else None
        if absent is not None:
            self.put("#ex-cell", absent)
            return
        heat = self.query_one(HeatMap)
        routing = state.routing_window()
        heat.set_data(routing)
        legend = self.query_one(ColourLegend)
        legend.lo, legend.hi, legend.unit = 0, float(routing.max()) if routing.size else 0.0, "tokens"
        legend.scale_name = heat.scale_name
        self._show_cell(state)
        self._show_stacked(state)
        self._show_outcome(state)
        steps = [h["step"] for h in state.history]
        values = [h["balancedness"] for h in state.history]

        self.query_one("#ex-balance-plot", Chart).plot_lines(steps, [("balancedness", values)], y_range=(0.0, 1.05))
        self._show_placement(state)

    def _show_cell(self, state) -> None:
        layer, expert = self.selected
        placement = state.placement_shown
        if placement is None or layer >= state.num_layers or expert >= state.num_experts:
            self.put("#ex-cell", "")
            return
        tokens = int(state.routing_window()[layer, expert])
        where = placement.replicas(layer, expert)
        devices = ", ".join(f"d{d}" for d, _ in where) or "nowhere"
        pinned = "  pinned" if placement.is_pinned(layer, expert) else ""
        self.put(
            "#ex-cell",
            f"L{layer}/E{expert}: {tokens:,} tokens in the window; on {devices} "
            f"({len(where)} replica{'s' if len(where) != 1 else ''}){pinned}")

    def _show_stacked(self, state) -> None:
        loads = state.device_loads(state.placement_shown)  # the stack is routing over placement: so is the total
        top = max(float(loads.max()) if len(loads) else 0.0, 1.0)
        tops = state.top_experts_per_device(len(SEGMENT_STYLES)) if state.placement_shown is not None else []
        rows = []
        for d in range(len(loads)):
            pieces = tuple(tokens / top for _, _, tokens in (tops[d] if tops else ()))
            tail = f" {loads[d]:,.0f}  " + " ".join(f"L{la}/E{e}" for la, e, _ in (tops[d][:2] if tops else []))
            rows.append((f"d{d}", pieces, float(loads[d]) / top, tail))
        self.query_one("#ex-stacked", StackedBars).set_rows(rows, empty="no devices")

    def _show_placement(self, state) -> None:
        placement = state.placement_shown
        layer = self.selected[0]
        label = "counterfactual placement" if state.counterfactual is not None else "placement"
        self.put("#ex-placement-title", f"{label.capitalize()}, layer {layer} (select a heat-map row to change layer)")
        if placement is None:
            self.put("#ex-placement", "[dim]no devices[/]")
            return
        counts = placement.replica_counts()
        lines = []
        for d in range(placement.num_devices):
            cells = []
            for e in placement.slots[layer, d]:
                if e < 0:
                    cells.append("  -  ")
                else:
                    mark = "*" if counts[layer, e] > 1 else ("^" if placement.is_pinned(layer, e) else " ")
                    cells.append(f"E{e:<3}{mark}")
            lines.append(f"d{d:<3} " + " ".join(cells))
        lines.append("[dim]* replicated  ^ pinned  - empty slot[/]")
        self.put("#ex-placement", "\n".join(lines))

    def _show_outcome(self, state) -> None:
        if state.simulated:
            self._show_simulated_outcome(state)
            return
        result = state.apply_outcome()
        if result is None:
            self.put("#ex-apply-outcome", "")
            return
        predicted, outcome = result["predicted"], result["outcome"]
        interval = (f" ({predicted['gain_low']:+.1%} to {predicted['gain_high']:+.1%})"
                    if "gain_low" in predicted else "")
        if outcome is None:
            so_far = result["so_far"]
            progress = ("" if so_far is None else f"; so far {so_far['gain']:+.1%} ({so_far['gain_low']:+.1%} to "
                        f"{so_far['gain_high']:+.1%}), resolved at +-{so_far['resolution_needed']:.1%}")
            self.put("#ex-apply-outcome",
                     f"after the apply: predicted {predicted['gain']:+.1%}{interval}; the outcome waits for steps of "
                     f"the batch shapes and contexts run before it ({result['matched']} of at least "
                     f"{result['min_steps']} matched in {result['steps_after']} steps){progress}")
            return
        clock = "simulated" if state.simulated else "modeled" if outcome["modeled"] else "measured"
        shapes = "1 population" if outcome["shapes"] == 1 else f"{outcome['shapes']} populations"
        experts_only = ("" if outcome["gain_experts_only"] is None else
                        f"; the experts' critical path alone {outcome['gain_experts_only']:+.1%} (the rest of the "
                        f"step held at its time before)")
        unresolved = "" if outcome["resolved"] else " [b]not resolved[/b] in the steps kept;"
        lines = [f"after the apply: {outcome['before']:,.0f} -> {outcome['after']:,.0f} tok/s {clock} "
                 f"({outcome['gain']:+.1%}, 90% interval {outcome['gain_low']:+.1%} to {outcome['gain_high']:+.1%};"
                 f"{unresolved} prompt+output per parallel step, on the {shapes} (batch shape, context) both sides "
                 f"ran, {outcome['steps']} steps each){experts_only}; " + _predicted_on(outcome, predicted, interval)]
        predicted_parts = predicted.get("parts") or {}
        for part, label in PART_LABELS.items():
            got = outcome["parts"].get(part)
            if got is None:
                continue
            forecast = predicted_parts.get(part)
            routing = predicted_parts.get("routing_s") if part == "dispatch_s" else None
            said = (f", predicted {forecast[0] * 1e3:.2f} -> {forecast[1] * 1e3:.2f}" if forecast else
                    f", predicted replica routing {routing[0] * 1e3:.2f} -> {routing[1] * 1e3:.2f} of it, the rest "
                    f"held" if routing else
                    ", predicted unchanged (held in the rest)" if part in ("dispatch_s", "rest_s") else "")
            lines.append(f"  {label}: {got['before_s'] * 1e3:.2f} -> {got['after_s'] * 1e3:.2f} ms a step "
                         f"({got['change_low_s'] * 1e3:+.2f} to {got['change_high_s'] * 1e3:+.2f}){said}")
        self.put("#ex-apply-outcome", "\n".join(lines))

    def _show_simulated_outcome(self, state) -> None:
        """A simulated cluster's engine runs the steps after an apply under both placements
        (sim_experts.py): the outcome on the same batches, the migration's stall included."""
        last, outcome = state.last_apply, state.sim_outcome
        if outcome is None:
            self.put("#ex-apply-outcome", "" if last is None else
                     f"after the apply: predicted {last['predicted']['gain']:+.1%} (simulated); the outcome "
                     f"follows once the engine has simulated the next steps under both placements")
            return
        predicted = outcome.get("predicted_gain")
        self.put(
            "#ex-apply-outcome",
            f"after the apply: {outcome['throughput_before']:,.0f} -> {outcome['throughput_after']:,.0f} tok/s "
            f"SIMULATED ({outcome['gain']:+.1%}; the same {outcome['steps']} batches under the old and the new "
            f"placement, the migration's {outcome['migration_stall_s'] * 1e3:.1f} ms stall included)"
            + ("" if predicted is None else f"; predicted {predicted:+.1%} on the batch before the apply"))

    def show_preview(self, summary: dict | None, error: str | None = None) -> None:
        result = self.query_one("#ex-preview-result", Static)
        if error:
            result.update(f"[red]{error}[/]")
            self.query_one("#ex-apply", Button).disabled = True
            return
        text = (f"predicted balancedness {summary['balancedness_before']:.3f} -> "
                f"{summary['balancedness_after']:.3f}, {summary['bytes_moved']:,} bytes to move "
                f"({summary['moves']} moves)")
        predicted = summary.get("predicted")
        if predicted:
            interval = (f", 90% interval {predicted['gain_low']:+.1%} to {predicted['gain_high']:+.1%}"
                        if "gain_low" in predicted else "")
            text += (f"\npredicted step {predicted['step_s_before'] * 1e3:.1f} -> {predicted['step_s_after'] * 1e3:.1f} ms, "
                     f"throughput {predicted['throughput_before']:,.0f} -> {predicted['throughput_after']:,.0f} tok/s "
                     f"(prompt+output per predicted parallel step) ({predicted['gain']:+.1%}{interval}; "
                     f"{predicted['model']})")
            if predicted.get("reason"):  # the gate's verdict (placement/decision.py): A still applies it
                text += f"\n{'it pays' if predicted['acts'] else 'it does not pay'}: {predicted['reason']}"
            if predicted.get("simulated"):
                text = "SIMULATED: " + text + (f"; the migration stalls one step by "
                                               f"{predicted.get('migration_stall_s', 0) * 1e3:.1f} ms")
                if predicted.get("step_model_gain") is not None:  # the simulator's own answer, same steps
                    text += f"; the step model itself gives {predicted['step_model_gain']:+.1%} on the same steps"
        result.update(text)
        self.query_one("#ex-apply", Button).disabled = False

    def on_heat_map_cell_selected(self, event: HeatMap.CellSelected) -> None:
        self.selected = (event.layer, event.expert)
        self.query_one("#ex-layer", Input).value = str(event.layer)
        self.query_one("#ex-expert", Input).value = str(event.expert)
        self.app.refresh_panels()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "ex-preview":
            self.post_message(ActionRequested(Action.REBALANCE_PREVIEW))
        elif event.button.id == "ex-apply":
            self.post_message(ActionRequested(Action.REBALANCE_APPLY))
            event.button.disabled = True
        elif event.button.id == "ex-do":
            self._request_edit()

    def on_switch_changed(self, event: Switch.Changed) -> None:
        self._request_auto(event.value)

    def _number(self, widget_id: str, kind=int, required: bool = True):
        text = self.query_one(widget_id, Input).value.strip()
        if not text:
            if required:
                raise ValueError(f"{self.query_one(widget_id, Input).placeholder}: required")
            return None
        try:
            return kind(text)
        except ValueError:
            raise ValueError(f"{self.query_one(widget_id, Input).placeholder}: {text!r} is not a number") from None

    def _request_auto(self, enabled: bool) -> None:
        try:
            threshold = self._number("#ex-threshold", float, required=False)
            every = self._number("#ex-every", int, required=False) or 0
        except ValueError as exc:
            self.show_error(str(exc))
            return
        self.post_message(ActionRequested(Action.AUTO_REBALANCE, enabled=enabled,
                                          threshold=threshold if threshold is not None else (0.9 if enabled else None),
                                          every_k_steps=every))

    def _request_edit(self) -> None:
        edit = self.query_one("#ex-edit", Select).value
        try:
            layer, expert = self._number("#ex-layer"), self._number("#ex-expert")
            args = {"layer": layer, "expert": expert}
            if edit == "move":
                args.update(src_device=self._number("#ex-device"), dst_device=self._number("#ex-to"))
            elif edit in ("replicate", "drop_replica"):
                args.update(device=self._number("#ex-device"))
        except ValueError as exc:
            self.show_error(str(exc))
            return
        self.post_message(ActionRequested(Action.EDIT, edit=edit, **args))

    def show_error(self, message: str | None) -> None:
        self.query_one("#ex-error", Static).update(f"[red]{message}[/]" if message else "")


def _predicted_on(outcome: dict, predicted: dict, interval: str) -> str:
    """The preview's own prediction on the outcome's population (its per-step predictions of the
    window steps of those shapes), beside its prediction for the whole window."""
    on = outcome.get("predicted_steps")
    gain = outcome["predicted_gain"] if on else predicted["gain"]
    said = (f"predicted {gain:+.1%} by the preview on these populations ({on} of the steps; on its whole window "
            f"{predicted['gain']:+.1%}{interval})" if on else f"predicted {gain:+.1%}{interval} by the preview")
    return f"{said}, {outcome['before'] * (1 + gain):,.0f} tok/s on this basis"
