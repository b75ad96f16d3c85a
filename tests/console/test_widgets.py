"""Console widgets: colour scales, HeatMap, Timeline, ScrubBar (headless Textual apps).

Async Textual tests run through asyncio.run in plain test functions (no pytest-asyncio here).
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
from rich.cells import cell_len
from rich.color import Color
from rich.style import Style
from textual.app import App, ComposeResult
from textual.strip import Strip

from moectl.console.widgets import SCALES, ColourLegend, ColourScale, HeatMap, ScrubBar, Span, Timeline, legend_strip
from moectl.console.widgets.heatmap import LEVELS, quantise


def cell_at(strip: Strip, x: int) -> tuple[str, Style]:
    """(character, style) at cell x of a rendered strip."""
    pos = 0
    for segment in strip:
        n = cell_len(segment.text)
        if pos <= x < pos + n:
            return segment.text[x - pos], segment.style or Style()
        pos += n
    raise IndexError(x)


def bg(style: Style) -> tuple[int, int, int] | None:
    return None if style.bgcolor is None else tuple(style.bgcolor.get_truecolor())


def rgb(colour: Color) -> tuple[int, int, int]:
    return tuple(colour.get_truecolor())


# ------------------------------------------------------------------------ colour scales


def test_colour_scales_endpoints_styles_and_refusal():
    viridis = ColourScale("viridis")
    assert rgb(viridis.colour(0.0)) == (0x44, 0x01, 0x54)
    assert rgb(viridis.colour(1.0)) == (0xFD, 0xE7, 0x25)
    assert rgb(viridis.colour(2.0)) == rgb(viridis.colour(1.0))  # clamped
    assert rgb(viridis.colour(float("nan"))) == rgb(viridis.colour(0.0))
    assert rgb(ColourScale("magma").colour(0.0)) == (0, 0, 4)
    assert rgb(ColourScale("cividis").colour(1.0)) == (0xFF, 0xEA, 0x46)
    assert set(SCALES) == {"viridis", "cividis", "magma", "grey"}
    for name in SCALES:  # sequential: lightness grows with the value
        scale = ColourScale(name)
        luma = [0.2126 * r + 0.7152 * g + 0.0722 * b for r, g, b in (scale.rgb(i / 10) for i in range(11))]
        assert luma == sorted(luma), name
        styles = scale.styles(16)
        assert len(styles) == 16
        assert rgb(styles[0].bgcolor) == rgb(scale.colour(0.0))
        assert rgb(styles[-1].bgcolor) == rgb(scale.colour(1.0))
    with pytest.raises(ValueError) as err:
        ColourScale("jet")
    assert "\n" not in str(err.value) and "jet" in str(err.value) and "viridis" in str(err.value)

    strip = legend_strip("viridis", 40, 0, 1234, "tok")
    assert strip.cell_length == 40
    assert strip.text.startswith("0 tok ") and strip.text.endswith(" 1234 tok")
    assert bg(cell_at(strip, 6)[1]) == rgb(viridis.colour(0.0))
    assert bg(cell_at(strip, 40 - 10)[1]) == rgb(viridis.colour(1.0))
    assert legend_strip("magma", 3).cell_length == 3  # too narrow for labels: gradient only


def test_quantise_keeps_zero_apart_from_tiny_values():
    levels = quantise(np.array([[1e6, 5e5, 1e-3, 0.0]]), 1e6, log_scale=False)
    assert levels.tolist() == [[LEVELS - 1, int(np.ceil(0.5 * (LEVELS - 1))), 1, 0]]
    # 1/100 of the max: the lowest level on a linear scale, about a third of the way on a log one
    linear = quantise(np.array([[1e6, 1e4, 0.0]]), 1e6, log_scale=False)
    logged = quantise(np.array([[1e6, 1e4, 0.0]]), 1e6, log_scale=True)
    assert linear[0, 1] == 1 and LEVELS // 4 < logged[0, 1] < LEVELS // 2
    assert logged[0, 0] == LEVELS - 1 and logged[0, 2] == 0
    assert quantise(np.zeros((2, 3)), 0.0, log_scale=False).tolist() == [[0, 0, 0], [0, 0, 0]]


# ------------------------------------------------------------------------------ heat map


class HeatApp(App):
    def __init__(self, matrix=None, **kwargs) -> None:
        super().__init__()
        self._matrix = matrix
        self._kwargs = kwargs
        self.selected: list[HeatMap.CellSelected] = []

    def compose(self) -> ComposeResult:
        yield HeatMap(self._matrix, **self._kwargs)

    def on_heat_map_cell_selected(self, message: HeatMap.CellSelected) -> None:
        self.selected.append(message)


SMALL = np.array(
    [
        [5.0, 0.0, 2.0, 1.0],
        [0.0, 10.0, 0.0, 3.0],
        [1.0, 1.0, 1.0, 0.0],
    ]
)


def test_heatmap_colours_max_zero_scale_and_log():
    async def body():
        app = HeatApp(SMALL, cell_width=1)
        async with app.run_test(size=(40, 8)) as pilot:
            heat = app.query_one(HeatMap)
            await pilot.pause()
            assert heat.max_value == 10.0 and heat.matrix.shape == (3, 4)
            gutter = len("L0 ")
            scale = ColourScale("viridis")
            row1 = heat.render_line(1 + 1)  # header row, then L0, L1
            assert row1.cell_length == 40
            assert row1.text.startswith("L1 ")
            # the max cell (layer 1, expert 1) at full colour, zeros at the bottom of the scale
            assert bg(cell_at(row1, gutter + 1)[1]) == rgb(scale.colour(1.0))
            assert bg(cell_at(row1, gutter + 0)[1]) == rgb(scale.colour(0.0))
            assert bg(cell_at(row1, gutter + 2)[1]) == rgb(scale.colour(0.0))
            # a small non-zero value is not drawn like a zero
            row2 = heat.render_line(3)
            small = bg(cell_at(row2, gutter + 0)[1])
            assert small != rgb(scale.colour(0.0))
            level = int(np.ceil(0.1 * (LEVELS - 1)))
            assert small == rgb(scale.colour(level / (LEVELS - 1)))
            # the cursor (0, 0) is drawn with a glyph, the other cells are blank
            row0 = heat.render_line(1)
            char, style = cell_at(row0, gutter)
            assert char == "◆" and style.bold
            assert cell_at(row0, gutter + 1)[0] == " "
            assert "▼" in heat.render_line(0).text  # cursor column marked in the ruler

            heat.scale_name = "magma"
            await pilot.pause()
            row1 = heat.render_line(2)
            assert bg(cell_at(row1, gutter + 1)[1]) == rgb(ColourScale("magma").colour(1.0))
            with pytest.raises(ValueError):
                heat.scale_name = "rainbow"

            linear = bg(cell_at(heat.render_line(3), gutter)[1])
            heat.log_scale = True
            await pilot.pause()
            logged = bg(cell_at(heat.render_line(3), gutter)[1])
            assert logged != linear  # 1/10 of max is brighter on a log scale
            assert sum(logged) > sum(linear)

    asyncio.run(body())


def test_heatmap_keys_click_and_cell_selected():
    async def body():
        app = HeatApp(SMALL)
        async with app.run_test(size=(40, 8)) as pilot:
            heat = app.query_one(HeatMap)
            heat.focus()
            await pilot.pause()
            assert heat.cell_width == 2  # the whole row fits at two characters per expert
            await pilot.press("right", "down")
            await pilot.pause()
            assert heat.cursor == (1, 1)
            assert [(m.layer, m.expert) for m in app.selected] == [(0, 1), (1, 1)]
            assert app.selected[-1].value == 10.0 and app.selected[-1].label == "L1"
            await pilot.press("end")
            await pilot.pause()
            assert heat.cursor == (1, 3) and app.selected[-1].value == 3.0
            await pilot.press("home", "up", "up")  # clamps at the top
            await pilot.pause()
            assert heat.cursor == (0, 0) and app.selected[-1].value == 5.0
            # the cursor cell spans both characters of the cell
            row0 = heat.render_line(1)
            assert cell_at(row0, 3)[0] + cell_at(row0, 4)[0] == "[]"

            # click layer 2, expert 2: x = gutter (3) + 2 * 2, y = 1 (ruler) + 2
            app.selected.clear()
            await pilot.click(HeatMap, offset=(3 + 2 * 2 + 1, 1 + 2))
            await pilot.pause()
            assert heat.cursor == (2, 2)
            assert [(m.layer, m.expert, m.value) for m in app.selected] == [(2, 2, 1.0)]
            # clicking the same cell again posts again; the ruler row selects nothing
            await pilot.click(HeatMap, offset=(3 + 2 * 2, 1 + 2))
            await pilot.click(HeatMap, offset=(3 + 2 * 2, 0))
            await pilot.pause()
            assert len(app.selected) == 2 and heat.cursor == (2, 2)

    asyncio.run(body())


def test_heatmap_large_grid_scrolls_to_far_cell_and_survives_reshapes():
    matrix = np.arange(61 * 384, dtype=np.float64).reshape(61, 384)

    async def body():
        app = HeatApp(matrix)
        async with app.run_test(size=(60, 15)) as pilot:
            heat = app.query_one(HeatMap)
            await pilot.pause()
            assert heat.cell_width == 1
            assert heat.virtual_size.width == len("L60 ") + 384
            for y in range(heat.size.height):  # only the visible slice is rendered
                assert heat.render_line(y).cell_length == 60
            heat.cursor = (60, 383)
            await pilot.pause()
            sx, sy = heat.scroll_offset
            assert sx > 300 and sy > 40
            assert app.selected[-1].value == matrix[60, 383]
            y = 1 + 60 - sy
            row = heat.render_line(y)
            assert row.text.startswith("L60 ")
            char, style = cell_at(row, len("L60 ") + 383 - sx)
            assert char == "◆"
            assert bg(style) == rgb(ColourScale("viridis").colour(1.0))  # the cursor keeps the cell's colour

            # another model's shape: the cursor is clamped, nothing breaks
            heat.set_data(np.ones((8, 16)), labels=list(range(3, 11)))
            await pilot.pause()
            assert heat.cursor == (7, 15) and heat.shape == (8, 16)
            assert heat.render_line(1).text.startswith("L3 ")
            for y in range(heat.size.height):
                heat.render_line(y)
            with pytest.raises(ValueError):
                heat.set_data(np.ones((8, 16)), labels=["a"])

            heat.set_data(np.zeros((0, 0)))
            await pilot.pause()
            assert "no routing yet" in heat.render_line(0).text
            assert heat.max_value == 0.0
            await pilot.press("down", "right")
            await pilot.click(HeatMap, offset=(5, 3))
            await pilot.pause()
            assert heat.render_line(3).text.strip() == ""

    asyncio.run(body())


# ------------------------------------------------------------------------------ timeline

MS = 1e-3


class TimelineApp(App):
    def __init__(self, lanes, spans) -> None:
        super().__init__()
        self._lanes, self._spans = lanes, spans
        self.selected: list[Span] = []

    def compose(self) -> ComposeResult:
        yield Timeline(self._lanes, self._spans)

    def on_timeline_span_selected(self, message: Timeline.SpanSelected) -> None:
        self.selected.append(message.span)


def small_spans() -> tuple[list[str], list[Span]]:
    lanes = ["engine", "gpu0->gpu1"]
    spans = [
        Span(0, "attn", 0.0, 4 * MS, layer=0, step=1),
        Span(0, "expert", 5 * MS, 3 * MS, layer=0, step=1, kind="kernel"),
        Span(1, "dispatch", 2 * MS, 4 * MS, modeled=True, layer=0, step=1),
    ]
    return lanes, spans


def test_timeline_measured_and_modeled_spans_look_different():
    lanes, spans = small_spans()

    async def body():
        app = TimelineApp(lanes, spans)
        async with app.run_test(size=(80, 8)) as pilot:
            timeline = app.query_one(Timeline)
            await pilot.pause()
            assert timeline.view_range == pytest.approx((0.0, 8 * MS))
            gutter, track = 14, 80 - 14
            measured_row = timeline.render_line(1)
            modeled_row = timeline.render_line(2)
            assert measured_row.text.startswith("engine") and modeled_row.text.startswith("gpu0->gpu1")
            x_measured = gutter + int(2 * MS / (8 * MS) * track)  # inside "attn"
            x_modeled = gutter + int(4 * MS / (8 * MS) * track)  # inside "dispatch"
            char, style = cell_at(measured_row, x_measured)
            assert char != "░" and style.bgcolor is not None
            char, style = cell_at(modeled_row, x_modeled)
            # a hatch in the span's colour over the widget's own background, no block of colour
            assert char == "░" and style.italic and style.bgcolor == timeline.visual_style.rich_style.bgcolor
            assert cell_at(modeled_row, gutter + 1)[0] == " "  # nothing before 2 ms
            assert "attn" in measured_row.text  # label inside the block
            legend = timeline.render_line(timeline.size.height - 1).text
            assert "█ measured" in legend and "░ modeled" in legend
            assert "ms" in timeline.render_line(0).text  # ruler unit

            # overlapping spans on one lane: the inner one is drawn on top, the outer elsewhere
            timeline.set_spans(["gpu0"], [Span(0, "step", 0.0, 8 * MS), Span(0, "k", 2 * MS, 1 * MS)])
            await pilot.pause()
            assert timeline.span_at(gutter + int(2.5 / 8 * track), 1).name == "k"
            assert timeline.span_at(gutter + int(6 / 8 * track), 1).name == "step"

            timeline.set_spans([], [])
            await pilot.pause()
            assert "no spans" in timeline.render_line(0).text
            await pilot.press("n", "plus", "left", "0")  # nothing to act on: no crash

    asyncio.run(body())


def test_timeline_zoom_pan_and_fit():
    lanes, spans = small_spans()

    async def body():
        app = TimelineApp(lanes, spans)
        async with app.run_test(size=(80, 8)) as pilot:
            timeline = app.query_one(Timeline)
            timeline.focus()
            await pilot.pause()
            ruler_before = timeline.render_line(0).text
            await pilot.press("plus")
            v0, v1 = timeline.view_range
            assert v1 - v0 == pytest.approx(4 * MS)
            assert (v0 + v1) / 2 == pytest.approx(4 * MS)  # zoomed around the centre
            assert timeline.render_line(0).text != ruler_before
            await pilot.press("right")
            w0, w1 = timeline.view_range
            assert w0 > v0 and w1 - w0 == pytest.approx(4 * MS)
            await pilot.press("left", "left")
            u0, _ = timeline.view_range
            assert u0 < w0
            await pilot.press("minus", "minus")
            z0, z1 = timeline.view_range
            assert z1 - z0 == pytest.approx(16 * MS)
            await pilot.press("0")
            assert timeline.view_range == pytest.approx((0.0, 8 * MS))
            for _ in range(10):  # panning stops at the data
                await pilot.press("left")
            assert timeline.view_range[0] == pytest.approx(0.0)

    asyncio.run(body())


def test_timeline_selection_keys_and_click():
    lanes, spans = small_spans()

    async def body():
        app = TimelineApp(lanes, spans)
        async with app.run_test(size=(80, 8)) as pilot:
            timeline = app.query_one(Timeline)
            timeline.focus()
            await pilot.pause()
            assert timeline.selected is None
            await pilot.press("n")
            await pilot.pause()
            assert [s.name for s in app.selected] == ["attn"]
            await pilot.press("n", "n")
            await pilot.pause()
            assert [s.name for s in app.selected] == ["attn", "expert", "dispatch"]
            assert timeline.selected.name == "dispatch"
            assert "dispatch" in timeline.render_line(timeline.size.height - 1).text  # in the legend
            await pilot.press("p")
            await pilot.pause()
            assert timeline.selected.name == "expert"
            # the selected span is drawn in the selection style
            selected_style = timeline.get_component_rich_style("timeline--selected")
            x = 14 + int(6 / 8 * 66)
            assert cell_at(timeline.render_line(1), x)[1].bgcolor == selected_style.bgcolor
            # click on the modeled span
            app.selected.clear()
            await pilot.click(Timeline, offset=(14 + int(4 / 8 * 66), 2))
            await pilot.pause()
            assert [s.name for s in app.selected] == ["dispatch"]
            assert timeline.selected is spans[2] or timeline.selected == spans[2]
            # a click on empty track or the gutter selects nothing new
            await pilot.click(Timeline, offset=(14 + 1, 2))
            await pilot.click(Timeline, offset=(2, 1))
            await pilot.pause()
            assert len(app.selected) == 1

    asyncio.run(body())


def test_timeline_129_lanes_thousands_of_spans():
    rng = np.random.default_rng(0)
    lanes = ["engine"] + [f"gpu{i}" for i in range(64)] + [f"link{i}" for i in range(64)]
    spans = []
    for lane in range(len(lanes)):
        t = 0.0
        for k in range(40):
            d = float(rng.uniform(20e-6, 300e-6))
            spans.append(Span(lane, f"k{k % 7}", t, d, modeled=lane > 64, layer=k % 61, step=k // 20))
            t += d + float(rng.uniform(0, 50e-6))

    async def body():
        app = TimelineApp(lanes, spans)
        async with app.run_test(size=(120, 40)) as pilot:
            timeline = app.query_one(Timeline)
            await pilot.pause()
            assert timeline.span_count == len(spans) == 129 * 40
            assert timeline.virtual_size.height == 129 + 2
            height = timeline.size.height
            rows = [timeline.render_line(y) for y in range(height)]
            assert all(r.cell_length == 120 for r in rows)
            assert rows[1].text.startswith("engine") and rows[2].text.startswith("gpu0")
            assert sum(r.text.startswith(("gpu", "link")) for r in rows) == height - 3

            last = timeline.spans_in_lane(128)[-1]
            timeline.select(last)
            await pilot.pause()
            assert app.selected[-1] == last
            assert timeline.scroll_offset.y == 129 + 2 - height
            assert timeline.render_line(height - 2).text.startswith("link63")
            # drawn inside the view now
            v0, v1 = timeline.view_range
            assert v0 <= last.start_s and last.end_s <= v1

    asyncio.run(body())


def test_timeline_draws_a_lane_of_narrow_spans_of_one_colour_as_one_segment():
    """Blank cells show no foreground, so they share the segment of the glyphs beside them: a lane
    of narrow spans with gaps is one segment for its whole track, and its cells are the same as
    drawing each span alone would give ("█" in the span's colour on the widget's background)."""
    starts = [k * 0.8 * MS for k in range(10)]
    lanes, spans = ["gpu0", "gpu1"], [Span(0, "k", t, 0.1 * MS) for t in starts] + [Span(1, "k", 0.0, 8 * MS)]

    async def body():
        app = TimelineApp(lanes, spans)
        async with app.run_test(size=(80, 8)) as pilot:
            timeline = app.query_one(Timeline)
            await pilot.pause()
            gutter, track = 14, 80 - 14
            row = timeline.render_line(1)
            assert len(list(row)) == 2  # the lane's name, then one segment for the track
            base = timeline.visual_style.rich_style
            scale = track / (8 * MS)
            covered = {c for t in starts for c in range(int(t * scale), max(math.ceil((t + 0.1 * MS) * scale),
                                                                             int(t * scale) + 1))}
            colour = cell_at(row, gutter + min(covered))[1].color
            for c in range(track):
                char, style = cell_at(row, gutter + c)
                assert char == ("█" if c in covered else " ")
                assert style.bgcolor == base.bgcolor and style.color == colour
            timeline.set_spans(["gpu0"], spans[:10])
            timeline.zoom(16.0, centre_s=4.4 * MS)  # between two spans: nothing in view on any lane
            await pilot.pause()
            assert timeline.render_line(1).text == "gpu0".ljust(80)

    asyncio.run(body())


def test_timeline_touching_spans_of_one_colour_alternate_shades():
    spans = [Span(0, "k", k * MS, MS) for k in range(8)]  # back to back, 8 cells each: the name fits
    narrow = [Span(0, "k", k * 0.1 * MS, 0.1 * MS) for k in range(80)]  # back to back, under a cell each

    async def body():
        app = TimelineApp(["gpu0"], narrow)
        async with app.run_test(size=(80, 8)) as pilot:
            timeline = app.query_one(Timeline)
            await pilot.pause()
            row = timeline.render_line(1)  # a block of colour a cell per span, no gap: no glyphs
            colours = [cell_at(row, 14 + c)[1].bgcolor for c in range(66)]
            assert row.text[14:] == " " * 66
            assert len(set(colours)) == 2 and all(a != b for a, b in zip(colours, colours[1:]))
            timeline.set_spans(["gpu0"], spans)  # wide enough for their names: blocks of background
            await pilot.pause()
            row = timeline.render_line(1)
            backgrounds = [style.bgcolor for segment in list(row)[1:] for style in [segment.style]]
            assert len(backgrounds) == 8 and all(a != b for a, b in zip(backgrounds, backgrounds[1:]))
            assert row.text.count(" k") == 8

    asyncio.run(body())


def test_timeline_builds_and_draws_only_the_lanes_on_screen():
    """A new set of columns builds no lane, nor does a frame that shows every span; a zoomed frame
    builds the lanes it shows, all of them in one pass, and each lane is drawn as it would be alone."""
    rng = np.random.default_rng(1)
    lanes = ["engine"] + [f"gpu{i}" for i in range(64)] + [f"link{i}" for i in range(64)]
    n = 6000
    lane = rng.integers(0, len(lanes), n)
    starts = rng.uniform(0, 10 * MS, n)
    durs = rng.uniform(1e-6, 400e-6, n)
    columns = dict(lane=lane, name=rng.integers(0, 5, n), names=[f"k{i}" for i in range(5)], start_s=starts,
                   dur_s=durs, modeled=lane > 64, layer=rng.integers(0, 61, n))

    async def body():
        app = TimelineApp([], [])
        async with app.run_test(size=(120, 40)) as pilot:
            timeline = app.query_one(Timeline)
            timeline.set_columns(lanes, **columns)
            assert timeline._lanes.built == 0
            await pilot.pause()
            shown = timeline._visible_lanes()
            assert len(shown) == 40 - 2 and timeline._lanes.built == 0  # all in view: the columns serve
            track, base = timeline.track_width, timeline.visual_style.rich_style

            def drawn_as_alone():
                for y, lane_index in enumerate(timeline._visible_lanes(), start=1):
                    alone = timeline._draw_tracks([lane_index], track, base)[lane_index]
                    timeline._tracks_key = None  # the next line draws the lanes on screen together again
                    assert list(timeline.render_line(y))[1 : 1 + len(alone)] == alone  # then padding

            drawn_as_alone()
            timeline.zoom(16.0)
            await pilot.pause()
            assert timeline._lanes.built == len(shown)
            drawn_as_alone()
            timeline.scroll_to(y=90, animate=False, immediate=True)
            await pilot.pause()
            assert timeline._lanes.built == len(shown) * 2  # the lanes scrolled to, no others
            drawn_as_alone()

    asyncio.run(body())


def test_timeline_paint_and_sort_match_the_simple_versions():
    """_paint (every lane on screen in one numpy pass) leaves each cell to the span that painting
    spans longest first, one at a time, leaves there; _lane_order is lexsort's order."""
    from moectl.console.widgets.timeline import _lane_order, _paint

    rng = np.random.default_rng(2)
    for trial in range(20):
        n, width = int(rng.integers(1, 60)), 50
        at = rng.integers(0, 3 * width, n)
        length = np.minimum(rng.integers(1, 30, n), 3 * width - at)
        durs = rng.choice([1.0, 2.0, 3.0, 5.0], n)  # ties on purpose
        expected = np.full(3 * width, -1)
        for i in np.argsort(-durs, kind="stable"):
            expected[at[i] : at[i] + length[i]] = i
        assert np.array_equal(_paint(at, length, durs, 3 * width), expected)

        lanes = rng.integers(0, 5, n)
        start = rng.choice([0.0, 1.0, 2.0], n) if trial % 2 else np.sort(rng.uniform(0, 1, n))
        kept = int(rng.integers(0, n + 1))
        lanes = np.where(np.arange(n) < kept, lanes, 5)  # dropped spans sort last
        assert np.array_equal(_lane_order(lanes, start, durs, kept),
                              np.lexsort((-durs, start, lanes))[:kept])


