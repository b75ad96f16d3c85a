"""PyTorch-profiler (Kineto) traces, as torch.profiler, vLLM and SGLang write them: read as a
stream, classed by rules kept as data (kernel_classes.json), and summed per rank.

A trace is Chrome trace-event JSON (`.json` or `.json.gz`), one file per rank, or a folder of
them: {"distributedInfo": {"rank", ...}, "traceEvents": [{"ph": "X", "cat", "name", "pid",
"tid", "ts" (us), "dur" (us), "args"}, ...]}; other keys and fields are ignored. ijson parses
the events one at a time, so a 1 GB trace never sits in memory; only the complete ("X") events
of the device (cat kernel, gpu_memcpy, gpu_memset) are kept, as (lane, class, name, start,
duration) arrays. A trace without device events (a CPU run) is read on its CPU ops instead: the
outermost cpu_op of each thread, the ops a CPU engine's time goes to.

Layers, where the trace's annotations allow: a CPU range (python_function or user_annotation)
whose name a layer pattern of the rules matches ("nn.Module: DeepseekV2DecoderLayer_3", as
torch.profiler names a module with with_stack; "layers.3" of a record_function)
marks its thread's time as that layer's. A kernel takes the layer of the instant its launch
(the cuda_runtime event of the same correlation id) ran on the CPU; a CPU op the layer of its own
start. Kernels replayed from a CUDA graph share one launch outside every layer, so they stay
unattributed.

Per rank (`rank_figures`), on the rank's device lanes (streams):
* breakdown: each class's summed event time, seconds;
* idle_s: the span from the first event's start to the last one's end that no event covers;
* overlap: as Holistic Trace Analysis defines its communication-computation overlap, the time a
  communication event (class dispatch_combine) runs while a computation event does (any other
  class but memcpy_memset), over the communication time;
* unclassed: event names no rule matched, by their summed time.
Across ranks the straggler is the rank with the most busy device time (the others wait for it at
every collective).

Limits, each a one-line error naming the file. On the bytes as they stream in (_Bounded): JSON
nested deeper than MAX_DEPTH levels (a profiler's traces nest a few; ijson's memory grows with the
square of the depth) and any string longer than MAX_STRING_BYTES (kernel names run to a few KiB;
reading one of tens of MiB took minutes). On each event kept (see above): a ts or dur that is not
a finite number, a negative dur, an args.correlation that is not an integer id (the figures would
be wrong, or not numbers at all). A name's class is decided on its first CLASSIFIED_CHARS
characters.
"""

from __future__ import annotations

import gzip
import itertools
import json
import math
import re
from array import array
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
COMM, MEMORY = "dispatch_combine", "memcpy_memset"
UNCLASSED = "unclassed"
MAX_DEPTH = 32  # JSON nesting: Kineto's deepest, an event's args holding lists of input shapes, is 6 or 7
MAX_STRING_BYTES = 1 << 20  # any JSON string: kernel names run to a few KiB
READ_BYTES = 1 << 16  # what ijson is handed at a time
MAX_ID = 2**63 - 1  # correlation ids are int64 columns
# a name's class is decided on its start (namespace, function, template arguments): a pattern
# searched in a whole name of MAX_STRING_BYTES takes a second, per distinct name
CLASSIFIED_CHARS = 16 << 10


class KinetoError(ValueError):
    """A file that is not a readable Kineto / Chrome trace; the message says which and why."""


_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')  # translate() deletes these
_NESTING = np.zeros(256, dtype=np.int8)
_NESTING[list(b"[{")], _NESTING[list(b"]}")] = 1, -1
_QUOTE = ord('"')
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a whole JSON string, escapes and all
_STRING_BODY = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*')  # up to a string's closing quote (or a lone \)


