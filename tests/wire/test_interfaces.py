"""The front ends' Protocols (wire/interfaces.py) hold for every implementation: EngineCore and
SimulatedEngine are an Engine, ExpertControl and SimExperts are its EngineExperts, and every
console source is a ConsoleSource. Member by member: a method with the same parameters (names,
kinds, defaults; annotations may differ), a property or attribute present on a built instance.
isinstance with runtime_checkable would only compare names."""

from __future__ import annotations

import inspect

import pytest

from moectl.console.engine_client import EngineSource
from moectl.console.live_source import LiveSource
from moectl.console.sources import AttachSource, ReplaySource
from moectl.console.vllm_source import VllmSource
from moectl.engine.core.config import EngineConfig
from moectl.engine.core.engine import EngineCore
from moectl.engine.experts.control import ExpertControl
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.sim.cluster_config import SimClusterConfig
from moectl.engine.sim.cluster_engine import SimulatedEngine
from moectl.engine.sim.sim_experts import SimExperts
from moectl.placement.topology import Topology
from moectl.wire.interfaces import ConsoleSource, Engine, EngineExperts
from tests.checkpoints import tiny_checkpoint
from tests.paths import DOCS


def members(protocol) -> dict[str, object]:
    """The protocol's own members: methods, properties and annotated or assigned attributes."""
    names = {n for n in vars(protocol) if not n.startswith("_")} | set(getattr(protocol, "__annotations__", {}))
    return {n: vars(protocol).get(n) for n in sorted(names)}


def parameters(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def mismatches(protocol, cls, instance=None) -> list[str]:
    """What `cls` (and, for attributes set in __init__, `instance`) lacks or has otherwise."""
    out = []
    for name, member in members(protocol).items():
        found = inspect.getattr_static(cls, name, None)
        if inspect.isfunction(member):
            if not inspect.isfunction(found):
                out.append(f"{name}: not a method")
            elif parameters(found) != parameters(member):
                out.append(f"{name}{inspect.signature(found)}, the protocol says {name}{inspect.signature(member)}")
        elif isinstance(member, property) and found is not None and not isinstance(found, property):
            out.append(f"{name}: not a property")
        elif found is None and (instance is None or not hasattr(instance, name)):
            out.append(f"{name}: missing")
    return out


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """An EngineCore with its expert layer, and a SimulatedEngine."""
    ckpt = tiny_checkpoint(tmp_path_factory.mktemp("interfaces") / "ckpt")
    core = LLMEngine(EngineConfig(model=str(ckpt), topology=Topology(num_devices=2), num_threads=1))
    sim = SimulatedEngine(SimClusterConfig(model=DOCS / "configs" / "deepseek-v3.json", devices=64))
    return core, sim


def test_the_engines_are_an_engine(engines):
    core, sim = engines
    assert isinstance(core, EngineCore)
    assert mismatches(Engine, EngineCore, core) == []
    assert mismatches(Engine, SimulatedEngine, sim) == []


def test_their_expert_layers_are_engine_experts(engines):
    core, sim = engines
    assert type(core.experts) is ExpertControl and type(sim.experts) is SimExperts
    assert mismatches(EngineExperts, ExpertControl, core.experts) == []
    assert mismatches(EngineExperts, SimExperts, sim.experts) == []


@pytest.mark.parametrize("source", [ReplaySource, AttachSource, EngineSource, LiveSource, VllmSource])
def test_every_console_source_is_a_console_source(source):
    assert ConsoleSource in source.__mro__  # it gives them its defaults (close, error, mode, header)
    assert mismatches(ConsoleSource, source) == []


def test_the_checker_sees_a_different_signature():
    class Other:
        def poll(self, limit):
            return [], []

        def act(self, kind, **args):
            return None

    found = mismatches(ConsoleSource, Other)
    assert any(m.startswith("poll(") for m in found) and "close: not a method" in found and "mode: missing" in found
