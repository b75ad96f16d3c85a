"""HeatMap: a [layers x experts] matrix as coloured cells (Textual Line API).

One text row per layer, a fixed label gutter at the left ("L12 ") and a fixed expert ruler at the
top; `cell_width` characters per expert. Big grids (61 x 384) scroll both ways, and a line is
rendered from the visible slice of one row only: values are quantised once per set_data into
colour levels (an int16 matrix), and a row becomes one Segment per run of equal level.

    heat = HeatMap(scale_name="viridis")
    heat.set_data(tokens_per_expert)          # np.ndarray [layers, experts], non-negative
    heat.cursor = (3, 17)                     # posts HeatMap.CellSelected(3, 17, value)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding, BindingType
from textual.geometry import Region, Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from moectl.console.widgets.colour_scale import ColourScale, _check_name
from moectl.console.widgets.line_cache import LineCacheMixin

LEVELS = 64
"""Colour levels: 0 is kept for cells whose value is 0, 1..LEVELS-1 for (0, max]."""

HEADER_ROWS = 1
_LOG_DECADES = 3.0  # log_scale: value / max over 3 decades, 1e-3 -> ~0.1, 1 -> 1
_MAX_SPACES = 4096
_SPACES = [" " * n for n in range(_MAX_SPACES + 1)]
_ROW_VERSIONS = itertools.count(1)


def _spaces(n: int) -> str:
    return _SPACES[n] if n <= _MAX_SPACES else " " * n


def quantise(matrix: np.ndarray, vmax: float, log_scale: bool, levels: int = LEVELS) -> np.ndarray:
    """int16 colour levels for a non-negative matrix: 0 where the value is 0, otherwise
    1..levels-1 by value / vmax (or its log over 3 decades), the largest value at levels-1."""
    out = np.zeros(matrix.shape, dtype=np.int16)
    if matrix.size == 0 or not vmax > 0:
        return out
    r = np.clip(matrix / vmax, 0.0, 1.0)
    if log_scale:
        r = np.log10(1.0 + r * (10.0**_LOG_DECADES - 1.0)) / _LOG_DECADES
    lev = np.ceil(r * (levels - 1))
    np.clip(lev, 1, levels - 1, out=lev)
    positive = matrix > 0
    out[positive] = lev[positive].astype(np.int16)
    return out


class HeatMap(LineCacheMixin, ScrollView, can_focus=True):
    """A scrollable heat map of a [layers x experts] matrix with a keyboard/mouse cursor."""

    COMPONENT_CLASSES = {
        "heatmap--label",
        "heatmap--label-cursor",
        "heatmap--header",
        "heatmap--header-cursor",
        "heatmap--empty",
    }
    LINE_CACHE_STYLES = tuple(sorted(COMPONENT_CLASSES))

    DEFAULT_CSS = """
    HeatMap {
        height: 1fr;
        width: 1fr;
    }
    HeatMap > .heatmap--label {
        color: $text-muted;
    }
    HeatMap > .heatmap--label-cursor {
        color: $text;
        background: $accent 40%;
        text-style: bold;
    }
    HeatMap > .heatmap--header {
        color: $text-muted;
    }
    HeatMap > .heatmap--header-cursor {
        color: $accent;
        text-style: bold;
    }
    HeatMap > .heatmap--empty {
        color: $text-muted;
        text-style: italic;
    }
    """

    BINDINGS: list[BindingType] = [
        Binding("up", "move_cursor(-1, 0)", "Layer up", show=False),
        Binding("down", "move_cursor(1, 0)", "Layer down", show=False),
        Binding("left", "move_cursor(0, -1)", "Expert left", show=False),
        Binding("right", "move_cursor(0, 1)", "Expert right", show=False),
        Binding("home", "cursor_home", "First expert", show=False),
        Binding("end", "cursor_end", "Last expert", show=False),
        Binding("pageup", "page_cursor(-1)", "Page up", show=False),
        Binding("pagedown", "page_cursor(1)", "Page down", show=False),
    ]

    class CellSelected(Message):
        """The cursor moved to a cell, or a cell was clicked."""

        def __init__(self, heat_map: HeatMap, layer: int, expert: int, value: float, label: str) -> None:
            super().__init__()
            self.heat_map = heat_map
            self.layer = layer
            """Row index into the matrix."""
            self.expert = expert
            """Column index into the matrix."""
            self.value = value
            self.label = label
            """The row's label (e.g. "L12")."""

        @property
        def control(self) -> HeatMap:
            return self.heat_map

    scale_name: reactive[str] = reactive("viridis")
    log_scale: reactive[bool] = reactive(False)
    cursor: reactive[tuple[int, int]] = reactive((0, 0), init=False)

    def __init__(
        self,
        matrix: np.ndarray | None = None,
        *,
        scale_name: str = "viridis",
        log_scale: bool = False,
        cell_width: int = 0,
        labels: Sequence[str | int] | None = None,
        name: str | None = None,
        id: str | None = None,
        classes: str | None = None,
        disabled: bool = False,
    ) -> None:
        """
        Args:
            matrix: initial data ([layers, experts], non-negative), or None for "no routing yet".
            scale_name: one of colour_scale.SCALES.
            log_scale: colour by log(value / max) over 3 decades instead of value / max.
            cell_width: characters per expert; 0 picks 2 when the whole row fits, else 1.
            labels: row labels (ints become "L<n>"); default "L0".."L<layers-1>".
        """
        super().__init__(name=name, id=id, classes=classes, disabled=disabled)
        self._cell_width_setting = max(0, int(cell_width))
        self._matrix: np.ndarray = np.zeros((0, 0))
        self._levels: np.ndarray = np.zeros((0, 0), dtype=np.int16)
        self._row_versions: list[int] = []  # per row: changes whenever the row's levels do
        self._labels: list[str] = []
        self._label_text: list[str] = []
        self._gutter = 0
        self._cw = 1
        self._max = 0.0
        self._vmax: float | None = None
        self._header_cache: tuple[tuple[int, int], str] | None = None
        self.set_reactive(HeatMap.scale_name, _check_name(scale_name))
        self.set_reactive(HeatMap.log_scale, bool(log_scale))
        self._scale = ColourScale(scale_name)
        self._styles = self._scale.styles(LEVELS)
        self._segment_table = self._build_segment_table()
        self._cursor_styles: dict[int, Style] = {}
        if matrix is not None:
            self.set_data(matrix, labels=labels)

    # ----------------------------------------------------------------------------- data

    def set_data(
        self,
        matrix: np.ndarray | Sequence[Sequence[float]],
        *,
        labels: Sequence[str | int] | None = None,
        vmax: float | None = None,
    ) -> None:
        """Show a new matrix (any shape: a replay of another model is fine).

        Args:
            matrix: [layers, experts] non-negative numbers (a 1-D array is one row); NaN and
                negative values are drawn as 0.
            labels: one per row; ints become "L<n>"; default "L0".."L<layers-1>".
            vmax: the value drawn at full colour (default: the matrix's max), so that a sequence
                of frames can share one scale.
        """
        arr = np.asarray(matrix, dtype=np.float64)
        if arr.ndim == 1:
            arr = arr.reshape(1, -1) if arr.size else np.zeros((0, 0))
        if arr.ndim != 2:
            raise ValueError(f"heat map data must be 2-D [layers, experts], got shape {arr.shape}")
        arr = np.nan_to_num(arr, nan=0.0, posinf=0.0, neginf=0.0)
        np.maximum(arr, 0.0, out=arr)
        rows = arr.shape[0] if arr.size else 0
        if labels is None or rows == 0:
            text = [f"L{i}" for i in range(rows)]
        else:
            if len(labels) != rows:
                raise ValueError(f"{len(labels)} labels for {rows} rows")
            text = [f"L{v}" if isinstance(v, (int, np.integer)) else str(v) for v in labels]
        before = (self._label_text, self._cw, self.virtual_size)
        self._matrix = arr if arr.size else np.zeros((0, 0))
        self._labels = text
        self._gutter = (max(len(t) for t in text) + 1) if text else 0
        self._label_text = [t.ljust(self._gutter) for t in text]
        self._max = float(arr.max()) if arr.size else 0.0
        self._vmax = float(vmax) if vmax is not None and vmax > 0 else None
        levels_changed = self._requantise()
        self._update_geometry()
        layer, expert = self.cursor
        clamped = self._clamp((layer, expert))
        if clamped != (layer, expert):
            self.set_reactive(HeatMap.cursor, clamped)
        elif not levels_changed and before == (self._label_text, self._cw, self.virtual_size):
            return  # the same picture: no repaint
        self.refresh()

    def clear(self) -> None:
        """Back to the "no routing yet" state."""
        self.set_data(np.zeros((0, 0)))

    @property
    def matrix(self) -> np.ndarray:
        """The data shown (float64 [layers, experts], NaN/negative replaced by 0); read-only view."""
        view = self._matrix.view()
        view.flags.writeable = False
        return view

    @property
    def max_value(self) -> float:
        """The largest value in the matrix (0 when empty)."""
        return self._max

    @property
    def labels(self) -> list[str]:
        return list(self._labels)

    @property
    def shape(self) -> tuple[int, int]:
        return (self._matrix.shape[0], self._matrix.shape[1]) if self._matrix.size else (0, 0)

    @property
    def cell_width(self) -> int:
        """Characters per expert in use now."""
        return self._cw

    def cell_value(self, layer: int, expert: int) -> float:
        return float(self._matrix[layer, expert])

    def _requantise(self) -> bool:
        """New colour levels; True if any changed (the rows that did get new versions)."""
        vmax = self._vmax if self._vmax is not None else self._max
        old, self._levels = self._levels, quantise(self._matrix, vmax, self.log_scale)
        if old.shape != self._levels.shape:
            self._row_versions = [next(_ROW_VERSIONS) for _ in range(self._levels.shape[0])]
            return True
        changed = np.flatnonzero((old != self._levels).any(axis=1)).tolist() if old.size else []
        for row in changed:
            self._row_versions[row] = next(_ROW_VERSIONS)
        return bool(changed)

    def _update_geometry(self) -> None:
        layers, experts = self.shape
        if not layers:
            self._cw = 1
            self.virtual_size = Size(0, 0)
            return
        if self._cell_width_setting:
            self._cw = self._cell_width_setting
        else:
            width = self.scrollable_content_region.width or self.size.width
            self._cw = 2 if width and self._gutter + 2 * experts <= width else 1
        self._header_cache = None
        self.virtual_size = Size(self._gutter + experts * self._cw, HEADER_ROWS + layers)

    # --------------------------------------------------------------------- reactives

    def validate_scale_name(self, name: str) -> str:
        return _check_name(name)

    def _build_segment_table(self) -> list[list[Segment]]:
        """[level][n]: a run of n blank cells of a level (n < 16; index 0 unused)."""
        return [[Segment(_spaces(n), style) for n in range(16)] for style in self._styles]

    def watch_scale_name(self, name: str) -> None:
        self._scale = ColourScale(name)
        self._styles = self._scale.styles(LEVELS)
        self._segment_table = self._build_segment_table()
        self._cursor_styles.clear()
        self.refresh()

    def watch_log_scale(self, _value: bool) -> None:
        self._requantise()
        self.refresh()

    def _clamp(self, cell: tuple[int, int]) -> tuple[int, int]:
        layers, experts = self.shape
        layer, expert = int(cell[0]), int(cell[1])
        if not layers:
            return (0, 0)
        return (min(max(layer, 0), layers - 1), min(max(expert, 0), experts - 1))

    def validate_cursor(self, cell: tuple[int, int]) -> tuple[int, int]:
        return self._clamp(cell)

    def watch_cursor(self, old: tuple[int, int], new: tuple[int, int]) -> None:
        if not self.shape[0]:
            return
        self._refresh_rows(old[0], new[0])
        self.scroll_to_cursor()
        self._post_selected()

    def _post_selected(self) -> None:
        layer, expert = self.cursor
        if self.shape[0]:
            self.post_message(
                self.CellSelected(self, layer, expert, self.cell_value(layer, expert), self._labels[layer])
            )

    def _refresh_rows(self, *rows: int) -> None:
        width = self.size.width
        sy = self.scroll_offset.y
        self.refresh(Region(0, 0, width, HEADER_ROWS))
        for row in rows:
            y = HEADER_ROWS + row - sy
            if HEADER_ROWS <= y < self.size.height:
                self.refresh(Region(0, y, width, 1))

    def scroll_to_cursor(self) -> None:
        """Scroll (no animation) the least distance that brings the cursor cell into view."""
        layers, _experts = self.shape
        if not layers:
            return
        region = self.scrollable_content_region
        view_w = max(1, region.width - self._gutter)
        view_h = max(1, region.height - HEADER_ROWS)
        layer, expert = self.cursor
        sx, sy = self.scroll_offset
        x0 = expert * self._cw
        x1 = x0 + self._cw
        if x0 < sx:
            sx = x0
        elif x1 > sx + view_w:
            sx = x1 - view_w
        if layer < sy:
            sy = layer
        elif layer >= sy + view_h:
            sy = layer - view_h + 1
        if (sx, sy) != tuple(self.scroll_offset):
            self.scroll_to(sx, sy, animate=False, immediate=True)

    # ----------------------------------------------------------------------- actions

    def select_cell(self, layer: int, expert: int) -> None:
        """Move the cursor to (layer, expert) and post CellSelected even when it is already there."""
        cell = self._clamp((layer, expert))
        if cell == self.cursor:
            self.scroll_to_cursor()
            self._post_selected()
        else:
            self.cursor = cell

    def action_move_cursor(self, d_layer: int, d_expert: int) -> None:
        layer, expert = self.cursor
        self.cursor = (layer + d_layer, expert + d_expert)

    def action_cursor_home(self) -> None:
        self.cursor = (self.cursor[0], 0)

    def action_cursor_end(self) -> None:
        self.cursor = (self.cursor[0], max(0, self.shape[1] - 1))

    def action_page_cursor(self, direction: int) -> None:
        page = max(1, self.scrollable_content_region.height - HEADER_ROWS)
        self.cursor = (self.cursor[0] + direction * page, self.cursor[1])

    def cell_at(self, x: int, y: int) -> tuple[int, int] | None:
        """The (layer, expert) under content offset (x, y), or None (header, gutter, outside)."""
        layers, experts = self.shape
        if not layers or y < HEADER_ROWS or x < self._gutter:
            return None
        sx, sy = self.scroll_offset
        layer = sy + y - HEADER_ROWS
        expert = (sx + x - self._gutter) // self._cw
        if 0 <= layer < layers and 0 <= expert < experts:
            return (layer, expert)
        return None

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None:
            return
        cell = self.cell_at(offset.x, offset.y)
        if cell is None and self.shape[0] and offset.y >= HEADER_ROWS and offset.x < self._gutter:
            # a click on a row label moves the cursor to that layer, same expert
            layer = self.scroll_offset.y + offset.y - HEADER_ROWS
            if layer < self.shape[0]:
                cell = (layer, self.cursor[1])
        if cell is not None:
            event.stop()
            self.focus()
            self.select_cell(*cell)

    def on_resize(self, _event: events.Resize) -> None:
        self._update_geometry()
        self.refresh()

    # --------------------------------------------------------------------- rendering

    def _cursor_style(self, level: int) -> Style:
        style = self._cursor_styles.get(level)
        if style is None:
            v = level / (LEVELS - 1)
            style = Style(bgcolor=self._scale.colour(v), color=self._scale.contrast(v), bold=True)
            self._cursor_styles[level] = style
        return style

    def _cursor_glyph(self) -> str:
        cw = self._cw
        if cw == 1:
            return "◆"
        return "[" + " " * (cw - 2) + "]"

    def _header_text(self) -> str:
        layers, experts = self.shape
        key = (experts, self._cw)
        if self._header_cache is not None and self._header_cache[0] == key:
            return self._header_cache[1]
        cw = self._cw
        step = next(s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if s * cw >= 8)
        chars = [" "] * (experts * cw)
        free_from = 0
        for e in range(0, experts, step):
            label = str(e)
            x = e * cw
            if x < free_from or x + len(label) > len(chars):
                continue
            chars[x : x + len(label)] = label
            free_from = x + len(label) + 1
        text = "".join(chars)
        self._header_cache = (key, text)
        return text

    def line_frame(self):
        return self._scale.name

    def line_key(self, y: int):
        layers, experts = self.shape
        if not layers:
            return ("empty", y)
        sx, sy = self.scroll_offset
        x1 = min(sx + max(self.size.width - self._gutter, 0), experts * self._cw)
        cursor_layer, cursor_expert = self.cursor
        if y < HEADER_ROWS:
            return ("header", sx, x1, self._cw, experts, self._gutter, cursor_expert)
        layer = sy + y - HEADER_ROWS
        if layer >= layers:
            return ("blank",)
        return ("row", layer, self._row_versions[layer], self._label_text[layer], sx, x1, self._cw,
                cursor_expert if layer == cursor_layer else None)

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        base = self.visual_style.rich_style
        layers, experts = self.shape
        if not layers:
            if y == 0:
                style = self.get_component_rich_style("heatmap--empty")
                return Strip([Segment(" no routing yet", style)]).adjust_cell_length(width, base)
            return Strip.blank(width, base)
        sx, sy = self.scroll_offset
        gutter = self._gutter
        cw = self._cw
        avail = width - gutter
        x1 = min(sx + max(avail, 0), experts * cw)  # visible chars [sx, x1) of the cell area
        cursor_layer, cursor_expert = self.cursor
        if y < HEADER_ROWS:
            segments = [Segment(_spaces(gutter), base)] if gutter else []
            if x1 > sx:
                text = self._header_text()[sx:x1]
                header_style = self.get_component_rich_style("heatmap--header")
                cx = cursor_expert * cw + (cw - 1) // 2 - sx
                if 0 <= cx < len(text):
                    mark = self.get_component_rich_style("heatmap--header-cursor")
                    if cx:
                        segments.append(Segment(text[:cx], header_style))
                    segments.append(Segment("▼", mark))
                    if cx + 1 < len(text):
                        segments.append(Segment(text[cx + 1 :], header_style))
                else:
                    segments.append(Segment(text, header_style))
            return Strip(segments).adjust_cell_length(width, base)

        layer = sy + y - HEADER_ROWS
        if layer >= layers:
            return Strip.blank(width, base)
        label_class = "heatmap--label-cursor" if layer == cursor_layer else "heatmap--label"
        segments = [Segment(self._label_text[layer][:width], self.get_component_rich_style(label_class))]
        if x1 > sx:
            e0 = sx // cw
            e1 = -(-x1 // cw)
            levels_row = self._levels[layer, e0:e1]
            chars = np.repeat(levels_row, cw) if cw > 1 else levels_row
            start = sx - e0 * cw
            chars = chars[start : start + (x1 - sx)]
            cursor_level = -1
            if layer == cursor_layer and e0 <= cursor_expert < e1:
                c0 = max(cursor_expert * cw - sx, 0)
                c1 = min(cursor_expert * cw + cw - sx, len(chars))
                if c1 > c0:
                    chars = chars.copy()
                    cursor_level = int(self._levels[layer, cursor_expert])
                    chars[c0:c1] = -1
            n = len(chars)
            starts = np.flatnonzero(np.concatenate(([True], chars[1:] != chars[:-1])))
            values = chars[starts].tolist()
            lengths = np.diff(np.append(starts, n)).tolist()
            # one Segment per run of equal level; short runs come from a pre-built table
            table = self._segment_table
            short = len(table[0])
            styles = self._styles
            if cursor_level < 0:
                run_segments = [
                    table[v][k] if k < short else Segment(_spaces(k), styles[v]) for v, k in zip(values, lengths)
                ]
            else:
                run_segments = []
                add = run_segments.append
                a = 0
                for v, k in zip(values, lengths):
                    if v < 0:  # the cursor cell (or the visible part of it)
                        offset = sx + a - cursor_expert * cw
                        add(Segment(self._cursor_glyph()[offset : offset + k], self._cursor_style(cursor_level)))
                    else:
                        add(table[v][k] if k < short else Segment(_spaces(k), styles[v]))
                    a += k
            segments.extend(run_segments)
            return Strip(segments, cell_len(segments[0].text) + n).adjust_cell_length(width, base)
        return Strip(segments).adjust_cell_length(width, base)
