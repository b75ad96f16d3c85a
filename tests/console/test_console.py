"""The console through Textual's Pilot: every panel shows the state, and every control acts on
the engine (live) or on the counterfactual (replay)."""

from __future__ import annotations

import pytest

from moectl.console.app import MoectlApp
from moectl.console.live_source import LiveSource
from moectl.console.sources import ReplaySource
from moectl.engine.core.config import EngineConfig
from moectl.engine.core.topology import Topology
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.tools.demo_workload import DemoLoad
from tests.checkpoints import tiny_checkpoint
from tests.paths import TRACES
from tests.pilot import run_app, text_of, until


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("console"))


def live(ckpt, **kw) -> LiveSource:
    config = EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=256, topology=Topology(num_devices=4),
                          redundant_slots=1, num_threads=1, **kw)
    return LiveSource(lambda: LLMEngine(config), DemoLoad(rate=40.0, prompt_len="8-24", output_len="8-16"))


def test_overview_shows_serving_figures_and_devices(ckpt):
    async def body(app, pilot):
        await until(pilot, lambda: app.state.steps_seen > 5 and app.state.throughput() > 0)
        await until(pilot, lambda: "tok/s" in text_of(app, "#ov-metrics"), timeout=5)
        metrics = text_of(app, "#ov-metrics")
        assert "KV" in metrics and "balancedness" in metrics
        assert text_of(app, "#ov-load").count("d") >= 4  # a bar per device
        assert "HBM" not in text_of(app, "#ov-hbm") or "/" in text_of(app, "#ov-hbm")
        assert "emulated" in text_of(app, "#ov-title")
    run_app(MoectlApp(live(ckpt)), body)


def test_rebalance_preview_then_apply_changes_the_engines_placement(ckpt):
    source = live(ckpt)

    async def body(app, pilot):
        before = source.engine.experts.placement
        await until(pilot, lambda: app.state.steps_seen > 5)
        await pilot.press("2")
        await pilot.press("r")
        await until(pilot, lambda: app.plan is not None)
        # the panel's text follows the plan on the UI thread: wait for it rather than race it
        await until(pilot, lambda: "predicted balancedness" in text_of(app, "#ex-preview-result"), timeout=5)
        await pilot.press("A")
        await until(pilot, lambda: source.engine.experts.placement != before)
        await until(pilot, lambda: app.state.placement == source.engine.experts.placement)
    run_app(MoectlApp(source), body)


def test_knobs_edit_the_scheduler_and_bad_values_change_nothing(ckpt):
    source = live(ckpt)

    async def body(app, pilot):
        await pilot.press("5")
        await until(pilot, lambda: app.query_one("#rq-max_num_seqs").value != "")
        app.query_one("#rq-max_num_seqs").value = "0"
        app.query_one("#rq-apply").press()
        await until(pilot, lambda: "max_num_seqs" in text_of(app, "#rq-error"), timeout=5)
        assert source.engine.scheduler.knobs.max_num_seqs == 64
        app.query_one("#rq-max_num_seqs").value = "abc"
        app.query_one("#rq-apply").press()
        await until(pilot, lambda: "not an integer" in text_of(app, "#rq-error"), timeout=5)
        app.query_one("#rq-max_num_seqs").value = "8"
        app.query_one("#rq-apply").press()
        await until(pilot, lambda: source.engine.scheduler.knobs.max_num_seqs == 8)
        assert text_of(app, "#rq-error").strip() == ""
    run_app(MoectlApp(source), body)


def test_workload_controls_pause_and_change_the_rate(ckpt):
    source = live(ckpt)

    async def body(app, pilot):
        await pilot.press("5")
        await pilot.pause(0.3)
        app.query_one("#rq-pause").value = True
        await until(pilot, lambda: source.workload.load.paused)
        app.query_one("#rq-rate").value = "-3"
        app.query_one("#rq-workload").press()
        await until(pilot, lambda: "rate" in text_of(app, "#rq-error"), timeout=5)
        assert source.workload.load.rate == 40.0
        app.query_one("#rq-error").update("")  # so the wait below sees this press's message
        app.query_one("#rq-rate").value = "inf"  # would flood the engine with requests
        app.query_one("#rq-workload").press()
        await until(pilot, lambda: "rate" in text_of(app, "#rq-error"), timeout=5)
        assert source.workload.load.rate == 40.0
        app.query_one("#rq-rate").value = "7.5"
        app.query_one("#rq-workload").press()
        await until(pilot, lambda: source.workload.load.rate == 7.5)
    run_app(MoectlApp(source), body)


