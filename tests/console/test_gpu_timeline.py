"""The console on a GPU timeline (console/gpu_timeline.py), through Pilot: a two-rank Kineto
folder shaped as vLLM and SGLang write it, opened from the source and from its `trace import`:
lanes per rank and stream on one time axis, search and zoom, the figures `trace report` gives.
Its SVG snapshot is in test_console_snapshots.py."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from moectl.cli.main import app as cli
from moectl.console.gpu_timeline import gpu_timeline_app, timeline_columns
from moectl.console.widgets import Timeline
from moectl.profiler.kineto_import import read_source, read_timeline
from moectl.profiler.trace_store import TraceReader
from tests.kineto_traces import two_rank_folder
from tests.pilot import run_app, text_of

LANES = ["r0 stream 7", "r0 stream 20", "r1 stream 7", "r1 stream 20"]


def imported_timeline(folder, out):
    result = CliRunner().invoke(cli, ["trace", "import", str(folder), "-o", str(out)])
    assert result.exit_code == 0, result.output
    with TraceReader(out) as reader:
        return read_timeline(reader)


async def check_the_view(app, pilot):
    timeline = app.query_one(Timeline)
    assert timeline.lanes == LANES and timeline.span_count == 18
    classes, ranks, layers = (text_of(app, i) for i in ("#gt-classes", "#gt-ranks", "#gt-layers"))
    assert "expert_gemm" in classes and "44.4% of 0.180 ms" in classes  # 80 of 180 us hidden
    assert "r1" in ranks.splitlines()[2] and "◀ straggler" in ranks.splitlines()[2]
    assert "L2" in layers and "100% of the time placed" in layers

    await pilot.press("slash", *"fused_moe", "enter")
    first = timeline.selected
    assert (first.name, first.kind, first.layer) == ("fused_moe_kernel", "expert_gemm", 0)
    assert "match 1 of 6" in text_of(app, "#gt-matches")
    assert "fused_moe_kernel (expert_gemm, layer 0) on r0 stream 7" in text_of(app, "#gt-detail")
    await pilot.press("right_square_bracket")  # rank 1's, at the same instant on a later lane
    second = timeline.selected
    assert timeline.lanes[second.lane] == "r1 stream 7" and second.start_s == first.start_s
    await pilot.press("right_square_bracket")
    assert timeline.selected.layer == 1 and "match 3 of 6" in text_of(app, "#gt-matches")
    await pilot.press("left_square_bracket", "left_square_bracket")
    assert timeline.selected == first
    await pilot.press("escape", "n")  # an event that is no match: the next match follows it in time
    assert timeline.selected.name == "flash_fwd_splitkv_kernel"
    await pilot.press("right_square_bracket")
    assert timeline.selected == first

    v0, v1 = timeline.view_range
    await pilot.press("plus")
    w0, w1 = timeline.view_range
    assert w1 - w0 == pytest.approx((v1 - v0) / 2)

    await pilot.press("slash", "ctrl+a", "backspace", "(", "enter")
    assert "not a regular expression" in text_of(app, "#gt-matches")
    await pilot.press("slash", "backspace", *"nothing_runs_this", "enter")
    assert "no event matches" in text_of(app, "#gt-matches")


def test_lanes_figures_search_and_zoom(tmp_path):
    folder = two_rank_folder(tmp_path / "profile")
    for ranks in (imported_timeline(folder, tmp_path / "gpu.trace"), read_source([folder])):
        run_app(gpu_timeline_app(ranks, "gpu.trace"), check_the_view)  # the import shows what the source does


def test_ranks_on_clocks_seconds_apart_share_one_axis(tmp_path):
    folder = two_rank_folder(tmp_path / "profile", rank1_later_us=2.5e6)
    for ranks in (imported_timeline(folder, tmp_path / "gpu.trace"), read_source([folder])):
        lanes, columns = timeline_columns(ranks)
        first = {lanes[lane]: start for lane, start in zip(columns["lane"][::-1], columns["start_s"][::-1])}
        assert first["r0 stream 7"] == pytest.approx(50e-6, abs=1e-12)
        assert first["r1 stream 7"] == pytest.approx(2.5 + 50e-6, abs=1e-12)
