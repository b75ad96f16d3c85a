"""Reusable Textual widgets for the console: heat map, timeline, scrub bar, colour scales."""

from moectl.console.widgets.colour_scale import SCALES, ColourLegend, ColourScale, legend_strip
from moectl.console.widgets.heatmap import HeatMap
from moectl.console.widgets.scrub_bar import ScrubBar
from moectl.console.widgets.timeline import Span, Timeline

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
