"""Timeline: kernels and spans of one or several engine steps, one row per lane (Line API).

    timeline = Timeline()
    timeline.set_spans(["engine", "gpu0", "gpu0->gpu1"], [Span(1, "attn", 0.0, 0.002), ...])

Layout: a time ruler on the first row, one row per lane (lane name in a fixed left gutter,
`gutter` characters), and a legend on the last row ("█ measured  ░ modeled", the visible range,
the selected span). Lanes scroll vertically; time is zoomed and panned with keys instead of a
horizontal scrollbar. Measured spans are solid blocks of colour (with their name inside when it
fits), modeled ones (a link transfer or a kernel the cost model estimated) are a "░" hatch in
italic. Where spans on a lane overlap at one character, the shorter (inner) one is drawn on top.

Spans are bucketed per lane and sorted by start when set; a row finds its visible spans with two
binary searches (starts, and the running maximum of ends), so render cost follows what is on
screen, not the total number of spans.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
import zlib
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from rich.cells import cell_len
from rich.color import Color
from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding, BindingType
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from moectl.console.widgets.line_cache import LineCacheMixin
from moectl.console.widgets.palette import PALETTE

HEADER_ROWS = 1
FOOTER_ROWS = 1
ZOOM_STEP = 2.0
PAN_FRACTION = 0.25
MIN_VIEW_S = 1e-9

MEASURED_GLYPH = "█"
MODELED_GLYPH = "░"
_ITALIC = Style(italic=True)

_MAX_SPACES = 2048
_SPACES = [" " * n for n in range(_MAX_SPACES + 1)]
_HATCH = [MODELED_GLYPH * n for n in range(_MAX_SPACES + 1)]


def _repeat(table: list[str], ch: str, n: int) -> str:
    return table[n] if n <= _MAX_SPACES else ch * n


@dataclass(frozen=True, slots=True)
class Span:
    """One span or kernel on a lane. Times are seconds from the timeline's origin."""

    lane: int
    name: str
    start_s: float
    dur_s: float
    modeled: bool = False
    layer: int = -1
    step: int = -1
    kind: str = "span"  # "span" | "kernel"

    @property
    def end_s(self) -> float:
        return self.start_s + self.dur_s


class _Lane:
    """A lane's spans as columns sorted by start (longest first on ties), for fast visibility
    queries and rendering; Span objects are only built when someone asks for them (selection)."""

    __slots__ = ("lane", "starts", "ends", "durs", "max_end", "style_ids", "modeled", "name_ids", "layers",
                 "steps", "kinds", "version", "_names", "_kinds", "_spans")

    def __init__(self, lane: int, starts, durs, modeled, name_ids, layers, steps, kinds, style_ids,
                 names: Sequence[str], kind_names: Sequence[str]) -> None:
        """Columns already in lane order (Timeline.set_columns sorts all lanes at once)."""
        self.lane = lane
        self.starts = starts
        self.durs = np.maximum(durs, 0.0)
        self.ends = self.starts + self.durs
        # running max of ends is non-decreasing: spans before the first index where it exceeds t
        # all end by t, so a binary search finds where visible spans can begin
        self.max_end = np.maximum.accumulate(self.ends) if len(self.starts) else self.ends
        self.modeled = modeled.tolist()
        self.name_ids, self.layers, self.steps, self.kinds = name_ids, layers, steps, kinds
        self._names, self._kinds = names, kind_names
        self.style_ids: list[int] = style_ids.tolist()  # per span: index into Timeline._styles
        self.version = 0  # what the lane draws; equal versions draw the same row (Timeline.line_key)
        self._spans: list[Span] | None = None

    def draws_like(self, other: _Lane) -> bool:
        """Whether the two lanes draw the same row (their step numbers may differ)."""
        return (self._names == other._names and np.array_equal(self.starts, other.starts)
                and np.array_equal(self.durs, other.durs) and self.modeled == other.modeled
                and np.array_equal(self.name_ids, other.name_ids) and np.array_equal(self.layers, other.layers))

    def __len__(self) -> int:
        return len(self.starts)

    def label(self, i: int) -> str:
        name, layer = self._names[self.name_ids[i]], int(self.layers[i])
        return name if layer < 0 else f"{name} L{layer}"

    def span(self, i: int) -> Span:
        """The i-th span alone (a lane of a GPU trace holds millions: `spans` would build them all)."""
        if self._spans is not None:
            return self._spans[i]
        return Span(self.lane, self._names[int(self.name_ids[i])], float(self.starts[i]), float(self.durs[i]),
                    self.modeled[i], int(self.layers[i]), int(self.steps[i]), self._kinds[int(self.kinds[i])])

    @property
    def spans(self) -> list[Span]:
        if self._spans is None:
            names, kinds = self._names, self._kinds
            self._spans = [Span(self.lane, names[n], s, d, m, layer, step, kinds[k]) for n, s, d, m, layer, step, k in
                           zip(self.name_ids.tolist(), self.starts.tolist(), self.durs.tolist(), self.modeled,
                               self.layers.tolist(), self.steps.tolist(), self.kinds.tolist())]
        return self._spans

    def visible(self, t0: float, t1: float) -> tuple[int, int]:
        """[lo, hi) index range that holds every span overlapping (t0, t1) (and maybe others)."""
        lo = int(np.searchsorted(self.max_end, t0, side="right"))
        hi = int(np.searchsorted(self.starts, t1, side="left"))
        return lo, max(lo, hi)