class _Bounded:
    """A binary file, read for ijson, that refuses JSON nested deeper than MAX_DEPTH or holding a
    string longer than MAX_STRING_BYTES before ijson sees the bytes: ijson keeps a path prefix
    per level ("traceEvents.item.item...") whose length grows with the depth, and assembles a
    string whole. Brackets count outside strings only; a chunk holding an escaped quote, or
    ending on a backslash, takes the exact (slower) regular-expression path."""

    def __init__(self, f, path: Path):
        self.f, self.path = f, path
        self.depth = 0
        self.in_string = False  # the last chunk ended inside a string
        self.escaped = False  # ... on a backslash, which escapes this chunk's first byte
        self.string_bytes = 0  # of the string still open
        self.offset = 0  # of the chunk being read, in the (decompressed) stream
        self.size = 0  # of that chunk

    def read(self, size: int = -1) -> bytes:
        most = min(READ_BYTES, MAX_STRING_BYTES)  # a longer string then always spans chunks, where it is counted
        chunk = self.f.read(most if size is None or size < 0 else min(size, most))
        self.size = len(chunk)
        if self.escaped or b'\\"' in chunk or chunk.endswith(b"\\"):
            self._nesting(self._outside_strings(chunk), inside=False)
        else:
            inside = self.in_string
            if inside:  # the open string runs to the first quote
                first = chunk.find(b'"')
                self._string(first if first >= 0 else len(chunk))
            quotes = chunk.count(b'"')
            self.in_string = (quotes + inside) % 2 == 1  # a string is left open at the end
            if self.in_string and quotes:  # one that opened at the chunk's last quote
                self.string_bytes = 0
                self._string(len(chunk) - chunk.rfind(b'"') - 1)
            self._nesting(chunk.translate(None, _NOT_STRUCTURE), inside)
        self.offset += len(chunk)
        return chunk

    def _where(self) -> str:
        return f"within bytes {self.offset:,}-{self.offset + self.size:,}"

    def _string(self, more: int) -> None:
        self.string_bytes += more
        if self.string_bytes > MAX_STRING_BYTES:
            raise KinetoError(f"{self.path}: a JSON string longer than {MAX_STRING_BYTES >> 20} MiB ({self._where()}):"
                              f" not a trace a profiler writes (kernel names run to a few KiB)")

    def _nesting(self, marks: bytes, inside: bool) -> None:
        """The nesting after a chunk's quotes and brackets (in order; `inside`: the first is in a
        string), refused past MAX_DEPTH."""
        if not marks:
            return
        mark = np.frombuffer(marks, dtype=np.uint8)
        quote = mark == _QUOTE
        in_string = (np.cumsum(quote, dtype=np.int64) + inside) % 2 == 1  # a quote steps 0 either way
        levels = np.cumsum(np.where(in_string, 0, _NESTING[mark]), dtype=np.int64) + self.depth
        if levels.max() > MAX_DEPTH:
            raise KinetoError(f"{self.path}: JSON nested more than {MAX_DEPTH} levels deep ({self._where()}): "
                              f"not a trace a profiler writes (they nest a few levels)")
        self.depth = int(levels[-1])

    def _outside_strings(self, chunk: bytes) -> bytes:
        """The chunk's bytes outside strings (escapes followed), the open string carried over."""
        start = 0
        if self.in_string:
            start = 1 if self.escaped else 0
            end = _STRING_BODY.match(chunk, start).end()
            if end < len(chunk) and chunk[end] == _QUOTE:  # the open string closes here
                self._string(end)
                self.in_string, self.escaped, start = False, False, end + 1
            else:
                self._string(len(chunk))
                self.escaped = end < len(chunk)  # stopped at a lone backslash, the chunk's last byte
                return b""
        outside = _STRING.sub(b"", chunk[start:])
        opened = outside.find(b'"')  # a string left open: it runs to the end of the chunk
        if opened >= 0:
            tail = outside[opened + 1:]
            self.in_string, self.string_bytes = True, 0
            self.escaped = _STRING_BODY.match(tail).end() < len(tail)
            self._string(len(tail))
            outside = outside[:opened]
        return outside