def test_timeline_panel_breakdown_is_step_breakdown_computed_once_per_record(monkeypatch):
    """The Timeline panel's per-step breakdown over the steps shown equals step_breakdown's, and a
    new record costs one record's breakdown, not one per step shown."""
    from moectl.console.panels import timeline as panel_module
    from moectl.profiler.analysis import step_breakdown

    def record(k: int) -> dict:
        spans = {"lanes": ["engine", "device 0", "link 0"], "names": ["attention", "experts", "dispatch"],
                 "lane": [0, 1, 2], "name": [0, 1, 2], "start_s": [0.0, 0.01, 0.02], "layer": [0, 0, 0],
                 "dur_s": [0.01, 0.02 + k * 1e-3, 0.005 + k * 1e-4], "modeled": [False, False, True]}
        return {"step": k, "t_start": k * 0.1, "t_end": k * 0.1 + 0.05, "spans": spans}

    calls = []
    monkeypatch.setattr(panel_module, "step_breakdown", lambda recs: calls.append(len(recs)) or step_breakdown(recs))
    panel = panel_module.TimelinePanel()
    panel.on_mount()
    records = [record(k) for k in range(6)]
    for shown in (records[:5], records[1:6]):
        expected = step_breakdown(shown)
        assert panel.breakdown(shown) == (expected["measured_mean_s"], expected["communication_modeled_mean_s"])
    assert calls == [1] * 6  # five, then the new one


