"""Timeline: kernels and spans of one or several engine steps, one row per lane (Line API).

    timeline = Timeline()
    timeline.set_spans(["engine", "gpu0", "gpu0->gpu1"], [Span(1, "attn", 0.0, 0.002), ...])

Layout: a time ruler on the first row, one row per lane (lane name in a fixed left gutter,
`gutter` characters), and a legend on the last row ("█ measured  ░ modeled", the visible range,
the selected span). Lanes scroll vertically; time is zoomed and panned with keys instead of a
horizontal scrollbar. Measured spans are blocks of colour (with their name inside when it fits;
a narrow piece beside a gap is "█" glyphs, which the gap's blanks share a segment with), modeled
ones (a link transfer or a kernel the cost model estimated) are a "░" hatch in italic. Where spans
on a lane overlap at one character, the shorter (inner) one is drawn on top; touching spans of one
colour alternate shades.

Spans are sorted by lane and start once when set; a lane's arrays are built the first time a frame
draws it (a new record costs one sort, not a build of every lane). A frame buckets the spans of all
the lanes on screen into the track's columns in one numpy pass (a lane finds its visible spans with
two binary searches: starts, and the running maximum of ends) and draws each lane in as few
segments as it takes: a blank shows no foreground, so the blanks and glyphs of one colour are one
segment. Textual's cost per frame follows the segments on screen, so it follows what the screen
shows, not the number of spans.
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
from typing import NamedTuple

import numpy as np
from rich.cells import cell_len
from rich.color import Color
from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding, BindingType
from textual.geometry import Region, Size
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

    __slots__ = ("lane", "starts", "ends", "durs", "max_end", "colours", "modeled", "name_ids", "layers",
                 "steps", "kinds", "version", "_names", "_kinds", "_spans")

    def __init__(self, lane: int, starts, durs, modeled, name_ids, layers, steps, kinds, colours,
                 names: Sequence[str], kind_names: Sequence[str]) -> None:
        """Columns already in lane order (Timeline.set_columns sorts all lanes at once)."""
        self.lane = lane
        self.starts = starts
        self.durs = durs
        self.ends = self.starts + self.durs
        # running max of ends is non-decreasing: spans before the first index where it exceeds t
        # all end by t, so a binary search finds where visible spans can begin
        self.max_end = np.maximum.accumulate(self.ends) if len(self.starts) else self.ends
        self.modeled = modeled  # bool array
        self.name_ids, self.layers, self.steps, self.kinds = name_ids, layers, steps, kinds
        self._names, self._kinds = names, kind_names
        self.colours = colours  # per span: palette index (the shade is chosen when drawn)
        self.version = 0  # what the lane draws; equal versions draw the same row (Timeline.line_key)
        self._spans: list[Span] | None = None

    def __len__(self) -> int:
        return len(self.starts)

    def span(self, i: int) -> Span:
        """The i-th span alone (a lane of a GPU trace holds millions: `spans` would build them all)."""
        if self._spans is not None:
            return self._spans[i]
        return Span(self.lane, self._names[int(self.name_ids[i])], float(self.starts[i]), float(self.durs[i]),
                    bool(self.modeled[i]), int(self.layers[i]), int(self.steps[i]), self._kinds[int(self.kinds[i])])

    @property
    def spans(self) -> list[Span]:
        if self._spans is None:
            names, kinds = self._names, self._kinds
            self._spans = [Span(self.lane, names[n], s, d, m, layer, step, kinds[k]) for n, s, d, m, layer, step, k in
                           zip(self.name_ids.tolist(), self.starts.tolist(), self.durs.tolist(),
                               self.modeled.tolist(), self.layers.tolist(), self.steps.tolist(),
                               self.kinds.tolist())]
        return self._spans

    def visible(self, t0: float, t1: float) -> tuple[int, int]:
        """[lo, hi) index range that holds every span overlapping (t0, t1) (and maybe others)."""
        lo = int(np.searchsorted(self.max_end, t0, side="right"))
        hi = int(np.searchsorted(self.starts, t1, side="left"))
        return lo, max(lo, hi)


class _Lanes(Sequence[_Lane]):
    """Every lane of a Timeline over one set of columns sorted by lane. A lane's _Lane is built the
    first time it is asked for: when a zoomed frame searches the lane for its spans in view, or for
    a selection (a frame that shows every span needs none); building all 129 lanes of a 64-device
    step on every new record took longer than sorting its spans."""

    def __init__(self, cols: list[np.ndarray], bounds: np.ndarray, versions: list[int], names: Sequence[str],
                 kinds: Sequence[str]) -> None:
        self.columns, self.bounds = cols, bounds  # sorted by lane; lane i is bounds[i]:bounds[i + 1]
        self._bounds, self._versions = bounds.tolist(), versions
        self._names, self._kinds = names, kinds
        self._built: dict[int, _Lane] = {}

    def __len__(self) -> int:
        return len(self._versions)

    def __getitem__(self, i: int) -> _Lane:  # type: ignore[override]  (ints only: no caller slices)
        data = self._built.get(i)
        if data is None:
            if not 0 <= i < len(self._versions):
                raise IndexError(i)
            a, b = self._bounds[i], self._bounds[i + 1]
            data = self._built[i] = _Lane(i, *(c[a:b] for c in self.columns), self._names, self._kinds)
            data.version = self._versions[i]
        return data

    def label(self, flat: int) -> str:
        """The name drawn in the span at `flat` in the columns (all lanes), without its lane."""
        return _label(self._names[int(self.columns[3][flat])], int(self.columns[4][flat]))

    def version(self, i: int) -> int:
        """Lane i's version (Timeline.line_key), without building it."""
        return self._versions[i]

    @property
    def built(self) -> int:
        """How many lanes have been built (tests: a frame builds only the lanes it draws)."""
        return len(self._built)