@dataclass
class Rules:
    """Ordered (class, compiled pattern) rules: the first match classes a name."""
    rules: list[tuple[str, re.Pattern]]
    layer_patterns: list[re.Pattern] = field(default_factory=list)  # group 1: the layer's index
    _cache: dict = field(default_factory=dict)
    _layer_cache: dict = field(default_factory=dict)

    @classmethod
    def load(cls, extra: Path | None = None, shipped_file: str = "kernel_classes.json") -> Rules:
        """The shipped rules (`shipped_file`, of profiler/), after a user's file of the same form
        (its rules first)."""
        shipped = json.loads(resources.files("moectl.profiler").joinpath(shipped_file).read_text())
        raw, layers = list(shipped["rules"]), list(shipped.get("layer_patterns") or ())
        if extra is not None:
            try:
                user = json.loads(Path(extra).read_text())
                raw = list(user["rules"]) + raw
                layers = list(user.get("layer_patterns") or ()) + layers
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise KinetoError(f"--rules: {extra}: not a rules file ({{\"rules\": [{{\"class\", \"pattern\"}}]}}): "
                                  f"{exc}") from None
        try:
            layer_patterns = [re.compile(str(p)) for p in layers]
            if any(p.groups < 1 for p in layer_patterns):
                raise re.error("a layer pattern needs a group for the layer's index")
            return cls([(str(r["class"]), re.compile(str(r["pattern"]), re.IGNORECASE)) for r in raw], layer_patterns)
        except (KeyError, TypeError, re.error) as exc:
            raise KinetoError(f"--rules: a rule needs a class and a valid pattern: {exc}") from None

    def classify(self, name: str) -> str:
        found = self._cache.get(name)
        if found is None:
            found = self._cache[name] = next((c for c, p in self.rules if p.search(name, 0, CLASSIFIED_CHARS)),
                                             UNCLASSED)
        return found

    def layer_of(self, name: str) -> int:
        """The layer a CPU range's name marks, or -1."""
        found = self._layer_cache.get(name)
        if found is None:
            match = next((m for m in (p.search(name) for p in self.layer_patterns) if m), None)
            index = match.group(1) if match else None  # None too where the group is optional
            found = int(index) if index and index.isdigit() else -1
            if len(self._layer_cache) < 1 << 16:  # python_function names carry addresses: bound it
                self._layer_cache[name] = found
        return found


@dataclass
class RankTrace:
    """One rank's device events: lanes, the distinct names and their classes, and per event its
    lane, name id, start and duration (s): columns, so millions of events stay small."""
    path: Path
    rank: int | None
    lanes: list[str]
    source: str  # "device" (kernels, copies) or "cpu_ops" (a CPU run's outermost ops)
    lane: np.ndarray  # per event
    name_id: np.ndarray  # per event, into names
    names: list[str]  # distinct event names
    classes: list[str]  # each distinct name's class
    start: np.ndarray
    dur: np.ndarray
    layer: np.ndarray  # per event: the layer its annotations place it in, -1 where none do
    # whole seconds on the trace's clock that `start` counts from: an epoch-based clock (1.7e9 s)
    # would leave a float64 second a quarter of a microsecond, and ranks align on these
    origin_s: float = 0.0