# ----------------------------------------------------------------------------- scrub bar


class ScrubApp(App):
    def __init__(self, **kwargs) -> None:
        super().__init__()
        self._kwargs = kwargs
        self.seeks: list[int] = []

    def compose(self) -> ComposeResult:
        yield ScrubBar(**self._kwargs)
        yield ColourLegend("cividis", 0, 100, "tok")

    def on_scrub_bar_seek(self, message: ScrubBar.Seek) -> None:
        self.seeks.append(message.step)


def test_scrub_bar_click_drag_markers_keys():
    async def body():
        app = ScrubApp(
            first_step=0, last_step=100, markers=[(10, "action"), (50, "alert"), (70, "note"), (500, "alert")]
        )
        async with app.run_test(size=(101, 6)) as pilot:
            bar = app.query_one(ScrubBar)
            await pilot.pause()
            assert bar.size.width == 101  # one column per step here
            marks = bar.render_line(0)
            assert cell_at(marks, 10)[0] == "▼" and cell_at(marks, 50)[0] == "!" and cell_at(marks, 70)[0] == "•"
            assert cell_at(marks, 10)[1] != cell_at(marks, 50)[1]
            assert marks.text.count("!") == 1  # the out-of-range marker is not drawn
            assert cell_at(bar.render_line(1), 0)[0] == "●"

            await pilot.click(ScrubBar, offset=(30, 1))
            await pilot.pause()
            assert app.seeks == [30] and bar.position == 30
            assert cell_at(bar.render_line(1), 30)[0] == "●"
            assert cell_at(bar.render_line(1), 29)[0] == "━"
            await pilot.press("right")
            await pilot.press("shift+right")
            await pilot.press("left")
            await pilot.pause()
            assert app.seeks == [30, 31, 41, 40]
            await pilot.press("end", "end", "home")
            await pilot.pause()
            assert app.seeks[-2:] == [100, 0] and bar.position == 0

            app.seeks.clear()
            await pilot.mouse_down(ScrubBar, offset=(5, 1))
            await pilot.hover(ScrubBar, offset=(20, 1))
            await pilot.mouse_up(ScrubBar, offset=(20, 1))
            await pilot.pause()
            assert app.seeks[0] == 5 and app.seeks[-1] == 20 and bar.position == 20

            bar.position = 60  # set by the program: no Seek
            bar.set_range(0, 50)  # clamped into the new range
            await pilot.pause()
            assert bar.position == 50 and app.seeks[-1] == 20
            bar.set_range(0, -1)
            await pilot.pause()
            assert "no steps" in bar.render_line(1).text
            legend = app.query_one(ColourLegend).render_line(0)
            assert legend.cell_length == 101 and legend.text.startswith("0 tok")

    asyncio.run(body())


