"""The live console on a simulated cluster (`moectl run --backend simulated`): its engine process
streams simulated records, every panel labels its figures simulated, and a rebalance is
previewed, applied and followed by its simulated outcome on the same batches."""

from __future__ import annotations

from moectl.cli.engine_process import EngineProcess
from moectl.console.app import MoectlApp
from moectl.console.engine_client import EngineSource
from tests.paths import DOCS
from tests.pilot import run_app, text_of, until

DSV3 = str(DOCS / "configs" / "deepseek-v3.json")


def test_the_console_rebalances_a_simulated_cluster_and_shows_the_simulated_outcome():
    engine = EngineProcess(["--backend", "simulated", "--model", DSV3, "--devices", "64", "--routing", "zipf:1.2",
                            "--workload", "rate=400,prompt=256-1024,output=64-256"])
    engine.wait_ready()
    source = EngineSource(engine.dir, owner=True)

    async def body(app, pilot):
        await until(pilot, lambda: app.state.steps_seen > 30 and app.state.throughput() > 0, timeout=60)
        assert "SIMULATED on the NVIDIA H800 SXM5 profile (kernel tables)" in text_of(app, "#ov-title")
        assert "simulated clock" in text_of(app, "#ov-metrics")
        await pilot.press("4")
        await until(pilot, lambda: "per step (simulated)" in text_of(app, "#tl-breakdown"), timeout=20)
        await pilot.press("2")
        await pilot.press("r")
        await until(pilot, lambda: "SIMULATED: predicted" in text_of(app, "#ex-preview-result"), timeout=30)
        assert "the migration stalls one step by" in text_of(app, "#ex-preview-result")
        before = app.state.placement
        await pilot.press("A")
        await until(pilot, lambda: app.state.placement is not None and app.state.placement != before, timeout=30)
        await until(pilot, lambda: any("simulated migration stall" in str(n.message) for n in app._notifications),
                    timeout=10)
        await until(pilot, lambda: "tok/s SIMULATED" in text_of(app, "#ex-apply-outcome"), timeout=60)
        assert app.state.sim_outcome["same_batches"] and app.state.sim_outcome["gain"] > 0
    try:
        run_app(MoectlApp(source), body)
    finally:
        source.close()
        engine.stop()


def test_a_preempted_request_counts_its_tokens_again_once_rescheduled():
    from moectl.console.state import ConsoleState

    state = ConsoleState({"model": {"num_layers": 1, "num_experts": 2}}, "live")

    def step(n, events, ids):
        state.apply([{"step": n, "t_start": n, "t_end": n + 1, "routing": [[0, 0]], "requests": events,
                      "batch": {"prefill_tokens": 0, "decode_tokens": len(ids), "num_seqs": len(ids),
                                "request_ids": ids, "preempted": []}}], [])
    step(1, [{"id": "a", "event": "arrived", "t": 0}, {"id": "a", "event": "scheduled", "t": 0},
             {"id": "a", "event": "first_token", "t": 1}], ["a"])
    step(2, [], ["a"])
    step(3, [{"id": "a", "event": "preempted", "t": 3}], [])
    step(4, [{"id": "a", "event": "scheduled", "t": 4}], ["a"])  # its recompute
    step(5, [], ["a"])  # decoding again: its tokens count on
    assert state.requests["a"]["output_tokens"] == 3 and state.counts == {"waiting": 0, "running": 1, "finished": 0}
    step(6, [{"id": "a", "event": "finished", "t": 6, "output_tokens": 4, "reason": "length"}], [])
    assert state.counts == {"waiting": 0, "running": 0, "finished": 1}
