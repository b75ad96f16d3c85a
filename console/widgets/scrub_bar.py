"""ScrubBar: a horizontal scrub bar over a range of engine steps, for replay (Line API).

    bar = ScrubBar()
    bar.set_range(0, 3599)
    bar.markers = [(120, "action"), (800, "alert")]
    bar.position = 42                      # no message: only the user's seeks post ScrubBar.Seek

Height 2 (the default): markers on the first row ("▼" operator actions, "!" alerts, "•" anything
else), the bar on the second ("━━━━●────": played part, knob, rest). Height 1 draws the markers on
the bar; height 3 or more adds a row of labels (first step, the position, last step).
Click or drag sets the position and posts ScrubBar.Seek(step); left/right move by one step,
shift+left/right by ten, pageup/pagedown by a tenth of the range, home/end jump to the ends.
"""

from __future__ import annotations

from collections.abc import Iterable

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.reactive import reactive
from textual.strip import Strip
from textual.widget import Widget

from moectl.console.widgets.line_cache import LineCacheMixin

MARKER_GLYPHS: dict[str, str] = {"action": "▼", "operator": "▼", "alert": "!", "error": "!", "warning": "!"}
"""Glyph per marker kind; other kinds are drawn as "•"."""
_MARKER_CLASS: dict[str, str] = {
    "action": "scrub-bar--marker-action",
    "operator": "scrub-bar--marker-action",
    "alert": "scrub-bar--marker-alert",
    "error": "scrub-bar--marker-alert",
    "warning": "scrub-bar--marker-alert",
}
_PRIORITY = {"scrub-bar--marker-alert": 2, "scrub-bar--marker-action": 1, "scrub-bar--marker": 0}