def trace_files(path: Path) -> list[Path]:
    """A trace file, or a folder's .json / .json.gz files (one per rank), sorted."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.name.endswith((".json", ".json.gz")))
        if not files:
            raise KinetoError(f"{path}: holds no .json or .json.gz trace")
        return files
    if not path.is_file():
        raise KinetoError(f"{path}: no such file or folder")
    return [path]


def is_kineto(path: Path) -> bool:
    """A .json / .json.gz file, or a folder holding one (an empty folder is no trace of either kind)."""
    path = Path(path)
    if path.is_dir():
        return any(p.name.endswith((".json", ".json.gz")) for p in path.iterdir())
    return path.name.endswith((".json", ".json.gz"))


def _first_byte(path: Path) -> bytes:
    try:
        with (gzip.open if path.name.endswith(".gz") else open)(path, "rb") as f:
            return f.read(4096).lstrip()[:1]
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise KinetoError(f"{path}: cannot read it ({exc})") from None


def looks_like_trace(path: Path) -> bool:
    """A Chrome trace by its first bytes (not its name: a saved vLLM EplbState is a .json too):
    {"traceEvents": ...} (Kineto writes a few header keys first) or an array of events."""
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.name.endswith((".json", ".json.gz"))) if path.is_dir() else [path]
    for file in files[:4]:  # a folder's stray metadata .json does not decide it
        try:
            with (gzip.open if file.name.endswith(".gz") else open)(file, "rb") as f:
                head = f.read(1 << 20).lstrip()
        except (OSError, EOFError, gzip.BadGzipFile):
            continue
        if (head[:1] == b"{" and b'"traceEvents"' in head) or (head[:1] == b"[" and b'"ph"' in head):
            return True
    return False


def _rank_from_name(name: str) -> int | None:
    m = re.search(r"(?:rank|tp|dp|ep)[-_]?(\d+)", name, re.IGNORECASE)
    return int(m.group(1)) if m else None


RUNTIME_CATS = frozenset({"cuda_runtime", "cuda_driver"})  # where a kernel's launch sits on the CPU
RANGE_CATS = frozenset({"python_function", "user_annotation"})  # where a layer's annotation can be
READ_CATS = DEVICE_CATS | RUNTIME_CATS | RANGE_CATS | {"cpu_op"}  # every other event is skipped unread


def read_rank(path: Path, rules: Rules) -> RankTrace:
    import ijson

    opener = gzip.open if path.name.endswith(".gz") else open
    # compact columns, names and lanes interned: a 1 GB trace's millions of events stay small
    names: dict[str, int] = {}
    lanes_seen: dict[str, int] = {}
    device = (array("i"), array("i"), array("d"), array("d"))  # lane, name, start, dur
    correlation = array("q")  # per device event, its launch's id (-1: none)
    cpu = (array("i"), array("i"), array("d"), array("d"))  # the same for CPU ops, dropped if the device has events
    threads: dict[str, int] = {}  # CPU threads: the CPU ops' lanes, launches' and layer ranges' threads
    launches = (array("q"), array("i"), array("d"))  # correlation id, thread, start
    ranges = (array("i"), array("i"), array("d"), array("d"))  # thread, layer, start, dur
    rank = None
    array_form = _first_byte(path) == b"["  # Chrome's JSON Array Format: events only, no header keys
    try:  # the rank, from the header keys before the events (Kineto writes distributedInfo first)
        with opener(path, "rb") as f:
            for prefix, event, value in ([] if array_form else ijson.parse(_Bounded(f, path), use_float=True)):
                if prefix == "distributedInfo.rank" and event == "number":
                    rank = _rank(value, path)
                if prefix == "traceEvents":
                    break
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise KinetoError(f"{path}: cannot read it ({exc})") from None
    except ijson.JSONError as exc:
        raise KinetoError(f"{path}: not valid trace JSON ({str(exc).splitlines()[0]})") from None
    events_at = "item" if array_form else "traceEvents.item"
    try:
        with opener(path, "rb") as f:
            for item in ijson.items(_Bounded(f, path), events_at, use_float=True):
                if not isinstance(item, dict) or item.get("ph") != "X":
                    continue
                cat = str(item.get("cat") or "")
                if cat not in READ_CATS:
                    continue
                try:  # start in microseconds as written: seconds once the origin is known
                    ts, dur = float(item["ts"]), float(item.get("dur") or 0) * 1e-6
                except KeyError:
                    continue  # no start: nowhere to place it
                except (TypeError, ValueError):
                    raise KinetoError(_bad_time(path, item)) from None
                if not (-math.inf < ts < math.inf and 0.0 <= dur < math.inf):  # NaN fails every comparison
                    raise KinetoError(_bad_time(path, item))
                name = str(item.get("name") or "?")
                if cat in DEVICE_CATS:
                    lane = lanes_seen.setdefault(f"{item.get('pid', '?')}/stream {item.get('tid', '?')}", len(lanes_seen))
                    for column, value in zip(device, (lane, names.setdefault(name, len(names)), ts, dur)):
                        column.append(value)
                    correlation.append(_correlation(item, path))
                elif cat in RUNTIME_CATS:
                    corr = _correlation(item, path)
                    if corr >= 0:
                        thread = threads.setdefault(f"{item.get('pid', '?')}/thread {item.get('tid', '?')}", len(threads))
                        for column, value in zip(launches, (corr, thread, ts)):
                            column.append(value)
                elif cat in RANGE_CATS:
                    layer = rules.layer_of(name)
                    if layer >= 0:
                        thread = threads.setdefault(f"{item.get('pid', '?')}/thread {item.get('tid', '?')}", len(threads))
                        for column, value in zip(ranges, (thread, layer, ts, dur)):
                            column.append(value)
                elif cat == "cpu_op" and not device[0]:  # a CPU run's ops: only while no device event came
                    thread = threads.setdefault(f"{item.get('pid', '?')}/thread {item.get('tid', '?')}", len(threads))
                    for column, value in zip(cpu, (thread, names.setdefault(name, len(names)), ts, dur)):
                        column.append(value)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise KinetoError(f"{path}: cannot read it ({exc})") from None
    except ijson.JSONError as exc:
        raise KinetoError(f"{path}: not valid trace JSON ({str(exc).splitlines()[0]})") from None
    rank = rank if rank is not None else _rank_from_name(path.name)
    lane, name_id, start, dur = (_column(c) for c in (device if device[0] else cpu))
    if not len(lane):
        raise KinetoError(f"{path}: no complete events (ph X) of a device or of CPU ops: not a Kineto trace")
    # times from the whole second before the first event: converting an epoch clock's microseconds
    # (1.7e15, parsed as float64 to a quarter of a microsecond) to seconds adds no further rounding
    # that way, and ranks align on these origins
    origin_us = math.floor(float(start.min()) / 1e6) * 1e6
    start = (start - origin_us) * 1e-6
    range_cols = [_column(c) for c in ranges]
    range_cols[2] = (range_cols[2] - origin_us) * 1e-6
    launch_cols = [_column(c) for c in launches]
    launch_cols[2] = (launch_cols[2] - origin_us) * 1e-6
    layer_at = _LayerRanges(*range_cols)
    if device[0]:
        source, lanes = "device", list(lanes_seen)
        layer = layer_at.of_launches(_column(correlation), *launch_cols)
    else:
        source, lanes = "cpu_ops", list(threads)
        keep = _outermost(lane, start, dur)
        lane, name_id, start, dur = lane[keep], name_id[keep], start[keep], dur[keep]
        layer = layer_at(lane, start)
        # only the threads that ran ops are lanes (a thread may hold only launches or ranges)
        used = np.unique(lane)
        lane = np.searchsorted(used, lane).astype(np.int32)
        lanes = [lanes[i] for i in used]
    by_id = list(names)
    return RankTrace(path, rank, lanes, source, lane, name_id, by_id, [rules.classify(n) for n in by_id],
                     start, dur, layer, origin_us * 1e-6)


def _correlation(item: dict, path: Path) -> int:
    """The event's args.correlation (its launch's id), -1 where it has none."""
    args = item.get("args")
    value = args.get("correlation") if isinstance(args, dict) else None
    if value is None:
        return -1
    whole = _whole(value)
    if whole is None or not -MAX_ID - 1 <= whole <= MAX_ID:
        raise KinetoError(f"{path}: event {_short(item.get('name'))} has args.correlation {_short(value)}: not an "
                          f"id (an integer of at most {MAX_ID})")
    return max(whole, -1)


def _rank(value, path: Path) -> int:
    whole = _whole(value)
    if whole is None or not 0 <= whole <= MAX_ID:
        raise KinetoError(f"{path}: distributedInfo.rank {_short(value)} is not a rank (an integer >= 0)")
    return whole


def _whole(value) -> int | None:
    """A JSON number that is an integer (1.0 too), else None (1.5, inf, "1", true)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    return value


