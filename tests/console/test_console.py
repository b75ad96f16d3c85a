"""The console through Textual's Pilot: every panel shows the state, and every control acts on
the engine (live: an engine process, as `moectl run` starts it) or on the counterfactual (replay)."""

from __future__ import annotations

import pytest

from moectl.cli.engine_process import EngineProcess
from moectl.console.app import MoectlApp
from moectl.console.engine_client import EngineSource
from moectl.console.sources import ReplaySource
from tests.checkpoints import tiny_checkpoint
from tests.paths import TRACES
from tests.pilot import run_app, text_of, until

WORKLOAD = "rate=40,prompt=8-24,output=8-16"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("console"))


def live(ckpt, *options: str) -> EngineSource:
    """The console's source on an engine process of its own (`moectl engine-host`, what `moectl
    run` starts); closing it (the app's unmount) stops that engine."""
    engine = EngineProcess(["--model", str(ckpt), "--workload", WORKLOAD, "--threads", "1", *options])
    try:
        engine.wait_ready(timeout_s=120)
        source = EngineSource(engine.dir, owner=True)
    except BaseException:
        engine.stop()
        raise
    close = source.close

    def close_and_stop() -> None:
        try:
            close()
        finally:
            engine.stop()
    source.close = close_and_stop
    source.process = engine
    return source


def test_overview_shows_serving_figures_and_devices(ckpt):
    async def body(app, pilot):
        await until(pilot, lambda: app.state.steps_seen > 5 and app.state.throughput() > 0, timeout=60)
        await until(pilot, lambda: "tok/s" in text_of(app, "#ov-metrics"), timeout=5)
        metrics = text_of(app, "#ov-metrics")
        assert "KV" in metrics and "balancedness" in metrics
        assert text_of(app, "#ov-load").count("d") >= 4  # a bar per device
        assert "HBM" not in text_of(app, "#ov-hbm") or "/" in text_of(app, "#ov-hbm")
        assert "emulated" in text_of(app, "#ov-title")
        # the load window's figures are the engine's, drawn as it sent them
        window = app.state.engine_window()
        assert window is not None and f"{window['balancedness']:.2f}" in metrics
        assert "engine" in app.sub_title and str(app.source.engine_dir) in app.sub_title
    run_app(MoectlApp(live(ckpt, "--devices", "4")), body)


def test_knobs_edit_the_scheduler_and_bad_values_change_nothing(ckpt):
    source = live(ckpt, "--devices", "4")

    def engine_knob(app):
        return ((app.state.latest or {}).get("knobs") or {}).get("max_num_seqs")

    async def body(app, pilot):
        await until(pilot, lambda: app.state.steps_seen > 3, timeout=60)
        before = engine_knob(app)
        await pilot.press("5")
        await until(pilot, lambda: app.query_one("#rq-max_num_seqs").value != "")
        app.query_one("#rq-max_num_seqs").value = "0"
        app.query_one("#rq-apply").press()
        await until(pilot, lambda: "max_num_seqs" in text_of(app, "#rq-error"), timeout=10)
        app.query_one("#rq-max_num_seqs").value = "abc"
        app.query_one("#rq-apply").press()
        await until(pilot, lambda: "not an integer" in text_of(app, "#rq-error"), timeout=5)
        steps = app.state.steps_seen
        await until(pilot, lambda: app.state.steps_seen > steps + 2, timeout=30)
        assert engine_knob(app) == before  # neither bad value reached the engine
        app.query_one("#rq-max_num_seqs").value = "8"
        app.query_one("#rq-apply").press()
        await until(pilot, lambda: engine_knob(app) == 8, timeout=30)
        assert text_of(app, "#rq-error").strip() == ""
    run_app(MoectlApp(source), body)


def test_workload_controls_pause_and_change_the_rate(ckpt):
    source = live(ckpt, "--devices", "4")

    async def body(app, pilot):
        await until(pilot, lambda: app.state.steps_seen > 0, timeout=60)
        await pilot.press("5")
        await pilot.pause(0.3)
        app.query_one("#rq-pause").value = True
        await until(pilot, lambda: source.load.paused, timeout=10)
        app.query_one("#rq-rate").value = "-3"
        app.query_one("#rq-workload").press()
        await until(pilot, lambda: "rate" in text_of(app, "#rq-error"), timeout=10)
        assert source.load.rate == 40.0
        app.query_one("#rq-error").update("")  # so the wait below sees this press's message
        app.query_one("#rq-rate").value = "inf"  # would flood the engine with requests
        app.query_one("#rq-workload").press()
        await until(pilot, lambda: "rate" in text_of(app, "#rq-error"), timeout=10)
        assert source.load.rate == 40.0
        app.query_one("#rq-rate").value = "7.5"
        app.query_one("#rq-workload").press()
        await until(pilot, lambda: source.load.rate == 7.5, timeout=10)
    run_app(MoectlApp(source), body)


