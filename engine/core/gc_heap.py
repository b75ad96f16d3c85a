"""Python's cyclic garbage collector against a long-lived engine heap: frozen once an engine is built.

Why: torch, the model's modules and the engine's own tables are hundreds of thousands of
objects that live as long as the process. Every full collection walks all of them, and stalls
whichever step it lands in (no benchmark in the repo isolates that cost; MOECTL_GC_FREEZE=0
gives the before/after). gc.freeze() moves every object alive at that moment
into a generation the collector never walks; reference counting still frees them.
vLLM (freeze_gc_heap at the end of its warm-up) and SGLang (freeze_gc) do the same.

Done when an engine is built, before it has any request: what is alive then lives as long as the
engine (freezing later, with requests in flight, would freeze their soon-to-be garbage, which the
collector could then never reclaim). Each time, what an
earlier freeze held is unfrozen and fully collected first, so an engine dropped by then is
reclaimed (a restart builds the new engine before it drops the old one, so the driver calls this
again once the old one is released). Only in processes that `own` their engine: the long-lived
commands (`serve`, `record`, `run` and the engine process behind it and `web`) and the distributed
ranks. A library user, a test suite, or a command that builds and drops engines to compare them
(`verify`, the bench suites) is left alone: there a dropped engine would stay frozen, uncollected.
MOECTL_GC_FREEZE=0 leaves the collector alone everywhere (for before/after measurements).
"""

from __future__ import annotations

import gc
import os
import threading

_lock = threading.Lock()
_owned = False


def own_process() -> None:
    """This process runs its engine for its whole life: freeze the heap once the engine is built."""
    global _owned
    _owned = True


def engine_built() -> int:
    """Called once an engine (or a rank's model and cache) is built, before any request. Returns
    how many objects the permanent generation holds (0 when nothing was frozen)."""
    if not _owned or os.environ.get("MOECTL_GC_FREEZE", "1") == "0":
        return 0
    with _lock:
        gc.unfreeze()
        gc.collect()
        gc.freeze()
    return gc.get_freeze_count()
