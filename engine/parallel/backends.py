"""The engine for a backend, for every front end (console, server, recorder, benchmarks, CLI)."""

from __future__ import annotations

from moectl.engine.core.config import EngineConfig
from moectl.engine.llm_engine import LLMEngine


class Engines:
    """make_engine() for `backend`, and close() for what it started: on the distributed backend
    this process becomes rank 0 and the other ranks are spawned now (one per topology device).
    local and multi-gpu: a plain LLMEngine (the config says where the experts live)."""

    def __init__(self, config: EngineConfig, backend: str = "local"):
        self.group = None
        if backend == "distributed":
            from moectl.engine.parallel.group import RankGroup

            self.group = RankGroup(config, config.topology.num_devices)
            self.make_engine = self.group.make_engine
        else:
            self.make_engine = lambda: LLMEngine(config)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
