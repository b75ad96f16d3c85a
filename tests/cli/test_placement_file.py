"""The placement file round trip through the CLI: `plan rebalance --json` writes a placement that
`record --placement` starts the engine with, and a bad placement file is a one-line error (exit 2).

`generate` has no --placement (only run/serve/record/bench do), so the round trip goes through
`record` and reads the placement back from the trace header."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.engine.experts.placement import Placement
from moectl.profiler.trace_store import TraceReader
from tests.paths import TRACES

runner = CliRunner()
WORKLOAD = "rate=50,prompt=16-32,output=4-8"


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def plan() -> dict:
    res = run("plan", "rebalance", TRACES / "steady_rebalance.trace", "--redundant", 1, "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_plan_rebalance_json_holds_a_placement(plan):
    placement = plan["placement"]
    assert set(placement) == {"num_experts", "num_devices", "slots_per_device", "layers", "pinned"}
    assert (placement["num_experts"], placement["num_devices"]) == (plan["experts"], plan["devices"])
    assert placement["slots_per_device"] == plan["slots_per_device"]
    assert len(placement["layers"]) == plan["layers"]
    assert Placement.from_dict(placement).to_dict() == placement


@pytest.mark.parametrize("whole_result", [False, True], ids=["placement", "plan-result"])
def test_record_starts_from_the_placement_file(plan, tmp_path, whole_result):
    """The file may hold the placement itself or the whole `plan rebalance --json` result."""
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(plan if whole_result else plan["placement"]))
    trace = tmp_path / "placed.trace"
    res = run("record", trace, "--steps", 5, "--devices", plan["devices"], "--redundant", 1,
              "--placement", path, "--workload", WORKLOAD)
    assert res.exit_code == 0, res.output
    default = Placement.contiguous(plan["layers"], plan["experts"], plan["devices"], 1).to_dict()
    assert plan["placement"] != default  # so the header shows the file's placement, not the default
    with TraceReader(trace) as reader:
        assert reader.header["devices"]["placement"] == plan["placement"]
        assert len(list(reader.steps())) == 5


def _wrong_expert_count(plan: dict) -> dict:
    """A well-formed placement for a model with half the experts (the sample model has 16)."""
    return Placement.contiguous(plan["layers"], plan["experts"] // 2, plan["devices"], 1).to_dict()


def _inconsistent(plan: dict) -> dict:
    return dict(plan["placement"], num_experts=plan["experts"] // 2)  # slots name experts past the count


@pytest.mark.parametrize("content, needle", [
    pytest.param("not json {", "is not JSON", id="not-json"),
    pytest.param("", "is not JSON", id="empty"),
    pytest.param(json.dumps([1, 2, 3]), "expected an object", id="not-an-object"),
    pytest.param(_inconsistent, "out of range", id="experts-out-of-range"),
    pytest.param(_wrong_expert_count, "8 experts", id="wrong-expert-count"),
])
def test_a_corrupt_placement_file_is_a_one_line_error(plan, tmp_path, content, needle):
    path = tmp_path / "bad.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content(plan)))
    res = run("record", tmp_path / "bad.trace", "--steps", 5, "--devices", plan["devices"], "--redundant", 1,
              "--placement", path, "--workload", WORKLOAD)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and isinstance(res.exception, SystemExit)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moectl: error: --placement: "), res.stderr
    assert needle in lines[0]


def test_a_placement_for_another_device_count_is_refused_naming_the_option(plan, tmp_path):
    path = tmp_path / "four_devices.json"
    path.write_text(json.dumps(plan["placement"]))
    res = run("record", tmp_path / "bad.trace", "--steps", 5, "--devices", 2, "--redundant", 1,
              "--placement", path, "--workload", WORKLOAD)
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moectl: error: --placement: ") and "Traceback" not in res.output
    assert f"{plan['devices']} devices" in lines[0] and "has 2" in lines[0]