class ScrubBar(LineCacheMixin, Widget, can_focus=True):
    """A step range with a draggable position and markers."""

    COMPONENT_CLASSES = {
        "scrub-bar--track",
        "scrub-bar--played",
        "scrub-bar--knob",
        "scrub-bar--marker",
        "scrub-bar--marker-action",
        "scrub-bar--marker-alert",
        "scrub-bar--label",
        "scrub-bar--empty",
    }
    LINE_CACHE_STYLES = tuple(sorted(COMPONENT_CLASSES))

    DEFAULT_CSS = """
    ScrubBar {
        height: 2;
        width: 1fr;
    }
    ScrubBar > .scrub-bar--track {
        color: $text-muted;
    }
    ScrubBar > .scrub-bar--played {
        color: $accent;
    }
    ScrubBar > .scrub-bar--knob {
        color: $text;
        text-style: bold;
    }
    ScrubBar:focus > .scrub-bar--knob {
        color: $accent;
    }
    ScrubBar > .scrub-bar--marker {
        color: $text-muted;
    }
    ScrubBar > .scrub-bar--marker-action {
        color: $primary;
        text-style: bold;
    }
    ScrubBar > .scrub-bar--marker-alert {
        color: $error;
        text-style: bold;
    }
    ScrubBar > .scrub-bar--label {
        color: $text-muted;
    }
    ScrubBar > .scrub-bar--empty {
        color: $text-muted;
        text-style: italic;
    }
    """

    BINDINGS: list[BindingType] = [
        Binding("left", "step(-1)", "Step back", show=False),
        Binding("right", "step(1)", "Step forward", show=False),
        Binding("shift+left", "step(-10)", "10 steps back", show=False),
        Binding("shift+right", "step(10)", "10 steps forward", show=False),
        Binding("pageup", "page(-1)", "Page back", show=False),
        Binding("pagedown", "page(1)", "Page forward", show=False),
        Binding("home", "jump(0)", "First step", show=False),
        Binding("end", "jump(1)", "Last step", show=False),
    ]

    class Seek(Message):
        """The user moved the position (click, drag or keys)."""

        def __init__(self, scrub_bar: ScrubBar, step: int) -> None:
            super().__init__()
            self.scrub_bar = scrub_bar
            self.step = step

        @property
        def control(self) -> ScrubBar:
            return self.scrub_bar

    position: reactive[int] = reactive(0)

    def __init__(
        self,
        first_step: int = 0,
        last_step: int = -1,
        *,
        markers: Iterable[tuple[int, str]] = (),
        name: str | None = None,
        id: str | None = None,
        classes: str | None = None,
        disabled: bool = False,
    ) -> None:
        """
        Args:
            first_step, last_step: the range (inclusive); last < first means empty.
            markers: (step, kind) pairs.
        """
        super().__init__(name=name, id=id, classes=classes, disabled=disabled)
        self._first = int(first_step)
        self._last = int(last_step)
        self._markers: list[tuple[int, str]] = []
        self._dragging = False
        self._marker_cache: tuple[tuple, list[tuple[int, str, str]]] | None = None
        self.set_reactive(ScrubBar.position, self._first)
        self.markers = list(markers)

    # ------------------------------------------------------------------------ range

    def set_range(self, first_step: int, last_step: int) -> None:
        """Steps first..last inclusive (last < first: empty). The position is clamped into it."""
        self._first = int(first_step)
        self._last = int(last_step)
        self._marker_cache = None
        clamped = self.validate_position(self.position)
        if clamped != self.position:
            self.set_reactive(ScrubBar.position, clamped)
        self.refresh()

    @property
    def first_step(self) -> int:
        return self._first

    @property
    def last_step(self) -> int:
        return self._last

    @property
    def is_empty(self) -> bool:
        return self._last < self._first

    @property
    def markers(self) -> list[tuple[int, str]]:
        """(step, kind) pairs; assigning a new list redraws."""
        return list(self._markers)

    @markers.setter
    def markers(self, markers: Iterable[tuple[int, str]]) -> None:
        self._markers = [(int(step), str(kind)) for step, kind in markers]
        self._markers_version = getattr(self, "_markers_version", 0) + 1
        self._marker_cache = None
        self.refresh()

    def set_markers(self, markers: Iterable[tuple[int, str]]) -> None:
        self.markers = markers

    def validate_position(self, step: int) -> int:
        step = int(step)
        if self.is_empty:
            return step
        return min(max(step, self._first), self._last)

    def watch_position(self, _step: int) -> None:
        self.refresh()

    # ------------------------------------------------------------------ geometry

    def column_of(self, step: int) -> int:
        """The column (0-based, in the content area) where `step` is drawn."""
        width = self.size.width
        if width <= 1 or self._last <= self._first:
            return 0
        frac = (min(max(step, self._first), self._last) - self._first) / (self._last - self._first)
        return int(round(frac * (width - 1)))

    def step_at(self, x: int) -> int:
        """The step under column x (clamped to the range)."""
        width = self.size.width
        if width <= 1 or self._last <= self._first:
            return self._first
        x = min(max(x, 0), width - 1)
        return self._first + int(round(x * (self._last - self._first) / (width - 1)))

    # ---------------------------------------------------------------- interaction

    def seek(self, step: int) -> None:
        """Move the position as the user would: clamps, then posts Seek."""
        if self.is_empty:
            return
        self.position = step
        self.post_message(self.Seek(self, self.position))

    def action_step(self, delta: int) -> None:
        if self.is_empty:
            return
        target = self.validate_position(self.position + delta)
        if target != self.position:
            self.seek(target)

    def action_page(self, direction: int) -> None:
        page = max(1, (self._last - self._first + 1) // 10)
        self.action_step(direction * page)

    def action_jump(self, end: int) -> None:
        if self.is_empty:
            return
        target = self._last if end else self._first
        if target != self.position:
            self.seek(target)

    def on_mouse_down(self, event: events.MouseDown) -> None:
        offset = event.get_content_offset(self)
        if offset is None or self.is_empty:
            return
        event.stop()
        self.focus()
        self._dragging = True
        self.capture_mouse()
        self.seek(self.step_at(offset.x))

    def on_mouse_move(self, event: events.MouseMove) -> None:
        if not self._dragging:
            return
        step = self.step_at(event.get_content_offset_capture(self).x)
        if step != self.position:
            self.seek(step)

    def on_mouse_up(self, event: events.MouseUp) -> None:
        if self._dragging:
            self._dragging = False
            self.capture_mouse(False)
            event.stop()

    # --------------------------------------------------------------------- rendering

    def _marker_columns(self) -> list[tuple[int, str, str]]:
        """(column, glyph, component class) per occupied column, the most important kind kept."""
        key = (self.size.width, self._first, self._last)
        if self._marker_cache is not None and self._marker_cache[0] == key:
            return self._marker_cache[1]
        by_col: dict[int, tuple[str, str]] = {}
        if not self.is_empty:
            for step, kind in self._markers:
                if not self._first <= step <= self._last:
                    continue
                col = self.column_of(step)
                cls = _MARKER_CLASS.get(kind, "scrub-bar--marker")
                held = by_col.get(col)
                if held is None or _PRIORITY[cls] > _PRIORITY[held[1]]:
                    by_col[col] = (MARKER_GLYPHS.get(kind, "•"), cls)
        result = sorted((col, glyph, cls) for col, (glyph, cls) in by_col.items())
        self._marker_cache = (key, result)
        return result

    def line_key(self, y: int):
        return (y, self._first, self._last, self.position, self._markers_version, self.has_focus)

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        height = self.size.height
        base = self.visual_style.rich_style
        if self.is_empty:
            if y == min(1, height - 1):
                style = self.get_component_rich_style("scrub-bar--empty")
                return Strip([Segment(" no steps", style)]).adjust_cell_length(width, base)
            return Strip.blank(width, base)
        if height >= 2 and y == 0:
            return self._render_markers(width, base)
        if y == (1 if height >= 2 else 0):
            return self._render_bar(width, base, overlay_markers=height < 2)
        if y == 2:
            return self._render_labels(width, base)
        return Strip.blank(width, base)

    def _render_markers(self, width: int, base: Style) -> Strip:
        segments: list[Segment] = []
        x = 0
        for col, glyph, cls in self._marker_columns():
            if col > x:
                segments.append(Segment(" " * (col - x), base))
            segments.append(Segment(glyph, self.get_component_rich_style(cls)))
            x = col + 1
        return Strip(segments).adjust_cell_length(width, base)

    def _render_bar(self, width: int, base: Style, *, overlay_markers: bool) -> Strip:
        knob = self.column_of(self.position)
        played = self.get_component_rich_style("scrub-bar--played")
        track = self.get_component_rich_style("scrub-bar--track")
        knob_style = self.get_component_rich_style("scrub-bar--knob")
        cells: list[tuple[str, Style]] = []
        if not overlay_markers:
            segments = []
            if knob:
                segments.append(Segment("━" * knob, played))
            segments.append(Segment("●", knob_style))
            if width - knob - 1 > 0:
                segments.append(Segment("─" * (width - knob - 1), track))
            return Strip(segments).adjust_cell_length(width, base)
        cells = [("━", played)] * knob + [("●", knob_style)] + [("─", track)] * max(0, width - knob - 1)
        for col, glyph, cls in self._marker_columns():
            if col != knob and col < len(cells):
                cells[col] = (glyph, self.get_component_rich_style(cls))
        segments = [Segment(text, style) for text, style in cells[:width]]
        return Strip(segments).simplify().adjust_cell_length(width, base)

    def _render_labels(self, width: int, base: Style) -> Strip:
        style = self.get_component_rich_style("scrub-bar--label")
        chars = [" "] * width
        first, last = str(self._first), str(self._last)
        here = f"step {self.position}"
        chars[: len(first)] = first[:width]
        if len(last) < width:
            chars[width - len(last) :] = last
        start = min(max(self.column_of(self.position) - len(here) // 2, 0), max(0, width - len(here)))
        chars[start : start + len(here)] = here[: width - start]
        return Strip([Segment("".join(chars[:width]), style)]).adjust_cell_length(width, base)
