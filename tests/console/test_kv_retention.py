"""KV retention in the console: the Requests tab's form sets the policy and budget on the engine,
and the Memory tab shows per device the tokens held, the context tokens full retention would
hold and the tokens evicted, as the engine counts them; records without the figures (older
traces, the simulated backend) say so."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from moectl.console.app import MoectlApp
from moectl.console.live_source import LiveSource
from moectl.console.panels.memory import MemoryPanel
from moectl.console.sources import ReplaySource
from moectl.console.state import ConsoleState
from moectl.engine.core.config import EngineConfig
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.tools.demo_workload import DemoLoad
from moectl.placement.topology import Topology
from tests.checkpoints import tiny_checkpoint
from tests.paths import TRACES
from tests.pilot import run_app, text_of, until
from tests.records import make_record

BLOCK = 16
BUDGET = 64
PROMPT = 300  # tokens: well over the budget, inside the tiny model's 512 positions
DEVICES = 2


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("retention"))


def shown_devices(app) -> dict[str, list[int]]:
    """The Memory tab's retention grid: device -> [held, context, evicted] tokens."""
    rows = {}
    for line in text_of(app, "#mem-retention").splitlines():
        cells = line.split()
        if cells and (cells[0].startswith("d") and cells[0][1:].isdigit() or cells[0] == "all"):
            rows[cells[0]] = [int(c.replace(",", "")) for c in cells[1:4]]
    return rows


def test_the_form_sets_retention_and_the_memory_tab_shows_the_engines_counts(ckpt, single_thread):
    """Through the Requests form: a bad budget and a policy without a budget are refused in the
    panel and change nothing; snapkv with 64 tokens reaches the engine. Then, with the engine held
    between two steps, the Memory tab's per-device figures are the engine's own: its pools'
    evicted tokens and its running sequences' held and computed tokens."""
    config = EngineConfig(model=str(ckpt), topology=Topology(num_devices=DEVICES), block_size=BLOCK, num_threads=1)
    source = LiveSource(lambda: LLMEngine(config), load=DemoLoad(paused=True))
    engine = source.engine
    gate, holding = threading.Event(), threading.Event()
    feed = source.driver.feed

    def hold_once_every_pool_evicted(eng) -> None:
        """The driver's feed, before a step: once every pool has evicted and requests run, the
        engine waits here (its state is that of the last step record) until the test lets go."""
        feed(eng)
        if not holding.is_set() and all(eng.blocks.evicted_tokens) and eng.scheduler.running:
            holding.set()
            gate.wait(60)

    source.driver.feed = hold_once_every_pool_evicted

    def knob_actions() -> list[dict]:
        return [a for a in engine.actions if a["kind"] == "knobs"]

    async def body(app, pilot):
        await pilot.press("5")
        await until(pilot, lambda: app.query_one("#rq-max_num_seqs").value != "", timeout=30)
        assert app.query_one("#rq-kv_retention").value == "full" and app.query_one("#rq-kv_budget").value == ""

        app.query_one("#rq-kv_retention").value = "snapkv"
        app.query_one("#rq-kv_budget").value = "lots"
        app.query_one("#rq-apply").press()
        await until(pilot, lambda: "not a token count" in text_of(app, "#rq-error"), timeout=5)
        assert text_of(app, "#rq-error").strip().count("\n") == 0  # one line

        app.query_one("#rq-kv_budget").value = ""  # snapkv with no budget: the engine's KnobError
        app.query_one("#rq-apply").press()
        await until(pilot, lambda: "needs a budget" in text_of(app, "#rq-error"), timeout=10)
        await pilot.pause(0.3)
        assert not knob_actions() and engine.knobs.kv_retention == "full"  # neither reached the engine

        app.query_one("#rq-kv_budget").value = str(BUDGET)
        app.query_one("#rq-apply").press()
        await until(pilot, lambda: engine.knobs.kv_retention == "snapkv", timeout=10)
        assert (engine.knobs.kv_budget, engine.knobs.kv_budget_fraction) == (BUDGET, 1.0)
        assert text_of(app, "#rq-error").strip() == ""
        assert knob_actions()[-1]["args"]["kv_retention"] == "snapkv"

        rng = np.random.default_rng(0)
        for _ in range(2 * DEVICES):
            engine.add_request(rng.integers(2, 300, PROMPT).tolist(), SamplingParams(max_tokens=120, ignore_eos=True))
        await pilot.press("3")
        await until(pilot, holding.is_set, timeout=60)
        # the engine waits before its next step: the last record it sent describes it now
        await until(pilot, lambda: app.state.latest is not None and app.state.latest["step"] == engine.step_count,
                    timeout=10)
        pools = engine.blocks.num_pools
        held, context = [0] * pools, [0] * pools
        for seq in engine.scheduler.running:
            held[engine.blocks.pool_of(seq)] += seq.kv_held_tokens
            context[engine.blocks.pool_of(seq)] += seq.num_computed
        evicted = list(engine.blocks.evicted_tokens)
        expected = {f"d{d}": [held[d], context[d], evicted[d]] for d in range(pools)}
        expected["all"] = [sum(held), sum(context), sum(evicted)]
        await until(pilot, lambda: shown_devices(app) == expected, timeout=10)
        assert pools == DEVICES and all(e > 0 and e % BLOCK == 0 for e in evicted) and sum(held) < sum(context)
        assert "snapkv: a sequence keeps at most 64 tokens" in text_of(app, "#mem-retention")

        # the curve of what the budget saves: shown, its newest points the engine's bytes
        assert app.query_one("#mem-kv-box").display
        last = app.state.kv_retention_history()[-1]
        token_bytes = engine.retention_record()["token_bytes"]
        assert (last["kv_held_bytes"], last["kv_full_bytes"]) == (sum(held) * token_bytes, sum(context) * token_bytes)
        legend = app.query_one("#mem-kv-plot").render_line(0).text
        assert "full retention would hold" in legend and "held (snapkv)" in legend
        gate.set()

        await pilot.press("5")  # a budget as a share of the context
        app.query_one("#rq-kv_budget").value = "25%"
        app.query_one("#rq-apply").press()
        await until(pilot, lambda: engine.knobs.kv_budget_fraction == 0.25, timeout=10)
        assert engine.knobs.kv_budget == 0 and engine.knobs.kv_retention == "snapkv"

    try:
        run_app(MoectlApp(source), body)
    finally:
        gate.set()


