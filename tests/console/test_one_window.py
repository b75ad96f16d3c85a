"""One routing window (placement/rebalancer.py LoadWindow, LOAD_WINDOW_STEPS), kept by the
engine: its figures travel in every step record (devices.window), and the console and /metrics
draw them instead of recomputing. There were three windows, each with its own bookkeeping."""

from __future__ import annotations

import numpy as np

from moectl.console.state import ConsoleState
from moectl.engine.core.config import EngineConfig
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.experts.cluster import WINDOW_FIGURES_EVERY
from moectl.engine.llm_engine import LLMEngine
from moectl.placement.rebalancer import LOAD_WINDOW_STEPS
from moectl.placement.topology import Topology
from moectl.profiler.recorder import engine_header
from moectl.server.metrics import ServerMetrics
from tests.checkpoints import prompts, tiny_checkpoint


def test_the_console_and_the_metrics_window_is_the_engines(tmp_path, single_thread):
    config = EngineConfig(model=str(tiny_checkpoint(tmp_path / "ckpt")), topology=Topology(num_devices=4),
                          redundant_slots=1, num_threads=1)
    engine = LLMEngine(config)
    records: list[dict] = []
    engine.add_listener(on_step=lambda stats: records.append(stats.as_record()))
    engine.generate(prompts(6), SamplingParams(max_tokens=90, ignore_eos=True))
    assert len(records) > LOAD_WINDOW_STEPS  # the window has slid
    engines_window = engine.experts.cluster.window
    header = engine_header(engine)

    state = ConsoleState(header, "live")
    state.apply(records[:10])
    state.apply(records[10:])
    np.testing.assert_array_equal(state.routing_window(), engines_window.totals())
    assert len(state.window) == len(engines_window) == LOAD_WINDOW_STEPS

    metrics = ServerMetrics(header)
    for record in records:
        metrics.observe_step(record)
    # the engine's figures, from its window and the placement in force, as the records carry them:
    # computed every WINDOW_FIGURES_EVERY steps (age_steps 0), carried unchanged by the steps after
    placement = engine.experts.placement
    ages = [r["devices"]["window"]["age_steps"] for r in records]
    fresh = max(i for i, age in enumerate(ages) if age == 0)
    assert ages[fresh:] == list(range(len(records) - fresh)) and max(ages) < WINDOW_FIGURES_EVERY
    assert ages.count(0) >= len(records) // WINDOW_FIGURES_EVERY
    then = records[fresh - LOAD_WINDOW_STEPS + 1:fresh + 1]  # the window as it was at that step
    per_layer, overall = placement.balancedness(np.sum([r["routing"] for r in then], axis=0))
    window = records[-1]["devices"]["window"]
    assert window["steps"] == LOAD_WINDOW_STEPS and window["balancedness"] == float(overall)
    assert state.balancedness()["overall"] == float(overall)
    assert state.balancedness()["per_layer"] == [float(x) for x in per_layer]
    measured = np.sum([r["devices"]["tokens"] for r in then], axis=0)
    np.testing.assert_array_equal(state.device_loads(), measured)
    sparse = np.asarray(header["model"]["sparse_layers"], dtype=bool)
    moe = per_layer[sparse] if sparse.any() else per_layer
    reported = {s.labels["quantile"]: s.value for s in _families(metrics)["moectl:expert_balancedness"].samples}
    assert reported == {"0": float(np.quantile(moe, 0)), "0.5": float(np.quantile(moe, 0.5)),
                        "1": float(np.quantile(moe, 1))}


def test_a_replay_what_if_is_the_consoles_own_estimate(tmp_path, single_thread):
    """A counterfactual placement (replay's what-if) is not the engine's: the console estimates it
    from the routing window, and says so (loads_estimated)."""
    from moectl.placement.placement import Placement

    config = EngineConfig(model=str(tiny_checkpoint(tmp_path / "ckpt")), topology=Topology(num_devices=4),
                          redundant_slots=1, num_threads=1)
    engine = LLMEngine(config)
    records: list[dict] = []
    engine.add_listener(on_step=lambda stats: records.append(stats.as_record()))
    engine.generate(prompts(3), SamplingParams(max_tokens=8, ignore_eos=True))
    state = ConsoleState(engine_header(engine), "replay")
    state.apply(records)
    other = Placement.contiguous(state.num_layers, state.num_experts, 4, 1).replicate(1, 0, 3)
    state.counterfactual = other
    assert state.engine_window() is None and state.loads_estimated
    assert state.balancedness()["overall"] == float(other.balancedness(state.routing_window())[1])


def _families(metrics):
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(metrics.render(None).decode())}


def test_a_live_console_draws_the_modeled_link_spans_the_engine_only_describes(tmp_path, single_thread):
    """The engine sends each step's link traffic, not its link spans (wire/link_spans.py); the
    console state derives them, so the Timeline's link lanes fill in live as in replay."""
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint(tmp_path / "ckpt")), topology=Topology(num_devices=2),
                                    num_threads=1, profile_spans=True))
    records: list[dict] = []
    engine.add_listener(on_step=lambda stats: records.append(stats.as_record()))
    engine.generate(prompts(4), SamplingParams(max_tokens=4, ignore_eos=True))
    sent = records[-1]["spans"]
    assert "links" in sent and "all_to_all dispatch" not in sent["names"]

    state = ConsoleState(engine_header(engine), "live")
    state.apply(records)
    spans = state.latest["spans"]
    names = [spans["names"][i] for i in spans["name"]]
    links = [i for i, name in enumerate(names) if name.startswith("all_to_all")]
    assert links and all(spans["modeled"][i] for i in links)
    assert {spans["lanes"][spans["lane"][i]] for i in links} <= {"link 0", "link 1"}
    assert "links" not in spans and "links" in records[-1]["spans"]  # the engine's record is left as sent
