"""Requests: running, waiting and finished requests, latency histograms, the batching knobs and
the KV retention policy and budget (editable live), and the demo workload's rate, lengths and pause."""

from __future__ import annotations

import heapq

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Button, DataTable, Input, Label, Select, Static, Switch

from moectl.console.panels.common import ActionRequested, ShowsOnChange, absent_in_import, fmt_s
from moectl.console.widgets.chart import Chart
from moectl.console.widgets.line_cache import LineCacheMixin
from moectl.wire.actions import Action
from moectl.wire.kv_budget import format_kv_budget, parse_kv_budget

KNOBS = (("max_num_seqs", "max seqs"), ("max_num_batched_tokens", "max batched tokens"),
         ("long_prefill_token_threshold", "prefill chunk"))
RETENTION_POLICIES = ("full", "streaming", "snapkv", "h2o")  # engine/core/config.py's, for the Select
NO_BUDGET = ("", "none")  # what the budget field takes for "no budget" (full retention needs none)
SHOWN_ROWS = 200


class RequestTable(LineCacheMixin, DataTable):
    """The requests table; its finished lines are reused while rows, scroll, cursor and hover stay."""

    version = 0  # bumped by every change: what the rows show
    COLUMNS = ("request", "state", "prompt", "output", "TTFT", "TPOT", "finish")

    def show_rows(self, rows) -> None:
        """Show `rows` (tuples in COLUMNS' order, the request id first). While the same requests
        stay in the same order, only the cells that changed are replaced (a running request's
        token count each step); a rebuild re-measures every cell of every row."""
        shown = getattr(self, "_shown", ())
        if [r[0] for r in rows] == [r[0] for r in shown]:
            for old, new in zip(shown, rows):
                if old == new:
                    continue
                for column, (before, after) in enumerate(zip(old, new)):
                    if before != after:
                        self.update_cell(new[0], self.COLUMNS[column], after, update_width=True)
        else:
            self._rebuild(rows)
        self._shown = tuple(rows)
        self.version += 1

    def _rebuild(self, rows) -> None:
        cursor, scroll = self.cursor_row, self.scroll_y
        self.clear()
        for row in rows:
            self.add_row(*row, key=row[0])
        if self.row_count:  # the operator's place in the table survives the refresh
            self.move_cursor(row=min(cursor, self.row_count - 1), animate=False)
            self.scroll_y = scroll

    def line_frame(self):
        return (self.version, self.virtual_size, self.row_count, self.show_header, self.zebra_stripes,
                tuple(column.get_render_width(self) for column in self.ordered_columns), self.get_pseudo_class_state(),
                self.scroll_offset, self.cursor_coordinate, self.hover_coordinate, self.cursor_type, self.show_cursor)

    def line_key(self, y: int):
        return y


