"""Bars: one horizontal bar per row, a label before it and a figure after it (Textual Line API).

    bars = Bars()
    bars.set_rows([("d0", 0.42, "1.2G / 80G"), ("d1", 0.97, "77G / 80G")], warn=0.8, crit=0.95)
    bars.set_rows([], empty="no accounting yet")

A row whose fraction is None has no bar: its label and text only (a figure the source lacks is
absent, not drawn as an empty bar).

The bar's colour crosses thresholds at `warn` and `crit`, and so does its glyph, so colour is not
the only signal: full blocks below warn, '▓' from warn, and a '!' after the figure from crit.
A row is drawn when it is on screen and its content changed; new figures re-lay out the screen
only when the number of rows changes. A Static of Rich Text (what this replaced) re-wrapped and
re-laid out all of its rows on every update: 7 ms a frame for 64 devices
(bench/console_bench.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from rich.segment import Segment
from rich.style import Style
from textual.strip import Strip
from textual.widget import Widget

from moectl.console.widgets.line_cache import LineCacheMixin

Row = tuple[str, float | None, str]


@functools.lru_cache(maxsize=64)
def _style(name: str) -> Style:
    return Style.parse(name)


class Bars(LineCacheMixin, Widget):
    """Labelled horizontal bars, one row each; its height is its number of rows."""

    COMPONENT_CLASSES = {"bars--empty"}
    LINE_CACHE_STYLES = tuple(sorted(COMPONENT_CLASSES))

    DEFAULT_CSS = """
    Bars {
        height: auto;
        width: 1fr;
    }
    Bars > .bars--empty {
        color: $text-muted;
    }
    """

    def __init__(self, *, styles: tuple[str, str, str] = ("green", "yellow", "red"), name: str | None = None,
                 id: str | None = None, classes: str | None = None) -> None:
        """styles: the bar's colour below warn, from warn, from crit (Rich style names)."""
        super().__init__(name=name, id=id, classes=classes)
        self._colours = styles
        self._rows: tuple[Row, ...] = ()
        self._empty = ""
        self._warn, self._crit = 0.8, 0.95

    def set_rows(self, rows: Sequence[Row], *, warn: float = 0.8, crit: float = 0.95, empty: str = "") -> None:
        """(label, fraction of full scale, text after the bar) per row; `empty`: shown without rows."""
        rows = tuple((str(label), None if frac is None else float(frac), str(after)) for label, frac, after in rows)
        if (rows, warn, crit, empty) == (self._rows, self._warn, self._crit, self._empty):
            return
        relayout = max(len(rows), 1) != max(len(self._rows), 1)
        self._rows, self._warn, self._crit, self._empty = rows, warn, crit, empty
        self.refresh(layout=relayout)

    @property
    def plain_text(self) -> str:
        """What the rows say, as text (one line a row): for tests and screen readers."""
        if not self._rows:
            return self._empty
        return "\n".join(self._row_text(row, self._widths(self.size.width or 80))[0] for row in self._rows)

    def get_content_height(self, container, viewport, width: int) -> int:
        return max(len(self._rows), 1)

    # ---------------------------------------------------------------------- line API

    def _widths(self, width: int) -> tuple[int, int]:
        label_w = max((len(r[0]) for r in self._rows), default=0)
        after_w = max((len(r[2]) for r in self._rows if r[1] is not None), default=0) + 2  # " text !"
        return label_w, max(4, width - label_w - 1 - after_w - 1)

    def line_key(self, y: int):
        row = self._rows[y] if y < len(self._rows) else None
        return (row, self._empty if not self._rows else None, self._warn, self._crit, self._widths(self.size.width))

    def _row_text(self, row: Row, widths: tuple[int, int]) -> tuple[str, int, int, int]:
        """(the row as text, where the bar starts, its filled cells, its width)."""
        label, frac, after = row
        label_w, bar_w = widths
        head = f"{label:>{label_w}} "
        if frac is None:
            return head + after, len(head), 0, 0
        frac = min(max(frac, 0.0), 1.0)
        filled = round(frac * bar_w)
        glyph = "█" if frac < self._warn else "▓"
        text = head + glyph * filled + "·" * (bar_w - filled) + f" {after}" + (" !" if frac >= self._crit else "")
        return text, len(head), filled, bar_w

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        base = self.visual_style.rich_style
        if not self._rows:
            if y == 0 and self._empty:
                return Strip([Segment(self._empty, self.get_component_rich_style("bars--empty"))]).adjust_cell_length(
                    width, base)
            return Strip.blank(width, base)
        if y >= len(self._rows):
            return Strip.blank(width, base)
        row = self._rows[y]
        text, at, filled, bar_w = self._row_text(row, self._widths(width))
        frac = row[1] or 0.0
        colour = self._colours[2] if frac >= self._crit else self._colours[1] if frac >= self._warn else self._colours[0]
        segments = [Segment(text[:at], base)]
        if filled:
            segments.append(Segment(text[at:at + filled], base + _style(colour)))
        if bar_w - filled:
            segments.append(Segment(text[at + filled:at + bar_w], base + _style("dim")))
        segments.append(Segment(text[at + bar_w:], base))
        return Strip(segments).adjust_cell_length(width, base)


