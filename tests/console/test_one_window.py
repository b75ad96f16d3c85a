"""One routing window (engine/experts/rebalancer.py LoadWindow, LOAD_WINDOW_STEPS): what the
engine plans from is what the console draws and what /metrics reports, over the same steps.
There were three windows, each with its own bookkeeping."""

from __future__ import annotations

import numpy as np

from moectl.console.state import ConsoleState
from moectl.engine.core.config import EngineConfig
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.core.topology import Topology
from moectl.engine.experts.rebalancer import LOAD_WINDOW_STEPS
from moectl.engine.llm_engine import LLMEngine
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
    np.testing.assert_array_equal(metrics._routing.totals(), engines_window.totals())
    # the same balancedness, then, from the same placement
    placement = engine.experts.placement
    assert state.balancedness()["overall"] == placement.balancedness(engines_window.totals())[1]
