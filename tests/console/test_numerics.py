"""The activation watch in the console (the Memory tab, console/panels/numerics.py): per layer and
point the window's largest value and its headroom to the dtype's limit, the tightest point marked,
fp16's headroom beside it for an engine not in fp16, the attention logits marked as a bound, only
the tightest layers of many; "not recorded" without the field. The headroom alert reaches the
Overview's alerts. Live and replay fill the same ConsoleState: a replayed trace drives the panel."""

from __future__ import annotations

import numpy as np
import pytest

from moectl.console.app import MoectlApp
from moectl.console.panels import numerics as panel
from moectl.console.sources import ReplaySource
from moectl.console.state import WINDOW_STEPS, ConsoleState
from tests.console import numerics_trace as trace
from tests.paths import TRACES
from tests.pilot import run_app, text_of, until
from tests.profiler.numerics_records import flat, record
from tests.records import make_record

RESIDUAL, SUMSQ, LOGITS, EXPERT = range(4)


def header(layers: int, **extra) -> dict:
    return {"model": {"name": "synthetic", "num_layers": layers, "num_experts": 4}, **extra}


def rows(text: str) -> dict[str, list[str]]:
    """The grid's rows: "L<n>" -> its cells."""
    return {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.split() and
            line.split()[0][:1] == "L" and line.split()[0][1:].isdigit()}


def test_without_the_field_the_state_has_none_and_the_panel_says_not_recorded():
    state = ConsoleState(header(2), "replay")
    state.apply([make_record(s) for s in range(1, 5)])
    assert state.numerics() is None
    assert "not recorded" in str(panel.render(state.numerics(), state.simulated))
    simulated = ConsoleState(header(2, clock="simulated"), "replay")
    simulated.apply([make_record(1)])
    assert "not modeled" in str(panel.render(simulated.numerics(), simulated.simulated))


def test_the_state_keeps_the_windows_peak_and_forgets_what_left_the_window():
    state = ConsoleState(header(3), "live")
    spike = flat(3)
    spike[1, EXPERT] = 30000.0
    state.apply([record(1, spike), make_record(2, routing=np.ones((3, 4), np.int32)), record(3, flat(3, 50.0))])
    found = state.numerics()
    assert (found["steps"], found["window"]) == (2, 3)  # the record without the field counts in the window only
    assert found["max"][1].tolist() == [100.0, 100.0, 100.0, 30000.0]
    assert found["headroom"][1, EXPERT] == pytest.approx(65504 / 30000)
    assert found["tightest"] == (1, EXPERT)
    assert state.numerics() is found  # one computation per state version
    state.apply([record(s, flat(3, 50.0)) for s in range(4, 4 + WINDOW_STEPS)])  # the spike leaves the window
    found = state.numerics()
    assert found["max"].max() == 50.0 and found["steps"] == WINDOW_STEPS
    state.reset()  # a replay seek
    assert state.numerics() is None


def test_the_grid_shows_the_tightest_layers_first_with_the_tightest_point_marked():
    layers = 300  # hundreds of layers: only the tightest are drawn
    peak = flat(layers, 10.0)
    peak[250, EXPERT] = 40000.0  # 1.64x: the tightest
    peak[17, LOGITS] = 20000.0  # 3.28x
    peak[3, SUMSQ] = 8188.0  # 8x
    state = ConsoleState(header(layers), "replay")
    state.apply([record(1, peak)])
    text = panel.render(state.numerics())
    plain = text.plain
    got = rows(plain)
    assert len(got) == panel.TOP_LAYERS and f"the tightest {panel.TOP_LAYERS} of 300 layers" in plain
    assert list(got)[:3] == ["L250", "L17", "L3"]
    assert got["L250"][-2:] == ["40000", "1.64x*"]  # max and headroom of expert_out, the row's tightest
    assert got["L17"][4:6] == ["20000", "3.28x*"]
    assert "tightest: L250 expert out 40000, headroom 1.64x to 65504" in plain
    header_line = next(line for line in plain.splitlines() if line.startswith("layer"))
    assert "attn logits≤" in header_line and "if served in fp16" not in plain  # fp16 engine: one block
    # the tightest cell is drawn in the alert's colour
    cell = plain.index("1.64x*")
    assert any(s.start <= cell < s.end and "red" in str(s.style) for s in text.spans)


