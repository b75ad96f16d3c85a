"""Reusable Textual widgets for the console: heat map, timeline, charts, scrub bar, colour scales."""

from moectl.console.widgets.chart import Chart
from moectl.console.widgets.colour_scale import SCALES, ColourLegend, ColourScale, legend_strip
from moectl.console.widgets.heatmap import HeatMap
from moectl.console.widgets.scrub_bar import ScrubBar
from moectl.console.widgets.timeline import Span, Timeline

__all__ = [
    "SCALES",
    "Chart",
    "ColourLegend",
    "ColourScale",
    "HeatMap",
    "ScrubBar",
    "Span",
    "Timeline",
    "legend_strip",
]
