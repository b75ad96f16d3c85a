"""Always-on spans: per step and per layer, where the time went.

The hot path is one clock read to open a span and a list append to close it; turning the
rows into the record's arrays happens once per step, after the forward pass. On CUDA a span is
a pair of timing events recorded on the stream that runs the work and resolved at the end of
the step (one synchronisation per step, none per span).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from moectl.wire.records import lanes_for

_now = time.monotonic  # the engine clock: step and request times use it too


class SpanRecorder:
    """The tracer of moectl.engine.models.tracing, recording."""

    enabled = True

    def __init__(self, num_devices: int, cuda: bool = False):
        self.lanes = lanes_for(num_devices)
        self.lane_index = {name: i for i, name in enumerate(self.lanes)}
        self.cuda = cuda
        self._names: dict[str, int] = {}
        self._rows: list[tuple] = []  # (lane, name id, layer, start, end), measured
        self._events: list[tuple] = []  # CUDA: (lane, name id, layer, start event, end event)
        self._blocks: list[tuple] = []  # modeled: (lanes, name id, layers, starts, ends), arrays
        self.t0 = 0.0
        self._t0_event = None

    def _name(self, name: str) -> int:
        index = self._names.get(name)
        if index is None:
            index = self._names[name] = len(self._names)
        return index

    def begin_step(self, t0: float | None = None) -> None:
        """t0: the step's start on the engine clock (span times are offsets from it)."""
        self._rows.clear()
        self._events.clear()
        self._blocks.clear()
        self.t0 = _now() if t0 is None else t0
        if self.cuda:
            self._t0_event = torch.cuda.Event(enable_timing=True)
            self._t0_event.record()

    def mark(self):
        """Opens a span: a perf_counter time, or on CUDA an event recorded on the current stream."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return _now()

    def close(self, mark, name: str, lane: int = 0, layer: int = -1) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((lane, self._name(name), layer, mark, end))
        else:
            self._rows.append((lane, self._name(name), layer, mark, _now()))

    def add_measured(self, name: str, lane: int, layer: int, start: float, end: float) -> None:
        """A span timed by someone else on the perf_counter clock (e.g. a device's busy time)."""
        self._rows.append((lane, self._name(name), layer, start, end))

    def add_modeled(self, name: str, lanes: np.ndarray, layers: np.ndarray, starts: np.ndarray,
                    seconds: np.ndarray) -> None:
        """Spans whose lengths are modeled (link time from bytes and bandwidth), flagged so: a
        whole step's of one name at once, as arrays (no Python loop per span)."""
        self._blocks.append((lanes, self._name(name), layers, starts, starts + seconds))

    def collect(self) -> dict:
        """The step's spans as the record's columns, times relative to begin_step: one [spans, 5]
        float array filled in place (the closed rows in one conversion, each modeled block by
        slices), then cut into columns."""
        rows = self._rows
        if self._events:
            rows = list(rows)
            self._events[-1][4].synchronize()
            for lane, name, layer, start, end in self._events:
                begin = self._t0_event.elapsed_time(start) / 1e3 + self.t0
                rows.append((lane, name, layer, begin, begin + start.elapsed_time(end) / 1e3))
        names = sorted(self._names, key=self._names.get)
        measured = len(rows)
        table = np.empty((measured + sum(len(block[0]) for block in self._blocks), 5))
        if measured:
            table[:measured] = rows
        at = measured
        for lanes, name_id, layers, starts, ends in self._blocks:
            end = at + len(lanes)
            block = table[at:end]
            block[:, 0], block[:, 1], block[:, 2], block[:, 3], block[:, 4] = lanes, name_id, layers, starts, ends
            at = end
        lane, name, layer = table[:, :3].T.astype(np.int16, order="C")  # each column contiguous
        start_s = table[:, 3] - self.t0
        modeled = np.zeros(len(table), dtype=bool)
        modeled[measured:] = True
        return {"lanes": self.lanes, "names": names, "lane": lane, "name": name, "layer": layer,
                "start_s": start_s, "dur_s": table[:, 4] - self.t0 - start_s, "modeled": modeled}
