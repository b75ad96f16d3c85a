"""Bars: one horizontal bar per row, a label before it and a figure after it (Textual Line API).

    bars = Bars()
    bars.set_rows([("d0", 0.42, "1.2G / 80G"), ("d1", 0.97, "77G / 80G")], warn=0.8, crit=0.95)
    bars.set_rows([], empty="no accounting yet")

A row whose fraction is None has no bar: its label and text only (a figure the source lacks is
absent, not drawn as an empty bar).

The bar's colour crosses thresholds at `warn` and `crit`, and so does its glyph, so colour is not
the only signal: full blocks below warn, '▓' from warn, and a '!' after the figure from crit.
StackedBars draws a stack of pieces per row instead. Both are drawn a row at a time, when it is
on screen and its content changed, and re-lay out the screen only when the number of rows
changes (a Static of Rich Text, which they replaced, re-wrapped and re-laid out every row on
every update).
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


class LabelledRows(LineCacheMixin, Widget):
    """What Bars and StackedBars share: one row each, its height the number of rows, a line of
    text when there are none. A subclass draws a row (`_row_segments`) and says what every row's
    drawing depends on beyond the row itself (`_frame`)."""

    COMPONENT_CLASSES = {"rows--empty"}
    LINE_CACHE_STYLES = tuple(sorted(COMPONENT_CLASSES))

    DEFAULT_CSS = """
    LabelledRows {
        height: auto;
        width: 1fr;
    }
    LabelledRows > .rows--empty {
        color: $text-muted;
    }
    """

    _rows: tuple = ()
    _empty = ""
    _settings: tuple = ()

    def _update(self, rows: tuple, empty: str, settings: tuple = ()) -> None:
        if (rows, empty, settings) == (self._rows, self._empty, self._settings):
            return
        relayout = max(len(rows), 1) != max(len(self._rows), 1)
        self._rows, self._empty, self._settings = rows, empty, settings
        self.refresh(layout=relayout)

    def _frame(self, width: int) -> tuple:
        return ()

    def _row_segments(self, row, width: int) -> list[tuple[str, Style | None]]:
        """(text, style or None for the plain style) runs of one row."""
        raise NotImplementedError

    @property
    def plain_text(self) -> str:
        """What the rows say, as text (one line a row): for tests and screen readers."""
        if not self._rows:
            return self._empty
        width = self.size.width or 80
        return "\n".join("".join(text for text, _ in self._row_segments(row, width)) for row in self._rows)

    def get_content_height(self, container, viewport, width: int) -> int:
        return max(len(self._rows), 1)

    def line_key(self, y: int):
        row = self._rows[y] if y < len(self._rows) else None
        width = self.size.width
        return (row, self._empty if not self._rows else None, self._settings, width, self._frame(width))

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        base = self.visual_style.rich_style
        if not self._rows:
            if y == 0 and self._empty:
                style = self.get_component_rich_style("rows--empty")
                return Strip([Segment(self._empty, style)]).adjust_cell_length(width, base)
            return Strip.blank(width, base)
        if y >= len(self._rows):
            return Strip.blank(width, base)
        segments = [Segment(text, base if style is None else base + style)
                    for text, style in self._row_segments(self._rows[y], width) if text]
        return Strip(segments).adjust_cell_length(width, base)


class Bars(LabelledRows):
    """Labelled horizontal bars, one row each."""

    def __init__(self, *, styles: tuple[str, str, str] = ("green", "yellow", "red"), name: str | None = None,
                 id: str | None = None, classes: str | None = None) -> None:
        """styles: the bar's colour below warn, from warn, from crit (Rich style names)."""
        super().__init__(name=name, id=id, classes=classes)
        self._colours = styles
        self._settings = (0.8, 0.95)

    def set_rows(self, rows: Sequence[Row], *, warn: float = 0.8, crit: float = 0.95, empty: str = "") -> None:
        """(label, fraction of full scale, text after the bar) per row; `empty`: shown without rows."""
        rows = tuple((str(label), None if frac is None else float(frac), str(after)) for label, frac, after in rows)
        self._update(rows, empty, (warn, crit))

    def _frame(self, width: int) -> tuple[int, int]:
        """(label width, bar width): every row's drawing depends on them. Computed once per rows
        and width, not per row drawn (256 simulated devices: 65,536 lengths a repaint otherwise)."""
        cached = getattr(self, "_frame_cache", None)  # (rows, width, frame); rows held: compared by identity
        if cached is None or cached[0] is not self._rows or cached[1] != width:
            label_w = max((len(r[0]) for r in self._rows), default=0)
            after_w = max((len(r[2]) for r in self._rows if r[1] is not None), default=0) + 2  # " text !"
            cached = self._frame_cache = (self._rows, width, (label_w, max(4, width - label_w - 1 - after_w - 1)))
        return cached[2]

    def _row_segments(self, row: Row, width: int) -> list[tuple[str, Style | None]]:
        label, frac, after = row
        label_w, bar_w = self._frame(width)
        head = f"{label:>{label_w}} "
        if frac is None:
            return [(head + after, None)]
        warn, crit = self._settings
        frac = min(max(frac, 0.0), 1.0)
        filled = round(frac * bar_w)
        glyph = "█" if frac < warn else "▓"
        colour = self._colours[2] if frac >= crit else self._colours[1] if frac >= warn else self._colours[0]
        return [(head, None), (glyph * filled, _style(colour)), ("·" * (bar_w - filled), _style("dim")),
                (f" {after}" + (" !" if frac >= crit else ""), None)]


