"""Pieces the panels share: updating a Static only on change, the action message, number formatting."""

from __future__ import annotations

from rich.cells import cell_len
from rich.text import Text
from textual.message import Message

_UNSET = object()


class ShowsOnChange:
    """For panels: send a Static new content only when it changes. Static.update re-lays out and
    re-renders the widget; most of a panel's lines stay the same from one step to the next."""

    def put(self, selector: str, content, key=_UNSET) -> None:
        """Show `content` (or what calling it returns, built only when needed) in the Static
        `selector`, unless `key` (default: the content itself) is what that Static shows already.
        New text of the same number of lines, none wider than the Static, keeps its size: it is
        repainted without a layout of the screen (a layout cost more than the paint)."""
        key = content if key is _UNSET else key
        shown = self.__dict__.setdefault("_shown_keys", {})
        if shown.get(selector, _UNSET) == key:
            return
        shown[selector] = key
        static = self.query_one(selector)
        content = content() if callable(content) else content
        shape = _text_shape(content, static.content_region.width)  # type: ignore[attr-defined]
        shapes = self.__dict__.setdefault("_shown_shapes", {})
        same = shape is not None and shapes.get(selector) == shape
        shapes[selector] = shape
        static.update(content, layout=not same)  # type: ignore[attr-defined]


def _text_shape(content, width: int) -> tuple[int, int] | None:
    """(lines, width) of text that cannot wrap at `width` (every line fits: markup only makes the
    shown line shorter than its source), else None (a table, or text that may wrap)."""
    if isinstance(content, Text):
        plain = content.plain
    elif isinstance(content, str):
        plain = content
    else:
        return None
    lines = plain.split("\n")
    if width <= 0 or max(cell_len(line) for line in lines) > width:
        return None
    return (len(lines), width)


class ActionRequested(Message):
    """A panel asks the app for an operator action (kind as in ConsoleSource.act, with its arguments)."""

    def __init__(self, kind: str, **args):
        super().__init__()
        self.kind = kind
        self.args = args


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
    """On a trace imported from another engine's expert-load records, or on another engine's live
    server: the line saying `what` is absent there (its records hold the routing only; its
    metrics hold no step records); None on the engine's own records."""
    external = state.external
    if external is not None:
        source = f"{external.get('engine', '?')} {external.get('engine_version') or ''}".strip()
        return (f"[b]absent[/b]: {what} are not exported by {source}'s /metrics (no step records); its own "
                f"figures are on the Overview tab")
    imported = state.imported
    if imported is None:
        return None
    source = f"{imported.get('engine', '?')} {imported.get('engine_version') or ''}".strip()
    return (f"[b]absent[/b]: {what} were not measured by {source} ({imported.get('mode', '?')}); "
            "this trace was imported from its expert-load records (Experts tab)")