# ------------------------------------------------------------------------------- Chart


class ChartApp(App):
    def compose(self) -> ComposeResult:
        from moectl.console.widgets import Chart

        yield Chart(id="chart")


def _chart_lines(draw, size=(60, 12)) -> list[Strip]:
    """The chart's rendered rows after draw(chart) (plot_lines / plot_histogram)."""
    from moectl.console.widgets import Chart

    async def go():
        app = ChartApp()
        async with app.run_test(size=size) as pilot:
            chart = app.query_one(Chart)
            draw(chart)
            await pilot.pause()
            return [chart.render_line(y) for y in range(chart.size.height)]

    return asyncio.run(go())


def _dots(strip: Strip) -> list[int]:
    """Columns of a plot row holding braille dots."""
    return [x for x, ch in enumerate(strip.text) if 0x2801 <= ord(ch) <= 0x28FF]


def test_chart_draws_a_rising_line_from_bottom_left_to_top_right_with_its_legend_and_axes():
    rows = _chart_lines(lambda c: c.plot_lines(range(10, 20), [("d0", [float(v) for v in range(10)])]))
    assert "d0" in rows[0].text  # the legend names the series
    plot = rows[1:-1]
    assert plot[0].text.split("│")[0].strip() == "9" and plot[-1].text.split("│")[0].strip() == "0"  # y labels
    first = next(r for r, strip in enumerate(plot) if _dots(strip))
    last = max(r for r, strip in enumerate(plot) if _dots(strip))
    assert (first, last) == (0, len(plot) - 1)  # spans the whole height
    assert min(_dots(plot[0])) > max(_dots(plot[-1]))  # the top row's dots lie right of the bottom row's
    assert all(_dots(strip) for strip in plot)  # connected: no empty row between the ends
    axis = rows[-1].text
    assert "10" in axis and "19" in axis  # x range