def _lane_order(lane: np.ndarray, start_s: np.ndarray, dur_s: np.ndarray, kept: int) -> np.ndarray:
    """The first `kept` indexes of one sort for every lane: by lane, then start, longest first on
    ties, as np.lexsort((-dur_s, start_s, lane)) (stable). A step's spans come in start order
    within each lane: a stable sort by lane alone, checked, takes a fifth of lexsort's time."""
    order = np.argsort(lane, kind="stable")[:kept]
    same_lane = lane[order[1:]] == lane[order[:-1]]
    starts, durs = start_s[order], dur_s[order]
    later = starts[1:] - starts[:-1]
    if np.all(~same_lane | (later > 0) | ((later == 0) & (durs[1:] <= durs[:-1]))):
        return order
    return np.lexsort((-dur_s, start_s, lane))[:kept]


def _label(name: str, layer: int) -> str:
    return name if layer < 0 else f"{name} L{layer}"


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


# (measured, modeled) per style id: palette index * 2 + shade (1: darker, for a span that touches
# one of its colour)
_STYLES = [_span_styles(colour, shade) for colour in PALETTE for shade in (0, 1)]
# per style id: (measured, modeled) drawn as a glyph in the colour, on the widget's background
_GLYPH_STYLES = [(Style(color=measured.bgcolor), modeled) for measured, modeled in _STYLES]
_LANE_VERSIONS = itertools.count(1)
_BLANK = -1  # _track_runs' key of a run of blank cells no glyph run takes in
_GLYPH_CODES = np.array([ord(" "), ord(MEASURED_GLYPH), ord(MODELED_GLYPH)], dtype="<u4")


