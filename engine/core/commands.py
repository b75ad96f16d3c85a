"""The engine's one inbox: work handed over by other threads, run on the engine thread.

Requests, aborts, knob changes, placements, captures and a driver's own calls all arrive here
as callables. They are validated by whoever submits them (so a bad one is refused at once, on
the caller's thread) and run in order at the start of the next step, so the step loop owns all
engine state. Each returns its result, or its exception, through a Future.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class CommandQueue:
    def __init__(self):
        self._lock = threading.Lock()
        self._items: list[tuple[str, Callable[[], Any], Future]] = []
        self.ready = threading.Event()  # set while commands wait: an idle driver wakes on it

    def submit(self, fn: Callable[[], Any], kind: str = "call") -> Future:
        """`kind` names the command in the "<kind>_failed" action recorded if it raises."""
        future: Future = Future()
        with self._lock:
            self._items.append((kind, fn, future))
            self.ready.set()
        return future

    def take(self) -> list[tuple[str, Callable[[], Any], Future]]:
        with self._lock:
            items, self._items = self._items, []
            self.ready.clear()
        return items

    def run(self, on_failure) -> None:
        """Runs every waiting command on the calling (engine) thread, each result or exception in
        its Future; on_failure(kind, exc) hears of each that raised (the engine records it)."""
        for kind, fn, future in self.take():
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - one bad command must not lose the others
                future.set_exception(exc)
                on_failure(kind, exc)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
