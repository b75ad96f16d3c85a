"""The engine on its own thread, and the operator actions every front end sends it.

EngineDriver steps an engine on a background thread while it has work and sleeps on the
engine's command queue otherwise, so the console, the server and the recorder never step it
themselves and never wait on it. There is one queue: the engine's own (core/commands.py);
`call(fn)` puts work on it like add_request or update_knobs do.

`act(kind, **args)` is where every operator action is validated, for the console, the CLI and
the server alike: a bad one raises ActionRefused (a ValueError) with a one-line reason at once;
a good one returns a Future that completes on the engine thread.

A step whose model run fails (StepFailed) fails only the requests it scheduled, with the cause
in their output's `error`, and the engine serves on. The engine is given up as failed when it
says so itself (`engine.failure`: MAX_FAILED_STEPS failed steps in a row, or a distributed rank
lost; see core/engine.py) or when anything else in the loop raises (the scheduler, a command,
the feed: its state is unknown). Then every request in flight fails, `error` says why (the
server's /health answers 503 with it), and the engine only runs commands until `restart()`
builds a fresh one from the same factory.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from moectl.engine.core import gc_heap
from moectl.engine.core.config import AutoRebalancePolicy
from moectl.engine.core.outputs import StepFailed, describe_error
from moectl.wire.actions import ACTIONS, Action, ActionRefused, action
from moectl.wire.interfaces import Engine
from moectl.wire.records import RECORD_BUFFER

__all__ = ["RECORD_BUFFER", "ActionRefused", "EngineDriver", "done"]  # ActionRefused: wire/actions.py

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.005  # an idle engine looks for new work this often (a command wakes it at once)


def done(result) -> Future:
    future: Future = Future()
    future.set_result(result)
    return future


class EngineDriver:
    def __init__(self, make_engine: Callable[[], Engine], *, feed: Callable | None = None, buffer_records: bool = True,
                 start: bool = True, name: str = "moectl-engine"):
        """make_engine(): a fresh engine (also used by restart). feed(engine): called on the engine
        thread before every step, to add requests that are due (a workload). buffer_records: keep
        step and action records for poll(). start=False: call start() once listeners are attached."""
        self._make_engine = make_engine
        self.feed = feed
        self._buffer = buffer_records
        self._records: deque = deque(maxlen=RECORD_BUFFER)
        self._actions: deque = deque(maxlen=RECORD_BUFFER)
        self._stop = threading.Event()
        self._error: str | None = None
        self._refreeze = False  # a restart asks the loop to freeze the heap again (gc_heap)
        self.engine: Engine = make_engine()
        self._attach(self.engine)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        if start:
            self.start()

    def start(self) -> EngineDriver:
        self._thread.start()
        return self

    def _attach(self, engine: Engine) -> None:
        if self._buffer:
            engine.add_listener(on_step=lambda stats: self._records.append(stats.as_record()),
                                on_action=self._actions.append)

    @property
    def error(self) -> str | None:
        """Why the engine stopped serving (None while it serves); the engine's own `failure` is
        seen at once, before this thread has failed the rest of its requests."""
        return self._error if self._error is not None else self.engine.failure

    # -- the engine thread
    def _loop(self) -> None:
        while not self._stop.is_set():
            engine = self.engine
            if self._refreeze:  # after a restart: the old engine, unreferenced now, is collected, not frozen
                self._refreeze = False
                gc_heap.engine_built()
            if self._error is not None:  # only commands (a restart) until someone restarts it;
                _fail_requests(engine, self._error)  # a request that still arrives fails at once
                engine.commands.ready.wait(0.05)
                continue
            try:
                if self.feed is not None:
                    self.feed(engine)
                if engine.has_unfinished():
                    engine.step()
                else:
                    engine.commands.ready.wait(IDLE_WAIT_S)
            except StepFailed as exc:  # its requests have failed; the engine serves on unless broken
                log.warning("%s", exc)  # one line where commands print warnings; the traceback at debug
                log.debug("the failed step's traceback", exc_info=exc.__cause__)
                if exc.failure is not None:
                    self._give_up(engine, exc.failure)
            except Exception as exc:  # noqa: BLE001 - reported through `error`; restart() recovers
                self._give_up(engine, describe_error(exc))

    def _give_up(self, engine, error: str) -> None:
        """The engine failed: `error` says why; every request in flight fails with it."""
        self._error = error
        _fail_requests(engine, error)

    # -- any thread
    def call(self, fn: Callable, kind: str = "call") -> Future:
        """fn() on the engine thread between steps."""
        return self.engine.submit(fn, kind)

    def poll(self) -> tuple[list[dict], list[dict]]:
        """The step and action records that arrived since the last call."""
        records = [self._records.popleft() for _ in range(len(self._records))]
        actions = [self._actions.popleft() for _ in range(len(self._actions))]
        return records, actions

    def restart(self) -> Future:
        """A fresh engine from the same factory (after a failure); same listeners' buffers."""
        def swap() -> dict:
            engine = self._make_engine()
            self._attach(engine)
            _release(self.engine)
            self.engine = engine
            self._refreeze = True  # by the loop, once no frame holds the old engine (see _loop)
            self._error = None
            return {"restarted": True}
        return self.call(swap, Action.RESTART)

    def act(self, kind: str, **args) -> Future:
        """An operator action. Validated now (ActionRefused); carried out between steps."""
        engine = self.engine
        try:
            kind = action(kind)
            if kind is Action.WORKLOAD:
                raise ActionRefused("workload: this engine has no demo workload")
            if kind is Action.KNOBS:
                engine.update_knobs(**args)
                return done({"knobs": args})
            if kind is Action.CAPTURE:
                return engine.capture(_int_arg(args, "steps", 1))
            if kind is Action.RESTART:
                return self.restart()
            experts = engine.experts
            if ACTIONS[kind].needs_devices and experts is None:
                raise ActionRefused(f"{kind}: this engine runs without devices (start with --devices N)")
            if kind is Action.REBALANCE_PREVIEW:
                return self.call(experts.preview, kind)
            if kind is Action.REBALANCE_APPLY:
                plan = args.get("plan")
                if plan is None:
                    raise ActionRefused("rebalance_apply: preview a plan first")
                # completes when the copy has run (or failed): its measured bytes and seconds
                return experts.apply(plan.placement, kind=kind, predicted=plan.prediction)
            if kind is Action.AUTO_REBALANCE:
                policy = AutoRebalancePolicy(mode="auto" if args.get("enabled") else "manual",
                                             every_k_steps=_int_arg(args, "every_k_steps", 0),
                                             threshold=args.get("threshold"), target=args.get("target"),
                                             min_gain=args.get("min_gain", 0.03),
                                             objective=args.get("objective", "step_time"))
                return experts.set_auto(policy)
            args = dict(args)
            return done({"placement": experts.edit(args.pop("edit", None), **args)})
        except ActionRefused:
            raise
        except (ValueError, KeyError) as exc:  # KnobError, PlacementError, ...: one line, named field
            prefix = "auto rebalance: " if kind == Action.AUTO_REBALANCE else ""
            raise ActionRefused(prefix + (str(exc).splitlines()[0] if str(exc) else kind)) from None

    def close(self) -> None:
        self._stop.set()
        self.engine.commands.ready.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        _release(self.engine)


def _fail_requests(engine, error: str) -> None:
    """Runs the engine's commands (a restart among them), then fails every request it holds."""
    try:
        engine.fail_all("error", error)
    except Exception:  # noqa: BLE001 - a broken engine's bookkeeping: its commands have run
        pass


def _release(engine) -> None:
    """What an engine holds beyond its memory: the NVML sampler's thread (engines sit in
    reference cycles, so waiting for the collector would leave it running after a restart)."""
    sampler = getattr(getattr(engine, "telemetry", None), "gpu", None)
    if sampler is not None:
        sampler.close()


def _int_arg(args: dict, name: str, default: int) -> int:
    value = args.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ActionRefused(f"{name}: must be an integer, got {value!r}")
    return value
