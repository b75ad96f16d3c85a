"""The moectl console: one Textual app over a live engine, a replayed trace or (later) a remote one.

The app polls its source on a timer (never per token), feeds the records into ConsoleState, and
tells the visible panel to show the state (attributes down). Panels ask for actions by message
(messages up); the app runs them through the source, off the UI thread when they take time.
"""

from __future__ import annotations

import gc

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.command import Hit, Hits, Provider
from textual.containers import VerticalScroll
from textual.css.query import NoMatches
from textual.screen import ModalScreen
from textual.widgets import Footer, Header, Static, TabbedContent, TabPane

from moectl.console.panels import (
    ActionRequested,
    ExpertsPanel,
    MemoryPanel,
    OverviewPanel,
    RequestsPanel,
    TimelinePanel,
    TransportBar,
)
from moectl.console.sources import ActionRefused, ReplaySource, counterfactual_plan
from moectl.console.state import ConsoleState
from moectl.console.widgets import HeatMap
from moectl.profiler.alert_feed import AlertCadence, window_alerts
from moectl.themes import HEATMAP_SCALE, STYLES, THEMES
from moectl.wire.actions import Action

REFRESH_S = 1 / 15  # 15 Hz: at least 10 screen updates a second while records arrive
TABS = ("overview", "experts", "memory", "timeline", "requests")


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,q,question_mark,f1", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        app = self.app
        lines = ["[b]moectl console keys[/b]", ""]
        for binding in app.BINDINGS:
            if isinstance(binding, Binding) and binding.description:
                keys = " / ".join(app.get_key_display(Binding(k, "")) for k in binding.key.split(","))
                lines.append(f"  [b]{keys:<14}[/b] {binding.description}")
        lines += ["", "  [b]arrows[/b]         move the heat-map cursor / pan the timeline",
                  "  [b]+ / - / 0[/b]      zoom the timeline in / out / to fit; [b]n / p[/b] next / previous span",
                  "  [b]tab[/b]            next control; [b]enter[/b] presses a button or submits a field",
                  "  [b]ctrl+p[/b]         command palette: every action by name", "",
                  "Modeled figures are marked: link time on emulated devices, and the activations and",
                  "communication buffers in the HBM accounting (derived from each step's shapes).",
                  "Balancedness and the stacked expert loads are the routing mapped over the placement",
                  "(replicas share evenly); the per-device load bars are the rows each device computed.",
                  "In replay, rebalance shows what the recorded routing would have done under the new placement."]
        with VerticalScroll(id="help-body"):
            yield Static("\n".join(lines))


class ConsoleCommands(Provider):
    """Every console action in the command palette."""

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        app = self.app
        for name, help_text, action in app.palette_commands():
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), action, help=help_text)