StackedRow = tuple[str, tuple[float, ...], float, str]


class StackedBars(LabelledRows):
    """One stacked bar per row: (label, the pieces' fractions of full scale, the row's total
    fraction, text after the bar). Piece i has its own style and glyph, so the stack reads without
    colour; what the total holds beyond the pieces is dotted."""

    def __init__(self, styles: Sequence[str], glyphs: str, *, name: str | None = None, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        if len(glyphs) < len(styles):
            raise ValueError("StackedBars: a glyph for every style")
        self._piece_styles, self._glyphs = tuple(styles), glyphs

    def set_rows(self, rows: Sequence[StackedRow], *, empty: str = "") -> None:
        rows = tuple((str(label), tuple(float(p) for p in pieces[:len(self._piece_styles)]), float(total), str(after))
                     for label, pieces, total, after in rows)
        self._update(rows, empty)

    def _frame(self, width: int) -> tuple[int, int]:
        """(label width, bar width): every row's drawing depends on them; bars never wrap. Once per
        rows and width, as Bars'."""
        cached = getattr(self, "_frame_cache", None)
        if cached is None or cached[0] is not self._rows or cached[1] != width:
            label_w = max((len(r[0]) for r in self._rows), default=0)
            after_w = max((len(r[3]) for r in self._rows), default=0)
            cached = self._frame_cache = (self._rows, width, (label_w, max(8, width - label_w - 1 - after_w)))
        return cached[2]

    def _row_segments(self, row: StackedRow, width: int) -> list[tuple[str, Style | None]]:
        label, pieces, total, after = row
        label_w, bar_w = self._frame(width)
        runs: list[tuple[str, Style | None]] = [(f"{label:<{label_w}} ", None)]
        used = 0
        for i, frac in enumerate(pieces):
            n = max(0, min(bar_w - used, round(min(max(frac, 0.0), 1.0) * bar_w)))
            if n:
                runs.append((self._glyphs[i] * n, _style(self._piece_styles[i])))
                used += n
        rest = max(0, min(bar_w - used, round(min(max(total, 0.0), 1.0) * bar_w) - used))
        if rest:
            runs.append(("·" * rest, _style("dim")))
        runs.append((" " * (bar_w - used - rest) + after, None))
        return runs