def test_memory_and_timeline_panels_show_records(ckpt):
    source = live(ckpt, "--devices", "4")

    async def body(app, pilot):
        await until(pilot, lambda: app.state.steps_seen > 3, timeout=60)
        await pilot.press("3")
        await until(pilot, lambda: "KV blocks" in text_of(app, "#mem-tiers"), timeout=5)
        assert "kv_blocks" in text_of(app, "#mem-categories") or "total" in text_of(app, "#mem-categories")
        from moectl.console.widgets import Chart

        await until(pilot, lambda: app.query_one("#mem-plot", Chart).kind == "lines", timeout=10)
        await pilot.press("4")
        await until(pilot, lambda: app.query_one("#tl-timeline").span_count > 0, timeout=10)
        assert "per step (measured)" in text_of(app, "#tl-breakdown")
    run_app(MoectlApp(source), body)


def test_an_engine_failure_is_shown_and_restart_recovers(ckpt):
    """An engine process whose forward fails (an injected device fault) gives up after its failed
    steps; the console names the cause, and its restart button builds a fresh engine there."""
    source = live(ckpt, "--devices", "4", "--inject-fault", "4")

    async def body(app, pilot):
        await until(pilot, lambda: source.error is not None, timeout=90)
        await until(pilot, lambda: "injected fault" in text_of(app, "#ov-error"), timeout=10)
        assert app.is_running and "engine failed" in text_of(app, "#ov-error")
        app.query_one("#ov-restart").press()
        await until(pilot, lambda: source.error is None, timeout=90)
        steps = app.state.steps_seen
        await until(pilot, lambda: app.state.steps_seen > steps + 2, timeout=60)
        assert "hidden" in app.query_one("#ov-error-box").classes
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
    """The state counts a running request's output tokens step by step from an engine process's
    records, and the count it ends with is the engine's own (the request sent over the protocol,
    with the demo workload paused so that it runs alone)."""
    import time

    from moectl.console.state import ConsoleState

    source = live(ckpt, "--devices", "2")
    try:
        source.act("workload", paused=True).result(timeout=30)
        state = ConsoleState(source.header, "live")
        handle = source.generate([5, 6, 7], max_tokens=6, ignore_eos=True)
        result = handle.result(timeout_s=60)
        rid = result["request_id"]
        counts: list[int] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (rid not in state.requests or state.requests[rid]["state"] != "finished"):
            for record in source.poll()[0]:
                state.apply([record])
                if rid in record["batch"]["request_ids"]:  # a step that computed it
                    counts.append(state.requests[rid]["output_tokens"])
            time.sleep(0.02)
        assert counts == [1, 2, 3, 4, 5, 6] and state.requests[rid]["state"] == "finished"
        assert state.requests[rid]["output_tokens"] == len(result["token_ids"])
    finally:
        source.close()


def test_memory_panel_shows_three_tiers_with_the_disk_tier(tmp_path):
    """--host-mem below the checkpoint's experts: the Memory panel shows HBM caches, the host
    tier and the disk tier, with the disk's reads counted."""
    from moectl.engine.experts.disk_tier import one_expert_bytes
    from moectl.engine.models.config import ModelConfig

    ckpt = tiny_checkpoint(tmp_path / "m")
    host_mem = 2 * one_expert_bytes(ModelConfig.from_dir(ckpt))
    # one layer's experts: refills every step
    source = live(ckpt, "--devices", "4", "--host-mem", str(host_mem), "--expert-cache", "3")

    async def body(app, pilot):
        await until(pilot, lambda: app.state.steps_seen > 5, timeout=60)
        await pilot.press("3")
        await until(pilot, lambda: "disk tier" in text_of(app, "#mem-tiers"), timeout=10)
        tiers = text_of(app, "#mem-tiers")
        assert "host tier: experts" in tiers and "HBM tier: expert cache hit rate" in tiers
        await until(pilot, lambda: app.state.tier_traffic()["disk"]["reads"] > 0, timeout=10)
    run_app(MoectlApp(source), body)