def test_chart_series_keep_their_colours_and_a_reference_line_is_drawn():
    from moectl.console.widgets.palette import PALETTE

    rows = _chart_lines(lambda c: c.plot_lines([0, 1, 2], [("low", [0.0, 0.0, 0.0]), ("high", [10.0, 10.0, 10.0])],
                                               hline=5.0))
    colours = {segment.style.color.name.upper() for strip in rows[1:-1] for segment in strip
               if segment.style is not None and segment.style.color is not None and _dots(Strip([segment]))}
    assert {PALETTE[0].upper(), PALETTE[1].upper()} <= {c.upper() for c in colours}
    middle = [r for r, strip in enumerate(rows[1:-1]) if len(_dots(strip)) > 40]
    assert len(middle) == 3  # low, high and the reference line each fill a row
    assert "5" in rows[0].text  # the reference line's value in the legend


def test_chart_histogram_bars_follow_the_counts_and_empty_data_says_so():
    values = [1.0] * 30 + [9.0] * 10
    rows = _chart_lines(lambda c: c.plot_histogram(values, bins=2, unit="ms"))
    assert "40 values" in rows[0].text and "ms" in rows[0].text
    plot = [strip.text.split("│", 1)[1] for strip in rows[1:-1]]
    height = lambda col: sum(line[col] != " " for line in plot)  # noqa: E731
    assert height(1) == len(plot)  # the 30-count bin is full height
    assert 0 < height(len(plot[0]) - 2) < len(plot) / 2  # the 10-count one a third of it
    rows = _chart_lines(lambda c: c.plot_histogram([]))
    assert "no data" in rows[0].text


