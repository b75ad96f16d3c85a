"""A forward written once, with yield points at its collectives (SGLang's operations and yield points).

A layer's `stages(...)` is a generator: it computes up to a collective, starts it asynchronously
and yields a `Collective` (the async handle); whoever drives the generator decides when to wait.
`run_stages` waits at once (one batch: the forward every backend runs); `interleave` drives two
micro-batches' stages in turn, so that one micro-batch's collective is in flight while the other
computes (two-batch overlap). Both micro-batches have the same stages (the same layers, the same
collectives), so the micro-batch started first stays exactly one stage ahead of the other and every
rank issues its collectives in the same order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Collective:
    """One collective in flight. `on_done(issued, waited_from, done)`, on the engine clock
    (time.monotonic): when it was started, when its micro-batch came back to wait for it, and
    when the wait ended; `synchronize` runs after the wait (a GPU's stream, so `done` is real)."""

    work: Any  # a torch.distributed Work (async_op=True): .wait(), .is_completed()
    on_done: Callable[[float, float, float], None] | None = None
    synchronize: Callable[[], None] | None = None
    issued: float = field(default_factory=time.monotonic)

    def finish(self, overlapped: bool = True) -> None:
        """Waits for it. overlapped False: it was waited for as soon as it started (one batch),
        so nothing ran under it."""
        waited_from = time.monotonic() if overlapped else self.issued
        self.work.wait()
        if self.synchronize is not None:
            self.synchronize()
        if self.on_done is not None:
            self.on_done(self.issued, waited_from, time.monotonic())


Stages = Generator[Collective, None, Any]


def run_stages(stages: Stages) -> Any:
    """One batch: every collective is waited for where it was started; returns the stages' result."""
    try:
        pending = next(stages)
        while True:
            pending.finish(overlapped=False)
            pending = stages.send(None)
    except StopIteration as end:
        return end.value


def interleave(first: Stages, second: Stages, switch: Callable[[int], None] | None = None) -> tuple[Any, Any]:
    """Two micro-batches: `first` runs to its first collective, `second` to its own (computing while
    the first one's is in flight), then each resumes once its collective is done, always after the
    other has computed its next stage. switch(i): called before micro-batch i runs (or waits for
    its collective). Returns both results."""
    gens, pending, results = (first, second), [None, None], [None, None]

    def advance(i: int) -> None:
        if switch is not None:
            switch(i)
        try:
            pending[i] = next(gens[i]) if pending[i] is None else gens[i].send(None)
        except StopIteration as end:
            pending[i], results[i] = None, end.value
            gens_done[i] = True

    gens_done = [False, False]
    advance(0)
    advance(1)
    while not all(gens_done):
        for i in (0, 1):
            if not gens_done[i]:
                if switch is not None:
                    switch(i)
                pending[i].finish()
                advance(i)
    return results[0], results[1]