@functools.lru_cache(maxsize=4096)
def _colour_of(name: str) -> int:
    """A span name's palette index: stable across runs, computed once per name."""
    return zlib.crc32(name.encode()) % len(PALETTE)


def _nice_step(raw: float) -> float:
    """The smallest of 1, 2, 5 x 10^k that is >= raw."""
    if raw <= 0 or not math.isfinite(raw):
        return 1.0
    exp = math.floor(math.log10(raw))
    for m in (1.0, 2.0, 5.0, 10.0):
        step = m * 10.0**exp
        if step >= raw * (1 - 1e-9):
            return step
    return 10.0 ** (exp + 1)


def _time_unit(step: float) -> tuple[str, float]:
    if step >= 1.0:
        return "s", 1.0
    if step >= 1e-3:
        return "ms", 1e3
    if step >= 1e-6:
        return "µs", 1e6
    return "ns", 1e9


def format_duration(seconds: float) -> str:
    a = abs(seconds)
    if a == 0:
        return "0"
    if a >= 1.0:
        return f"{seconds:.3g} s"
    if a >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    if a >= 1e-6:
        return f"{seconds * 1e6:.3g} µs"
    return f"{seconds * 1e9:.3g} ns"


def _darken(hex_colour: str, factor: float) -> Color:
    h = hex_colour.lstrip("#")
    r, g, b = (int(h[i : i + 2], 16) for i in (0, 2, 4))
    return Color.from_rgb(int(r * factor), int(g * factor), int(b * factor))


def _contrast(c: Color) -> Color:
    r, g, b = c.get_truecolor()
    luma = 0.2126 * r + 0.7152 * g + 0.0722 * b
    return Color.from_rgb(0, 0, 0) if luma > 120 else Color.from_rgb(255, 255, 255)


def _span_styles(colour: str, shade: int) -> tuple[Style, Style]:
    c = _darken(colour, 0.78 if shade else 1.0)
    return Style(bgcolor=c, color=_contrast(c)), Style(color=c, italic=True)


# (measured, modeled) per style id: palette index * 2 + shade (every other span on a lane darker)
_STYLES = [_span_styles(colour, shade) for colour in PALETTE for shade in (0, 1)]
_LANE_VERSIONS = itertools.count(1)


