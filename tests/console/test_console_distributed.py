"""The console on the distributed backend (2 gloo ranks), its engine in a process of its own as
`moectl run --backend distributed --nproc 2` starts it: the same panels and controls as on
emulated devices, a live rebalance that migrates experts between the rank processes, the
preview's predicted time beside the measured outcome, and a rank killed (or hung) mid-run, named
on screen, with restart refused (ranks serve one engine) and the console still up."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from moectl.console.app import MoectlApp
from moectl.engine.parallel.group import STALE_S
from tests.checkpoints import tiny_checkpoint
from tests.console.test_console import live
from tests.pilot import run_app, text_of, until


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("console_dist"))


def rank_processes(engine_pid: int) -> list[psutil.Process]:
    """The engine process's rank workers (multiprocessing spawns them; its resource tracker is not one)."""
    ranks = []
    for child in psutil.Process(engine_pid).children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            ranks.append(child)
    return ranks


def on_ranks(ckpt, body) -> None:
    """body(app, pilot, source) in the console over an engine process with 2 gloo ranks; every
    process is gone after."""
    source = live(ckpt, "--backend", "distributed", "--nproc", "2", "--redundant", "1")
    engine_pid = source.process.pid
    ranks = rank_processes(engine_pid)
    assert len(ranks) == 1, ranks  # rank 1's process (rank 0 is the engine process itself)

    async def run(app, pilot):
        await until(pilot, lambda: app.state.steps_seen > 3, timeout=90)
        await body(app, pilot, source)
    run_app(MoectlApp(source), run)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                                              for p in ranks):
        time.sleep(0.1)
    assert not psutil.pid_exists(engine_pid) or psutil.Process(engine_pid).status() == psutil.STATUS_ZOMBIE
    assert all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in ranks)


def test_console_on_ranks_rebalances_and_shows_predicted_and_measured(ckpt):
    async def body(app, pilot, source):
        await until(pilot, lambda: app.state.steps_seen > 8, timeout=60)
        assert "distributed" in text_of(app, "#ov-title")
        before = app.state.placement
        source.act("auto_rebalance", enabled=False, objective="balance").result(timeout=30)  # a plan that moves
        await pilot.press("2")
        await pilot.press("r")
        await until(pilot, lambda: app.plan is not None, timeout=30)
        await until(pilot, lambda: "predicted balancedness" in text_of(app, "#ex-preview-result"), timeout=5)
        preview = text_of(app, "#ex-preview-result")
        assert "predicted balancedness" in preview and "predicted step" in preview and "measured" in preview
        await pilot.press("A")
        await until(pilot, lambda: any(a["kind"] == "rebalance_apply" for a in app.state.actions), timeout=30)
        assert app.state.placement != before
        migration = [a for a in app.state.actions if a["kind"] == "rebalance_apply"][-1]["result"]["migration"]
        assert migration["measured"] and len(migration["per_rank"]) == 2
        await until(pilot, lambda: (app.state.apply_outcome() or {}).get("outcome") is not None, timeout=60)
        outcome = text_of(app, "#ex-apply-outcome")
        assert "tok/s measured" in outcome and "predicted" in outcome
        assert "prompt+output per parallel step" in outcome and "on this basis" in outcome  # one basis for both
    on_ranks(ckpt, body)


async def _fail_rank(app, pilot, source, sig) -> float:
    """Sends `sig` to rank 1; the seconds until the console's source reports the failure, which
    the Overview then shows while the app keeps running."""
    (rank,) = rank_processes(source.process.pid)
    os.kill(rank.pid, sig)
    t0 = time.monotonic()
    try:
        await until(pilot, lambda: source.error is not None, timeout=30)
        detected = time.monotonic() - t0
    finally:
        if sig == signal.SIGSTOP:
            try:
                os.kill(rank.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # already stopped for good by the watchdog
    assert "rank 1" in source.error
    await pilot.press("1")
    await until(pilot, lambda: "rank 1" in text_of(app, "#ov-error"), timeout=10)
    assert app.is_running
    return detected


def test_a_killed_rank_is_named_within_the_bound_and_the_console_stays_up(ckpt):
    async def body(app, pilot, source):
        assert await _fail_rank(app, pilot, source, signal.SIGKILL) < 10.0
        # ranks serve one engine: restart is refused, with the reason, and the console stays up
        app.query_one("#ov-restart").press()
        await until(pilot, lambda: any("restart the command" in str(n.message) for n in app._notifications),
                    timeout=10)
    on_ranks(ckpt, body)


def test_a_hung_rank_is_named_within_the_bound(ckpt):
    async def body(app, pilot, source):
        detected = await _fail_rank(app, pilot, source, signal.SIGSTOP)
        assert detected < STALE_S + 3.0 <= 10.0, detected
        assert "stopped responding" in source.error
    on_ranks(ckpt, body)


def test_two_batch_overlap_on_ranks_is_shown_measured(ckpt):
    """--overlap two-batch: the Overview says how many steps ran as two micro-batches and how long
    the collectives were in flight under the other one's compute; rank 0's timeline names both."""
    # prompts long enough that steps pass the 512-token fallback (the later --workload wins)
    source = live(ckpt, "--backend", "distributed", "--nproc", "2", "--overlap", "two-batch", "--workload",
                  "rate=80,prompt=200-300,output=2-4")

    async def run(app, pilot):
        await until(pilot, lambda: app.state.micro_batches() is not None, timeout=90)
        await pilot.press("1")
        await until(pilot, lambda: "two-batch overlap" in text_of(app, "#ov-overlap"), timeout=10)
        text = text_of(app, "#ov-overlap")
        assert "micro-batches" in text and "in flight under the other's compute" in text and "measured" in text
        split = [r for r in app.state.window if len((r.get("devices") or {}).get("micro_batches", ())) == 2]
        names = set(split[-1]["spans"]["names"])
        assert {"experts (mb 0)", "experts (mb 1)"} <= names, names
    run_app(MoectlApp(source), run)
