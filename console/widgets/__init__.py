"""Reusable Textual widgets for the console: heat map, timeline, scrub bar, colour scales."""

from .colour_scale import SCALES, ColourLegend, ColourScale, legend_strip
from .heatmap import HeatMap
from .scrub_bar import ScrubBar
from .timeline import Span, Timeline

__all__ = [
    "SCALES",
    "ColourLegend",
    "ColourScale",
    "HeatMap",
    "ScrubBar",
    "Span",
    "Timeline",
    "legend_strip",
]