def test_expert_edits_and_auto_rebalance_reach_the_engine(ckpt):
    source = live(ckpt)

    async def body(app, pilot):
        await pilot.press("2")
        await pilot.pause(0.2)
        panel = app.query_one("#panel-experts")
        app.query_one("#ex-edit").value = "pin"
        app.query_one("#ex-layer").value = "0"
        app.query_one("#ex-expert").value = "99"
        app.query_one("#ex-do").press()
        await until(pilot, lambda: "expert" in text_of(app, "#ex-error"), timeout=5)  # out of range: refused inline
        app.query_one("#ex-expert").value = "1"
        app.query_one("#ex-do").press()
        await until(pilot, lambda: source.engine.experts.placement.is_pinned(0, 1))
        app.query_one("#ex-threshold").value = "0.85"
        app.query_one("#ex-auto").value = True
        await until(pilot, lambda: source.engine.experts.auto.mode == "auto")
        assert source.engine.experts.auto.threshold == 0.85
        assert panel is not None
    run_app(MoectlApp(source), body)


def test_heat_map_selection_shows_the_cell_and_its_devices(ckpt):
    async def body(app, pilot):
        await pilot.press("2")
        await until(pilot, lambda: app.state.steps_seen > 3)
        app.query_one("#ex-heatmap").focus()
        await pilot.press("right", "down")
        await until(pilot, lambda: text_of(app, "#ex-cell").startswith("L1/E1:"), timeout=5)
        cell = text_of(app, "#ex-cell")
        assert cell.startswith("L1/E1:") and "tokens" in cell and "on d" in cell
        assert "layer 1" in text_of(app, "#ex-placement-title")
    run_app(MoectlApp(live(ckpt)), body)


def test_memory_and_timeline_panels_show_records(ckpt):
    source = live(ckpt)

    async def body(app, pilot):
        await until(pilot, lambda: app.state.steps_seen > 3)
        await pilot.press("3")
        await until(pilot, lambda: "KV blocks" in text_of(app, "#mem-tiers"), timeout=5)
        assert "kv_blocks" in text_of(app, "#mem-categories") or "total" in text_of(app, "#mem-categories")
        await pilot.press("4")
        await until(pilot, lambda: app.query_one("#tl-timeline").span_count > 0)
        assert "per step (measured)" in text_of(app, "#tl-breakdown")
        app.query_one("#tl-capture").press()
        await until(pilot, lambda: any(r.get("kernels") for r in app.state.window))
    run_app(MoectlApp(source), body)


def test_themes_switch_live_and_the_help_screen_opens(ckpt):
    async def body(app, pilot):
        assert app.theme == "moectl-light"
        await pilot.press("t")
        assert app.theme == "moectl-high-contrast" and app.query_one("#ex-heatmap").scale_name == "grey"
        await pilot.press("question_mark")
        await pilot.pause(0.1)
        assert app.screen.__class__.__name__ == "HelpScreen"
        await pilot.press("escape")
        assert app.screen.__class__.__name__ != "HelpScreen"
    run_app(MoectlApp(live(ckpt), theme="light"), body)


def test_an_engine_failure_is_shown_and_restart_recovers(ckpt):
    source = live(ckpt)

    def broken_step():
        raise RuntimeError("simulated device fault")

    async def body(app, pilot):
        await until(pilot, lambda: app.state.steps_seen > 2)
        source.engine.step = broken_step
        await until(pilot, lambda: source.error is not None)
        await until(pilot, lambda: "simulated device fault" in text_of(app, "#ov-error"), timeout=5)
        app.query_one("#ov-restart").press()
        await until(pilot, lambda: source.error is None)
        steps = app.state.steps_seen
        await until(pilot, lambda: app.state.steps_seen > steps + 2)
    run_app(MoectlApp(source), body)


