"""What front ends program against: the engine, its expert control and a console source, as
typing.Protocols. The engine (engine/core/engine.py EngineCore, engine/sim/cluster_engine.py
SimulatedEngine) and its expert control (engine/experts/control.py ExpertControl,
engine/sim/sim_experts.py SimExperts) satisfy them without naming them; the console's sources
(console/sources.py, console/engine_client.py, console/live_source.py) subclass ConsoleSource,
which gives them its defaults. tests/wire/test_interfaces.py checks every implementation, member
by member, signature by signature.

Torch-free, and importing nothing from the engine: the engine's own types (SamplingParams,
SchedulerKnobs, AutoRebalancePolicy, RequestOutput) are named in words, not imported.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from moectl.placement.placement import Placement
    from moectl.placement.rebalancer import RebalancePlan
    from moectl.placement.topology import Topology


class EngineExperts(Protocol):
    """An engine's expert layer (`engine.experts`): the placement in force, and the operator's
    expert actions on it (preview, apply, edit, auto-rebalance)."""

    placement: Placement
    topology: Topology
    auto: Any  # AutoRebalancePolicy (engine/core/config.py)

    @property
    def num_devices(self) -> int: ...

    @property
    def backend(self) -> str: ...

    def header(self) -> dict: ...

    def balancedness(self) -> float: ...

    def preview(self) -> RebalancePlan: ...

    def apply(self, placement: Placement, kind: str = "placement", predicted: dict | None = None) -> Future:
        """Applied between steps; `predicted`: the previewed plan's own prediction, which the
        outcome is then compared with (None: priced at the apply)."""

    def edit(self, edit: str, **args) -> Placement: ...

    def set_auto(self, policy) -> Future: ...

    def check_knobs(self, knobs) -> None: ...

    def after_step(self, step: int) -> None: ...


class Engine(Protocol):
    """An engine a driver runs step by step on its thread (engine/core/driver.py) and front ends
    read: requests in, a step at a time, knobs, operator commands run between steps, listeners
    for its step and action records."""

    config: Any  # EngineConfig or SimClusterConfig: what the engine was built from
    model_config: Any  # the model's shape (ModelConfig, or the simulator's)
    tokenizer: Any  # None on the simulated engine: it takes prompt lengths, not text
    max_model_len: int
    experts: EngineExperts | None  # None: no devices, so no expert actions
    step_count: int
    step_log: deque
    failure: str | None  # why this engine should not serve on

    def add_request(self, prompt, params=None, *, request_id: str | None = None, priority: int = 0,
                    arrival: float | None = None, stream: bool = False): ...

    def abort(self, request_id: str) -> None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list: ...

    def fail_all(self, reason: str = "error", error: str | None = None) -> list: ...

    @property
    def knobs(self): ...  # SchedulerKnobs (engine/core/config.py)

    def update_knobs(self, **changes): ...

    def capture(self, steps: int) -> Future: ...

    def submit(self, fn, kind: str = "call") -> Future: ...

    def run_commands(self) -> None: ...

    def add_listener(self, on_step=None, on_action=None) -> None: ...

    def remove_listener(self, on_step=None, on_action=None) -> None: ...

    def record_action(self, kind: str, args: dict, result) -> None: ...

    def stats(self) -> dict: ...


class ConsoleSource(Protocol):
    """Where a console's records come from, and where its actions go: `poll()` hands over the
    step and action records that arrived since the last call; `act(kind, **args)` asks for an
    operator action and returns its result, or raises ActionRefused with a one-line reason."""

    mode = "?"
    header: dict = {}

    def poll(self) -> tuple[list[dict], list[dict]]:
        raise NotImplementedError

    def act(self, kind: str, **args):
        raise NotImplementedError

    def close(self) -> None:
        pass

    @property
    def error(self) -> str | None:
        return None