def test_chart_skips_a_redraw_when_the_data_is_the_same():
    from moectl.console.widgets import Chart

    async def go():
        app = ChartApp()
        async with app.run_test(size=(60, 12)) as pilot:
            chart = app.query_one(Chart)
            chart.plot_lines([1, 2], [("a", [1.0, 2.0])])
            await pilot.pause()
            version = chart._version
            chart.plot_lines([1, 2], [("a", [1.0, 2.0])])
            same = chart._version
            chart.plot_lines([1, 2], [("a", [1.0, 3.0])])
            return version, same, chart._version

    version, same, changed = asyncio.run(go())
    assert same == version and changed != version


# -------------------------------------------------------------------------------- Bars


class BarsApp(App):
    def compose(self) -> ComposeResult:
        from moectl.console.widgets.bars import Bars

        yield Bars(id="bars")


def test_bars_fill_by_fraction_mark_thresholds_and_leave_absent_figures_without_a_bar():
    from moectl.console.widgets.bars import Bars

    async def go():
        app = BarsApp()
        async with app.run_test(size=(60, 10)) as pilot:
            bars = app.query_one(Bars)
            bars.set_rows([("d0", 0.5, "half"), ("d1", 0.9, "warm"), ("d10", 1.0, "full"), ("gpu", None, "no memory")])
            await pilot.pause()
            lines = [bars.render_line(y).text for y in range(4)]
            layout_before = bars.size.height
            bars.set_rows([("d0", 0.1, "x")])
            await pilot.pause()
            after = bars.size.height
            bars.set_rows([], empty="no devices")
            await pilot.pause()
            return lines, layout_before, after, bars.plain_text, bars.render_line(0).text

    lines, height4, height1, plain, empty_line = asyncio.run(go())
    half, warm, full, absent = lines
    assert half.startswith(" d0 ") and warm.startswith(" d1 ") and full.startswith("d10 ")  # labels right-aligned
    bar = lambda line: line[4:].split(" ")[0]  # noqa: E731
    assert abs(bar(half).count("█") * 2 - len(bar(half))) <= 1 and "▓" not in half  # half full, below warn
    assert "▓" in warm and "!" not in warm  # from warn: another glyph
    assert full.rstrip().endswith("full !")  # from crit: a mark
    assert absent.strip() == "gpu no memory" and "·" not in absent  # no bar at all
    assert (height4, height1) == (4, 1)  # its height is its row count
    assert plain == "no devices" and empty_line.startswith("no devices")