class MoectlApp(App):
    CSS_PATH = str(STYLES)
    TITLE = "moectl"
    COMMANDS = App.COMMANDS | {ConsoleCommands}
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark,f1", "help", "Help"),
        Binding("1", "tab('overview')", "Overview", show=False),
        Binding("2", "tab('experts')", "Experts", show=False),
        Binding("3", "tab('memory')", "Memory", show=False),
        Binding("4", "tab('timeline')", "Timeline", show=False),
        Binding("5", "tab('requests')", "Requests", show=False),
        Binding("r", "rebalance_preview", "Preview rebalance"),
        Binding("A", "rebalance_apply", "Apply rebalance"),
        Binding("t", "next_theme", "Theme"),
        Binding("space", "toggle_play", "Play/pause", show=False),
        Binding("period", "step_once", "Step (replay)", show=False),
    ]

    def __init__(self, source, theme: str = "dark"):
        super().__init__()
        self.source = source
        self.state = ConsoleState(source.header, source.mode)
        self.theme_key = theme
        self.plan = None
        self.replay = isinstance(source, ReplaySource)
        self._alert_cadence = AlertCadence()  # replay and in-process live: no engine process computes them
        self._alerts_running = False
        self._alerts_asked = 0  # alert computations started: only the latest one's answer is shown
        self._shown_version, self._shown_error = -1, None
        self._notified_error: str | None = None
        engine_dir = getattr(source, "engine_dir", None)  # where other consoles and `generate --engine` attach
        self.sub_title = f"{source.mode} · {self.state.model_name}" + (f" · engine {engine_dir}" if engine_dir else "")

    def compose(self) -> ComposeResult:
        yield Header()
        with TabbedContent(id="tabs", initial="overview"):
            with TabPane("Overview", id="overview"):
                yield OverviewPanel(id="panel-overview")
            with TabPane("Experts", id="experts"):
                yield ExpertsPanel(id="panel-experts")
            with TabPane("Memory", id="memory"):
                yield MemoryPanel(id="panel-memory")
            with TabPane("Timeline", id="timeline"):
                yield TimelinePanel(id="panel-timeline")
            with TabPane("Requests", id="requests"):
                yield RequestsPanel(id="panel-requests")
        if self.replay:
            yield TransportBar(id="transport")
        yield Footer()

    def on_mount(self) -> None:
        for theme in THEMES.values():
            self.register_theme(theme)
        self.apply_theme(self.theme_key)
        if self.replay:
            self.query_one(TransportBar).setup(self.source)
        self.set_interval(REFRESH_S, self.tick)
        self.tick()
        # the widgets, styles and imports live as long as the app: out of the collector's sight,
        # a full collection no longer walks them (it paused tab switches for up to 200 ms: see
        # bench/README.md, console responsiveness). Garbage first, so none of it is frozen.
        gc.collect()
        gc.freeze()

    # -- the update loop
    def tick(self) -> None:
        try:
            self._tick()
        except NoMatches:  # mounting or unmounting: the widgets come (or go) between ticks
            self._shown_version = None

    def _tick(self) -> None:
        moved = False  # a replay seek: the window is another one now
        try:
            records, actions = self.source.poll()
            moved = self.replay and getattr(self.source, "needs_reset", False)
            if moved:
                self.state.reset()
            self.state.apply(records, actions)
        except Exception as exc:  # noqa: BLE001 - a damaged record: say so once, keep running
            message = f"source: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            if message != getattr(self, "_last_source_error", None):
                self.notify(message, severity="error")
                self._last_source_error = message
            return
        if self._alerts_from_engine:
            self._engine_alerts()
        self._external_figures()
        error = self._engine_error()
        # after a seek at once: the replay opens on a full window, so the alerts computed then would
        # otherwise stay on screen for ALERT_EVERY_S (profiler/alert_feed.py) after the operator seeks
        # elsewhere. Checked before the no-news return below: steps that all arrived within
        # ALERT_EVERY_S of the last computation (a short burst) get theirs once the interval is over
        if not self._alerts_from_engine and self.state.window and not self._alerts_running and (
                moved or self._alert_cadence.due(self.state.steps_seen)):
            self._alerts_running = True
            self._alerts_asked += 1
            self.compute_alerts(list(self.state.window), self.state.placement_shown, self._alerts_asked)
        if self.state.version == self._shown_version and error == self._shown_error:
            if self.replay:  # play/pause and position still change the transport's line
                self.query_one(TransportBar).show(self.source)
            return  # nothing new: leave the UI thread to the keyboard
        self.refresh_panels()

    def _external_figures(self) -> None:
        """Another engine's server (VllmSource): its latest figures, when a scrape brought new ones."""
        version = getattr(self.source, "figures_version", None)
        if version is not None and version != getattr(self, "_figures_version", None):
            self._figures_version = version
            self.state.external_figures = self.source.figures
            self.state.version += 1

    @property
    def _alerts_from_engine(self) -> bool:
        """The engine process computes the alerts for every client (EngineSource.engine_alerts)."""
        return getattr(self.source, "engine_alerts", False)

    def _engine_alerts(self) -> None:
        version = self.source.alerts_version
        if version != self._alerts_asked:
            self._alerts_asked = version
            self.state.alerts = list(self.source.alerts)
            self.state.version += 1

    # a fixed description: Textual would otherwise repr() the arguments (the whole window) on the UI thread
    @work(thread=True, exclusive=True, group="alerts", description="alerts")
    def compute_alerts(self, records: list[dict], placement, asked: int = 0) -> None:
        found = window_alerts(records, placement, self.state.header.get("devices"))
        self.call_from_thread(self._set_alerts, found, asked)

    def _set_alerts(self, found: list[dict], asked: int = 0) -> None:
        if asked != self._alerts_asked:  # for a window a seek has replaced: the newer answer follows
            return
        self.state.alerts = found
        self.state.version += 1
        self._alerts_running = False

    def _engine_error(self) -> str | None:
        """The source's error, notified the first time it is read: every read goes through here, so
        an error can never be shown in a panel (or marked shown) without having been notified; the
        engine's reader thread may set it between any two reads."""
        error = self.source.error
        if error is not None and error != self._notified_error:  # said at once, whichever tab is shown
            self.notify(error, severity="error", title="engine", timeout=30)
            self._notified_error = error
        return error

    def refresh_panels(self) -> None:
        error = self._engine_error()
        self._shown_version, self._shown_error = self.state.version, error
        try:  # at start-up, or on a tab switched to just now, the panel may still be composing
            active = self.query_one(TabbedContent).active
            panel = self.query_one(f"#panel-{active}")
            if active == "overview":
                panel.show(self.state, error)
            else:
                panel.show(self.state)
            if active == "requests":
                panel.fill_forms(self.state.knobs, getattr(self.source, "load", None))
        except NoMatches:
            self._shown_version = None  # so that the next tick draws it
            return
        if self.replay:
            self.query_one(TransportBar).show(self.source)

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        self.refresh_panels()

    # -- actions from panels, keys and the palette
    def on_action_requested(self, message: ActionRequested) -> None:
        self.run_action_request(message.kind, dict(message.args))

    def run_action_request(self, kind: str, args: dict) -> None:
        if self.replay:
            self._replay_action(kind)
            return
        if kind == Action.REBALANCE_APPLY:
            if self.plan is None:
                self._refused(kind, "preview a rebalance first")
                return
            args["plan"] = self.plan
        try:
            future = self.source.act(kind, **args)
        except ActionRefused as exc:
            self._refused(kind, str(exc))
            return
        self._clear_errors(kind)
        self.wait_for(kind, future)

    @work(thread=True, group="actions", description="action")
    def wait_for(self, kind: str, future) -> None:
        try:
            result = future.result(timeout=60)
        except Exception as exc:  # noqa: BLE001 - shown inline, the engine is unchanged
            self.call_from_thread(self._refused, kind, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return
        self.call_from_thread(self._done, kind, result)

    def _done(self, kind: str, result) -> None:
        if kind == Action.REBALANCE_PREVIEW:
            self.plan = result
            self._show_preview(result.summary())
        elif kind == Action.REBALANCE_APPLY:  # answered once the copy has run, with what it measured
            self.plan = None
            result = result if isinstance(result, dict) else {}
            moved, seconds = result.get("bytes_moved"), result.get("seconds")
            how = "a simulated migration stall" if result.get("simulated") else "measured"
            copied = (f": {moved:,} bytes copied in {seconds * 1e3:.1f} ms ({how})"
                      if isinstance(moved, int) and isinstance(seconds, (int, float)) else "")
            self.notify(f"rebalance applied between steps{copied}")
        elif kind == Action.KNOBS:
            self.notify("knobs take effect at the next step")
        elif kind == Action.RESTART:
            self.notify("engine restarted")
        else:
            self.notify(f"{kind}: done")
        self.refresh_panels()

    def _show_preview(self, summary: dict, counterfactual: bool = False) -> None:
        self.query_one(ExpertsPanel).show_preview(summary)
        what = "counterfactual " if counterfactual else ""
        self.notify(f"{what}balancedness {summary['balancedness_before']:.3f} -> {summary['balancedness_after']:.3f}, "
                    f"{summary['bytes_moved']:,} bytes to move; press A to apply", title="rebalance preview")

    def _refused(self, kind: str, reason: str) -> None:
        if kind in (Action.KNOBS, Action.WORKLOAD):
            self.query_one(RequestsPanel).show_error(reason)
        elif kind in (Action.EDIT, Action.AUTO_REBALANCE):
            self.query_one(ExpertsPanel).show_error(reason)
        elif kind in (Action.REBALANCE_PREVIEW, Action.REBALANCE_APPLY):
            self.query_one(ExpertsPanel).show_preview(None, reason)
        self.notify(reason, severity="error", title=kind)

    def _clear_errors(self, kind: str) -> None:
        if kind in (Action.KNOBS, Action.WORKLOAD):
            self.query_one(RequestsPanel).show_error(None)
        elif kind in (Action.EDIT, Action.AUTO_REBALANCE):
            self.query_one(ExpertsPanel).show_error(None)

    def _replay_action(self, kind: str) -> None:
        """Replay: rebalance is a counterfactual on the recorded routing; nothing else applies."""
        try:
            if kind == Action.REBALANCE_PREVIEW:
                self.plan = counterfactual_plan(self.state)
                self._show_preview(self.plan.summary(), counterfactual=True)
            elif kind == Action.REBALANCE_APPLY:
                if self.plan is None:
                    raise ActionRefused("preview a rebalance first")
                self.state.counterfactual = self.plan.placement
                self.notify("counterfactual: panels now show the recorded routing under the new placement")
                self.refresh_panels()
            else:
                self.source.act(kind)
        except ActionRefused as exc:
            self._refused(kind, str(exc))

    # -- key actions
    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_tab(self, tab: str) -> None:
        self.query_one(TabbedContent).active = tab

    def action_rebalance_preview(self) -> None:
        self.run_action_request(Action.REBALANCE_PREVIEW, {})

    def action_rebalance_apply(self) -> None:
        self.run_action_request(Action.REBALANCE_APPLY, {})

    def apply_theme(self, key: str) -> None:
        self.theme_key = key
        self.theme = THEMES[key].name
        self.query_one(HeatMap).scale_name = HEATMAP_SCALE[key]

    def action_next_theme(self) -> None:
        keys = list(THEMES)
        self.apply_theme(keys[(keys.index(self.theme_key) + 1) % len(keys)])

    def action_toggle_play(self) -> None:
        if self.replay:
            self.source.pause() if self.source.playing else self.source.play()
            self.refresh_panels()

    def action_step_once(self) -> None:
        if self.replay:
            self.source.step_forward()
            self.tick()

    def on_transport_bar_command(self, message: TransportBar.Command) -> None:
        src = self.source
        try:
            if message.command == "toggle":
                src.pause() if src.playing else src.play()
            elif message.command == "step":
                src.step_forward()
            elif message.command == "speed":
                src.set_speed(message.value)
            elif message.command == "seek_step":
                src.seek_step(message.value)
            elif message.command == "seek_time":
                src.seek_time(message.value)
        except ActionRefused as exc:
            self.query_one(TransportBar).show(src, str(exc))
            return
        self.query_one(TransportBar).error = None
        self.tick()

    def palette_commands(self) -> list[tuple[str, str, object]]:
        cmds = [(f"Show {t}", f"switch to the {t} panel", lambda t=t: self.action_tab(t)) for t in TABS]
        cmds += [("Preview rebalance", "plan for the window's routing; nothing changes", self.action_rebalance_preview),
                 ("Apply rebalance", "apply the previewed plan between steps", self.action_rebalance_apply),
                 ("Auto rebalance on", "rebalance when balancedness falls below 0.9",
                  lambda: self.run_action_request(Action.AUTO_REBALANCE, {"enabled": True, "threshold": 0.9})),
                 ("Auto rebalance off", "operator rebalances only",
                  lambda: self.run_action_request(Action.AUTO_REBALANCE, {"enabled": False})),
                 ("Deep capture 2 steps", "torch.profiler kernels into the timeline",
                  lambda: self.run_action_request(Action.CAPTURE, {"steps": 2})),
                 ("Pause workload", "stop adding demo requests",
                  lambda: self.run_action_request(Action.WORKLOAD, {"paused": True})),
                 ("Resume workload", "add demo requests again",
                  lambda: self.run_action_request(Action.WORKLOAD, {"paused": False})),
                 ("Restart engine", "a fresh engine with the same configuration",
                  lambda: self.run_action_request(Action.RESTART, {})),
                 ("Help", "keys and what they do", self.action_help)]
        cmds += [(f"Theme: {k}", f"switch to the {k} theme", lambda k=k: self.apply_theme(k)) for k in THEMES]
        if self.replay:
            cmds += [("Play / pause", "replay transport", self.action_toggle_play),
                     ("Step", "one recorded step", self.action_step_once)]
        return cmds

    def on_unmount(self) -> None:
        self.source.close()
