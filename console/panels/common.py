"""Pieces the panels share: the action message, bar rendering, number formatting."""

from __future__ import annotations

from rich.text import Text
from textual.message import Message


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
    out = Text()
    label_w = max((len(r[0]) for r in rows), default=0)
    bar_w = max(4, width - label_w - 24)
    for i, (label, frac, after) in enumerate(rows):
        frac = min(max(frac, 0.0), 1.0)
        filled = round(frac * bar_w)
        style = styles[2] if frac >= crit else styles[1] if frac >= warn else styles[0]
        glyph = "█" if frac < warn else "▓"
        out.append(f"{label:>{label_w}} ")
        out.append(glyph * filled, style=style)
        out.append("·" * (bar_w - filled), style="dim")
        out.append(f" {after}" + (" !" if frac >= crit else ""))
        if i < len(rows) - 1:
            out.append("\n")
    return out


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