@dataclass(slots=True)
class _Raster:
    """Which span draws each cell of some lanes' tracks, one row per lane (Timeline._raster_of).
    The spans in view are "slots" 0..n-1; per slot arrays say what to draw."""

    width: int
    owner: np.ndarray  # int64 [rows * width]: the slot drawn at each cell, -1 for none
    lanes: list[int]  # per row: its lane
    row: np.ndarray  # per slot: its row
    index: np.ndarray  # per slot: the span's index in its lane
    flat: np.ndarray  # per slot: the span's index in the columns of all lanes
    first: np.ndarray  # per slot: the column where the span starts
    colours: np.ndarray  # per slot: palette index
    modeled: np.ndarray  # per slot: bool

    def slot(self, lane: int, index: int) -> int:
        """The slot of span `index` of `lane`, -2 where it is not in view."""
        if lane not in self.lanes:
            return -2
        hit = np.flatnonzero((self.row == self.lanes.index(lane)) & (self.index == index))
        return int(hit[0]) if len(hit) else -2


def _paint(at: np.ndarray, length: np.ndarray, durs: np.ndarray, cells: int) -> np.ndarray:
    """Per cell, the span drawn there (-1: none), for spans covering cells [at, at + length):
    where several cover a cell the shortest (innermost) is on top, on equal durations the later
    one, as painting them longest first in order would leave it, for all rows in one pass."""
    span = np.repeat(np.arange(len(durs)), length)
    cell = np.arange(len(span)) + np.repeat(at - (np.cumsum(length) - length), length)
    shortest = np.full(cells, np.inf)
    np.minimum.at(shortest, cell, durs[span])
    on_top = durs[span] == shortest[cell]
    top = np.full(cells, -1, dtype=np.int64)
    np.maximum.at(top, cell[on_top], span[on_top])
    return top


def _glyph_text(owner: np.ndarray, modeled: np.ndarray) -> str:
    """The tracks' characters, one per cell: blank, a measured "█" or a modeled "░" (the pieces
    drawn on their own, _track_runs, write their own text)."""
    drawn = owner >= 0
    which = np.where(drawn, 1 + modeled[np.where(drawn, owner, 0)], 0) if len(modeled) else 0 * owner
    return _GLYPH_CODES[which].tobytes().decode("utf-32-le")


def _track_runs(raster: _Raster, selected: int) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """The segments that draw the raster's tracks, as lists (start cell, end cell, key, slot,
    style id), one entry per segment, in cell order (a row starts a new segment).

    A key >= 0 is a run of glyphs of one style (style id * 2 + modeled) with the blank cells
    beside them: a blank shows no foreground, so it joins a glyph run next to it, and a lane of
    narrow spans of one colour with gaps between is one segment instead of two per span.
    _BLANK is blank cells with no glyph run beside them. A key below that is a piece with a
    background of its own, one segment each: the span's name where the span starts (4 cells or
    more), the `selected` slot, or any other measured piece but a narrow one beside a blank."""
    owner, width = raster.owner, raster.width
    if not len(raster.index):  # nothing in view: a blank run per row
        starts = list(range(0, len(owner), width))
        return starts, [a + width for a in starts], [_BLANK] * len(starts), [-1] * len(starts), [-1] * len(starts)
    differs = owner[1:] != owner[:-1]
    differs[width - 1 :: width] = True  # rows never share a run
    a = np.concatenate(([0], np.flatnonzero(differs) + 1))
    b = np.concatenate((a[1:], [len(owner)]))
    row_first, row_last = a % width == 0, b % width == 0
    slot = owner[a]
    drawn = slot >= 0
    at = np.where(drawn, slot, 0)  # a slot that is safe to read for blanks
    colour = np.where(drawn, raster.colours[at], -1)
    style = colour * 2 + _shades(drawn, colour, row_first)
    modeled = drawn & raster.modeled[at]
    key = np.where(drawn, style * 2 + modeled, _BLANK)
    own = drawn & ((slot == selected) | ((b - a >= 4) & (raster.first[at] == a % width)))
    # glyphs only for a measured piece too narrow for a name with a blank beside it to share a
    # segment with (narrow spans are the many); others stay blocks of background, seamless where
    # a font leaves gaps between "█"s (an SVG screenshot)
    blank_beside = np.zeros(len(a), dtype=bool)
    blank_beside[1:] |= ~drawn[:-1] & ~row_first[1:]
    blank_beside[:-1] |= ~drawn[1:] & ~row_last[:-1]
    own |= drawn & ~modeled & ~(blank_beside & (b - a < 4))
    key = _blanks_joined(np.where(own, _BLANK - 1 - np.arange(len(a)), key), drawn, row_first, row_last)
    cut = np.flatnonzero(np.concatenate(([True], (key[1:] != key[:-1]) | row_first[1:])))
    ends = np.concatenate((a[cut[1:]], [len(owner)]))
    return a[cut].tolist(), ends.tolist(), key[cut].tolist(), slot[cut].tolist(), style[cut].tolist()


