"""The console on the distributed backend (2 gloo ranks): the same panels and controls as on
emulated devices, a live rebalance that migrates experts between the rank processes, the
preview's predicted time beside the measured outcome, and a rank killed mid-run."""

from __future__ import annotations

import os
import signal
import time

import pytest

from moectl.console.app import MoectlApp
from moectl.console.live_source import LiveSource
from moectl.engine.core.config import EngineConfig
from moectl.engine.core.topology import Topology
from moectl.engine.parallel.group import STALE_S, RankGroup
from moectl.engine.tools.demo_workload import DemoLoad
from tests.checkpoints import tiny_checkpoint
from tests.pilot import run_app, text_of, until


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("console_dist"))


def on_ranks(ckpt, body) -> None:
    """body(app, pilot, source, group) in the console over 2 gloo ranks; every rank is gone after."""
    config = EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=256, topology=Topology(num_devices=2),
                          redundant_slots=1, num_threads=1)
    group = RankGroup(config, 2)
    source = LiveSource(group.make_engine, DemoLoad(rate=40.0, prompt_len="8-24", output_len="8-16"),
                        on_close=group.close)

    async def run(app, pilot):
        await until(pilot, lambda: app.state.steps_seen > 3, timeout=60)
        await body(app, pilot, source, group)
    try:
        run_app(MoectlApp(source), run)
    finally:
        group.close()
    assert all(not p.is_alive() for p in group.procs)


def test_console_on_ranks_rebalances_and_shows_predicted_and_measured(ckpt):
    async def body(app, pilot, source, group):
        await until(pilot, lambda: app.state.steps_seen > 8, timeout=60)
        assert "distributed" in text_of(app, "#ov-title")
        before = source.engine.experts.placement
        await pilot.press("2")
        await pilot.press("r")
        await until(pilot, lambda: app.plan is not None, timeout=30)
        await until(pilot, lambda: "predicted balancedness" in text_of(app, "#ex-preview-result"), timeout=5)
        preview = text_of(app, "#ex-preview-result")
        assert "predicted balancedness" in preview and "predicted step" in preview and "measured" in preview
        await pilot.press("A")
        await until(pilot, lambda: source.engine.experts.placement != before, timeout=30)
        await until(pilot, lambda: any(a["kind"] == "rebalance_apply" for a in app.state.actions), timeout=30)
        migration = [a for a in app.state.actions if a["kind"] == "rebalance_apply"][-1]["result"]["migration"]
        assert migration["measured"] and len(migration["per_rank"]) == 2
        await until(pilot, lambda: app.state.apply_outcome() is not None, timeout=60)
        outcome = text_of(app, "#ex-apply-outcome")
        assert "tok/s measured" in outcome and "predicted" in outcome
        assert "prompt+output per parallel step" in outcome and "on this basis" in outcome  # one basis for both
    on_ranks(ckpt, body)


async def _fail_rank(app, pilot, source, group, sig) -> float:
    """Sends `sig` to rank 1; the seconds until the console's source reports the failure, which
    the Overview then shows while the app keeps running."""
    os.kill(group.procs[0].pid, sig)
    t0 = time.monotonic()
    try:
        await until(pilot, lambda: source.error is not None, timeout=30)
        detected = time.monotonic() - t0
    finally:
        if sig == signal.SIGSTOP:
            try:
                os.kill(group.procs[0].pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # already stopped for good by the watchdog
    assert "rank 1" in source.error
    await pilot.press("1")
    await until(pilot, lambda: "rank 1" in text_of(app, "#ov-error"), timeout=10)
    assert app.is_running
    assert source.engine.has_unfinished() is False  # in-flight requests were failed, not left waiting
    return detected


def test_a_killed_rank_is_named_within_the_bound_and_the_console_stays_up(ckpt):
    async def body(app, pilot, source, group):
        assert await _fail_rank(app, pilot, source, group, signal.SIGKILL) < 10.0
    on_ranks(ckpt, body)


def test_a_hung_rank_is_named_within_the_bound(ckpt):
    async def body(app, pilot, source, group):
        detected = await _fail_rank(app, pilot, source, group, signal.SIGSTOP)
        assert detected < STALE_S + 3.0 <= 10.0, detected
        assert "stopped responding" in source.error
    on_ranks(ckpt, body)
