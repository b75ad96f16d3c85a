"""The sample traces recorded on 2 real rank processes (torch.distributed, gloo) with an operator
rebalance mid-run: distributed_rebalance.trace (the sample model) and dsv3_ranks_rebalance.trace
(sample-dsv3, the seeds' class). Each opens with the trace reader, holds measured (not modeled)
link and step times from both ranks and the migration the rebalance did, and replays in the
console."""

from __future__ import annotations

import pytest

from moectl.console.app import MoectlApp
from moectl.console.sources import ReplaySource
from moectl.placement.placement import Placement
from moectl.profiler import analysis
from moectl.profiler.trace_store import TraceReader
from tests.paths import TRACES
from tests.pilot import run_app, text_of, until

MODEL_OF = {"distributed_rebalance.trace": "sample_model", "dsv3_ranks_rebalance.trace": "sample_model_dsv3"}


@pytest.fixture(scope="module", params=sorted(MODEL_OF))
def trace(request) -> tuple[dict, list[dict], list[dict], str]:
    with TraceReader(TRACES / request.param) as reader:
        assert reader.complete and reader.dropped == 0
        return reader.header, list(reader.steps()), list(reader.actions()), request.param


def test_trace_is_small_complete_and_from_two_distributed_ranks(trace):
    header, steps, _, name = trace
    assert (TRACES / name).stat().st_size <= 5 << 20
    assert header["model"]["name"] == MODEL_OF[name]
    devices = header["devices"]
    assert devices["backend"] == "distributed" and devices["topology"]["num_devices"] == 2
    assert devices["link_time"] == "measured" and devices["step_time"] == "measured"
    assert len(steps) >= 300 and [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    for record in steps:
        dev = record["devices"]
        assert dev["backend"] == "distributed"
        assert len(dev["tokens"]) == len(dev["busy_s"]) == len(dev["link_s"]) == 2
        assert dev["link_s_modeled"] is False and dev["step_time"]["modeled"] is False
    # both ranks did expert work and spent measured time on the link
    assert all(sum(r["devices"]["tokens"][d] for r in steps) > 0 for d in range(2))
    assert all(sum(r["devices"]["link_s"][d] for r in steps) > 0 for d in range(2))


def test_rebalance_migrated_experts_between_ranks_and_raised_balancedness(trace):
    header, steps, actions, _ = trace
    kinds = [a["kind"] for a in actions]
    assert "rebalance_preview" in kinds and "rebalance_apply" in kinds
    applied = next(a for a in actions if a["kind"] == "rebalance_apply")
    assert steps[0]["step"] < applied["step"] < steps[-1]["step"]  # mid-run
    migration = applied["result"]["migration"]
    assert migration["bytes_transferred"] > 0 and migration["seconds_max"] > 0
    assert len(migration["per_rank"]) == 2
    assert sum(r["bytes_sent"] for r in migration["per_rank"]) == migration["bytes_transferred"]
    initial = Placement.from_dict(header["devices"]["placement"])
    new = Placement.from_dict(applied["result"]["placement"])
    assert new != initial and new.num_devices == 2
    before = [r for r in steps if r["step"] <= applied["step"]]
    after = [r for r in steps if r["step"] > applied["step"]]
    assert analysis.balancedness(after, new)["overall"] > analysis.balancedness(before, initial)["overall"]


def test_replay_in_the_console_shows_both_ranks_and_steps_through_the_rebalance(trace):
    _, _, actions, name = trace
    at = next(a for a in actions if a["kind"] == "rebalance_apply")["step"]
    source = ReplaySource(TRACES / name)

    async def body(app, pilot):
        source.seek_step(at - 5)
        app.tick()
        await pilot.pause(0.2)
        assert app.state.latest["step"] == at - 5
        recorded = app.state.placement
        title = text_of(app, "#ov-title")
        assert "2 device(s)" in title and "distributed" in title and "measured" in title
        assert "measured" in text_of(app, "#ov-load-title")
        load = text_of(app, "#ov-load")
        assert "d0" in load and "d1" in load and "tok" in load
        assert "balancedness" in text_of(app, "#ov-metrics")
        app.set_focus(None)  # keys go to the app's bindings
        for _ in range(10):  # step through the recorded rebalance: its action arrives on the way
            await pilot.press("period")
        await until(pilot, lambda: app.state.latest["step"] == at + 5)
        assert app.state.placement != recorded
        await pilot.press("space")  # play
        await until(pilot, lambda: source.position > at + 5, timeout=5.0)
        await pilot.press("space")
        for key in "2345":  # every other panel renders the trace
            await pilot.press(key)
            await pilot.pause(0.1)
    run_app(MoectlApp(source), body, size=(160, 50))
