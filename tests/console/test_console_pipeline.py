"""A pipelined simulated cluster (`--backend simulated --pp N`) in the console: each device row
names its stage, and the panels that map devices to placement columns (the straggler analysis)
read a stage's devices against its own EP group and layers."""

from __future__ import annotations

from typer.testing import CliRunner

from moectl.cli.main import app as cli
from moectl.console.app import MoectlApp
from moectl.console.sources import ReplaySource
from moectl.profiler.analysis import stragglers
from moectl.profiler.trace_queries import placement_in_force
from moectl.profiler.trace_store import TraceReader
from tests.pilot import run_app, text_of, until


def _pipelined_trace(tmp_path):
    path = tmp_path / "pp.trace"
    result = CliRunner().invoke(cli, ["record", str(path), "--backend", "simulated", "--devices", "8", "--pp", "2",
                                      "--steps", "12"])
    assert result.exit_code == 0, result.output
    return path


def test_each_device_shows_its_stage(tmp_path):
    source = ReplaySource(_pipelined_trace(tmp_path))

    async def body(app, pilot):
        await pilot.pause()
        await until(pilot, lambda: app.state.latest is not None, timeout=20)
        await until(pilot, lambda: "d7 s1" in text_of(app, "#ov-load"), timeout=20)
        shown = text_of(app, "#ov-load")
        assert "d0 s0" in shown and "d3 s0" in shown and "d4 s1" in shown
        assert "pipeline stage N of 2" in text_of(app, "#ov-load-title")
    run_app(MoectlApp(source), body, size=(160, 50))


def test_stragglers_read_a_stage_against_its_own_placement_columns_and_layers(tmp_path):
    with TraceReader(_pipelined_trace(tmp_path)) as reader:
        records = list(reader.steps())
        placement, _ = placement_in_force(reader, None)
    assert records and records[-1]["devices"]["pp"] == 2 and records[-1]["devices"]["stage"] == [0] * 4 + [1] * 4
    assert placement.num_devices == 4  # one stage's EP group
    found = stragglers(records, placement)  # device indices past one stage's EP group must not fail
    assert found and all(0 <= s["device"] < 8 for s in found)
    for s in found:
        for e in s.get("experts", []):
            first, last = records[0]["devices"]["pipeline"]["stage_layers"][s["device"] // 4]
            assert first <= e["layer"] <= last  # a stage's devices carry only its layers' experts
