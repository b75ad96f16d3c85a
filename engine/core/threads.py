"""The engine's torch intra-op thread count, `num_threads="auto"`: as many threads as there are
cores that other processes leave free, re-measured about once a second.

Why: torch's default is a thread per core. When another process holds one of them, every
parallel op waits at its barrier for the thread whose core is taken, and a 2-core machine then
runs the engine at a fraction of the speed one thread would give (`moectl bench --compare hf
--contended` measures both). The engine cannot see "contention" directly, so it measures what
others use: the machine's busy CPU time minus this process's own, over the last interval.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable

import psutil
import torch

INTERVAL_S = 1.0
FIRST_INTERVAL_S = 0.2
CONFIRM_INTERVAL_S = 0.5
# a core counts as taken when others kept it this busy: a brief burst (a compiler, a log
# rotation) must not halve the engine's threads
TAKEN_SHARE = 0.6


def usable_cores() -> int:
    """The cores this process may use: its CPU affinity, no more than the physical cores (SMT
    siblings share one core's arithmetic), a cgroup CPU quota, or OMP_NUM_THREADS when set."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    physical = psutil.cpu_count(logical=False)
    if physical:
        cores = min(cores, physical)
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        cores = min(cores, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, cores)


def _busy_seconds() -> tuple[float, float]:
    """(CPU seconds the cores this process may run on spent busy, CPU seconds it used) so far.
    Only those cores: in a container pinned to a few of a host's many, the others' work is not
    in the way."""
    per_cpu = psutil.cpu_times(percpu=True)
    try:
        mine = [per_cpu[i] for i in os.sched_getaffinity(0) if i < len(per_cpu)]
    except (AttributeError, OSError):
        mine = per_cpu
    # niced work is left out: the scheduler lets the engine preempt it
    busy = sum(getattr(t, name, 0.0) for t in mine for name in ("user", "system", "irq", "softirq", "steal"))
    own = psutil.Process().cpu_times()
    return busy, own.user + own.system


class AdaptiveThreads:
    """threads = usable cores - reserved - cores others kept busy (at least 1). `maybe_update()`
    is cheap between measurements (one clock read); a measurement costs two /proc reads.
    reserved: cores this process needs for other work (the console's UI thread). The count
    changes only when two measurements in a row agree on the new value: a one-second burst next
    door does not move it, and two adaptive engines on one machine do not chase each other."""

    def __init__(self, cores: int | None = None, reserved: int = 0, interval_s: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic,
                 sample: Callable[[], tuple[float, float]] = _busy_seconds,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 get_threads: Callable[[], int] = torch.get_num_threads):
        self.cores = cores or usable_cores()
        self.reserved = reserved
        self.interval_s = interval_s
        self._clock, self._sample, self._set, self._get = clock, sample, set_threads, get_threads
        self.threads = max(1, self.cores - reserved)
        self.others_busy = 0.0  # cores' worth of CPU others used in the last interval
        self.updates = 0  # measurements taken
        self.changes: deque[tuple[float, int]] = deque(maxlen=64)  # (clock, threads), the latest changes
        self.change_count = 0
        self._proposed: int | None = None
        self._last_time = clock()
        self._last_busy, self._last_own = sample()
        # the first measurement comes early: a contended start should not run a second on too many threads
        self._wait_s = min(FIRST_INTERVAL_S, interval_s)
        self._set(self.threads)

    def maybe_update(self) -> int:
        now = self._clock()
        elapsed = now - self._last_time
        if elapsed < self._wait_s:
            if self._get() != self.threads:  # someone else in this process changed torch's setting
                self._set(self.threads)
            return self.threads
        self._wait_s = self.interval_s
        busy, own = self._sample()
        others = max(0.0, (busy - self._last_busy) - (own - self._last_own)) / elapsed
        self._last_time, self._last_busy, self._last_own = now, busy, own
        self.others_busy = others
        self.updates += 1
        taken = int(others // 1 + (1 if others % 1 >= TAKEN_SHARE else 0))
        threads = max(1, self.cores - self.reserved - taken)
        if threads == self.threads:
            self._proposed = None
        elif threads != self._proposed:
            self._proposed = threads  # the next measurement, sooner than usual, must agree
            self._wait_s = min(CONFIRM_INTERVAL_S, self.interval_s)
        else:
            self.threads, self._proposed = threads, None
            self.changes.append((now, threads))
            self.change_count += 1
            self._set(threads)
        return self.threads

    def describe(self) -> dict:
        return {"policy": "auto", "cores": self.cores, "reserved": self.reserved, "threads": self.threads,
                "others_busy_cores": round(self.others_busy, 2), "updates": self.updates,
                "threads_changes": self.change_count}