def test_timeline_keeps_the_version_of_each_lane_that_draws_the_same_after_new_columns():
    """set_columns compares all lanes in one pass: a lane whose spans did not change keeps its
    version (its rendered line is reused), one whose spans moved gets a new one."""
    timeline = Timeline()
    lane = np.array([0, 0, 1, 1, 2])
    starts = np.array([0.0, 0.5, 0.0, 0.4, 0.2])
    durs = np.array([0.2, 0.2, 0.3, 0.3, 0.1])
    kwargs = dict(name=np.array([0, 1, 0, 1, 0]), names=["a", "b"], dur_s=durs)
    timeline.set_columns(["x", "y", "z"], lane=lane, start_s=starts, **kwargs)
    before = [data.version for data in timeline._lanes]
    moved = starts.copy()
    moved[3] = 0.45  # lane 1's second span
    timeline.set_columns(["x", "y", "z"], lane=lane, start_s=moved, step=np.full(5, 7), **kwargs)
    after = [data.version for data in timeline._lanes]
    assert after[0] == before[0] and after[2] == before[2]  # a new step number alone does not redraw
    assert after[1] != before[1]
    timeline.set_columns(["x", "y", "z"], lane=lane[:4], start_s=moved[:4], dur_s=durs[:4],
                         name=np.array([0, 1, 0, 1]), names=["a", "b"])  # lane 2 emptied: counts differ
    assert [data.version for data in timeline._lanes][:2] == after[:2]
    assert timeline._lanes[2].version != after[2]


def test_stacked_bars_draw_each_piece_with_its_glyph_then_the_rest_dotted():
    from moectl.console.widgets.bars import StackedBars

    class StackedApp(App):
        def compose(self) -> ComposeResult:
            yield StackedBars(("red", "blue"), "█▓", id="stacked")

    async def go():
        app = StackedApp()
        async with app.run_test(size=(60, 6)) as pilot:
            bars = app.query_one(StackedBars)
            bars.set_rows([("d0", (0.25, 0.25), 0.75, " 300"), ("d1", (1.0,), 1.0, " 400")])
            await pilot.pause()
            return [bars.render_line(y).text for y in range(2)], bars.plain_text

    (first, second), plain = asyncio.run(go())
    bar = first[3:].split(" ")[0]
    assert bar.count("█") == bar.count("▓") > 0 and bar.index("▓") > bar.rindex("█")  # pieces in order
    assert abs(bar.count("·") - bar.count("█")) <= 1  # the rest of the 0.75 total, dotted
    assert first.rstrip().endswith("300") and second.rstrip().endswith("400")
    assert "·" not in second and plain.splitlines()[0].startswith("d0")