def test_an_engine_not_in_fp16_also_shows_what_fp16_would_leave():
    peak = flat(4, 1000.0)
    peak[2, SUMSQ] = 131008.0  # twice fp16's limit: fine in bf16, past it in fp16
    state = ConsoleState(header(4), "replay")
    state.apply([record(1, peak, dtype="bfloat16", residual_dtype="float32")])
    plain = panel.render(state.numerics()).plain
    assert plain.startswith("bfloat16 activations (largest finite 3.39e+38), residual stream float32")
    assert "if served in fp16 (65504): L2 norm sum x² 131008, headroom 0.5x to 65504 (past it)" in plain
    got = rows(plain)
    assert list(got)[0] == "L2"
    assert got["L2"][2:4] == ["1.3e5", "1e33x*"]  # the dtype's headroom ...
    assert got["L2"][8:] == ["|", "65.5x", "0.5x*", "65.5x", "65.5x"]  # ... and fp16's


def test_nonfinite_cells_are_said_loudly():
    peak = flat(5)
    flags = np.zeros((5, 4), bool)
    flags[2, LOGITS] = flags[3, RESIDUAL] = True
    peak[flags] = np.inf
    state = ConsoleState(header(5), "replay")
    state.apply([record(1, peak, nonfinite=flags)])
    text = panel.render(state.numerics())
    assert "inf/NaN seen: L2 attn logits≤, L3 residual (first: L2)" in text.plain
    got = rows(text.plain)
    assert list(got)[:2] == ["L2", "L3"] and got["L2"][4:6] == ["inf/NaN", "NONFIN*"]


def test_a_record_as_json_sends_it_draws_without_a_crash():
    """An attached console's records came through JSON: lists, an inf as null."""
    state = ConsoleState(header(2), "attach")
    rec = record(1, flat(2))
    rec["numerics"] = {**rec["numerics"], "max": [[1.0, None, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]],
                       "nonfinite": [[False] * 4, [False] * 4]}
    state.apply([rec])
    assert state.numerics()["nonfinite_at"] == [(0, SUMSQ)]
    assert "inf/NaN" in panel.render(state.numerics()).plain


def replayed(step: int):
    """run_app's body: the numerics trace paused at `step`, the alerts computed."""
    async def at(app, pilot):
        await pilot.pause()
        app.source.pause()
        app.source.seek_step(step)
        app.tick()
        await until(pilot, lambda: app.state.latest is not None and app.state.latest["step"] == step, timeout=10)
        await until(pilot, lambda: not app._alerts_running, timeout=20)
    return at


def test_replay_draws_the_memory_tab_and_the_alert_on_the_overview(tmp_path):
    path = tmp_path / "numerics.trace"
    trace.write_numerics_trace(path)
    app = MoectlApp(ReplaySource(path))

    async def body(app, pilot):
        await replayed(trace.STEPS)(app, pilot)
        await pilot.press("3")
        await until(pilot, lambda: "L7" in text_of(app, "#mem-numerics"), timeout=10)
        shown = text_of(app, "#mem-numerics")
        got = rows(shown)
        assert list(got)[:2] == ["L7", "L9"]  # 1.64x, then the 3.28x bound
        assert got["L7"][-2:] == ["40000", "1.64x*"] and got["L9"][4:6] == ["20000", "3.28x*"]
        assert "residual stream float32" in shown and "attn logits≤" in shown
        await pilot.press("1")
        await until(pilot, lambda: "expert_out" in text_of(app, "#ov-alerts"), timeout=10)
        alerts = text_of(app, "#ov-alerts")
        assert "layer 7 expert_out reached 40000" in alerts and "headroom 1.64x" in alerts

        # seek back: the window is refilled from step 10, the spike not yet there, nor the alert
        await replayed(10)(app, pilot)
        await until(pilot, lambda: "expert_out" not in text_of(app, "#ov-alerts"), timeout=10)
        await pilot.press("3")
        await until(pilot, lambda: rows(text_of(app, "#mem-numerics")).get("L7", [""])[-1] == "6.55x*", timeout=10)
        assert list(rows(text_of(app, "#mem-numerics")))[0] == "L9"
    run_app(app, body, size=(160, 50))