def _bad_time(path: Path, item: dict) -> str:
    """What is wrong with a kept event's ts or dur, in words."""
    try:
        ts_ok = math.isfinite(float(item["ts"]))
    except (TypeError, ValueError):
        ts_ok = False
    key, what = ("dur", "a finite number >= 0") if ts_ok else ("ts", "a finite number")
    return (f"{path}: event {_short(item.get('name'))} (cat {item.get('cat')}) has {key} {_short(item.get(key))}: "
            f"not a time in microseconds ({what})")


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _column(c: array) -> np.ndarray:
    return np.frombuffer(c, dtype={"i": np.int32, "q": np.int64, "d": np.float64}[c.typecode]).copy()


class _LayerRanges:
    """The layer ranges of a trace's CPU threads: the outermost per thread (a layer's range nested
    in another is the same layer's part), so a thread's ranges are disjoint and one binary search
    finds the range holding an instant."""

    def __init__(self, thread: np.ndarray, layer: np.ndarray, start: np.ndarray, dur: np.ndarray):
        keep = _outermost(thread, start, dur) if len(thread) else np.zeros(0, dtype=np.int64)
        order = keep[np.lexsort((start[keep], thread[keep]))]
        self.thread, self.layer, self.start = thread[order], layer[order], start[order]
        self.end = self.start + dur[order]

    def __call__(self, thread: np.ndarray, t: np.ndarray) -> np.ndarray:
        """The layer holding each (thread, instant), -1 where none does."""
        out = np.full(len(t), -1, dtype=np.int32)
        for th in np.unique(self.thread):
            lo, hi = np.searchsorted(self.thread, [th, th + 1])
            mine = np.flatnonzero(thread == th)
            i = np.searchsorted(self.start[lo:hi], t[mine], side="right") - 1 + lo
            inside = (i >= lo) & (t[mine] < self.end[np.maximum(i, lo)])
            out[mine[inside]] = self.layer[i[inside]]
        return out

    def of_launches(self, kernel_corr: np.ndarray, corr: np.ndarray, thread: np.ndarray,
                    t: np.ndarray) -> np.ndarray:
        """Each kernel's layer: that of the instant its launch ran."""
        out = np.full(len(kernel_corr), -1, dtype=np.int32)
        if not len(self.thread) or not len(corr):
            return out
        order = np.argsort(corr, kind="stable")
        corr, thread, t = corr[order], thread[order], t[order]
        i = np.minimum(np.searchsorted(corr, kernel_corr), len(corr) - 1)
        found = (corr[i] == kernel_corr) & (kernel_corr >= 0)
        out[found] = self(thread[i[found]], t[i[found]])
        return out


