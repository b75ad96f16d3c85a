"""Pieces the panels share: the action message, bar rendering, number formatting."""

from __future__ import annotations

from rich.text import Span, Text
from textual.message import Message

_UNSET = object()


class ShowsOnChange:
    """For panels: send a Static new content only when it changes. Static.update re-lays out and
    re-renders the widget; most of a panel's lines stay the same from one step to the next."""

    def put(self, selector: str, content, key=_UNSET) -> None:
        """Show `content` (or what calling it returns, built only when needed) in the Static
        `selector`, unless `key` (default: the content itself) is what that Static shows already."""
        key = content if key is _UNSET else key
        shown = self.__dict__.setdefault("_shown_keys", {})
        if shown.get(selector, _UNSET) == key:
            return
        shown[selector] = key
        self.query_one(selector).update(content() if callable(content) else content)  # type: ignore[attr-defined]


def replot(plot, data, draw) -> None:
    """Redraw a PlotextPlot only when `data` (or the theme) changed: plotext rebuilds the whole
    plot on every render. `draw(plt)` adds the series; the plot's theme is set first because plotext
    colours a series when it is added, and textual-plotext sets the theme only when it renders."""
    key = (data, plot.app.theme)
    if getattr(plot, "_moectl_plotted", None) == key:
        return
    plot._moectl_plotted = key
    plt = plot.plt
    plt.clear_data()
    plt.theme(plot._get_plotext_theme_name(plot.app.theme))
    draw(plt)
    plot.refresh()


class ActionRequested(Message):
    """A panel asks the app for an operator action (kind as in Source.act, with its arguments)."""

    def __init__(self, kind: str, **args):
        super().__init__()
        self.kind = kind
        self.args = args


def bars(rows: list[tuple[str, float, str]], width: int, *, warn: float = 0.8, crit: float = 0.95,
         styles: tuple[str, str, str] = ("green", "yellow", "red")) -> Text:
    """Horizontal bars, one per row: (label, fraction of full scale, text after the bar). The
    colour crosses thresholds at `warn` and `crit`, and the glyph does too (so colour is not the
    only signal): full blocks below warn, '▓' at warn, '!' marks at crit."""
    label_w = max((len(r[0]) for r in rows), default=0)
    bar_w = max(4, width - label_w - 24)
    # one string and a list of spans: what Text.append would build, without its per-call cost
    parts: list[str] = []
    spans: list[Span] = []
    at = 0
    for i, (label, frac, after) in enumerate(rows):
        frac = min(max(frac, 0.0), 1.0)
        filled = round(frac * bar_w)
        style = styles[2] if frac >= crit else styles[1] if frac >= warn else styles[0]
        glyph = "█" if frac < warn else "▓"
        head = f"{label:>{label_w}} "
        tail = f" {after}" + (" !" if frac >= crit else "") + ("\n" if i < len(rows) - 1 else "")
        at += len(head)
        if filled:
            spans.append(Span(at, at + filled, style))
        if bar_w - filled:
            spans.append(Span(at + filled, at + bar_w, "dim"))
        at += bar_w + len(tail)
        parts += (head, glyph * filled, "·" * (bar_w - filled), tail)
    return Text("".join(parts), spans=spans)


def fmt_s(value, scale: float = 1e3, unit: str = "ms", digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f} {unit}"


def fmt_bytes(n) -> str:
    """Compact sizes for tables: 9.0M, 416K, 80G (binary units)."""
    if n is None:
        return "-"
    n = int(n)
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift:
            value = n / (1 << shift)
            return f"{value:.1f}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return f"{n}B"


def absent_in_import(state, what: str) -> str | None:
    """On a trace imported from another engine's expert-load records: the line saying `what` is
    absent there (its records hold the routing only); None on the engine's own traces."""
    imported = state.imported
    if imported is None:
        return None
    source = f"{imported.get('engine', '?')} {imported.get('engine_version') or ''}".strip()
    return (f"[b]absent[/b]: {what} were not measured by {source} ({imported.get('mode', '?')}); "
            "this trace was imported from its expert-load records (Experts tab)")

