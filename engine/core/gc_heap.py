"""Python's cyclic garbage collector against a long-lived engine heap: frozen after the first step.

Why: torch, the model's modules and the engine's own tables are hundreds of thousands of
objects that live as long as the process. Every full collection walks all of them: on the sample
model a profiled run of 485 steps spent 2.7% of its wall time in the collector, 99 ms of it in
one full collection that stalled one step (measured with gc.callbacks around
`moectl bench --suite profiler`'s workload). gc.freeze() moves every object alive at that moment
into a generation the collector never walks; reference counting still frees them.
vLLM (freeze_gc_heap at the end of its warm-up) and SGLang (freeze_gc) do the same.

Done after an engine's first step (its lazily built state exists by then), after a full
collection so that no garbage is frozen with the heap (after the first freeze a full collection
walks only what was made since). Only in processes that `own` their engine: the CLI's (its main
sets it, the engine process and `serve` included) and the distributed ranks. A library user or
a test suite that builds and drops many engines in one process is left alone: a frozen engine
that later becomes cyclic garbage is never collected. MOECTL_GC_FREEZE=0 leaves the collector
alone everywhere (for before/after measurements).
"""

from __future__ import annotations

import gc
import os
import threading

_lock = threading.Lock()
_owned = False


def own_process() -> None:
    """This process runs its engine for its whole life: freeze the heap after the first step."""
    global _owned
    _owned = True


def after_first_step() -> int:
    """Called by an engine (or a rank's step loop) after its first step. Returns how many objects
    the permanent generation holds (0 when nothing was frozen)."""
    if not _owned or os.environ.get("MOECTL_GC_FREEZE", "1") == "0":
        return 0
    with _lock:
        gc.collect()
        gc.freeze()
    return gc.get_freeze_count()
