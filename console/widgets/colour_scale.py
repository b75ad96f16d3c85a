"""Colour-blind-safe sequential colour scales for heat maps, and a one-line legend.

The stops are the published matplotlib colormaps (viridis, cividis, magma) sampled at ten evenly
spaced points (0, 1/9, ... 1), interpolated linearly in RGB by textual's Gradient; between two
neighbouring samples these maps are close to straight lines, so the error is a few units of 255 at
most. "grey" is a plain
dark-to-white ramp for high-contrast themes and monochrome screenshots.

    scale = ColourScale("viridis")
    scale.colour(0.5)        # rich.color.Color
    scale.styles(64)         # 64 background Styles, index i for value i / 63 (cached)
"""

from __future__ import annotations

from functools import lru_cache

from rich.color import Color
from rich.segment import Segment
from rich.style import Style
from textual.app import RenderResult
from textual.color import Gradient
from textual.reactive import reactive
from textual.strip import Strip
from textual.widget import Widget

from moectl.console.widgets.line_cache import LineCacheMixin

_STOPS_HEX: dict[str, tuple[str, ...]] = {
    "viridis": (
        "#440154", "#482878", "#3e4a89", "#31688e", "#26828e",
        "#1f9e89", "#35b779", "#6dcd59", "#b4de2c", "#fde725",
    ),
    "cividis": (
        "#00204d", "#00306f", "#39486b", "#575d6d", "#707173",
        "#8a8779", "#a69d75", "#c4b56c", "#e4cf5b", "#ffea46",
    ),
    "magma": (
        "#000004", "#180f3d", "#440f76", "#721f81", "#9e2f7f",
        "#cd4071", "#f1605d", "#fd9668", "#fec98d", "#fcfdbf",
    ),
    # starts above black so that zero cells stay visible on a black terminal background
    "grey": ("#262626", "#ffffff"),
}

SCALES: tuple[str, ...] = tuple(_STOPS_HEX)
"""Names accepted by ColourScale, the default first."""


def _check_name(name: str) -> str:
    if name not in _STOPS_HEX:
        raise ValueError(f"unknown colour scale {name!r}; choose one of: {', '.join(SCALES)}")
    return name


class ColourScale:
    """A sequential colour scale: values in [0, 1] to colours (darkest at 0, lightest at 1)."""

    __slots__ = ("name", "_gradient")

    def __init__(self, name: str = "viridis") -> None:
        self.name = _check_name(name)
        # one gradient step per stop: get_color then blends linearly between neighbouring stops
        self._gradient = Gradient.from_colors(*_STOPS_HEX[name], quality=len(_STOPS_HEX[name]))

    def __repr__(self) -> str:
        return f"ColourScale({self.name!r})"

    def rgb(self, v: float) -> tuple[int, int, int]:
        """(r, g, b) 0-255 for v in [0, 1]; v is clamped, NaN counts as 0."""
        if v != v:  # NaN
            v = 0.0
        return self._gradient.get_color(float(v)).rgb

    def colour(self, v: float) -> Color:
        """The colour for v in [0, 1] (clamped)."""
        return Color.from_rgb(*self.rgb(v))

    def contrast(self, v: float) -> Color:
        """Black or white, whichever reads better on top of colour(v)."""
        r, g, b = self.rgb(v)
        luma = 0.2126 * r + 0.7152 * g + 0.0722 * b
        return Color.from_rgb(0, 0, 0) if luma > 140 else Color.from_rgb(255, 255, 255)

    def styles(self, n: int) -> list[Style]:
        """n background styles, index i for value i / (n - 1): pre-built for fast rendering."""
        return list(_styles(self.name, max(1, int(n))))


@lru_cache(maxsize=64)
def _styles(name: str, n: int) -> tuple[Style, ...]:
    scale = ColourScale(name)
    if n == 1:
        return (Style(bgcolor=scale.colour(1.0)),)
    return tuple(Style(bgcolor=scale.colour(i / (n - 1))) for i in range(n))


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    a = abs(value)
    if a >= 1e6 or a < 1e-3:
        return f"{value:.2g}"
    if a >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"


def legend_strip(
    scale: ColourScale | str,
    width: int,
    lo: float = 0.0,
    hi: float = 1.0,
    unit: str = "",
    *,
    label_style: Style | None = None,
) -> Strip:
    """One line, exactly `width` cells: "lo unit ▕gradient▏ hi unit" (the labels are dropped
    first when the line is too narrow for them and a gradient of at least 4 cells)."""
    if isinstance(scale, str):
        scale = ColourScale(scale)
    width = max(0, int(width))
    label_style = label_style or Style()
    suffix = f" {unit}" if unit else ""
    left = f"{_fmt(lo)}{suffix} "
    right = f" {_fmt(hi)}{suffix}"
    if width - len(left) - len(right) < 4:
        left = right = ""
    bar = width - len(left) - len(right)
    segments: list[Segment] = []
    if left:
        segments.append(Segment(left, label_style))
    if bar > 0:
        styles = _styles(scale.name, max(2, bar))
        segments.extend(Segment(" ", styles[i]) for i in range(bar))
    if right:
        segments.append(Segment(right, label_style))
    return Strip(segments, width).simplify() if width else Strip([], 0)


class ColourLegend(LineCacheMixin, Widget):
    """A one-line legend: minimum label, the gradient, maximum label."""

    DEFAULT_CSS = """
    ColourLegend {
        height: 1;
        width: 1fr;
    }
    """

    scale_name: reactive[str] = reactive("viridis")
    lo: reactive[float] = reactive(0.0)
    hi: reactive[float] = reactive(1.0)
    unit: reactive[str] = reactive("")

    def __init__(
        self,
        scale_name: str = "viridis",
        lo: float = 0.0,
        hi: float = 1.0,
        unit: str = "",
        *,
        name: str | None = None,
        id: str | None = None,
        classes: str | None = None,
    ) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.set_reactive(ColourLegend.scale_name, _check_name(scale_name))
        self.set_reactive(ColourLegend.lo, float(lo))
        self.set_reactive(ColourLegend.hi, float(hi))
        self.set_reactive(ColourLegend.unit, unit)

    def validate_scale_name(self, name: str) -> str:
        return _check_name(name)

    def render(self) -> RenderResult:  # pragma: no cover - render_line is used instead
        return ""

    def line_key(self, y: int):
        return (y, self.scale_name, self.lo, self.hi, self.unit, self.rich_style)

    def render_line(self, y: int) -> Strip:
        if y != 0:
            return Strip.blank(self.size.width, self.rich_style)
        return legend_strip(
            ColourScale(self.scale_name), self.size.width, self.lo, self.hi, self.unit,
            label_style=self.rich_style,
        )