# -- the state and the panel's text from synthetic records ---------------------------------------

def retention(policy="snapkv", held=(160, 96), context=(512, 300), evicted=(352, 208), token_bytes=256) -> dict:
    return {"policy": policy, "budget_tokens": 64 if policy != "full" else 0, "budget_fraction": 1.0,
            "token_bytes": token_bytes, "held_tokens": list(held), "context_tokens": list(context),
            "evicted_tokens": list(evicted)}


def step(i: int, kv_retention: dict | None) -> dict:
    record = make_record(i, busy_s=[0.01] * DEVICES)
    record["knobs"] = dict(KNOBS)
    if kv_retention is not None:
        record["cache"]["kv_retention"] = kv_retention
        record["knobs"].update(kv_retention=kv_retention.get("policy"), kv_budget=kv_retention.get("budget_tokens", 0))
    return record


KNOBS = {"max_num_seqs": 8, "kv_retention": "full", "kv_budget": 0, "kv_budget_fraction": 1.0, "kv_sink_tokens": 4,
         "kv_recent_tokens": 64}
HEADER = {"model": {"name": "synthetic", "num_layers": 2, "num_experts": 4},
          "devices": {"topology": {"num_devices": DEVICES, "hbm_bytes": 1 << 30}, "backend": "emulated"},
          "knobs": KNOBS}


def test_state_without_retention_figures_says_not_recorded():
    state = ConsoleState(HEADER, "replay")
    state.apply([step(i, None) for i in range(5)])
    assert state.kv_retention() is None and state.kv_retention_history() == []
    assert all(h["kv_held_bytes"] is None and h["kv_full_bytes"] is None for h in state.history)
    assert "not recorded" in str(MemoryPanel._retention(state, None))
    simulated = ConsoleState({**HEADER, "clock": "simulated"}, "replay")
    assert "not modeled" in str(MemoryPanel._retention(simulated, None))


def test_state_sums_retention_per_pool_and_keeps_the_curve_only_after_a_budget():
    state = ConsoleState(HEADER, "replay")
    full = retention("full", held=(100, 50), context=(100, 50), evicted=(0, 0))
    state.apply([step(0, None)] + [step(i, full) for i in range(1, 4)])  # an old record, then full retention
    got = state.kv_retention()
    assert got["policy"] == "full" and got["held_bytes"] == got["context_bytes"] == 150 * 256
    assert state.kv_retention_history() == []  # full throughout: no curve to show

    state.apply([step(i, retention()) for i in range(4, 7)])
    got = state.kv_retention()
    assert got["held_tokens"] == [160, 96] and got["context_tokens"] == [512, 300]
    assert got["evicted_tokens"] == [352, 208]
    assert (got["held_bytes"], got["context_bytes"]) == (256 * 256, 812 * 256)
    curve = state.kv_retention_history()
    assert [h["step"] for h in curve] == [1, 2, 3, 4, 5, 6]  # the step without figures is left out
    assert [h["kv_policy"] for h in curve] == ["full"] * 3 + ["snapkv"] * 3

    text = MemoryPanel._retention(state, got).plain
    lines = {line.split()[0]: line.split() for line in text.splitlines()[1:]}
    assert text.splitlines()[0].startswith("policy snapkv: a sequence keeps at most 64 tokens")
    assert "sinks 4, recent 64 tokens always kept" in text.splitlines()[0]
    assert lines["d0"][1:4] == ["160", "512", "352"] and lines["d1"][1:4] == ["96", "300", "208"]
    assert lines["all"][1:4] == ["256", "812", "560"]
    assert lines["d0"][4:] == ["40.0K", "128K", "69%"]


def test_a_record_with_a_partial_retention_field_is_read_not_fatal():
    state = ConsoleState(HEADER, "replay")
    state.apply([step(0, {"policy": "streaming", "held_tokens": [32], "token_bytes": 8})])
    got = state.kv_retention()
    assert got["held_tokens"] == [32] and got["context_tokens"] == [0] and got["evicted_tokens"] == [0]
    assert "streaming" in MemoryPanel._retention(state, got).plain


def test_a_sample_trace_in_replay_says_whether_retention_was_recorded():
    """The Memory tab on a recorded trace: "not recorded" where its steps carry no retention
    figures (traces recorded before the engine sent them), the policy where they do."""
    source = ReplaySource(TRACES / "kv_pressure.trace")

    async def body(app, pilot):
        await pilot.press("3")
        await until(pilot, lambda: text_of(app, "#mem-retention").strip() != "", timeout=10)
        recorded = "kv_retention" in (app.state.latest.get("cache") or {})
        assert ("policy" if recorded else "not recorded") in text_of(app, "#mem-retention")
        assert not app.query_one("#mem-kv-box").display  # no budget in force: no saving to draw
    run_app(MoectlApp(source), body, size=(120, 40))