StackedRow = tuple[str, tuple[float, ...], float, str]


class StackedBars(LineCacheMixin, Widget):
    """One stacked bar per row: (label, the pieces' fractions of full scale, the row's total
    fraction, text after the bar). Piece i has its own style and glyph, so the stack reads without
    colour; what the total holds beyond the pieces is dotted. Drawn like Bars: a row when it is
    on screen and changed, a layout only when the number of rows changes."""

    COMPONENT_CLASSES = {"stacked--empty"}
    LINE_CACHE_STYLES = tuple(sorted(COMPONENT_CLASSES))

    DEFAULT_CSS = """
    StackedBars {
        height: auto;
        width: 1fr;
    }
    StackedBars > .stacked--empty {
        color: $text-muted;
    }
    """

    def __init__(self, styles: Sequence[str], glyphs: str, *, name: str | None = None, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        if len(glyphs) < len(styles):
            raise ValueError("StackedBars: a glyph for every style")
        self._piece_styles, self._glyphs = tuple(styles), glyphs
        self._rows: tuple[StackedRow, ...] = ()
        self._empty = ""

    def set_rows(self, rows: Sequence[StackedRow], *, empty: str = "") -> None:
        rows = tuple((str(label), tuple(float(p) for p in pieces[:len(self._piece_styles)]), float(total), str(after))
                     for label, pieces, total, after in rows)
        if (rows, empty) == (self._rows, self._empty):
            return
        relayout = max(len(rows), 1) != max(len(self._rows), 1)
        self._rows, self._empty = rows, empty
        self.refresh(layout=relayout)

    @property
    def plain_text(self) -> str:
        if not self._rows:
            return self._empty
        return "\n".join("".join(text for text, _ in self._pieces(row, self.size.width or 80)) for row in self._rows)

    def get_content_height(self, container, viewport, width: int) -> int:
        return max(len(self._rows), 1)

    def line_key(self, y: int):
        row = self._rows[y] if y < len(self._rows) else None
        after_w = max((len(r[3]) for r in self._rows), default=0)  # every bar's width depends on it
        return (row, self._empty if not self._rows else None, self.size.width, self._label_width(), after_w)

    def _label_width(self) -> int:
        return max((len(r[0]) for r in self._rows), default=0)

    def _pieces(self, row: StackedRow, width: int) -> list[tuple[str, str | None]]:
        """(text, style name or None) runs of one row: label, pieces, dotted rest, padding, text after."""
        label, pieces, total, after = row
        label_w = self._label_width()
        after_w = max((len(r[3]) for r in self._rows), default=0)
        bar_w = max(8, width - label_w - 1 - after_w)  # bars never wrap
        runs: list[tuple[str, str | None]] = [(f"{label:<{label_w}} ", None)]
        used = 0
        for i, frac in enumerate(pieces):
            n = max(0, min(bar_w - used, round(min(max(frac, 0.0), 1.0) * bar_w)))
            if n:
                runs.append((self._glyphs[i] * n, self._piece_styles[i]))
                used += n
        rest = max(0, min(bar_w - used, round(min(max(total, 0.0), 1.0) * bar_w) - used))
        if rest:
            runs.append(("·" * rest, "dim"))
        runs.append((" " * (bar_w - used - rest) + after, None))
        return runs

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        base = self.visual_style.rich_style
        if not self._rows:
            if y == 0 and self._empty:
                style = self.get_component_rich_style("stacked--empty")
                return Strip([Segment(self._empty, style)]).adjust_cell_length(width, base)
            return Strip.blank(width, base)
        if y >= len(self._rows):
            return Strip.blank(width, base)
        segments = [Segment(text, base if style is None else base + _style(style))
                    for text, style in self._pieces(self._rows[y], width)]
        return Strip(segments).adjust_cell_length(width, base)
