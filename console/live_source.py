"""The engine on a thread of the console's own process, as a ConsoleSource (wire/interfaces.py).

`moectl run` puts the engine in a process of its own (server/engine_host.py) and the console
attaches to it (engine_client.py); this in-process source is what that design is measured
against (bench/console_bench.py) and what engine-level console tests drive directly. It is the
one console module that loads torch: the console's process never imports it (pyproject.toml's
import-linter contract lists the modules that process imports).
"""

from __future__ import annotations

from concurrent.futures import Future

from moectl.engine.core.driver import EngineDriver
from moectl.engine.tools.demo_workload import DemoLoad, DemoWorkload
from moectl.profiler.recorder import engine_header
from moectl.wire.actions import Action
from moectl.wire.interfaces import ConsoleSource


class LiveSource(ConsoleSource):
    """The embedded engine on its driver's thread, fed by the demo workload."""

    mode = "live"

    def __init__(self, make_engine, load: DemoLoad | None = None, on_close=None):
        """make_engine(): builds a fresh LLMEngine (also used by restart). on_close(): after the
        driver stops (the distributed backend's ranks are released there)."""
        self._on_close = on_close
        self._load = load or DemoLoad()
        self.workload = DemoWorkload(self._load)
        self.driver = EngineDriver(make_engine, feed=self.workload.feed)
        self._header = (None, {})

    @property
    def engine(self):
        return self.driver.engine

    @property
    def header(self) -> dict:
        engine, header = self._header
        if engine is not self.driver.engine:  # a restart made a new engine
            engine = self.driver.engine
            self._header = (engine, engine_header(engine))
        return self._header[1]

    @property
    def error(self) -> str | None:
        return self.driver.error

    def poll(self) -> tuple[list[dict], list[dict]]:
        return self.driver.poll()

    def act(self, kind: str, **args) -> Future:
        """The engine's actions go to the driver (validated there, ActionRefused); the demo
        workload's own are handled here."""
        if kind != Action.WORKLOAD:
            return self.driver.act(kind, **args)
        return self.workload.steer(self.driver, **args)

    @property
    def load(self) -> DemoLoad:
        return self.workload.load

    def close(self) -> None:
        try:
            self.driver.close()
        finally:
            if self._on_close is not None:
                self._on_close()
