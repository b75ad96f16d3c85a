"""One placement file for every command (placement/placement_file.py): `plan rebalance --json`
writes a placement, with the model it was planned for, that `record`/`generate`/`run --placement`
start the engine with and `trace report --placement` replays a trace on. A bad placement file,
or one planned for another model, is a one-line error (exit 2).

The round trips go through `record` and read the placement back from the trace header."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.placement.placement import Placement
from moectl.profiler.trace_store import TraceReader
from tests.checkpoints import tiny_checkpoint
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
    assert set(placement) == {"num_experts", "num_devices", "slots_per_device", "layers", "pinned", "model"}
    with TraceReader(TRACES / "steady_rebalance.trace") as reader:
        recorded = reader.header["model"]
    assert placement["model"]["name"] == recorded["name"]  # the model the trace recorded
    assert placement["model"]["sparse_layers"] == recorded["sparse_layers"]
    assert (placement["num_experts"], placement["num_devices"]) == (plan["experts"], plan["devices"])
    assert placement["slots_per_device"] == plan["slots_per_device"]
    assert len(placement["layers"]) == plan["layers"]
    assert Placement.from_dict(placement).to_dict() == _bare(placement)


def _bare(placement: dict) -> dict:
    return {k: v for k, v in placement.items() if k != "model"}


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
        assert reader.header["devices"]["placement"] == _bare(plan["placement"])
        assert len(list(reader.steps())) == 5


def _wrong_expert_count(plan: dict) -> dict:
    """A well-formed placement for a model with half the experts (the sample model has 16)."""
    return Placement.contiguous(plan["layers"], plan["experts"] // 2, plan["devices"], 1).to_dict()


def _inconsistent(plan: dict) -> dict:
    return dict(plan["placement"], num_experts=plan["experts"] // 2)  # slots name experts past the count


@pytest.mark.parametrize("content, needle", [
    pytest.param("not json {", "not JSON", id="not-json"),
    pytest.param("", "not JSON", id="empty"),
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


# ---- one format across commands and models --------------------------------------------------

@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """3 layers, the first dense, 8 routed experts."""
    return tiny_checkpoint(tmp_path_factory.mktemp("deepseek"), "deepseek_v3")


@pytest.fixture(scope="module")
def synthetic_plan(deepseek) -> dict:
    res = run("plan", "rebalance", "--synthetic", "--model", deepseek, "--devices", 2, "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def _record(tmp_path, model, placement: dict | None, devices=2, redundant=1):
    path = tmp_path / "placement.json"
    if placement is not None:
        path.write_text(json.dumps(placement))
    trace = tmp_path / "run.trace"
    res = run("record", trace, "--model", model, "--steps", 3, "--devices", devices, "--redundant", redundant,
              "--placement", path, "--workload", "rate=50,prompt=8-16,output=2-4", "--overwrite")
    return res, trace


def test_a_synthetic_plan_for_a_model_has_a_row_for_every_layer_and_starts_it(synthetic_plan, deepseek, tmp_path):
    """It once had rows for the MoE layers only, which that model's own run refused."""
    placement = synthetic_plan["placement"]
    assert synthetic_plan["layers"] == len(placement["layers"]) == 3
    model = placement["model"]
    assert model["architecture"] == "DeepseekV3ForCausalLM" and model["sparse_layers"] == [False, True, True]
    assert model["name"] == deepseek.name
    assert synthetic_plan["balancedness_after_per_layer"][0] == 1.0  # the dense layer routes nothing
    res, trace = _record(tmp_path, deepseek, synthetic_plan)
    assert res.exit_code == 0, res.output
    with TraceReader(trace) as reader:
        assert reader.header["devices"]["placement"] == _bare(placement)


def test_rows_for_the_moe_layers_only_get_the_dense_rows_filled_in(synthetic_plan, deepseek, tmp_path):
    """vLLM's layer indexing, and plans written before every-layer rows."""
    moe_only = dict(_bare(synthetic_plan["placement"]), layers=synthetic_plan["placement"]["layers"][1:])
    res, trace = _record(tmp_path, deepseek, moe_only)
    assert res.exit_code == 0, res.output
    with TraceReader(trace) as reader:
        rows = reader.header["devices"]["placement"]["layers"]
    assert rows[1:] == moe_only["layers"]
    assert rows[0] == Placement.contiguous(1, 8, 2, len(rows[0][0]) - 4).to_dict()["layers"][0]


def test_a_placement_planned_for_another_model_is_refused_naming_both(synthetic_plan, tmp_path):
    """qwen3_moe: the same 3 layers x 8 experts, another model. It was accepted silently."""
    qwen3 = tiny_checkpoint(tmp_path / "qwen3", "qwen3_moe")
    res, _ = _record(tmp_path, qwen3, synthetic_plan)
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moectl: error: --placement: "), res.stderr
    assert "planned for" in lines[0] and "DeepseekV3ForCausalLM" in lines[0] and "Qwen3MoeForCausalLM" in lines[0]
    # the same rows without the model they were planned for fit by shape
    res, _ = _record(tmp_path, qwen3, _bare(synthetic_plan["placement"]))
    assert res.exit_code == 0, res.output


def test_trace_report_takes_the_plan_file_that_record_takes(plan, tmp_path):
    """trace report --placement once refused the `plan rebalance --json` file."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    res = run("trace", "report", TRACES / "steady_rebalance.trace", "--placement", path, "--json")
    assert res.exit_code == 0, res.output
    counterfactual = json.loads(res.stdout)["counterfactual"]
    # the plan's "after" is the whole trace's routing on the planned placement: the same figure
    assert counterfactual["overall"] == pytest.approx(plan["balancedness_after"])


def test_trace_report_refuses_a_placement_for_another_model(synthetic_plan, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(synthetic_plan))
    res = run("trace", "report", TRACES / "steady_rebalance.trace", "--placement", path)
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moectl: error: --placement: ") and "planned for" in lines[0]


def test_synthetic_layers_or_experts_other_than_the_models_are_refused(deepseek):
    res = run("plan", "rebalance", "--synthetic", "--model", deepseek, "--layers", 5, "--json")
    assert res.exit_code == 2 and res.stderr.startswith("moectl: error: --layers: "), res.output
