"""The console on a GPU timeline (console/gpu_timeline.py), through Pilot: a two-rank Kineto
folder shaped as vLLM and SGLang write it, opened from the source and from its `trace import`:
lanes per rank and stream, search and zoom, the figures `trace report` gives; and an SVG
snapshot (pytest-textual-snapshot)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from moectl.cli.main import app as cli
from moectl.console.gpu_timeline import gpu_timeline_app
from moectl.console.widgets import Timeline
from moectl.profiler.kineto_import import read_source, read_timeline
from moectl.profiler.trace_store import TraceReader
from tests.kineto_traces import two_rank_folder
from tests.pilot import run_app, text_of

LANES = ["r0 stream 7", "r0 stream 20", "r1 stream 7", "r1 stream 20"]


@pytest.fixture
def imported(tmp_path):
    folder = two_rank_folder(tmp_path / "profile")
    out = CliRunner().invoke(cli, ["trace", "import", str(folder), "-o", str(tmp_path / "gpu.trace")])
    assert out.exit_code == 0, out.output
    with TraceReader(tmp_path / "gpu.trace") as reader:
        return folder, read_timeline(reader)


def text(app, widget_id: str) -> str:
    return text_of(app, widget_id)


def test_lanes_figures_search_and_zoom(imported):
    folder, traces = imported
    for ranks in (traces, read_source(folder)):  # the import shows what the source does
        run_app(gpu_timeline_app(ranks, "gpu.trace"), check)


async def check(app, pilot):
        if True:
            timeline = app.query_one(Timeline)
            assert timeline.lanes == LANES and timeline.span_count == 18
            classes, ranks_text, layers = (text(app, i) for i in ("#gt-classes", "#gt-ranks", "#gt-layers"))
            assert "expert_gemm" in classes and "44.4% of 0.180 ms" in classes  # 80 of 180 us hidden
            assert "r1" in ranks_text and "◀ straggler" in ranks_text.splitlines()[2]
            assert "L2" in layers and "100% of the time placed" in layers

            await pilot.press("slash")
            await pilot.press(*"fused_moe", "enter")
            first = timeline.selected
            assert first.name == "fused_moe_kernel" and first.kind == "expert_gemm" and first.layer == 0
            assert "match 1 of 6" in text(app, "#gt-matches")
            assert "fused_moe_kernel (expert_gemm, layer 0) on r0 stream 7" in text(app, "#gt-detail")
            await pilot.press("right_square_bracket")
            second = timeline.selected
            assert second.name == "fused_moe_kernel" and second.start_s >= first.start_s and second != first
            await pilot.press("left_square_bracket")
            assert timeline.selected == first

            v0, v1 = timeline.view_range
            await pilot.press("plus")
            w0, w1 = timeline.view_range
            assert w1 - w0 == pytest.approx((v1 - v0) / 2)

            await pilot.press("slash", "ctrl+a", "backspace", "(", "enter")
            assert "not a regular expression" in text(app, "#gt-matches")
            await pilot.press("slash", "backspace", *"nothing_runs_this", "enter")
            assert "no event matches" in text(app, "#gt-matches")


def test_snapshot(snap_compare, imported):
    pytest.importorskip("pytest_textual_snapshot")

    async def search(pilot):
        await pilot.press("slash", *"nccl", "enter")
        await pilot.pause()

    assert snap_compare(gpu_timeline_app(imported[1], "gpu.trace"), terminal_size=(160, 50), run_before=search)
