"""`moectl replay` opens on the first full window, not on step 1 with an empty one: the panels
show the recorded figures at once, and a seek right after opening shows its own alerts."""

from __future__ import annotations

import re

import pytest

from moectl.console.app import MoectlApp
from moectl.console.sources import ReplaySource
from moectl.console.state import WINDOW_STEPS, ConsoleState
from moectl.placement.topology import Topology
from moectl.profiler.analysis import alerts
from moectl.profiler.trace_queries import placement_in_force
from tests.paths import TRACES
from tests.pilot import run_app, text_of, until
from tests.profiler.test_trace_store import write_trace


@pytest.mark.parametrize("name", ["steady_rebalance.trace", "kv_pressure.trace"])
def test_replay_opens_on_the_first_full_window_with_real_figures(name):
    source = ReplaySource(TRACES / name)
    opening = int(source.steps[WINDOW_STEPS - 1])  # the trace's 64th step

    async def body(app, pilot):
        await until(pilot, lambda: app.state.latest is not None, timeout=10)
        assert not source.playing and source.position == opening
        assert len(app.state.window) == WINDOW_STEPS and app.state.latest["step"] == opening
        await until(pilot, lambda: "d0" in text_of(app, "#ov-hbm"), timeout=10)
        assert "no accounting yet" not in text_of(app, "#ov-hbm")
        assert app.state.routing_window().sum() > 0 and app.state.throughput() > 0
        assert f"step {opening} of" in text_of(app, "#tr-status")
    run_app(MoectlApp(source), body)


def test_a_trace_shorter_than_the_window_opens_on_its_last_step(tmp_path):
    path = tmp_path / "short.trace"
    write_trace(path, 10)
    source = ReplaySource(path)
    try:
        assert source.opening_index == 9
        records, _ = source.poll()
        assert [r["step"] for r in records] == list(range(10)) and source.position == 9
    finally:
        source.close()


def test_stepping_from_the_opening_continues_after_it():
    source = ReplaySource(TRACES / "steady_rebalance.trace")
    state = ConsoleState(source.header, "replay")
    try:
        state.apply(*source.poll())
        opening = source.position
        source.step_forward()
        records, _ = source.poll()
        assert [r["step"] for r in records] == [int(source.steps[WINDOW_STEPS])] and not source.needs_reset
        state.apply(records)
        assert state.latest["step"] == source.position > opening and len(state.window) == WINDOW_STEPS
    finally:
        source.close()


def test_a_seek_right_after_opening_shows_the_alerts_of_the_new_window():
    """The opening window's alerts are computed at once; a seek within the alert interval must
    not leave them on screen for the window it moved to."""
    source = ReplaySource(TRACES / "steady_rebalance.trace")
    target = 250

    async def body(app, pilot):
        await until(pilot, lambda: app.state.latest is not None and not app._alerts_running, timeout=10)
        opening_alerts = app.state.alerts
        source.seek_step(target)
        app.tick()
        await until(pilot, lambda: not app._alerts_running, timeout=10)
        placement, _ = placement_in_force(source.reader, target)
        devices = source.header["devices"]
        expected = alerts(list(app.state.window), placement, Topology.from_mapping(devices["topology"]),
                          devices.get("expert_bytes"), devices.get("redundant_slots") or None)
        assert expected != opening_alerts  # else this test could not tell the two windows apart
        assert app.state.latest["step"] == target
        assert [a["message"] for a in app.state.alerts] == [a["message"] for a in expected]
    run_app(MoectlApp(source), body)


def test_a_directory_is_refused_as_not_a_trace(tmp_path):
    from moectl.profiler.trace_store import TraceError

    with pytest.raises(TraceError, match=f"^{re.escape(str(tmp_path))}: is a directory, not a trace$"):
        ReplaySource(tmp_path)
