"""Chart: line series in braille dots, or a histogram in eighth blocks (Textual Line API).

    chart = Chart()
    chart.plot_lines(steps, [("d0", hbm_d0), ("d1", hbm_d1)], hline=capacity)
    chart.plot_histogram(ttft_ms, bins=20, unit="ms")

Layout: a legend on the first row, the plot area below it with y-axis labels in a left gutter,
and x-axis labels on the last row. A line series is rasterised with numpy onto a grid of 2 x 4
dots per character (Unicode braille), consecutive columns joined by a vertical run so a steep
line stays connected; where series share a character its dots are merged and the later series'
colour is drawn. Series colours are the Okabe-Ito palette (distinguishable with the common
colour-vision deficiencies) and every series is named in the legend, so colour is not the only
signal. A redraw costs what numpy and one Segment per colour run cost, not a Python loop per
dot: plotext, which it replaced, rebuilt its whole canvas in Python on every redraw (the Memory
tab's frame in bench/console_bench.py fell from 101 to 17.5 ms with this and the memory table's
change).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
from rich.segment import Segment
from rich.style import Style
from textual.strip import Strip
from textual.widget import Widget

from moectl.console.widgets.line_cache import LineCacheMixin
from moectl.console.widgets.palette import PALETTE

LEGEND_ROWS = 1
AXIS_ROWS = 1
# bit of each dot in a braille cell, by (row 0-3, column 0-1): Unicode's dot numbering
_BRAILLE_BITS = np.array([[0x01, 0x08], [0x02, 0x10], [0x04, 0x20], [0x40, 0x80]], dtype=np.int64)
_EIGHTHS = np.array(list(" ▁▂▃▄▅▆▇█"), dtype=object)
_BRAILLE = np.array([" "] + [chr(0x2800 + bits) for bits in range(1, 256)], dtype=object)
_VERSIONS = itertools.count(1)


def format_tick(value: float) -> str:
    """A short axis label: 3 significant digits, k/M/G from ten thousand up."""
    a = abs(value)
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e4, "k")):
        if a >= scale:
            return f"{value / scale:.3g}{suffix}"
    if a >= 100:
        return f"{value:.0f}"
    if a >= 1 or a == 0:
        return f"{value:.3g}"
    return f"{value:.2g}"


def _finite_range(values: np.ndarray, lo: float | None, hi: float | None) -> tuple[float, float]:
    finite = values[np.isfinite(values)]
    v0 = float(finite.min()) if lo is None and finite.size else (lo if lo is not None else 0.0)
    v1 = float(finite.max()) if hi is None and finite.size else (hi if hi is not None else 1.0)
    if v1 <= v0:  # a flat series: give it a band to sit in
        pad = abs(v0) * 0.05 or 1.0
        v0, v1 = (v0 - pad, v1 + pad) if lo is None else (v0, v0 + 2 * pad)
    return v0, v1


class Chart(LineCacheMixin, Widget):
    """Line series or a histogram, sized to the widget."""

    COMPONENT_CLASSES = {"chart--axis", "chart--legend", "chart--empty", "chart--hline"}
    LINE_CACHE_STYLES = tuple(sorted(COMPONENT_CLASSES))

    DEFAULT_CSS = """
    Chart {
        height: 12;
        width: 1fr;
    }
    Chart > .chart--axis {
        color: $text-muted;
    }
    Chart > .chart--legend {
        color: $text;
    }
    Chart > .chart--empty {
        color: $text-muted;
        text-style: italic;
    }
    Chart > .chart--hline {
        color: $error;
    }
    """

    def __init__(self, *, name: str | None = None, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self._kind = "empty"
        self._data: tuple = ()
        self._version = next(_VERSIONS)
        self._drawn: tuple | None = None  # (version, size) of the rows in self._rows
        self._rows: list[Strip] = []

    # ------------------------------------------------------------------------------ data

    def _set(self, kind: str, data: tuple) -> None:
        if (kind, data) == (self._kind, self._data):
            return  # the same picture: no redraw
        self._kind, self._data = kind, data
        self._version = next(_VERSIONS)
        self.refresh()

    def plot_lines(self, x: Sequence[float], series: Sequence[tuple[str, Sequence[float]]], *,
                   y_range: tuple[float | None, float | None] = (None, None), hline: float | None = None) -> None:
        """Series against one x axis: `series` is (label, y values, one per x); `y_range` fixes
        either end of the y axis (None: the data's); `hline` draws a horizontal reference line."""
        xs = tuple(float(v) for v in x)
        data = (xs, tuple((str(label), tuple(float(v) for v in ys)) for label, ys in series), tuple(y_range), hline)
        self._set("lines" if xs and series else "empty", data)

    def plot_histogram(self, values: Sequence[float], *, bins: int = 20, unit: str = "") -> None:
        """The distribution of `values` in `bins` equal bins, one bar each, counts on the y axis."""
        data = (tuple(float(v) for v in values), int(bins), unit)
        self._set("histogram" if values else "empty", data)

    @property
    def kind(self) -> str:
        """"lines", "histogram" or "empty"."""
        return self._kind

    # ---------------------------------------------------------------------- line API

    def line_key(self, y: int):
        return (self._version, y)

    def render_line(self, y: int) -> Strip:
        width, height = self.size
        key = (self._version, width, height, self._style_generation, self.app.theme)
        if self._drawn != key:
            self._rows = self._draw(width, height)
            self._drawn = key
        base = self.visual_style.rich_style
        if y < len(self._rows):
            return self._rows[y].adjust_cell_length(width, base)
        return Strip.blank(width, base)

    # --------------------------------------------------------------------- drawing

    def _draw(self, width: int, height: int) -> list[Strip]:
        base = self.visual_style.rich_style
        if self._kind == "empty" or width < 8 or height < LEGEND_ROWS + AXIS_ROWS + 1:
            return [Strip([Segment(" no data yet", self.get_component_rich_style("chart--empty"))])]
        if self._kind == "lines":
            return self._draw_lines(width, height, base)
        return self._draw_histogram(width, height, base)

    def _frame(self, width: int, height: int, y0: float, y1: float,
               counts: bool = False) -> tuple[int, int, int, list[str]]:
        """(gutter, plot width, plot height, y label per plot row) for a y range (counts: whole
        numbers only, the middle label dropped when it would not be one)."""
        rows = height - LEGEND_ROWS - AXIS_ROWS
        labels = [""] * rows
        for row in sorted({0, rows // 2, rows - 1}):
            frac = 1.0 - row / max(1, rows - 1)
            value = y0 + frac * (y1 - y0)
            if counts and abs(value - round(value)) > 1e-9:
                continue
            labels[row] = format_tick(round(value) if counts else value)
        gutter = max(len(s) for s in labels) + 1
        return gutter, max(1, width - gutter), rows, labels

    def _x_axis(self, gutter: int, plot_w: int, x0: float, x1: float, axis: Style) -> Strip:
        chars = [" "] * plot_w
        free = 0
        ticks = max(2, plot_w // 14)
        for k in range(ticks + 1):
            col = round(k * (plot_w - 1) / ticks)
            label = format_tick(x0 + (x1 - x0) * col / max(1, plot_w - 1))
            start = min(col, plot_w - len(label))
            if start >= free:
                chars[start:start + len(label)] = label
                free = start + len(label) + 1
        return Strip([Segment(" " * gutter, axis), Segment("".join(chars), axis)])

    def _legend(self, entries: list[tuple[str, Style]], base: Style, extra: str = "") -> Strip:
        legend = self.get_component_rich_style("chart--legend")
        segments = [Segment(" ", base)]
        for label, style in entries:
            segments += [Segment("━━", base + style), Segment(f" {label}  ", legend)]
        if extra:
            segments.append(Segment(extra, self.get_component_rich_style("chart--axis")))
        return Strip(segments)

    def _rows_from_cells(self, gutter: int, labels: list[str], glyphs: np.ndarray, owner: np.ndarray,
                         styles: list[Style], base: Style, axis: Style) -> list[Strip]:
        """One Strip per plot row: the y label, then one Segment per run of one owner (-1: blank)."""
        out = []
        for row in range(glyphs.shape[0]):
            segments = [Segment(labels[row].rjust(gutter - 1) + "│", axis)]
            own = owner[row]
            change = np.flatnonzero(own[1:] != own[:-1]) + 1
            bounds = [0, *change.tolist(), len(own)]
            text = "".join(glyphs[row].tolist())
            for a, b in zip(bounds, bounds[1:]):
                who = int(own[a])
                segments.append(Segment(text[a:b], base if who < 0 else base + styles[who]))
            out.append(Strip(segments))
        return out

    def _draw_lines(self, width: int, height: int, base: Style) -> list[Strip]:
        xs_raw, series, (lo, hi), hline = self._data
        xs = np.asarray(xs_raw, dtype=np.float64)
        ys_all = np.array([ys for _, ys in series], dtype=np.float64).reshape(len(series), -1)
        extra = ys_all if hline is None else np.append(ys_all, hline)
        y0, y1 = _finite_range(np.ravel(extra), lo, hi)
        gutter, plot_w, rows, labels = self._frame(width, height, y0, y1)
        x0, x1 = float(xs.min()), float(xs.max())
        dots_w, dots_h = 2 * plot_w, 4 * rows
        columns = np.arange(dots_w)
        # each dot column's x, and each series' y there (linear between samples)
        x_at = x0 + (x1 - x0) * columns / max(1, dots_w - 1) if x1 > x0 else np.full(dots_w, x0)
        half = 0.5 * (x1 - x0) / max(1, dots_w - 1)
        order = np.argsort(xs, kind="stable")
        bits = np.zeros((rows, plot_w), dtype=np.int64)
        owner = np.full((rows, plot_w), -1, dtype=np.int64)
        drawn = [(k, ys) for k, ys in enumerate(ys_all)]
        if hline is not None:
            drawn.insert(0, (len(series), np.full(len(xs), float(hline))))
        for k, ys in drawn:
            ok = np.isfinite(ys[order])
            if not ok.any():
                continue
            xo, yo = xs[order][ok], ys[order][ok]
            inside = (x_at >= xo[0] - half) & (x_at <= xo[-1] + half)
            level = np.rint((y1 - np.interp(x_at, xo, yo)) / (y1 - y0) * (dots_h - 1))
            level = np.clip(level, 0, dots_h - 1).astype(np.int64)
            # join each column to the one before it with a vertical run, so steep lines stay connected
            prev = np.where(np.concatenate([[True], ~inside[:-1]]), level, np.concatenate([level[:1], level[:-1]]))
            top, bottom = np.minimum(level, prev), np.maximum(level, prev)
            if not inside.any():
                continue
            # only the character rows the series touches (a flat line: one or two of them)
            r0, r1 = int(top[inside].min()) // 4, int(bottom[inside].max()) // 4 + 1
            dot_rows = np.arange(4 * r0, 4 * r1)[:, None]
            dots = (dot_rows >= top) & (dot_rows <= bottom) & inside
            cell_bits = (dots.reshape(r1 - r0, 4, plot_w, 2) * _BRAILLE_BITS[None, :, None, :]).sum(axis=(1, 3))
            bits[r0:r1] |= cell_bits
            owner[r0:r1] = np.where(cell_bits > 0, k, owner[r0:r1])
        glyphs = _BRAILLE[bits]
        styles = [Style(color=PALETTE[k % len(PALETTE)]) for k in range(len(series))]
        styles.append(self.get_component_rich_style("chart--hline"))
        axis = self.get_component_rich_style("chart--axis")
        entries = [(label, styles[k]) for k, (label, _) in enumerate(series) if len(series) > 1 or label]
        extra = f"┄ {format_tick(hline)}" if hline is not None else ""
        return [self._legend(entries, base, extra),
                *self._rows_from_cells(gutter, labels, glyphs, owner, styles, base, axis),
                self._x_axis(gutter, plot_w, x0, x1, axis)]

    def _draw_histogram(self, width: int, height: int, base: Style) -> list[Strip]:
        values_raw, bins, unit = self._data
        values = np.asarray(values_raw, dtype=np.float64)
        values = values[np.isfinite(values)]
        lo, hi = (float(values.min()), float(values.max())) if values.size else (0.0, 1.0)
        if hi <= lo:
            hi = lo + (abs(lo) * 0.05 or 1.0)
        counts, edges = np.histogram(values, bins=max(1, bins), range=(lo, hi))
        top = int(counts.max()) if counts.size else 0
        gutter, plot_w, rows, labels = self._frame(width, height, 0.0, float(max(top, 1)), counts=True)
        # each bin gets an equal share of the columns; a bar's height in eighths of a row
        col_bin = np.minimum((np.arange(plot_w) * len(counts)) // plot_w, len(counts) - 1)
        eighths = np.rint(counts[col_bin] / max(top, 1) * rows * 8).astype(np.int64)
        row_floor = (rows - 1 - np.arange(rows))[:, None] * 8  # eighths below each row
        fill = np.clip(eighths[None, :] - row_floor, 0, 8)
        glyphs = _EIGHTHS[fill]
        # alternate two shades of one colour between neighbouring bins, so bars stay apart
        owner = np.where(fill > 0, (col_bin % 2)[None, :], -1)
        colour = PALETTE[1]
        styles = [Style(color=colour), Style(color=colour, dim=True)]
        axis = self.get_component_rich_style("chart--axis")
        x_unit = f", x in {unit}" if unit else ""
        legend = self._legend([(f"count per bin ({len(values)} values, {len(counts)} bins{x_unit})", styles[0])], base)
        axis_strip = self._x_axis(gutter, plot_w, float(edges[0]), float(edges[-1]), axis)
        return [legend, *self._rows_from_cells(gutter, labels, glyphs, owner, styles, base, axis), axis_strip]

