"""Recording a running engine to a trace file: its header, then every step and action record.

The engine's listeners only pack each record for the TraceWriter's pipe, where records go in
batches (BATCH_S); encoding and SQLite writes happen in the writer's own process, so recording
never blocks the step loop nor takes its GIL for that work (a full pipe and backlog drops the
record and counts it).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict
from pathlib import Path

from moectl.profiler.trace_store import TraceWriter
from moectl.wire.records import FORMAT_VERSION

# the engine's records go to the writer process in batches: one pipe write for many steps (a write
# per step cost ~1% of a step); a step sends its batch once that is this old, and an idle engine's
# goes at twice this (TraceWriter's sender thread)
BATCH_S = 0.1


def engine_header(engine) -> dict:
    """What a trace needs to be understood without the engine: model, devices, placement, config."""
    cfg = engine.config
    model_cfg = engine.model_config
    simulated = getattr(engine, "header_extra", None)  # the simulated backend (engine/sim/cluster_engine.py)
    if simulated is not None:
        from moectl.engine.sim.cluster_engine import engine_config_dict

        config = engine_config_dict(cfg)
    else:
        config = {k: v for k, v in asdict(cfg).items() if k not in ("topology", "knobs", "auto_rebalance")}
    header = {
        "record_format": FORMAT_VERSION,
        "clock_origin": {"monotonic": time.monotonic(), "unix": time.time()},
        "model": {"path": str(cfg.model), "name": Path(str(cfg.model)).name,
                  "architecture": model_cfg.hf_architecture, "num_layers": model_cfg.num_layers,
                  "num_experts": model_cfg.num_experts, "top_k": model_cfg.top_k,
                  "hidden_size": model_cfg.hidden_size, "vocab_size": model_cfg.vocab_size,
                  "sparse_layers": list(model_cfg.sparse_layers)},
        "engine_config": config,
        "knobs": engine.knobs.as_dict(),
        "devices": engine.experts.header() if engine.experts is not None else None,
    }
    if simulated is not None:
        header.update(simulated())
        header["memory_plan"] = engine.memory_plan_table()
        return header
    return with_memory_plan(header)  # computed with the engine: consoles only draw it


def with_memory_plan(header: dict) -> dict:
    """The header with its engine's per-device memory plan ("memory_plan"): the one it carries,
    else planned now from the model's config.json (a trace recorded before engines put it there)."""
    if isinstance(header.get("memory_plan"), dict):
        return header
    from moectl.engine.planning.memory_plan import plan_for_header  # torch: only for such old traces

    return {**header, "memory_plan": plan_for_header(header)}


class TraceRecorder:
    """Attach to an engine, write everything it emits to `path` until close() (or, with
    max_steps, until that many steps are written: `full` is set then)."""

    def __init__(self, engine, path, *, overwrite: bool = False, queue_size: int = 4096,
                 max_steps: int | None = None):
        self.engine = engine
        self.max_steps = max_steps
        self.full = threading.Event()
        self.path = Path(path)
        # the engine's records key every dict by str: the codec's fast path applies
        self.writer = TraceWriter(self.path, engine_header(engine), queue_size=queue_size, overwrite=overwrite,
                                  str_keys=True, batch_s=BATCH_S)
        self.steps = 0
        self.record_s = 0.0  # seconds in stats.as_record() on the engine thread
        self._closed = False
        engine.add_listener(on_step=self._on_step, on_action=self._on_action)
        self.writer.write_action({"time": time.monotonic(), "step": engine.step_count, "kind": "record_start",
                                  "args": {"path": str(self.path)}, "result": {}})

    def _on_step(self, stats) -> None:
        if self._closed or self.full.is_set():  # close() raced with a step already under way
            return
        self.steps += 1
        t0 = time.perf_counter()
        record = stats.as_record()
        self.record_s += time.perf_counter() - t0
        self.writer.write_step(record)
        if self.max_steps is not None and self.steps >= self.max_steps:
            self.full.set()

    def _on_action(self, action: dict) -> None:
        if not self._closed:
            self.writer.write_action(action)

    @property
    def dropped(self) -> int:
        return self.writer.dropped

    def close(self) -> None:
        self._closed = True
        self.engine.remove_listener(on_step=self._on_step, on_action=self._on_action)
        self.writer.write_action({"time": time.monotonic(), "step": self.engine.step_count, "kind": "record_stop",
                                  "args": {}, "result": {"steps": self.steps, "dropped": self.writer.dropped}})
        self.writer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
