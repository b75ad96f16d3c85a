"""The distributed backend under a long-running front end (console, server, recorder, bench).

`RankGroup` makes this process rank 0 of N and spawns ranks 1..N-1 as worker processes. Rank 0
holds the scheduler and whatever front end runs here; the workers follow its steps. A failing
rank must not hang the front end:

* a worker that dies is seen by a watchdog thread within WATCH_S, and the step in flight (or
  the next one) fails with "distributed: rank R exited with code C"; a worker that raised first
  leaves its exception in the rendezvous store (`moectl/error/R`), so the message names it:
  "distributed: rank R failed: ValueError: ... (exit code 1)";
* an error in rank 0's own part of a step's forward (between publishing the step and gathering
  the ranks' figures) leaves the other ranks waiting in a collective that will never come: it
  ends the group too, naming rank 0 and the error. Errors in rank 0's input preparation,
  sampling or postprocess happen while the ranks are in step: they fail only that step's
  requests, as on one process;
* a worker that hangs (stopped, stuck) stops beating its heartbeat in the rendezvous store; after
  STALE_S the watchdog names it and stops it for good, so a collective blocked on it fails at
  once. Compute collectives also time out after RANK_TIMEOUT_S, a backstop long enough for a
  big prefill or an expert migration on a slow machine.

Any failure is final: the group is not used again (every collective after a failed one could
be out of step), and the workers are stopped.

The engine driver then fails every request in flight and reports the error; nothing waits on
the dead rank again.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from moectl.engine.core.config import EngineConfig
from moectl.engine.core.outputs import describe_error
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.models.config import ModelConfig
from moectl.engine.parallel.distributed import (
    DistributedError,
    _init_from_store,
    check_layout,
    default_tp,
    start_rank,
    threads_per_rank,
)

RANK_TIMEOUT_S = 60.0  # a compute collective waiting longer than this fails (the heartbeat is faster)
STARTUP_TIMEOUT_S = 300.0  # every rank must have joined (interpreter, torch, the checkpoint) by then
HEARTBEAT_S = 0.5
STALE_S = 5.0  # a heartbeat older than this names its rank as the one that hangs (and it is stopped)
WATCH_S = 0.2


def _heartbeat(store, rank: int, parent: int) -> None:
    while True:
        if os.getppid() != parent:  # rank 0 is gone: never outlive it
            os._exit(1)
        try:
            store.set(f"moectl/heartbeat/{rank}", repr(time.time()))
        except Exception:  # noqa: BLE001 - the store (rank 0) is gone
            os._exit(1)
        time.sleep(HEARTBEAT_S)


def _report_error(store, rank: int, exc: BaseException) -> None:
    """The exception that ends a worker, for rank 0's watchdog (see _failure_of)."""
    try:
        store.set(f"moectl/error/{rank}", f"{time.time()!r} {describe_error(exc)}")
        store.check([f"moectl/error/{rank}"])  # a round trip: the store has it before this rank exits
    except Exception:  # noqa: BLE001 - the store (rank 0) is gone: nobody to tell
        pass


def _worker(rank: int, world: int, port: int, config: EngineConfig, tp: int | None, num_threads: int | None,
            parent: int) -> None:
    code = 0
    store = None
    try:
        if num_threads:
            torch.set_num_threads(num_threads)
        # the heartbeat's store client is made here, before the process group's: nothing of c10d is
        # constructed from two threads at once
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        store.set(f"moectl/heartbeat/{rank}", repr(time.time()))
        threading.Thread(target=_heartbeat, args=(store, rank, parent), daemon=True).start()
        state = _init_from_store(rank, world, port, config.device, STARTUP_TIMEOUT_S)
        start_rank(config, tp, state, RANK_TIMEOUT_S)  # serves rank 0's steps until it says stop
    except BaseException as exc:  # noqa: BLE001 - rank 0 reports the failure (agreement or watchdog)
        code = 1
        if store is not None:
            _report_error(store, rank, exc)
    os._exit(code)