def test_replay_transport_and_counterfactual_rebalance():
    source = ReplaySource(TRACES / "steady_rebalance.trace")

    async def body(app, pilot):
        await pilot.pause(0.2)
        app.query_one("#tr-seek-step").value = "200"
        await pilot.click("#tr-seek-step")
        await pilot.press("enter")
        await pilot.pause(0.3)
        assert source.position == 200 and app.state.latest["step"] == 200
        assert len(app.state.window) == 64  # the window was refilled from before the seek
        recorded = app.state.placement
        app.set_focus(None)  # keys now go to the app's bindings, not the seek field
        await pilot.press("2")
        await pilot.press("r")
        await pilot.pause(0.2)
        await pilot.press("A")
        await until(pilot, lambda: "counterfactual" in text_of(app, "#ex-placement-title").lower(), timeout=5)
        assert app.state.counterfactual is not None and app.state.placement == recorded
        assert app.state.balancedness()["overall"] > app.state.balancedness(recorded)["overall"]
        assert "counterfactual" in text_of(app, "#ex-placement-title").lower()
        await pilot.press("5")
        await until(pilot, lambda: "cannot change" in text_of(app, "#rq-error"), timeout=5)  # replay: no dead knob forms
        assert not app.query_one("#rq-apply").parent.display
        with pytest.raises(Exception, match="cannot change the recorded engine"):
            source.act("knobs", max_num_seqs=8)
        await pilot.press("space")
        await pilot.pause(0.5)
        assert source.position > 200
    run_app(MoectlApp(source), body)


