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
    """One collective in flight. `on_done(issued, hidden_until, waited_from, done)`, on the engine
    clock (time.monotonic): when it was started; until when it ran under the other micro-batch's
    compute (when it completed, if that was before its micro-batch came back to wait for it, else
    that moment; on a GPU, whose completion the host does not see, always that moment: an upper
    bound); when its micro-batch came back to wait for it; and when the wait ended.
    `synchronize` runs after the wait (a GPU's compute stream, so `done` is real)."""

    work: Any  # a torch.distributed Work (async_op=True): .wait(), .get_future()
    on_done: Callable[[float, float, float, float], None] | None = None
    synchronize: Callable[[], None] | None = None
    issued: float = field(default_factory=time.monotonic)
    completed: float | None = None  # set from the work's future on the CPU (gloo)

    def __post_init__(self) -> None:
        if self.synchronize is None and hasattr(self.work, "get_future"):
            self.work.get_future().add_done_callback(self._mark_completed)

    def _mark_completed(self, _future) -> None:
        self.completed = time.monotonic()

    def finish(self, overlapped: bool = True) -> None:
        """Waits for it. overlapped False: it was waited for as soon as it started (one batch),
        so nothing ran under it."""
        waited_from = time.monotonic() if overlapped else self.issued
        completed = self.completed
        hidden_until = min(waited_from, completed) if completed is not None else waited_from
        self.work.wait()
        if self.synchronize is not None:
            self.synchronize()
        if self.on_done is not None:
            self.on_done(self.issued, hidden_until, waited_from, time.monotonic())


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
    other has computed its next stage. switch(i): called when micro-batch i takes over (to wait for
    its collective and run its next stage). Returns both results. If a stage raises, both
    generators are closed and the error propagates (the collective left in flight is the process
    group's to fail or drain, as in one batch)."""
    gens, pending, results, done = (first, second), [None, None], [None, None], [False, False]

    def turn(i: int) -> None:
        if switch is not None:
            switch(i)
        if pending[i] is not None:
            pending[i].finish()
        try:
            pending[i] = next(gens[i]) if pending[i] is None else gens[i].send(None)
        except StopIteration as end:
            pending[i], results[i], done[i] = None, end.value, True

    try:
        turn(0)
        turn(1)
        while not all(done):
            for i in (0, 1):
                if not done[i]:
                    turn(i)
    except BaseException:
        for gen in gens:
            gen.close()
        raise
    return results[0], results[1]