def test_an_older_trace_says_not_recorded():
    source = ReplaySource(TRACES / "steady_rebalance.trace")

    async def body(app, pilot):
        await pilot.press("3")
        await until(pilot, lambda: text_of(app, "#mem-numerics").strip() != "", timeout=10)
        assert "not recorded" in text_of(app, "#mem-numerics")
    run_app(MoectlApp(source), body, size=(120, 40))


# -- live: the checkpoint built to overflow fp16 ---------------------------------------------------

def _live(ckpt, **config):
    from moectl.console.live_source import LiveSource
    from moectl.engine.core.config import EngineConfig
    from moectl.engine.llm_engine import LLMEngine
    from moectl.engine.tools.demo_workload import DemoLoad

    return LiveSource(lambda: LLMEngine(EngineConfig(model=str(ckpt), dtype="fp16", num_threads=1, **config)),
                      load=DemoLoad(paused=True))


def test_live_fp16_overflow_is_named_in_the_memory_tab_and_the_alerts(tmp_path, single_thread):
    """The overflow checkpoint in pure fp16, greedy requests (argmax survives NaN logits, so the
    steps complete and their records arrive): the Memory tab marks layer 0's residual as
    non-finite, and the Overview's critical alert says it starts there."""
    from moectl.engine.core.sampling import SamplingParams
    from tests.checkpoints import overflow_checkpoint

    source = _live(overflow_checkpoint(tmp_path / "overflow"))

    async def body(app, pilot):
        # enough steps for the alerts' cadence (they are computed every few steps, off the UI thread)
        source.engine.add_request(list(range(2, 40)), SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        await until(pilot, lambda: app.state.numerics() is not None and app.state.numerics()["nonfinite_at"],
                    timeout=60)
        assert app.state.numerics()["nonfinite_at"][0] == (0, 0)  # layer 0, residual
        await pilot.press("3")
        await until(pilot, lambda: "NONFIN" in text_of(app, "#mem-numerics"), timeout=10)
        assert "L0" in rows(text_of(app, "#mem-numerics"))
        await pilot.press("1")
        # the steps all arrive within the alerts' interval: their alert follows once it is over
        await until(pilot, lambda: "inf/NaN" in text_of(app, "#ov-alerts"), timeout=30)
        assert "first appears at layer 0, residual" in text_of(app, "#ov-alerts")
    run_app(MoectlApp(source), body, size=(160, 50))


def test_live_mixed_precision_shows_the_residual_past_fp16_but_finite(tmp_path, single_thread):
    """The same checkpoint with the residual stream in fp32: nothing non-finite, and the panel says
    what fp16 would leave for that stream: less than its value (headroom under 1x)."""
    from moectl.engine.core.sampling import SamplingParams
    from tests.checkpoints import overflow_checkpoint

    source = _live(overflow_checkpoint(tmp_path / "overflow"), mixed_precision=True)

    async def body(app, pilot):
        source.engine.add_request(list(range(2, 40)), SamplingParams(max_tokens=4, temperature=0.0))
        await until(pilot, lambda: app.state.numerics() is not None, timeout=60)
        found = app.state.numerics()
        assert not found["nonfinite_at"] and found["residual_dtype"] == "float32"
        await pilot.press("3")
        await until(pilot, lambda: "residual stream float32" in text_of(app, "#mem-numerics"), timeout=10)
        assert "NONFIN" not in text_of(app, "#mem-numerics")
    run_app(MoectlApp(source), body, size=(160, 50))