def _outermost(lane: np.ndarray, start: np.ndarray, dur: np.ndarray) -> np.ndarray:
    """Indices of the ops no other op of their thread encloses (a CPU run's time, each instant
    counted once): sorted by thread, start and longest first, an op is outermost when it starts
    at or after every earlier op of its thread has ended."""
    order = np.lexsort((-dur, start, lane))
    lane_s, start_s, end_s = lane[order], start[order], (start + dur)[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = lane_s[1:] != lane_s[:-1]
    # the running latest end within each thread (offset per thread so one cumulative max serves all)
    offset = (lane_s - lane_s.min()) * (float(end_s.max() - start_s.min()) + 1.0)
    running = np.maximum.accumulate(end_s - start_s.min() + offset) - offset + start_s.min()
    before = np.empty_like(running)
    before[0], before[1:] = -np.inf, running[:-1]
    return order[first | (start_s >= before)]


def _union(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The disjoint, sorted intervals covering these: (starts, ends) arrays."""
    if not len(starts):
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], np.maximum.accumulate(ends[order])
    new = np.empty(len(s), dtype=bool)
    new[0], new[1:] = True, s[1:] > e[:-1]
    last = np.append(np.flatnonzero(new)[1:] - 1, len(s) - 1)
    return s[new], e[last]


def _covered(union: tuple[np.ndarray, np.ndarray], x: np.ndarray) -> np.ndarray:
    """How much of `union` lies before each x."""
    us, ue = union
    before = np.concatenate([[0.0], np.cumsum(ue - us)])
    i = np.searchsorted(us, x, side="right") - 1
    inside = np.where(i >= 0, np.clip(x - us[np.maximum(i, 0)], 0, (ue - us)[np.maximum(i, 0)]), 0.0)
    return before[np.maximum(i, 0)] * (i >= 0) + inside


def _length(union) -> float:
    return float((union[1] - union[0]).sum())


def _intersection(a, b) -> float:
    """The length of two unions' intersection (a's intervals measured against b's coverage)."""
    if not len(a[0]) or not len(b[0]):
        return 0.0
    return float((_covered(b, a[1]) - _covered(b, a[0])).sum())


def rank_figures(trace: RankTrace, top_unclassed: int = 10) -> dict:
    classes = sorted(set(trace.classes))
    cls = np.array([classes.index(c) for c in trace.classes], dtype=np.int32)[trace.name_id]
    ends = trace.start + trace.dur
    sums = np.bincount(cls, weights=trace.dur, minlength=len(classes))
    breakdown = {c: float(sums[i]) for i, c in enumerate(classes) if (cls == i).any()}
    busy = _union(trace.start, ends)
    span = float(ends.max() - trace.start.min())
    comm = cls == classes.index(COMM) if COMM in classes else np.zeros(len(cls), dtype=bool)
    memory = cls == classes.index(MEMORY) if MEMORY in classes else np.zeros(len(cls), dtype=bool)
    compute = ~comm & ~memory
    comm_u, compute_u = _union(trace.start[comm], ends[comm]), _union(trace.start[compute], ends[compute])
    comm_s, overlapped = _length(comm_u), _intersection(comm_u, compute_u)
    per_name = np.bincount(trace.name_id, weights=trace.dur, minlength=len(trace.names))
    present = np.bincount(trace.name_id, minlength=len(trace.names)) > 0  # names of this source's events
    unclassed = sorted(((trace.names[i], float(per_name[i])) for i, c in enumerate(trace.classes)
                        if c == UNCLASSED and present[i]), key=lambda kv: -kv[1])[:top_unclassed]
    return {"file": str(trace.path), "rank": trace.rank, "source": trace.source, "lanes": trace.lanes,
            "events": int(len(trace.dur)), "span_s": span, "busy_s": _length(busy), "idle_s": span - _length(busy),
            "breakdown": breakdown, "layers": _per_layer(trace.layer, cls, classes, trace.dur),
            "overlap": {"communication_s": comm_s, "overlapped_s": overlapped,
                        "fraction": overlapped / comm_s if comm_s > 0 else None},
            "unclassed": unclassed}


def _per_layer(layer: np.ndarray, cls: np.ndarray, classes: list[str], dur: np.ndarray) -> dict:
    """{layer: {class: seconds}} of the events the annotations place, and the time they cover."""
    placed = layer >= 0
    out: dict = {}
    if placed.any():
        keys = layer[placed].astype(np.int64) * len(classes) + cls[placed]
        unique, inverse = np.unique(keys, return_inverse=True)
        sums = np.bincount(inverse, weights=dur[placed])
        for key, seconds in zip(unique.tolist(), sums.tolist()):
            out.setdefault(str(key // len(classes)), {})[classes[key % len(classes)]] = seconds
    return {"by_layer": dict(sorted(out.items(), key=lambda kv: int(kv[0]))),
            "placed_s": float(dur[placed].sum()), "total_s": float(dur.sum())}


def _merge_layers(ranks: list[dict]) -> dict:
    by_layer: dict[str, dict[str, float]] = {}
    for r in ranks:
        for layer, per_class in r["layers"]["by_layer"].items():
            mine = by_layer.setdefault(layer, {})
            for c, seconds in per_class.items():
                mine[c] = mine.get(c, 0.0) + seconds
    return {"by_layer": dict(sorted(by_layer.items(), key=lambda kv: int(kv[0]))),
            "placed_s": sum(r["layers"]["placed_s"] for r in ranks),
            "total_s": sum(r["layers"]["total_s"] for r in ranks),
            "how": "a kernel takes the layer its launch ran in on the CPU (a python_function or user_annotation "
                   "range a layer pattern matches); a CPU op the layer of its start"}


def _numbered(ranks: list, names: list[str]) -> list[int]:
    """Each file's rank as it says it, else the lowest number no file says; two files saying the
    same rank are bad input (their lanes would merge)."""
    said: dict[int, int] = {}  # rank -> the first file saying it
    for i, rank in enumerate(ranks):
        if rank is not None and said.setdefault(rank, i) != i:
            raise KinetoError(f"{names[said[rank]]} and {names[i]} both say they are rank {rank} (the same rank): "
                              f"give one file per rank")
    free = (n for n in itertools.count() if n not in said)
    return [rank if rank is not None else next(free) for rank in ranks]


def read_ranks(sources: list[Path], rules: Rules) -> list[RankTrace]:
    """Every rank of these sources (files, or folders of one per rank), numbered (_numbered)."""
    traces = [read_rank(p, rules) for source in sources for p in trace_files(source)]
    for t, rank in zip(traces, _numbered([t.rank for t in traces], [t.path.name for t in traces])):
        t.rank = rank
    return traces


def report(path: Path, rules_file: Path | None = None) -> dict:
    """`trace report` of a Kineto trace (a file, or a folder of one per rank): one rank's events
    in memory at a time, so a folder of many ranks needs no more than its largest file."""
    rules = Rules.load(rules_file)
    return combine([rank_figures(read_rank(p, rules)) for p in trace_files(path)], path)


def summarise(traces: list[RankTrace], path) -> dict:
    """The report's figures of these ranks' events (read from the source, or from a moectl trace
    `trace import` wrote)."""
    return combine([rank_figures(t) for t in traces], path)


def combine(ranks: list[dict], path) -> dict:
    """The report from each rank's figures (rank_figures), every rank numbered (_numbered)."""
    for r, rank in zip(ranks, _numbered([r["rank"] for r in ranks], [Path(r["file"]).name for r in ranks])):
        r["rank"] = rank
    breakdown: dict[str, float] = {}
    for r in ranks:
        for c, s in r["breakdown"].items():
            breakdown[c] = breakdown.get(c, 0.0) + s
    comm = sum(r["overlap"]["communication_s"] for r in ranks)
    overlapped = sum(r["overlap"]["overlapped_s"] for r in ranks)
    straggler = max(ranks, key=lambda r: r["busy_s"])
    return {"kind": "kineto", "path": str(path), "ranks": ranks, "breakdown": breakdown,
            "layers": _merge_layers(ranks), "idle_s": sum(r["idle_s"] for r in ranks),
            "overlap": {"communication_s": comm, "overlapped_s": overlapped,
                        "fraction": overlapped / comm if comm > 0 else None,
                        "definition": "communication time overlapped by computation / communication time "
                                      "(Holistic Trace Analysis' comm-comp overlap)"},
            "straggler": {"rank": straggler["rank"], "busy_s": straggler["busy_s"],
                          "behind_median_s": straggler["busy_s"] - float(np.median([r["busy_s"] for r in ranks]))},
            "unclassed": _merge_unclassed(ranks)}


def _merge_unclassed(ranks: list[dict], top: int = 10) -> list:
    total: dict[str, float] = {}
    for r in ranks:
        for name, s in r["unclassed"]:
            total[name] = total.get(name, 0.0) + s
    return sorted(total.items(), key=lambda kv: -kv[1])[:top]