def test_replay_of_an_unreadable_trace_is_a_one_line_error(tmp_path):
    from typer.testing import CliRunner

    from moectl.cli.main import app

    bad = tmp_path / "bad.trace"
    bad.write_bytes(b"\x00garbage" * 64)
    for args in (["replay", str(bad)], ["replay", str(tmp_path / "missing.trace")],
                 ["replay", str(TRACES / "kv_pressure.trace"), "--theme", "sepia"]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2, res.output
        assert res.stderr.count("\n") == 1 and "Traceback" not in res.output


@pytest.mark.parametrize("name", ["kv_pressure.trace", "offload_prefetch.trace"])
def test_every_panel_shows_each_sample_trace_in_replay(name):
    source = ReplaySource(TRACES / name)

    async def body(app, pilot):
        source.seek_step(source.last_step // 2)
        app.tick()
        for key in "12345":
            await pilot.press(key)
            await pilot.pause(0.1)
        assert app.state.latest["step"] == source.position
        if name == "offload_prefetch.trace":
            await pilot.press("3")
            await until(pilot, lambda: "expert cache hit rate" in text_of(app, "#mem-tiers"), timeout=5)
        else:
            assert app.state.cache()["preemptions"] > 0 or app.state.cache()["kv_usage"] > 0.5
    run_app(MoectlApp(source), body, size=(120, 40))


def test_transport_and_timeline_inputs_refuse_bad_values():
    source = ReplaySource(TRACES / "kv_pressure.trace")

    async def submit(pilot, app, field: str, value: str) -> None:
        app.query_one(field).value = value
        await pilot.click(field)
        await pilot.press("enter")

    async def body(app, pilot):
        await submit(pilot, app, "#tr-speed", "fast")
        await until(pilot, lambda: "not a number" in text_of(app, "#tr-status"))
        await submit(pilot, app, "#tr-speed", "0")
        await until(pilot, lambda: "speed: must be" in text_of(app, "#tr-status"))
        assert source.speed == 1.0
        await submit(pilot, app, "#tr-seek-step", "99999")
        await until(pilot, lambda: "outside the trace" in text_of(app, "#tr-status"))
        await submit(pilot, app, "#tr-seek-time", "0.5")
        await until(pilot, lambda: source.position > source.first_step)
        assert source.trace_time <= 0.5
        app.set_focus(None)
        await pilot.press("4")
        await pilot.pause(0.2)
        await submit(pilot, app, "#tl-steps", "500")
        await until(pilot, lambda: "[1, 64]" in text_of(app, "#tl-status"))
        await submit(pilot, app, "#tl-steps", "3")
        await until(pilot, lambda: text_of(app, "#tl-breakdown").startswith(
            f"steps {source.position - 2}-{source.position}"))
    run_app(MoectlApp(source), body, size=(160, 50))


def test_scrub_bar_marks_operator_actions_and_alerts():
    """Alert markers come from the alert bar's own analysis over the console's window: the first
    is the step where profiler.analysis.alerts first finds the imbalance, and the rebalance at
    step 300 clears it for the rest of the trace."""
    from moectl.console.state import WINDOW_STEPS
    from moectl.profiler.analysis import alerts
    from moectl.profiler.trace_queries import placement_in_force

    source = ReplaySource(TRACES / "steady_rebalance.trace")
    try:
        markers = source.markers()
        assert (300, "action") in markers  # the recorded rebalance
        starts = [step for step, kind in markers if kind == "alert"]
        assert starts and all(step < 300 for step in starts)
        placement, _ = placement_in_force(source.reader, starts[0])
        window = [source.reader.seek_step(int(s)) for s in source.steps if s <= starts[0]][-WINDOW_STEPS:]
        assert "imbalance" in {a["kind"] for a in alerts(window, placement)}
        assert not alerts(window[:-1], placement)
    finally:
        source.close()


def test_replay_delivers_actions_while_stepping_through_them():
    """The operator's rebalance at step 300 arrives when stepping past it (not only on a seek),
    and the state's placement follows it."""
    from moectl.console.state import ConsoleState

    source = ReplaySource(TRACES / "steady_rebalance.trace")
    state = ConsoleState(source.header, "replay")
    source.seek_step(290)
    state.apply(*source.poll())
    recorded = state.placement
    kinds = []
    for _ in range(20):
        source.step_forward()
        records, actions = source.poll()
        kinds += [a["kind"] for a in actions]
        state.apply(records, actions)
    source.close()
    assert "rebalance_apply" in kinds and state.placement != recorded


def test_a_damaged_step_is_skipped_not_fatal(tmp_path):
    import shutil
    import sqlite3

    from moectl.console.state import ConsoleState

    path = tmp_path / "damaged.trace"
    shutil.copy(TRACES / "kv_pressure.trace", path)
    with sqlite3.connect(path) as db:
        db.execute("UPDATE steps SET payload = ? WHERE step = 10", (b"\x00garbage",))
    source = ReplaySource(path)
    state = ConsoleState(source.header, "replay")
    source.seek_step(20)
    state.apply(*source.poll())
    assert source.skipped == 1 and 10 not in [r["step"] for r in state.window] and state.latest["step"] == 20
    source.close()


def test_running_requests_count_their_tokens_from_the_step_records(ckpt):
    """The state counts a running request's output tokens step by step, and the count it ends
    with is the engine's own."""
    from moectl.console.state import ConsoleState
    from moectl.engine.core.sampling import SamplingParams

    config = EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=128, topology=Topology(num_devices=2))
    eng = LLMEngine(config)
    state = ConsoleState({"model": {"name": "tiny", "num_layers": 2, "num_experts": 8}}, "live")
    rid = eng.add_request([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    counts = []
    while eng.has_unfinished():
        eng.step()
        state.apply([eng.step_log[-1].as_record()])
        counts.append(state.requests[rid]["output_tokens"])
    assert counts == [1, 2, 3, 4, 5, 6] and state.requests[rid]["state"] == "finished"


def test_memory_panel_shows_three_tiers_with_the_disk_tier(tmp_path):
    """--host-mem below the checkpoint's experts: the Memory panel shows HBM caches, the host
    tier and the disk tier, with the disk's reads counted."""
    from moectl.engine.experts.disk_tier import one_expert_bytes
    from moectl.engine.models.config import ModelConfig

    ckpt = tiny_checkpoint(tmp_path / "m")
    host_mem = 2 * one_expert_bytes(ModelConfig.from_dir(ckpt))
    source = live(ckpt, host_mem=host_mem, expert_cache_slots=3)  # one layer's experts: refills every step

    async def body(app, pilot):
        await until(pilot, lambda: app.state.steps_seen > 5)
        await pilot.press("3")
        await until(pilot, lambda: "disk tier" in text_of(app, "#mem-tiers"), timeout=5)
        tiers = text_of(app, "#mem-tiers")
        assert "host tier: experts" in tiers and "HBM tier: expert cache hit rate" in tiers
        await until(pilot, lambda: app.state.tier_traffic()["disk"]["reads"] > 0, timeout=10)
    run_app(MoectlApp(source), body)