class RequestsPanel(ShowsOnChange, VerticalScroll):
    def compose(self) -> ComposeResult:
        yield Static(id="rq-counts")
        yield RequestTable(id="rq-table", zebra_stripes=True, cursor_type="row")
        with Horizontal(classes="row"):
            with Vertical():
                yield Static("TTFT (ms), finished requests", classes="section-title")
                yield Chart(id="rq-ttft")
            with Vertical():
                yield Static("TPOT (ms), finished requests", classes="section-title")
                yield Chart(id="rq-tpot")
        yield Static("Batching knobs and KV retention (applied at the next step)", classes="section-title")
        with Horizontal(classes="controls"):
            for name, label in KNOBS:
                yield Label(label)
                yield Input(id=f"rq-{name}", classes="small")
            yield Label("policy")
            yield Select([("fcfs", "fcfs"), ("priority", "priority")], id="rq-policy", allow_blank=False, value="fcfs")
        with Horizontal(classes="controls"):
            yield Label("KV retention")
            yield Select([(p, p) for p in RETENTION_POLICIES], id="rq-kv_retention", allow_blank=False, value="full")
            yield Label("budget")
            yield Input(id="rq-kv_budget", classes="small", placeholder="4096 or 25%")
            yield Button("Apply knobs", id="rq-apply", variant="primary")
        yield Static("Workload generator", classes="section-title")
        with Horizontal(classes="controls"):
            yield Label("rate (req/s)")
            yield Input(id="rq-rate", classes="small")
            yield Label("prompt")
            yield Input(id="rq-prompt", classes="small")
            yield Label("output")
            yield Input(id="rq-output", classes="small")
            yield Label("pause")
            yield Switch(id="rq-pause")
            yield Button("Apply workload", id="rq-workload")
        yield Static(id="rq-error", classes="error")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for column in RequestTable.COLUMNS:
            table.add_column(column, key=column)
        self._filled = False
        self._knobs: dict = {}

    def fill_forms(self, knobs: dict, load) -> None:
        """Put the current values in the forms once (later edits are the operator's)."""
        self._knobs = knobs  # the engine's, for what Apply may send
        if self._filled:
            return
        if self.app.state.mode == "replay":  # a recording cannot be re-batched: say so, show no dead forms
            for widget in self.query(".controls"):
                widget.display = False
            self.show_error("replay: the knobs and the workload are the recorded ones (shown above); "
                            "they cannot change")
        for name, _ in KNOBS:
            self.query_one(f"#rq-{name}", Input).value = str(knobs.get(name, ""))
        self.query_one("#rq-policy", Select).value = knobs.get("policy", "fcfs")
        if knobs.get("kv_retention") in RETENTION_POLICIES:
            self.query_one("#rq-kv_retention", Select).value = knobs["kv_retention"]
        budget = format_kv_budget(int(knobs.get("kv_budget") or 0), float(knobs.get("kv_budget_fraction") or 1.0))
        self.query_one("#rq-kv_budget", Input).value = "" if budget == "none" else budget
        if load is not None:
            self.query_one("#rq-rate", Input).value = f"{load.rate:g}"
            self.query_one("#rq-prompt", Input).value = load.prompt_len
            self.query_one("#rq-output", Input).value = load.output_len
            self.query_one("#rq-pause", Switch).value = load.paused
        self._filled = True

    def show(self, state) -> None:
        absent = absent_in_import(state, "requests, latencies and batching knobs" if state.external is None
                                  else "per-request rows and batching knobs")
        if absent is not None:
            self.put("#rq-counts", absent)
            return
        counts = state.request_counts()
        self.put("#rq-counts",
                 f"running {counts['running']}   waiting {counts['waiting']}   finished (kept) {counts['finished']}   "
                 f"knobs: " + ", ".join(f"{k}={v}" for k, v in state.knobs.items()))
        order = {"running": 0, "waiting": 1, "finished": 2}
        # the first SHOWN_ROWS without sorting them all (10^5 in flight on a simulated cluster)
        rows = heapq.nsmallest(SHOWN_ROWS, state.requests.values(), key=lambda r: (order[r["state"]], -r["arrived"]))
        cells = tuple((r["id"], r["state"], str(r["prompt_tokens"] or "-"), str(r["output_tokens"] or 0),
                       fmt_s(r["ttft"]), fmt_s(r["tpot"]), r["reason"] or "") for r in rows[:SHOWN_ROWS])
        if cells != getattr(self, "_cells", None):
            self._cells = cells
            self.query_one(RequestTable).show_rows(cells)
        for plot_id, values in (("#rq-ttft", state.ttft), ("#rq-tpot", state.tpot)):
            self.query_one(plot_id, Chart).plot_histogram([v * 1e3 for v in values], bins=20, unit="ms")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "rq-apply":
            try:
                changes = {}
                for name, label in KNOBS:
                    text = self.query_one(f"#rq-{name}", Input).value.strip()
                    try:
                        changes[name] = int(text)
                    except ValueError:
                        raise ValueError(f"{label}: {text!r} is not an integer") from None
                changes["policy"] = self.query_one("#rq-policy", Select).value
                changes.update(self._retention_changes())
            except ValueError as exc:
                self.show_error(str(exc))
                return
            self.post_message(ActionRequested(Action.KNOBS, **changes))
        elif event.button.id == "rq-workload":
            self._request_workload()

    def _retention_changes(self) -> dict:
        """The retention policy and budget as the engine's knobs take them; ValueError for a budget
        that is neither a token count nor a percentage. A policy other than full with no budget
        goes to the engine as asked: its KnobError says what is missing. An engine that has no
        retention knobs (its records name none) is sent them only when set away from full."""
        policy = self.query_one("#rq-kv_retention", Select).value
        text = self.query_one("#rq-kv_budget", Input).value.strip()
        tokens, fraction = 0, 1.0
        if text.lower() not in NO_BUDGET:
            for part in text.split(" and "):  # format_kv_budget's "4096 and 25%": both caps
                t, f = parse_kv_budget(part, "budget")
                tokens, fraction = t or tokens, min(f, fraction)
        if "kv_retention" not in self._knobs and policy == "full" and text.lower() in NO_BUDGET:
            return {}
        return {"kv_retention": policy, "kv_budget": tokens, "kv_budget_fraction": fraction}

    def on_switch_changed(self, event: Switch.Changed) -> None:
        if event.switch.id == "rq-pause":
            self.post_message(ActionRequested(Action.WORKLOAD, paused=event.value))

    def _request_workload(self) -> None:
        text = self.query_one("#rq-rate", Input).value.strip()
        try:
            rate = float(text)
        except ValueError:
            self.show_error(f"rate: {text!r} is not a number")
            return
        self.post_message(ActionRequested(Action.WORKLOAD, rate=rate,
                                          prompt_len=self.query_one("#rq-prompt", Input).value.strip(),
                                          output_len=self.query_one("#rq-output", Input).value.strip()))

    def show_error(self, message: str | None) -> None:
        self.put("#rq-error", f"[red]{message}[/]" if message else "")