def _shades(drawn: np.ndarray, colour: np.ndarray, row_first: np.ndarray) -> np.ndarray:
    """Per run, its shade: along a chain of touching runs of one colour every other one is
    darker (1), so that where they meet shows; a run after a blank or another colour is 0."""
    step = np.arange(len(drawn))
    touching = np.zeros(len(drawn), dtype=bool)
    touching[1:] = drawn[1:] & (colour[1:] == colour[:-1]) & ~row_first[1:]
    chain = np.maximum.accumulate(np.where(touching, 0, step))  # where each run's chain began
    return (step - chain) & 1


def _blanks_joined(key: np.ndarray, drawn: np.ndarray, row_first: np.ndarray, row_last: np.ndarray) -> np.ndarray:
    """The runs' keys with each blank run taking the key of a glyph run beside it in its row (the
    one before it first); runs never repeat their owner, so blank runs are never side by side."""
    before = np.concatenate(([_BLANK], key[:-1]))
    before[row_first] = _BLANK
    after = np.concatenate((key[1:], [_BLANK]))
    after[row_last] = _BLANK
    blank = ~drawn
    return np.where(blank & (before >= 0), before, np.where(blank & (after >= 0), after, key))


class _Geometry(NamedTuple):
    """What every line of a frame looks at: the widget's size, scroll, base style."""

    width: int
    height: int  # of the scrollable content region
    track: int  # characters of the time axis
    scroll_y: int
    base: Style
    components: dict[str, Style]  # component class -> rich style, filled as lines ask


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
        self._lanes = _Lanes([np.zeros(0)] * 8, np.zeros(1, dtype=np.int64), [], [], [])
        self._lane_offsets: list[int] = [0]
        self._count = 0
        self._extent = (0.0, 1.0)
        self._view = (0.0, 1.0)
        self._selected: tuple[int, int] | None = None  # (lane, index in lane order)
        self._styles = _STYLES  # per style id (palette index * 2 + shade): (measured, modeled)
        self._swatch: int | None = None
        self._glyph_base: Style | None = None
        self._glyph_cache: list[Style] = []
        self._tracks: dict[int, list[Segment]] = {}  # the lanes on screen, drawn together (_track_segments)
        self._tracks_key: tuple | None = None
        self._held_geometry: _Geometry | None = None  # during render_lines
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
        order = _lane_order(np.where(keep, lane, len(lane_names)), start_s, dur_s, int(np.count_nonzero(keep)))
        sorted_lane = lane[order]
        bounds = np.searchsorted(sorted_lane, np.arange(len(lane_names) + 1), side="left")
        # a span's colour follows its name (or colour key); touching neighbours of one colour get
        # alternate shades when drawn (_track_runs)
        keys = list(colour_keys) if colour_keys is not None else names
        colours = np.array([_colour_of(k) for k in keys], dtype=np.int64) if names else np.zeros(1, np.int64)
        span_colours = colours[name[order]] if len(order) else np.zeros(0, np.int64)
        if self._swatch is None and len(order):  # the legend's swatch: the first span's colour, ever
            self._swatch = int(span_colours[0]) * 2
        cols = [start_s[order], np.maximum(dur_s[order], 0.0), modeled[order], name[order], layer[order],
                step[order], kind[order], span_colours]
        versions = self._lane_versions(lane_names, names, bounds, cols)
        self._previous_columns = (lane_names, names, bounds, cols, versions)
        self._lane_names = lane_names
        self._lanes = _Lanes(cols, bounds, versions, names, kinds)
        self._lane_offsets = bounds.tolist()
        self._count = len(order)
        self._extent = self._extent_of(cols[0], cols[1])
        self._selected = None
        self._matches = None
        if fit or not self._count:
            self._view = self._extent
        self.virtual_size = Size(0, HEADER_ROWS + len(lane_names) + FOOTER_ROWS)
        self.refresh()

    @staticmethod
    def _extent_of(starts: np.ndarray, durs: np.ndarray) -> tuple[float, float]:
        if not len(starts):
            return (0.0, 1.0)
        t0, t1 = float(starts.min()), float((starts + durs).max())
        if t1 - t0 < MIN_VIEW_S:
            t1 = t0 + max(MIN_VIEW_S, 1e-6)
        return (t0, t1)

    def _lane_versions(self, lane_names: list[str], names: list[str], bounds: np.ndarray,
                       cols: list[np.ndarray]) -> list[int]:
        """Per lane, the version it had before this set_columns where it draws the same (its line
        is then reused), else a new one: every lane whose span count is unchanged is compared span
        by span in a few numpy calls for all of them, no lane built."""
        previous = getattr(self, "_previous_columns", None)
        if previous is None or previous[0] != lane_names or previous[1] != names:
            return [next(_LANE_VERSIONS) for _ in lane_names]
        old_bounds, before, old_versions = previous[2], previous[3], previous[4]
        counts = np.diff(bounds)
        same_count = counts == np.diff(old_bounds)
        lane_of = np.repeat(np.arange(len(lane_names)), counts)
        if np.array_equal(bounds, old_bounds):
            at = was = slice(None)
        else:  # each span of such a lane against the one at the same place in it before
            at = np.flatnonzero(same_count[lane_of])
            lane_of = lane_of[at]
            was = at - bounds[lane_of] + old_bounds[lane_of]
        # starts, durs, modeled, name ids, layers, colours: what a lane draws (steps and kinds do not show)
        equal = np.ones(len(lane_of), dtype=bool)
        for k in (0, 1, 2, 3, 4, 7):
            equal &= before[k][was] == cols[k][at]
        differs = np.zeros(len(lane_names), dtype=bool)
        differs[lane_of[~equal]] = True
        alike = (same_count & ~differs).tolist()
        return [old if same else next(_LANE_VERSIONS) for same, old in zip(alike, old_versions)]

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
        return self._geometry().track

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
        geometry = self._geometry()
        rows = max(1, geometry.height - HEADER_ROWS - FOOTER_ROWS)
        return range(geometry.scroll_y, min(len(self._lanes), geometry.scroll_y + rows))

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
        """int64 [width]: index (in lane order) of the span drawn at each column, -1 for none."""
        raster = self._raster_of([lane], width)
        if not len(raster.index):
            return None
        return np.where(raster.owner >= 0, raster.index[np.maximum(raster.owner, 0)], -1)

    def _raster_of(self, lanes: Sequence[int], width: int) -> _Raster:
        """The spans of `lanes` (a row each) bucketed into `width` columns of the view, all rows
        in a few numpy calls: what a frame draws, computed once for every lane on screen."""
        v0, v1 = self._view
        columns, bounds = self._lanes.columns, self._lanes.bounds
        at = np.asarray(lanes, dtype=np.int64)
        if v0 <= self._extent[0] and self._extent[1] <= v1:  # every span in view: no lane to search
            begin, counts = bounds[at], bounds[at + 1] - bounds[at]
        else:
            ranges = [self._lanes[lane].visible(v0, v1) for lane in lanes]
            counts = np.array([hi - lo for lo, hi in ranges], dtype=np.int64)
            begin = np.array([bounds[lane] + lo for lane, (lo, _) in zip(lanes, ranges)], dtype=np.int64)
        row = np.repeat(np.arange(len(lanes)), counts)
        flat = np.arange(len(row)) + np.repeat(begin - (np.cumsum(counts) - counts), counts)
        starts, durs = columns[0][flat], columns[1][flat]
        ends = starts + durs
        keep = np.flatnonzero((ends > v0) | ((durs == 0) & (starts >= v0)))
        flat, row, starts, ends, durs = flat[keep], row[keep], starts[keep], ends[keep], durs[keep]
        scale = width / (v1 - v0)
        c0 = np.clip(np.floor((starts - v0) * scale), 0, width - 1).astype(np.int64)
        c1 = np.clip(np.maximum(np.ceil((ends - v0) * scale), c0 + 1), 1, width).astype(np.int64)
        owner = _paint(row * width + c0, c1 - c0, durs, len(lanes) * width)
        index = flat - bounds[at[row]]
        return _Raster(width, owner, list(lanes), row, index, flat, c0, columns[7][flat], columns[2][flat])

    def render_lines(self, crop: Region) -> list[Strip]:
        # the geometry once per frame: line_key and render_line run for every line, and each look
        # at the widget's region walks the DOM
        self._held_geometry = None
        self._held_geometry = self._geometry()
        try:
            return super().render_lines(crop)
        finally:
            self._held_geometry = None

    def _geometry(self) -> _Geometry:
        held = self._held_geometry
        if held is not None:
            return held
        region = self.scrollable_content_region
        return _Geometry(self.size.width, region.height, max(1, region.width - self._gutter), self.scroll_offset.y,
                         self.visual_style.rich_style, {})

    def _component_style(self, name: str) -> Style:
        styles = self._geometry().components
        style = styles.get(name)
        if style is None:
            style = styles[name] = self.get_component_rich_style(name)
        return style

    def line_key(self, y: int):
        if not self._count:
            return ("empty", y)
        geometry = self._geometry()
        height = geometry.height
        if y < HEADER_ROWS:
            return ("ruler", self._view, geometry.track)
        if y == height - 1:
            sel = self._selected
            where = (self._lanes.version(sel[0]), self._lane_names[sel[0]]) if sel is not None else None
            return ("legend", self._view, self._extent, self._count, self._swatch, sel, where)
        lane = geometry.scroll_y + y - HEADER_ROWS
        if lane >= len(self._lanes) or y >= height:
            return ("blank",)
        sel = self._selected
        return ("lane", lane, self._lanes.version(lane), self._lane_names[lane], self._view, geometry.track,
                self._gutter, sel[1] if sel is not None and sel[0] == lane else None)

    def render_line(self, y: int) -> Strip:
        geometry = self._geometry()
        width, base = geometry.width, geometry.base
        if not self._count:
            if y == 0:
                style = self._component_style("timeline--empty")
                return Strip([Segment(" no spans", style)]).adjust_cell_length(width, base)
            return Strip.blank(width, base)
        height = geometry.height
        if y < HEADER_ROWS:
            return self._render_ruler(width, base)
        if y == height - 1:
            return self._render_legend(width, base)
        lane = geometry.scroll_y + y - HEADER_ROWS
        if lane >= len(self._lanes) or y >= height:
            return Strip.blank(width, base)
        return self._render_lane(lane, width, base)

    def _render_lane(self, lane: int, width: int, base: Style) -> Strip:
        gutter = self._gutter
        selected = self._selected
        sel_index = selected[1] if selected is not None and selected[0] == lane else -2
        name_style = self._component_style("timeline--lane-selected" if sel_index >= 0 else "timeline--lane")
        name = self._lane_names[lane]
        if cell_len(name) > gutter - 1:
            name = name[: max(0, gutter - 2)] + "…"
        segments = [Segment(name.ljust(gutter)[:gutter], name_style)]
        track = self._geometry().track
        segments += self._track_segments(lane, track, base)
        return Strip(segments, gutter + track).adjust_cell_length(width, base)

    def _track_segments(self, lane: int, track: int, base: Style) -> list[Segment]:
        """A lane's track in as few segments as draw it (_track_runs): Textual's cost per frame
        follows the number of segments on screen, not cells. The lanes on screen are drawn
        together, once per view, width, selection and set of spans (a new record: once)."""
        lanes = self._visible_lanes()
        if lane not in lanes:
            lanes = range(lane, lane + 1)
        key = (self._lanes, self._view, track, self._selected, base, lanes)
        if self._tracks_key != key:
            self._tracks, self._tracks_key = self._draw_tracks(lanes, track, base), key
        return self._tracks[lane]

    def _draw_tracks(self, lanes: Sequence[int], track: int, base: Style) -> dict[int, list[Segment]]:
        """Per lane, its track's segments."""
        raster = self._raster_of(lanes, track)
        selected = raster.slot(*self._selected) if self._selected is not None else -2
        text = _glyph_text(raster.owner, raster.modeled)
        glyph_styles = self._glyph_styles(base)
        out: dict[int, list[Segment]] = {lane: [] for lane in lanes}
        for a, b, key, slot, style_id in zip(*_track_runs(raster, selected)):
            segments = out[raster.lanes[a // track]]
            if key >= 0:
                segments.append(Segment(text[a:b], glyph_styles[key]))
            elif key == _BLANK:
                segments.append(Segment(text[a:b], base))
            else:
                label = self._lanes.label(raster.flat[slot]) if b - a >= 4 and raster.first[slot] == a % track else ""
                modeled = bool(raster.modeled[slot])
                segments.append(self._piece(modeled, style_id, b - a, label, slot == selected, glyph_styles))
        return out

    def _glyph_styles(self, base: Style) -> list[Style]:
        """Per glyph key (style id * 2 + modeled): the colour as a foreground over the widget's
        background, so that blank cells beside the glyphs can share their segment."""
        if self._glyph_base != base:
            self._glyph_base = base
            self._glyph_cache = [base + style for pair in _GLYPH_STYLES for style in pair]
        return self._glyph_cache

    def _piece(self, modeled: bool, style_id: int, n: int, label: str, selected: bool,
               glyph_styles: list[Style]) -> Segment:
        """A piece of a span drawn on its own: it shows the span's name or is the selection."""
        if modeled:
            if selected:
                style = self.get_component_rich_style("timeline--selected") + _ITALIC
            else:
                style = glyph_styles[style_id * 2 + 1]
            if label and n >= len(label) + 4:
                return Segment(f"{MODELED_GLYPH} {label} {_repeat(_HATCH, MODELED_GLYPH, n - len(label) - 3)}", style)
            return Segment(_repeat(_HATCH, MODELED_GLYPH, n), style)
        style = self.get_component_rich_style("timeline--selected") if selected else self._styles[style_id][0]
        # names are taken as one cell per character: kernel and span names are ASCII
        return Segment(f" {label}"[:n].ljust(n) if label else _repeat(_SPACES, " ", n), style)

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
        # the swatches on the widget's background, as the tracks draw them (unset, a terminal
        # shows its own background there: black behind them in the light theme)
        segments = [
            Segment(" ", base),
            Segment(MEASURED_GLYPH, base + Style(color=swatch_measured.bgcolor)),
            Segment(" measured", style),
            *([Segment("  ", style), Segment(MODELED_GLYPH, base + swatch_modeled), Segment(" modeled", style)]
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