class RankGroup:
    def __init__(self, config: EngineConfig, nproc: int, tp: int | None = None, num_threads: int | None = None):
        """Spawns ranks 1..nproc-1 and joins them as rank 0 (returns once all are in the group).
        Bad layouts are refused (ValueError) before anything starts."""
        import torch.multiprocessing as mp

        if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
            raise ValueError(f"--nproc: must be a positive integer, got {nproc!r}")
        cfg = ModelConfig.from_dir(config.model, dtype=config.dtype)
        self.tp = default_tp(cfg, nproc) if tp is None else tp
        check_layout(cfg, nproc, self.tp)
        if num_threads is None:
            num_threads = threads_per_rank(config.device, nproc)
        # "auto" becomes the fixed share too: an adaptive rank 0 would count its sibling ranks'
        # work as other processes' and take fewer threads than its share
        keep = isinstance(config.num_threads, int)
        self.config = config if keep else dataclasses.replace(config, num_threads=num_threads)
        self.nproc = nproc
        self.store = dist.TCPStore("127.0.0.1", 0, nproc + 1, True, wait_for_workers=False,
                                   timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
        ctx = mp.get_context("spawn")
        self._spawn = lambda rank: ctx.Process(target=_worker, args=(rank, nproc, self.store.port, self.config,
                                                                     self.tp, num_threads, os.getpid()),
                                               daemon=True, name=f"moectl-rank{rank}")
        self.procs = [self._spawn(r) for r in range(1, nproc)]
        for p in self.procs:
            p.start()
        self.failure: str | None = None
        self._closed = threading.Event()
        self.engine: LLMEngine | None = None
        self.state = None
        try:
            self._await_workers()
            self.state = _init_from_store(0, nproc, self.store.port, config.device, STARTUP_TIMEOUT_S,
                                          export_env=False)
        except BaseException:
            self.close()
            raise
        threading.Thread(target=self._watch, name="moectl-rank-watchdog", daemon=True).start()

    def _await_workers(self) -> None:
        """Until every worker's first heartbeat: a worker that dies while starting is reported
        at once, not after the rendezvous timeout."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        waiting = set(range(1, self.nproc))
        respawned: set[int] = set()
        while waiting:
            for rank in list(waiting):
                p = self.procs[rank - 1]
                if p.exitcode is not None and p.exitcode < 0 and rank not in respawned:
                    # killed by a signal before it said anything (seen once: a crash while the
                    # interpreter and torch load): it joined nothing yet, so start it once more
                    respawned.add(rank)
                    self.procs[rank - 1] = p = self._spawn(rank)
                    p.start()
                elif p.exitcode is not None:
                    raise DistributedError(f"{self._failure_of([rank])} while starting")
                if self.store.check([f"moectl/heartbeat/{rank}"]):
                    waiting.discard(rank)
            if time.monotonic() > deadline:
                raise DistributedError(f"distributed: ranks {sorted(waiting)} did not start in {STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(WATCH_S / 2)

    def make_engine(self) -> LLMEngine:
        """Rank 0's engine (once: a new engine needs a new launch of every rank)."""
        if self.engine is not None:
            raise DistributedError("distributed: the ranks serve one engine; restart the command for a new one")
        self.engine = start_rank(self.config, self.tp, self.state, RANK_TIMEOUT_S)
        self.engine.runner.health = self.engine.experts.cluster.health = self.check
        return self.engine

    # -- failure detection
    def _watch(self) -> None:
        while not self._closed.wait(WATCH_S):
            if self.failure is not None:
                continue
            exited = [rank for rank, p in enumerate(self.procs, start=1) if p.exitcode is not None]
            if exited:
                self.failure = self._failure_of(exited)
            else:
                # only once serving: loading and the start-up exchanges may hold a worker's GIL for long
                stale = self._stale_rank() if self.engine is not None else None
                if stale is not None:
                    self.failure = (f"distributed: rank {stale} stopped responding (no heartbeat for "
                                    f"{STALE_S:.0f} s); it was stopped")
                    self.procs[stale - 1].kill()

    def _failure_of(self, exited: list[int]) -> str:
        """Names the rank that failed first among those that exited: one that left no error
        crashed outright (killed); otherwise the earliest error (the others' are usually the
        lost connection to it)."""
        reports = {}
        for rank in exited:
            reports[rank] = self._error_report(rank)
            if reports[rank] is None:
                return f"distributed: rank {rank} exited with code {self.procs[rank - 1].exitcode}"
        rank = min(reports, key=lambda r: reports[r][0])
        return f"distributed: rank {rank} failed: {reports[rank][1]} (exit code {self.procs[rank - 1].exitcode})"

    def _error_report(self, rank: int) -> tuple[float, str] | None:
        """(when, "Type: message") of the exception that ended worker `rank`, or None."""
        key = f"moectl/error/{rank}"
        try:
            if not self.store.check([key]):
                return None
            when, _, error = self.store.get(key).decode().partition(" ")
            return float(when), error
        except Exception:  # noqa: BLE001 - unreadable: as if it left none
            return None

    def _stale_rank(self) -> int | None:
        now = time.time()
        for rank in range(1, self.nproc):
            try:
                beat = float(self.store.get(f"moectl/heartbeat/{rank}").decode())
            except Exception:  # noqa: BLE001 - no heartbeat yet, or unreadable
                continue
            if now - beat > STALE_S:
                return rank
        return None

    def check(self, error: BaseException | None = None) -> None:
        """Raise DistributedError naming the failed rank: before a step (a rank died while idle)
        or after a collective failed (`error`)."""
        if error is None and self.failure is None:
            return
        if error is not None:
            deadline = time.monotonic() + 1.0  # a dead rank's exit code may take a moment to show
            while self.failure is None and time.monotonic() < deadline:
                time.sleep(WATCH_S / 2)
        if self.failure is None:  # no rank died: rank 0's own part of the step failed, or a collective timed out
            self.failure = f"distributed: rank 0 failed: {describe_error(error)}"
        self._stop_workers()  # the ranks may be out of step now: nothing runs on this group again
        raise DistributedError(self.failure)

    def _stop_workers(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()

    def close(self) -> None:
        self._closed.set()
        if self.engine is not None and self.failure is None:
            try:
                self.engine.runner.shutdown()
            except Exception:  # noqa: BLE001 - a rank already gone: stop the rest below
                pass
        for p in self.procs:
            p.join(5 if self.failure is None else 0.5)
            if p.is_alive():
                p.kill()
                p.join(2)
        if self.state is not None and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
