"""Always-on spans: per step and per layer, where the time went.

The hot path is one clock read to open a span and, to close it, three stores into preallocated
arrays reused across steps (a key for its lane, name and layer, its start, its end): turning
them into the record's columns at the end of the step is a few array operations, with no list
of rows to convert. On CUDA a span is a pair of timing events recorded on the stream that runs
the work and resolved at the end of the step (one synchronisation per step, none per span).
The local backend's modeled link spans are not built here: the step carries their traffic
(spans["links"], moectl.wire.link_spans) and readers derive them.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from moectl.wire.link_spans import LINKS
from moectl.wire.records import lanes_for

_now = time.monotonic  # the engine clock: step and request times use it too
_CAPACITY = 256  # spans per step before the arrays first grow (a step of the sample model: ~40)


class SpanRecorder:
    """The tracer of moectl.engine.models.tracing, recording."""

    enabled = True

    def __init__(self, num_devices: int, cuda: bool = False):
        self.lanes = lanes_for(num_devices)
        self.lane_index = {name: i for i, name in enumerate(self.lanes)}
        self.cuda = cuda
        self._names: dict[str, int] = {}
        # a span's (name, lane, layer) as one key: one dict lookup and one store per close
        self._keys: dict[tuple, int] = {}
        self._key_columns = np.zeros((3, 0), dtype=np.int16)  # lane, name, layer of each key
        self._n = 0  # spans closed this step
        self._key = np.zeros(_CAPACITY, dtype=np.int32)
        self._start = np.zeros(_CAPACITY)
        self._end = np.zeros(_CAPACITY)
        self._events: list[tuple] = []  # CUDA: (key, start event, end event)
        self._blocks: list[tuple] = []  # modeled: (lanes, name id, layers, starts, ends), arrays
        self._links: dict | None = None  # the link traffic readers derive modeled spans from
        self.t0 = 0.0
        self._t0_event = None

    def _key_of(self, name: str, lane: int, layer: int) -> int:
        """A new kind of span's key and its columns: once per (name, lane, layer), not per step."""
        key = self._keys[(name, lane, layer)] = len(self._keys)
        self._key_columns = np.concatenate(
            (self._key_columns, np.array([[lane], [self._name(name)], [layer]], dtype=np.int16)), axis=1)
        return key

    def _name(self, name: str) -> int:
        index = self._names.get(name)
        if index is None:
            index = self._names[name] = len(self._names)
        return index

    def _grow(self) -> None:
        """Twice the room, keeping what this step closed (a step with more spans than ever before)."""
        size = 2 * len(self._key)
        self._key = np.resize(self._key, size)
        self._start = np.resize(self._start, size)
        self._end = np.resize(self._end, size)

    def begin_step(self, t0: float | None = None) -> None:
        """t0: the step's start on the engine clock (span times are offsets from it)."""
        self._n = 0
        self._events.clear()
        self._blocks.clear()
        self._links = None
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
        key = self._keys.get((name, lane, layer))
        if key is None:
            key = self._key_of(name, lane, layer)
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((key, mark, end))
        else:
            self._put(key, mark, _now())

    def _put(self, key: int, start: float, end: float) -> None:
        i = self._n
        try:  # the key's store fails first when full: nothing is half-written
            self._key[i] = key
        except IndexError:
            self._grow()
            self._key[i] = key
        self._start[i] = start
        self._end[i] = end
        self._n = i + 1

    def add_measured(self, name: str, lane: int, layer: int, start: float, end: float) -> None:
        """A span timed by someone else on the perf_counter clock (e.g. a device's busy time)."""
        key = self._keys.get((name, lane, layer))
        if key is None:
            key = self._key_of(name, lane, layer)
        self._put(key, start, end)

    def add_modeled(self, name: str, lanes: np.ndarray, layers: np.ndarray, starts: np.ndarray,
                    seconds: np.ndarray) -> None:
        """Spans whose lengths are modeled, flagged so: a whole step's of one name at once, as
        arrays (no Python loop per span)."""
        self._blocks.append((lanes, self._name(name), layers, starts, starts + seconds))

    def add_links(self, links: dict) -> None:
        """The step's link traffic (moectl.wire.link_spans): readers derive its modeled spans."""
        self._links = links

    def collect(self) -> dict:
        """The step's spans as the record's columns, times relative to begin_step: slices of the
        step's arrays taken through the keys' columns, then any modeled blocks appended."""
        if self._events:
            self._resolve_events()
        n = self._n
        lane, name, layer = self._key_columns[:, self._key[:n]]  # a copy: the arrays are reused
        start = self._start[:n]
        start_s = start - self.t0
        dur_s = self._end[:n] - start
        spans = {"lanes": self.lanes, "names": list(self._names), "lane": lane, "name": name,  # names: in id order
                 "layer": layer, "start_s": start_s, "dur_s": dur_s, "modeled": np.zeros(n, dtype=bool)}
        if self._blocks:
            self._append_blocks(spans)
        if self._links is not None:
            spans[LINKS] = self._links
        return spans

    def _resolve_events(self) -> None:
        """CUDA: the step's events into the arrays, on the engine clock (one synchronisation)."""
        events, self._events = self._events, []
        events[-1][2].synchronize()
        for key, start, end in events:
            begin = self._t0_event.elapsed_time(start) / 1e3 + self.t0
            self._put(key, begin, begin + start.elapsed_time(end) / 1e3)

    def _append_blocks(self, spans: dict) -> None:
        for lanes, name_id, layers, starts, ends in self._blocks:
            count = len(lanes)
            for key, values in (("lane", lanes), ("name", np.full(count, name_id)), ("layer", layers)):
                spans[key] = np.concatenate((spans[key], np.asarray(values, dtype=np.int16)))
            spans["start_s"] = np.concatenate((spans["start_s"], starts - self.t0))
            spans["dur_s"] = np.concatenate((spans["dur_s"], ends - starts))
            spans["modeled"] = np.concatenate((spans["modeled"], np.ones(count, dtype=bool)))
