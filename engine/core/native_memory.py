"""The C allocator under torch's CPU tensors: glibc malloc's statistics, and a periodic trim.

Why the engine does anything here: torch allocates every CPU tensor with posix_memalign and
frees it at once (there is no caching allocator on CPU), so glibc sees every activation of
every step. When no free chunk fits, glibc grows a heap arena for a block below its mmap
threshold (128 KiB at start) and gives a larger one its own mmap, but the threshold is
*dynamic*: each time such a block is freed it rises to that block's size (up to 32 MiB), so
after the first steps every activation and KV gather is carved out of the heap arenas. A new
batch shape every step leaves free holes between live blocks; glibc only gives back free
memory at the very top of a heap, so RSS creeps up with each new mix of shapes while the bytes
in use stay flat (bench/engine_memory_growth.py, steps 200-560: RSS +35 MiB, malloc in use
+1 MiB, the arenas' free bytes 41 -> 72 MiB, and one malloc_trim takes RSS below its start).

The fix is malloc_trim(0) every TRIM_EVERY_STEPS steps: it hands every whole free page in every
arena back to the OS (madvise), holes included, and the blocks stay where they are, so steps
in between still reuse warm pages. Fixing the thresholds instead (mallopt M_MMAP_THRESHOLD and
M_TRIM_THRESHOLD, MOECTL_NATIVE_MEMORY=mmap) keeps large blocks off the heap but pays an mmap,
page faults and a munmap for each one, every step (7x the system time in `moectl bench --suite
soak`) and still lets the smaller blocks fragment the heap.

MOECTL_NATIVE_MEMORY=off leaves glibc alone (for before/after measurements). Everything is a
no-op where the C library is not glibc.

bound_kernel_caches() is the other native cost of a long-lived engine: oneDNN, which runs
torch's bf16 and fp16 matmuls on CPU, JIT-compiles a kernel for every distinct (rows, in, out)
shape and keeps the last 1,024, and ideep, torch's layer over it, keeps an LRU of its own as
large. A server's batches have a new row count almost every step, so both fill, and that was
most of `moectl serve`'s growth over its first bursts, levelling off once they were full
(bench/serve_memory.py measures it; docs/serve_memory.md says what is where, and the trade).
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading

# Steps between trims. A trim is cheap itself; the cost is re-faulting the pages it gave back
# that the next steps need again. Against glibc alone, in the same run of the 10,000-request
# soak on a shared 2-core box: 3.61 vs 3.72 steps/s and +2% user CPU, within that box's noise.
TRIM_EVERY_STEPS = 64

# mallopt parameter numbers, from glibc's <malloc.h>; only for MOECTL_NATIVE_MEMORY=mmap
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 256 << 10
TRIM_THRESHOLD = 1 << 20

# oneDNN's kernel cache: a miss is a JIT compile, a kept kernel its code. 256 is the middle of the
# trade bench/serve_memory.py --kernel-caches measures (docs/serve_memory.md): far less memory
# than 1,024 for a little more CPU, where 64 costs much more CPU. ideep's LRU saved no time
# there (`--kernel-caches 256/1,256/1024`), so 1 (0 crashes torch 2.13). An operator's own
# setting of either variable wins.
KERNEL_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256", "LRU_CACHE_CAPACITY": "1"}
_KERNEL_CACHE_ALIASES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "DNNL_PRIMITIVE_CACHE_CAPACITY"}  # oneDNN's older name

_ENV = "MOECTL_NATIVE_MEMORY"  # trim (default) | mmap | off
_lock = threading.Lock()
_applied: dict | None = None
_steps = 0


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _glibc():
    """libc as a ctypes library when it is glibc with mallopt, malloc_trim and mallinfo2 (2.33+)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    if not all(hasattr(libc, fn) for fn in ("mallopt", "malloc_trim", "mallinfo2")):
        return None
    libc.mallinfo2.restype = _Mallinfo2
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


_LIBC = _glibc()


def available() -> bool:
    return _LIBC is not None


def mallinfo() -> dict | None:
    """glibc's view, in bytes: `heap` (the arenas' memory), `mmapped` (blocks on their own mmap,
    `mmapped_blocks` of them), `in_use` (allocated, both kinds), `free` (free chunks the arenas
    hold: what fragmentation keeps), `releasable` (free at the top of the main arena). None
    where the C library is not glibc."""
    if _LIBC is None:
        return None
    m = _LIBC.mallinfo2()
    return {"heap": m.arena, "mmapped": m.hblkhd, "mmapped_blocks": m.hblks, "in_use": m.uordblks + m.hblkhd,
            "free": m.fordblks, "releasable": m.keepcost}


def trim() -> bool:
    """malloc_trim(0): every whole free page in every arena back to the OS. True when some
    memory was released."""
    return bool(_LIBC.malloc_trim(0)) if _LIBC is not None else False


def fix_thresholds(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> dict:
    """Sets both thresholds, which turns glibc's dynamic adjustment off (the alternative the
    module docstring measures). mallopt returns 1 on success."""
    return {"mmap_threshold": mmap_threshold, "mmap_threshold_ok": _LIBC.mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1,
            "trim_threshold": trim_threshold, "trim_threshold_ok": _LIBC.mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1}


def setup() -> dict:
    """Once per process (the engine calls it at start). Returns the mode in force, the same
    dict on every later call: {"mode": "trim" | "mmap" | "off", ...}."""
    global _applied
    with _lock:
        if _applied is None:
            mode = os.environ.get(_ENV, "trim").lower()
            if _LIBC is None:
                _applied = {"mode": "off", "reason": "not glibc"}
            elif mode == "off":
                _applied = {"mode": "off", "reason": f"{_ENV}=off"}
            elif mode == "mmap":
                _applied = {"mode": "mmap", **fix_thresholds()}
            else:
                _applied = {"mode": "trim", "every_steps": TRIM_EVERY_STEPS}
        return dict(_applied)


def after_step() -> None:
    """The engine calls this after each step: trims every TRIM_EVERY_STEPS steps (process-wide)."""
    global _steps
    if _applied is None or _applied["mode"] != "trim":
        return
    _steps += 1
    if _steps % TRIM_EVERY_STEPS == 0:
        _LIBC.malloc_trim(0)


def bound_kernel_caches() -> dict[str, str]:
    """Bounds oneDNN's and ideep's kernel caches (KERNEL_CACHES) for this process and the ones it
    starts. Only before the process's first matmul: both read their variable once, when their
    first kernel is built. Returns the settings in force."""
    in_force = {}
    for name, value in KERNEL_CACHES.items():
        given = [n for n in (name, _KERNEL_CACHE_ALIASES.get(name)) if n is not None and n in os.environ]
        if not given:
            os.environ[name] = value
        in_force[name] = os.environ[given[0] if given else name]
    return in_force
