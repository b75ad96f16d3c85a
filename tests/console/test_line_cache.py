"""The console's render caches: finished lines are reused between frames only while what they show
is unchanged, and a change of data, width, theme, scroll or cursor redraws exactly the lines it
touches; panels send a widget new content only when it changes, and still show every new record.

Async Textual tests run through asyncio.run in plain test functions (no pytest-asyncio here).
"""

from __future__ import annotations

import asyncio

import numpy as np
from textual.app import App, ComposeResult
from textual.geometry import Region

from moectl.console.app import MoectlApp
from moectl.console.panels.requests import RequestTable
from moectl.console.sources import ReplaySource
from moectl.console.widgets import ColourLegend, HeatMap, ScrubBar, Span, Timeline
from tests.paths import TRACES
from tests.pilot import text_of, until

MS = 1e-3


class One(App):
    def __init__(self, widget) -> None:
        super().__init__()
        self.widget = widget

    def compose(self) -> ComposeResult:
        yield self.widget


def lines(widget) -> list:
    """The widget's finished lines, as the compositor asks for them."""
    width, height = widget.size
    return widget.render_lines(Region(0, 0, width, height))


def lane_spans(lane: int, dur: float = MS) -> list[Span]:
    return [Span(lane, "attn", 2 * k * MS, dur, layer=k, step=1) for k in range(4)]


def test_timeline_reuses_unchanged_lines_and_redraws_changed_ones():
    names = [f"lane{i}" for i in range(12)]
    spans = [s for i in range(12) for s in lane_spans(i)]
    timeline = Timeline(names, spans)

    async def body():
        app = One(timeline)
        async with app.run_test(size=(80, 8)) as pilot:
            await pilot.pause()
            first = lines(timeline)
            timeline.refresh()  # a full repaint with nothing new: every line is the same object
            assert all(a is b for a, b in zip(first, lines(timeline)))

            # new data on lane 1 only (same extent): lane 0 keeps its line, lane 1 is redrawn
            spans2 = [s for s in spans if s.lane != 1] + lane_spans(1, dur=0.5 * MS)
            timeline.set_spans(names, spans2)
            await pilot.pause()
            second = lines(timeline)
            assert second[1] is first[1] and second[1].text.startswith("lane0")
            assert second[2] is not first[2] and second[2].text != first[2].text

            # the selection redraws its lane (and the legend)
            timeline.select(timeline.spans_in_lane(0)[0])
            await pilot.pause()
            third = lines(timeline)
            assert third[1] is not second[1] and "attn" in third[-1].text

            # scrolling: the first lane row now shows another lane
            timeline.scroll_to(y=3, animate=False, immediate=True)
            await until(pilot, lambda: lines(timeline)[1].text.startswith("lane3"), timeout=5)

            # a narrower terminal: every line is rebuilt at the new width
            await pilot.resize_terminal(60, 8)
            await until(pilot, lambda: all(s.cell_length == timeline.size.width for s in lines(timeline))
                        and timeline.size.width < 80, timeout=5)

            # a theme switch restyles the lane names
            before = [seg.style for seg in lines(timeline)[1]][0]
            app.theme = "textual-light"
            await until(pilot, lambda: [seg.style for seg in lines(timeline)[1]][0] != before, timeout=5)

    asyncio.run(body())


def test_heat_map_redraws_only_rows_whose_colours_change():
    rng = np.random.default_rng(0)
    matrix = rng.integers(1, 100, size=(6, 20)).astype(float)
    matrix[0, 0] = 200.0  # the max stays put, so other rows keep their colour levels
    heat = HeatMap(matrix)

    async def body():
        app = One(heat)
        async with app.run_test(size=(60, 10)) as pilot:
            await pilot.pause()
            first = lines(heat)
            heat.set_data(matrix.copy())  # the same picture
            heat.refresh()
            same = lines(heat)
            assert all(a is b for a, b in zip(first, same))

            changed = matrix.copy()
            changed[3, 5] = 0.0  # row 3 only (line 4: the expert ruler is line 0)
            heat.set_data(changed)
            await pilot.pause()
            second = lines(heat)
            assert second[4] is not first[4] and second[2] is first[2]
            assert [s.style for s in second[4]] != [s.style for s in first[4]]

            heat.cursor = (2, 3)  # the cursor rows and the ruler's marker redraw
            await pilot.pause()
            third = lines(heat)
            assert third[3] is not second[3] and third[0] is not second[0] and third[5] is second[5]

            heat.scale_name = "magma"  # new colours everywhere
            await pilot.pause()
            fourth = lines(heat)
            assert [s.style for s in fourth[5]] != [s.style for s in third[5]]

    asyncio.run(body())


def test_scrub_bar_and_legend_follow_position_and_range():
    bar = ScrubBar(0, 100)
    legend = ColourLegend("viridis", 0, 10, "tok")

    class Both(App):
        def compose(self) -> ComposeResult:
            yield bar
            yield legend

    async def body():
        app = Both()
        async with app.run_test(size=(60, 6)) as pilot:
            await pilot.pause()
            knob = lines(bar)[1].text.index("●")
            bar.position = 100
            await until(pilot, lambda: lines(bar)[1].text.index("●") > knob, timeout=5)
            text = lines(legend)[0].text
            legend.hi = 5000
            await until(pilot, lambda: lines(legend)[0].text != text and "5000" in lines(legend)[0].text, timeout=5)

    asyncio.run(body())


def test_panels_show_each_new_record_in_replay():
    source = ReplaySource(TRACES / "steady_rebalance.trace")
    app = MoectlApp(source)

    async def body():
        async with app.run_test(size=(160, 50)) as pilot:
            await pilot.pause()
            source.pause()
            source.seek_step(100)
            app.tick()
            await pilot.press("4")  # timeline: its breakdown names the steps shown
            await until(pilot, lambda: "steps 100-100" in text_of(app, "#tl-breakdown"), timeout=5)
            timeline = app.query_one(Timeline)
            before = lines(timeline)
            source.step_forward()
            app.tick()
            await until(pilot, lambda: "steps 101-101" in text_of(app, "#tl-breakdown"), timeout=5)
            assert [s.text for s in lines(timeline)] != [s.text for s in before]

            await pilot.press("5")  # requests: the table follows the recorded requests
            table = app.query_one(RequestTable)
            await until(pilot, lambda: table.row_count > 0, timeout=5)
            first_row, version = table.get_row_at(0), table.version
            source.seek_step(300)
            app.tick()
            await until(pilot, lambda: table.version > version, timeout=5)
            assert table.get_row_at(0) != first_row

            await pilot.press("2")  # experts: the heat map follows the window
            heat = app.query_one(HeatMap)
            await until(pilot, lambda: heat.shape[0] > 0, timeout=5)
            matrix = heat.matrix.copy()
            source.seek_step(150)
            app.tick()
            await until(pilot, lambda: not np.array_equal(heat.matrix, matrix), timeout=5)

    asyncio.run(body())
