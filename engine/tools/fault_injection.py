"""Fault injection for resilience tests: an engine whose forward fails from a given step on, as a
device fault would, so the failure path (failed steps, the engine given up, its cause on every
client, a restart) runs in a real engine process (`moectl engine-host --inject-fault STEP`)."""

from __future__ import annotations

from collections.abc import Callable


class InjectedFault(RuntimeError):
    """What an injected fault raises in the model's forward."""


def inject_fault(engine, from_step: int) -> None:
    """engine's forward raises InjectedFault in every step from `from_step` on."""
    real = engine.runner.run

    def run(items):
        if engine.step_count >= from_step:
            raise InjectedFault(f"injected fault at step {engine.step_count} (--inject-fault {from_step})")
        return real(items)
    engine.runner.run = run


def first_engine_faulty(make_engine: Callable, from_step: int) -> Callable:
    """make_engine, but the first engine it makes has the fault; the ones a restart makes do not."""
    made = [0]

    def make():
        engine = make_engine()
        made[0] += 1
        if made[0] == 1:
            inject_fault(engine, from_step)
        return engine
    return make
