"""The console on the distributed backend (2 gloo ranks): the same panels and controls as on
emulated devices, a live rebalance that migrates experts between the rank processes, the
preview's predicted time beside the measured outcome, and a rank killed mid-run."""

from __future__ import annotations

import os
import signal
import time

import pytest

from moectl.console.app import MoectlApp
from moectl.console.sources import DemoLoad, LiveSource
from moectl.engine.core.config import EngineConfig
from moectl.engine.core.topology import Topology
from moectl.engine.parallel.group import STALE_S, RankGroup
from tests.checkpoints import tiny_checkpoint
from tests.pilot import run_app, text_of, until


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("console_dist"))


def distributed(ckpt) -> tuple[LiveSource, RankGroup]:
    config = EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=256, topology=Topology(num_devices=2),
                          redundant_slots=1, num_threads=1)
    group = RankGroup(config, 2)
    source = LiveSource(group.make_engine, DemoLoad(rate=40.0, prompt_len="8-24", output_len="8-16"),
                        on_close=group.close)
    return source, group


def test_console_on_ranks_rebalances_and_shows_predicted_and_measured(ckpt):
    source, group = distributed(ckpt)

    async def body(app, pilot):
        await until(pilot, lambda: app.state.steps_seen > 8, timeout=60)
        assert "distributed" in text_of(app, "#ov-title")
        before = source.engine.experts.placement
        await pilot.press("2")
        await pilot.press("r")
        await until(pilot, lambda: app.plan is not None, timeout=30)
        preview = text_of(app, "#ex-preview-result")
        assert "predicted balancedness" in preview and "predicted step" in preview and "measured" in preview
        await pilot.press("A")
        await until(pilot, lambda: source.engine.experts.placement != before, timeout=30)
        migration = [a for a in app.state.actions if a["kind"] == "rebalance_apply"]
        await until(pilot, lambda: any(a["kind"] == "rebalance_apply" for a in app.state.actions), timeout=30)
        migration = [a for a in app.state.actions if a["kind"] == "rebalance_apply"][-1]["result"]["migration"]
        assert migration["measured"] and len(migration["per_rank"]) == 2
        await until(pilot, lambda: app.state.apply_outcome() is not None, timeout=60)
        outcome = text_of(app, "#ex-apply-outcome")
        assert "tok/s measured" in outcome and "predicted" in outcome
    try:
        run_app(MoectlApp(source), body)
    finally:
        group.close()
    assert all(not p.is_alive() for p in group.procs)


def test_a_killed_rank_is_named_within_the_bound_and_the_console_stays_up(ckpt):
    source, group = distributed(ckpt)

    async def body(app, pilot):
        await until(pilot, lambda: app.state.steps_seen > 3, timeout=60)
        os.kill(group.procs[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        await until(pilot, lambda: source.error is not None, timeout=30)
        detected = time.monotonic() - t0
        assert detected < 10.0, detected
        assert "rank 1" in source.error
        await pilot.pause(0.3)
        assert app.is_running  # the console shows the error and stays alive
        assert source.engine.has_unfinished() is False  # in-flight requests were failed, not left waiting
    try:
        run_app(MoectlApp(source), body)
    finally:
        group.close()
    assert all(not p.is_alive() for p in group.procs)


def test_a_hung_rank_is_named_within_the_bound(ckpt):
    source, group = distributed(ckpt)

    async def body(app, pilot):
        await until(pilot, lambda: app.state.steps_seen > 3, timeout=60)
        os.kill(group.procs[0].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            await until(pilot, lambda: source.error is not None, timeout=30)
            detected = time.monotonic() - t0
        finally:
            try:
                os.kill(group.procs[0].pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # already stopped for good by the watchdog
        assert detected < STALE_S + 3.0 <= 10.0, detected
        assert "rank 1" in source.error and "stopped responding" in source.error
    try:
        run_app(MoectlApp(source), body)
    finally:
        group.close()