class Timeline(LineCacheMixin, ScrollView, can_focus=True):
    """Spans on lanes against a zoomable, pannable time axis."""

    COMPONENT_CLASSES = {
        "timeline--lane",
        "timeline--lane-selected",
        "timeline--ruler",
        "timeline--legend",
        "timeline--selected",
        "timeline--empty",
    }
    LINE_CACHE_STYLES = tuple(sorted(COMPONENT_CLASSES))

    DEFAULT_CSS = """
    Timeline {
        height: 1fr;
        width: 1fr;
        overflow-x: hidden;
    }
    Timeline > .timeline--lane {
        color: $text-muted;
    }
    Timeline > .timeline--lane-selected {
        color: $text;
        text-style: bold;
    }
    Timeline > .timeline--ruler {
        color: $text-muted;
    }
    Timeline > .timeline--legend {
        color: $text-muted;
    }
    Timeline > .timeline--selected {
        color: $text;
        background: $accent;
        text-style: bold;
    }
    Timeline > .timeline--empty {
        color: $text-muted;
        text-style: italic;
    }
    """

    BINDINGS: list[BindingType] = [
        Binding("plus,equals_sign", "zoom_in", "Zoom in", show=False),
        Binding("minus", "zoom_out", "Zoom out", show=False),
        Binding("left", "pan(-1)", "Pan left", show=False),
        Binding("right", "pan(1)", "Pan right", show=False),
        Binding("shift+left", "pan(-4)", "Pan left more", show=False),
        Binding("shift+right", "pan(4)", "Pan right more", show=False),
        Binding("0", "fit", "Fit all", show=False),
        # n/p, not tab: tab must still move the focus out of the timeline
        Binding("n", "select_next(1)", "Next span", show=False),
        Binding("p", "select_next(-1)", "Previous span", show=False),
        Binding("escape", "clear_selection", "Clear selection", show=False),
    ]

    class SpanSelected(Message):
        """A span was selected (keys or click)."""

        def __init__(self, timeline: Timeline, span: Span) -> None:
            super().__init__()
            self.timeline = timeline
            self.span = span

        @property
        def control(self) -> Timeline:
            return self.timeline

    def __init__(
        self,
        lanes: Sequence[str] | None = None,
        spans: Sequence[Span] | None = None,
        *,
        gutter: int = 14,
        name: str | None = None,
        id: str | None = None,
        classes: str | None = None,
        disabled: bool = False,
    ) -> None:
        """
        Args:
            lanes: lane names, one row each (Span.lane indexes this list).
            spans: the spans to draw.
            gutter: width of the lane-name column.
        """
        super().__init__(name=name, id=id, classes=classes, disabled=disabled)
        self._gutter = max(1, int(gutter))
        self.shows_modeled = True  # the legend's modeled swatch; a trace with none measured otherwise says so
        self._lane_names: list[str] = []
        self._lanes: list[_Lane] = []
        self._lane_offsets: list[int] = [0]
        self._count = 0
        self._extent = (0.0, 1.0)
        self._view = (0.0, 1.0)
        self._selected: tuple[int, int] | None = None  # (lane, index in lane order)
        self._styles = _STYLES  # per style id (palette index * 2 + shade): (measured, modeled)
        self._swatch: int | None = None
        self._segment_cache: dict[object, Segment] = {}
        self._segment_cache_base: Style | None = None
        self.set_spans(list(lanes or []), list(spans or []))

    # ----------------------------------------------------------------------------- data

    def set_spans(self, lanes: Sequence[str], spans: Sequence[Span], *, fit: bool = True) -> None:
        """Replace everything drawn. Spans whose lane is out of range are dropped.

        Args:
            lanes: lane names.
            spans: spans with Span.lane indexing `lanes`.
            fit: reset the view to show all spans (otherwise the current time range is kept).
        """
        names: dict[str, int] = {}
        kinds: dict[str, int] = {}
        cols = [(s.lane, names.setdefault(s.name, len(names)), s.start_s, s.dur_s, s.modeled, s.layer, s.step,
                 kinds.setdefault(s.kind, len(kinds))) for s in spans]
        lane, name, start, dur, modeled, layer, step, kind = (np.array(c) for c in zip(*cols)) if cols else \
            (np.zeros(0),) * 8
        self.set_columns(lanes, lane=lane, name=name, names=list(names), start_s=start, dur_s=dur, modeled=modeled,
                         layer=layer, step=step, kind=kind, kinds=list(kinds) or ["span"], fit=fit)

    def set_columns(self, lanes: Sequence[str], *, lane, name, names: Sequence[str], start_s, dur_s, modeled=None,
                    layer=None, step=None, kind=None, kinds: Sequence[str] = ("span",), fit: bool = True,
                    colour_keys: Sequence[str] | None = None) -> None:
        """Replace everything drawn, from columns (one entry per span): lane and name are indexes
        into `lanes` and `names`, kind into `kinds`. The fast path: no Span object is built.
        colour_keys: per name, what its colour follows (a kernel's class; default the name)."""
        lane_names = [str(n) for n in lanes]
        lane = np.asarray(lane, dtype=np.int64)
        n = len(lane)
        start_s, dur_s = np.asarray(start_s, dtype=np.float64), np.asarray(dur_s, dtype=np.float64)

        def fill(col, value, dtype):
            return np.full(n, value, dtype=dtype) if col is None else np.asarray(col, dtype=dtype)

        modeled, layer = fill(modeled, False, bool), fill(layer, -1, np.int64)
        step, kind = fill(step, -1, np.int64), fill(kind, 0, np.int64)
        name = np.asarray(name, dtype=np.int64)
        keep = (lane >= 0) & (lane < len(lane_names)) & np.isfinite(start_s) & np.isfinite(dur_s)
        names, kinds = list(names), list(kinds)
        # one sort for every lane: by lane, then start, longest first on ties (lexsort is stable)
        order = np.lexsort((-dur_s, start_s, np.where(keep, lane, len(lane_names))))
        order = order[: int(np.count_nonzero(keep))]
        sorted_lane = lane[order]
        bounds = np.searchsorted(sorted_lane, np.arange(len(lane_names) + 1), side="left")
        # alternate shades along each lane so that neighbours of one colour stay apart
        keys = list(colour_keys) if colour_keys is not None else names
        colours = np.array([_colour_of(k) for k in keys], dtype=np.int64) if names else np.zeros(1, np.int64)
        position = np.arange(len(order)) - bounds[sorted_lane] if len(order) else np.zeros(0, np.int64)
        style_ids = colours[name[order]] * 2 + (position & 1) if len(order) else np.zeros(0, np.int64)
        if self._swatch is None and len(order):  # the legend's swatch: the first span's colour, ever
            self._swatch = int(style_ids[0])
        cols = [start_s[order], dur_s[order], modeled[order], name[order], layer[order], step[order], kind[order],
                style_ids]
        old = {data.lane: data for data in self._lanes} if self._lane_names == lane_names else {}
        same = self._lanes_drawing_alike(lane_names, names, bounds, cols)
        self._lane_names = lane_names
        self._lanes = []
        for i in range(len(lane_names)):
            a, b = bounds[i], bounds[i + 1]
            data = _Lane(i, *(c[a:b] for c in cols), names, kinds)
            previous = old.get(i)
            alike = same[i] if same is not None else previous is not None and data.draws_like(previous)
            data.version = previous.version if previous is not None and alike else next(_LANE_VERSIONS)
            self._lanes.append(data)
        self._previous_columns = (lane_names, list(names), bounds, cols)
        offsets = [0]
        for data in self._lanes:
            offsets.append(offsets[-1] + len(data))
        self._lane_offsets = offsets
        self._count = offsets[-1]
        starts = [data.starts[0] for data in self._lanes if len(data)]
        ends = [data.max_end[-1] for data in self._lanes if len(data)]
        if starts:
            t0, t1 = min(starts), max(ends)
            if t1 - t0 < MIN_VIEW_S:
                t1 = t0 + max(MIN_VIEW_S, 1e-6)
            self._extent = (float(t0), float(t1))
        else:
            self._extent = (0.0, 1.0)
        self._selected = None
        self._matches = None
        if fit or not starts:
            self._view = self._extent
        self.virtual_size = Size(0, HEADER_ROWS + len(lane_names) + FOOTER_ROWS)
        self.refresh()

    def _lanes_drawing_alike(self, lane_names, names, bounds, cols) -> np.ndarray | None:
        """Per lane, whether it draws as it did before this set_columns, in a few numpy calls
        for all lanes; None where the lanes' span counts changed (then each lane compares)."""
        previous = getattr(self, "_previous_columns", None)
        if previous is None or previous[0] != lane_names or previous[1] != list(names) \
                or not np.array_equal(previous[2], bounds) or not len(cols[0]):
            return None
        before, now = previous[3], cols
        # starts, durs, modeled, name ids, layers: what a lane draws (steps and kinds do not show)
        equal = np.ones(len(now[0]), dtype=bool)
        for k in (0, 1, 2, 3, 4):
            equal &= before[k] == now[k]
        counts = np.diff(bounds)
        alike = np.ones(len(counts), dtype=bool)
        nonempty = counts > 0
        alike[nonempty] = np.logical_and.reduceat(equal, bounds[:-1][nonempty])
        return alike

    @property
    def lanes(self) -> list[str]:
        return list(self._lane_names)

    @property
    def span_count(self) -> int:
        return self._count

    @property
    def extent(self) -> tuple[float, float]:
        """(first start, last end) over all spans, seconds."""
        return self._extent

    @property
    def view_range(self) -> tuple[float, float]:
        """The time range (start_s, end_s) across the drawing area."""
        return self._view

    @property
    def selected(self) -> Span | None:
        if self._selected is None:
            return None
        lane, index = self._selected
        return self._lanes[lane].span(index)

    def spans_in_lane(self, lane: int) -> list[Span]:
        """A lane's spans in start order."""
        return list(self._lanes[lane].spans)

    # ------------------------------------------------------------------------ view

    @property
    def track_width(self) -> int:
        """Characters of the time axis (widget width less the lane gutter)."""
        return max(1, self.scrollable_content_region.width - self._gutter)

    def _clamp_view(self, start: float, width: float) -> tuple[float, float]:
        width = max(width, MIN_VIEW_S)
        lo_extent, hi_extent = self._extent
        lo = min(lo_extent, hi_extent - width)
        hi = max(lo_extent, hi_extent - width)
        start = min(max(start, lo), hi)
        return (start, start + width)

    def set_view(self, start_s: float, end_s: float) -> None:
        """Show [start_s, end_s] (clamped so that the view keeps overlapping the spans)."""
        if not (math.isfinite(start_s) and math.isfinite(end_s)):
            return
        if end_s < start_s:
            start_s, end_s = end_s, start_s
        self._view = self._clamp_view(start_s, end_s - start_s)
        self.refresh()

    def fit(self) -> None:
        """Show every span."""
        self._view = self._extent
        self.refresh()

    def zoom(self, factor: float, centre_s: float | None = None) -> None:
        """Zoom in by `factor` (> 1 in, < 1 out) keeping `centre_s` (default: the selected span
        when it is in view, else the middle of the view) at the same place on screen."""
        if factor <= 0:
            return
        v0, v1 = self._view
        if centre_s is None:
            span = self.selected
            mid = None if span is None else span.start_s + span.dur_s / 2
            centre_s = mid if mid is not None and v0 <= mid <= v1 else (v0 + v1) / 2
        extent_w = self._extent[1] - self._extent[0]
        new_w = min(max((v1 - v0) / factor, MIN_VIEW_S), max(extent_w, MIN_VIEW_S) * 8)
        frac = (centre_s - v0) / (v1 - v0) if v1 > v0 else 0.5
        self._view = self._clamp_view(centre_s - frac * new_w, new_w)
        self.refresh()

    def pan(self, fraction: float) -> None:
        """Move the view by `fraction` of its width (negative: earlier)."""
        v0, v1 = self._view
        self._view = self._clamp_view(v0 + fraction * (v1 - v0), v1 - v0)
        self.refresh()

    def action_zoom_in(self) -> None:
        self.zoom(ZOOM_STEP)

    def action_zoom_out(self) -> None:
        self.zoom(1.0 / ZOOM_STEP)

    def action_pan(self, steps: int) -> None:
        self.pan(PAN_FRACTION * steps)

    def action_fit(self) -> None:
        self.fit()

    # ------------------------------------------------------------------- selection

    def select(self, span: Span | None, *, post: bool = True) -> None:
        """Select a span (one of those set; None clears), bring it into view, post SpanSelected."""
        if span is None:
            self._set_selected(None, post=False)
            return
        lane = span.lane
        if not 0 <= lane < len(self._lanes):
            return
        spans = self._lanes[lane].spans
        i = bisect_left(self._lanes[lane].starts, span.start_s)
        while i < len(spans) and spans[i].start_s == span.start_s:
            if spans[i] == span:
                self._set_selected((lane, i), post=post)
                return
            i += 1

    def _set_selected(self, key: tuple[int, int] | None, *, post: bool) -> None:
        self._selected = key
        self.refresh()
        if key is None:
            return
        self._bring_into_view(key)
        if post:
            span = self.selected
            assert span is not None
            self.post_message(self.SpanSelected(self, span))

    def _bring_into_view(self, key: tuple[int, int]) -> None:
        lane, index = key
        span = self._lanes[lane].span(index)
        v0, v1 = self._view
        w = v1 - v0
        if span.start_s < v0 or span.end_s > v1:
            if span.dur_s <= w * 0.9:
                start = span.start_s + span.dur_s / 2 - w / 2
            else:
                start = span.start_s - 0.05 * w
            self._view = self._clamp_view(start, w)
        rows = max(1, self.scrollable_content_region.height - HEADER_ROWS - FOOTER_ROWS)
        sy = self.scroll_offset.y
        if lane < sy:
            self.scroll_to(y=lane, animate=False, immediate=True)
        elif lane >= sy + rows:
            self.scroll_to(y=lane - rows + 1, animate=False, immediate=True)

    def action_select_next(self, direction: int) -> None:
        if not self._count:
            return
        if self._selected is None:
            key = self._first_in_view() if direction > 0 else self._last_in_view()
        else:
            lane, index = self._selected
            flat = (self._lane_offsets[lane] + index + direction) % self._count
            lane = bisect_left(self._lane_offsets, flat + 1) - 1
            key = (lane, flat - self._lane_offsets[lane])
        if key is not None:
            self._set_selected(key, post=True)

    def _visible_lanes(self) -> range:
        rows = max(1, self.scrollable_content_region.height - HEADER_ROWS - FOOTER_ROWS)
        sy = self.scroll_offset.y
        return range(sy, min(len(self._lanes), sy + rows))

    def _first_in_view(self) -> tuple[int, int] | None:
        v0, v1 = self._view
        for lane in [*self._visible_lanes(), *range(len(self._lanes))]:
            data = self._lanes[lane]
            lo, hi = data.visible(v0, v1)
            for i in range(lo, hi):
                if data.ends[i] > v0 or data.durs[i] == 0:
                    return (lane, i)
        return self._flat_key(0)

    def _last_in_view(self) -> tuple[int, int] | None:
        v0, v1 = self._view
        for lane in [*reversed(self._visible_lanes()), *reversed(range(len(self._lanes)))]:
            data = self._lanes[lane]
            lo, hi = data.visible(v0, v1)
            for i in range(hi - 1, lo - 1, -1):
                if data.ends[i] > v0:
                    return (lane, i)
        return self._flat_key(self._count - 1)

    def _flat_key(self, flat: int) -> tuple[int, int] | None:
        if not 0 <= flat < self._count:
            return None
        lane = bisect_left(self._lane_offsets, flat + 1) - 1
        return (lane, flat - self._lane_offsets[lane])

    def find(self, pattern: str, direction: int = 1) -> tuple[int, int]:
        """Select the next (direction 1) or previous (-1) span whose name the regular expression
        (case-insensitive) matches, after or before the selected one in time, wrapping round;
        bring it into view. Returns (its place among the matches from 1, the matches), (0, 0)
        where none matches; a bad expression raises re.error."""
        if self._matches is None or self._matches[0] != pattern:
            regex = re.compile(pattern, re.IGNORECASE)
            names = self._lanes[0]._names if self._lanes else []
            hit = np.array([bool(regex.search(n)) for n in names] or [False])
            parts = []
            for data in self._lanes:  # (start, lane, index) of every matching span, in time order
                where = np.flatnonzero(hit[data.name_ids]) if len(data) else np.zeros(0, np.int64)
                parts.append(np.stack([data.starts[where], np.full(len(where), data.lane), where]).T)
            found = np.concatenate(parts) if parts else np.zeros((0, 3))
            self._matches = (pattern, found[np.lexsort((found[:, 2], found[:, 1], found[:, 0]))] if len(found)
                             else found)
        found = self._matches[1]
        if not len(found):
            return 0, 0
        if self._selected is None:
            at = 0 if direction > 0 else len(found) - 1
        else:
            lane, index = self._selected
            mine = np.flatnonzero((found[:, 1] == lane) & (found[:, 2] == index))
            if len(mine):  # the selection is a match: its neighbour
                at = (int(mine[0]) + direction) % len(found)
            else:  # the first match after it in (start, lane, index) order (the last before it, going back)
                start = self._lanes[lane].starts[index]
                after = (found[:, 0] > start) | ((found[:, 0] == start) & (
                    (found[:, 1] > lane) | ((found[:, 1] == lane) & (found[:, 2] > index))))
                at = (int(np.argmax(after)) if after.any() else 0) if direction > 0 else \
                    (int(np.flatnonzero(~after)[-1]) if (~after).any() else len(found) - 1)
        self._set_selected((int(found[at, 1]), int(found[at, 2])), post=True)
        return at + 1, len(found)

    def action_clear_selection(self) -> None:
        self._set_selected(None, post=False)

    def span_at(self, x: int, y: int) -> Span | None:
        """The span drawn at content offset (x, y) (or one character either side), else None."""
        if y < HEADER_ROWS or x < self._gutter:
            return None
        if y >= self.scrollable_content_region.height - FOOTER_ROWS:
            return None
        lane = self.scroll_offset.y + y - HEADER_ROWS
        if not 0 <= lane < len(self._lanes):
            return None
        owner = self._raster(lane, self.track_width)
        if owner is None:
            return None
        col = x - self._gutter
        for c in (col, col - 1, col + 1):
            if 0 <= c < len(owner) and owner[c] >= 0:
                return self._lanes[lane].span(int(owner[c]))
        return None

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None:
            return
        span = self.span_at(offset.x, offset.y)
        if span is not None:
            event.stop()
            self.focus()
            self.select(span)

    # --------------------------------------------------------------------- rendering

    def _raster(self, lane: int, width: int) -> np.ndarray | None:
        """int32 [width]: index (in lane order) of the span drawn at each column, -1 for none."""
        raster = self._raster_with_starts(lane, width)
        return None if raster is None else raster[0]

    def _raster_with_starts(self, lane: int, width: int) -> tuple[np.ndarray, dict[int, int]] | None:
        """(owner per column as in _raster, {span index: column where it starts})."""
        data = self._lanes[lane]
        if not len(data) or width <= 0:
            return None
        v0, v1 = self._view
        lo, hi = data.visible(v0, v1)
        if hi <= lo:
            return None
        ends = data.ends[lo:hi]
        starts = data.starts[lo:hi]
        keep = (ends > v0) | ((data.durs[lo:hi] == 0) & (starts >= v0))
        idx = np.flatnonzero(keep)
        if not len(idx):
            return None
        scale = width / (v1 - v0)
        c0 = np.floor((starts[idx] - v0) * scale)
        c1 = np.ceil((ends[idx] - v0) * scale)
        c0 = np.clip(c0, 0, width - 1).astype(np.int64)
        c1 = np.clip(np.maximum(c1, c0 + 1), 1, width).astype(np.int64)
        owner = np.full(width, -1, dtype=np.int32)
        # longest first, so shorter (inner) spans end up on top
        order = np.argsort(-data.durs[lo:hi][idx], kind="stable")
        index = (idx + lo)[order].tolist()
        first = c0[order].tolist()
        for i, a, b in zip(index, first, c1[order].tolist()):
            owner[a:b] = i
        return owner, dict(zip(index, first))

    def line_key(self, y: int):
        if not self._count:
            return ("empty", y)
        height = self.scrollable_content_region.height
        if y < HEADER_ROWS:
            return ("ruler", self._view, self.track_width)
        if y == height - 1:
            sel = self._selected
            where = (self._lanes[sel[0]].version, self._lane_names[sel[0]]) if sel is not None else None
            return ("legend", self._view, self._extent, self._count, self._swatch, sel, where)
        lane = self.scroll_offset.y + y - HEADER_ROWS
        if lane >= len(self._lanes) or y >= height:
            return ("blank",)
        sel = self._selected
        return ("lane", lane, self._lanes[lane].version, self._lane_names[lane], self._view, self.track_width,
                self._gutter, sel[1] if sel is not None and sel[0] == lane else None)

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        base = self.visual_style.rich_style
        if not self._count:
            if y == 0:
                style = self.get_component_rich_style("timeline--empty")
                return Strip([Segment(" no spans", style)]).adjust_cell_length(width, base)
            return Strip.blank(width, base)
        height = self.scrollable_content_region.height
        if y < HEADER_ROWS:
            return self._render_ruler(width, base)
        if y == height - 1:
            return self._render_legend(width, base)
        lane = self.scroll_offset.y + y - HEADER_ROWS
        if lane >= len(self._lanes) or y >= height:
            return Strip.blank(width, base)
        return self._render_lane(lane, width, base)

    def _render_lane(self, lane: int, width: int, base: Style) -> Strip:
        gutter = self._gutter
        selected = self._selected
        name_style = self.get_component_rich_style(
            "timeline--lane-selected" if selected is not None and selected[0] == lane else "timeline--lane"
        )
        name = self._lane_names[lane]
        if cell_len(name) > gutter - 1:
            name = name[: max(0, gutter - 2)] + "…"
        segments = [Segment(name.ljust(gutter)[:gutter], name_style)]
        track = self.track_width
        raster = self._raster_with_starts(lane, track)
        if raster is None:
            segments.append(Segment(_repeat(_SPACES, " ", track), base))
            return Strip(segments, gutter + track).adjust_cell_length(width, base)
        owner, start_cols = raster
        data = self._lanes[lane]
        modeled_of = data.modeled
        style_ids = data.style_ids
        styles = self._styles
        sel_index = selected[1] if selected is not None and selected[0] == lane else -2
        sel_style = self.get_component_rich_style("timeline--selected") if sel_index >= 0 else None
        change = np.flatnonzero(owner[1:] != owner[:-1]) + 1
        bounds = [0, *change.tolist(), track]
        values = owner[bounds[:-1]].tolist()
        add = segments.append
        spaces, hatch = _SPACES, _HATCH
        # plain runs (blank, or a span piece without a label) repeat a lot: keep their Segments
        cache = self._segment_cache
        if self._segment_cache_base != base or len(cache) > 50_000:
            cache.clear()
            self._segment_cache_base = base
        for value, a, b in zip(values, bounds, bounds[1:]):
            n = b - a
            if value < 0:
                segment = cache.get(n)
                if segment is None:
                    segment = cache[n] = Segment(_repeat(spaces, " ", n), base)
                add(segment)
                continue
            # the span's name goes in the piece where the span starts, if it fits (names are
            # taken as one cell per character: kernel and span names are ASCII)
            label = data.label(value) if n >= 4 and start_cols[value] == a else ""
            modeled = modeled_of[value]
            if not label and value != sel_index:
                key = (style_ids[value], n, modeled)
                segment = cache.get(key)
                if segment is None:
                    measured_style, modeled_style = styles[style_ids[value]]
                    if modeled:
                        segment = Segment(_repeat(hatch, MODELED_GLYPH, n), modeled_style)
                    else:
                        segment = Segment(_repeat(spaces, " ", n), measured_style)
                    cache[key] = segment
                add(segment)
                continue
            measured_style, modeled_style = styles[style_ids[value]]
            if modeled:
                style = modeled_style if value != sel_index else sel_style + _ITALIC
                if label and n >= len(label) + 4:
                    text = f"{MODELED_GLYPH} {label} {_repeat(hatch, MODELED_GLYPH, n - len(label) - 3)}"
                else:
                    text = _repeat(hatch, MODELED_GLYPH, n)
            else:
                style = measured_style if value != sel_index else sel_style
                if label:
                    text = f" {label}"[:n]
                    text = text + _repeat(spaces, " ", n - len(text))
                else:
                    text = _repeat(spaces, " ", n)
            add(Segment(text, style))
        return Strip(segments, gutter + track).adjust_cell_length(width, base)

    def _render_ruler(self, width: int, base: Style) -> Strip:
        gutter = self._gutter
        track = self.track_width
        v0, v1 = self._view
        span = v1 - v0
        step = _nice_step(span / max(1, track / 12))
        unit, mult = _time_unit(step)
        decimals = max(0, -math.floor(math.log10(step * mult) + 1e-9))
        chars = [" "] * track
        free_from = 0
        first = math.ceil(v0 / step - 1e-9)
        k = first
        while True:
            t = k * step
            if t > v1 + 1e-12:
                break
            col = int(round((t - v0) / span * track))
            label = "╷" + f"{t * mult:.{decimals}f}"
            if col >= free_from and col + len(label) <= track:
                chars[col : col + len(label)] = label
                free_from = col + len(label) + 1
            k += 1
            if k - first > track:  # paranoia against float trouble
                break
        style = self.get_component_rich_style("timeline--ruler")
        head = f" {unit}".ljust(gutter)[:gutter]
        return Strip([Segment(head, style), Segment("".join(chars), style)]).adjust_cell_length(width, base)

    def _render_legend(self, width: int, base: Style) -> Strip:
        style = self.get_component_rich_style("timeline--legend")
        swatch_measured, swatch_modeled = self._styles[self._swatch] if self._swatch is not None else (Style(), Style())
        v0, v1 = self._view
        zoom = (self._extent[1] - self._extent[0]) / (v1 - v0) if v1 > v0 else 1.0
        segments = [
            Segment(" "),
            Segment(MEASURED_GLYPH, Style(color=swatch_measured.bgcolor)),
            Segment(" measured", style),
            *([Segment("  ", style), Segment(MODELED_GLYPH, swatch_modeled), Segment(" modeled", style)]
              if self.shows_modeled else []),
            Segment(
                f"  │ {format_duration(v0)} – {format_duration(v1)}  ×{zoom:.3g}"
                f"  │ {self._count} spans",
                style,
            ),
        ]
        span = self.selected
        if span is not None:
            where = self._lane_names[span.lane] if span.lane < len(self._lane_names) else str(span.lane)
            extra = [span.name, where, f"at {format_duration(span.start_s)}", f"dur {format_duration(span.dur_s)}"]
            if span.layer >= 0:
                extra.append(f"layer {span.layer}")
            if span.step >= 0:
                extra.append(f"step {span.step}")
            extra.append("modeled" if span.modeled else "measured")
            selected_style = self.get_component_rich_style("timeline--lane-selected")
            segments.append(Segment("  │ ▶ " + "  ".join(extra), selected_style))
        return Strip(segments).adjust_cell_length(width, base)
