"""`plan rebalance` on an imported engine trace, with its counterfactual, and `--export sglang|vllm`:
the written file has the structure the engine's loader expects (SGLang's expert_location.py:
a dict of exactly `physical_to_logical_map`), and reproduces the plan. Plus the option bounds."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.profiler.trace_store import TraceReader
from tests.paths import TRACES
from tests.profiler.test_external_load import LOCAL, P2L, D, E, L, sglang_per_pass, vllm_state

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def plan(*args) -> dict:
    res = run("plan", "rebalance", *args, "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.fixture
def sglang_trace(tmp_path):
    files, expected = sglang_per_pass(tmp_path)
    out = tmp_path / "sglang.trace"
    res = run("trace", "import", *files, "--ep-size", D, "-o", out)
    assert res.exit_code == 0, res.output
    return out, expected


def device_loads(slots: np.ndarray, loads: np.ndarray) -> np.ndarray:
    """[L, D] tokens per device, replicas sharing their expert's tokens evenly, worked out slot by slot."""
    out = np.zeros(slots.shape[:2])
    for layer in range(slots.shape[0]):
        replicas = {e: np.count_nonzero(slots[layer] == e) for e in range(loads.shape[1])}
        for d in range(slots.shape[1]):
            out[layer, d] = sum(loads[layer, e] / replicas[e] for e in slots[layer, d] if e >= 0)
    return out


def balance(dl: np.ndarray) -> float:
    return dl.mean(1).sum() / dl.max(1).sum()


@pytest.mark.parametrize("suffix", [".json", ".pt"])
def test_plan_on_an_imported_sglang_trace_exports_what_init_expert_location_reads(sglang_trace, tmp_path, suffix):
    trace, expected = sglang_trace
    out = tmp_path / f"location{suffix}"
    result = plan(trace, "--redundant", 1, "--export", "sglang", "-o", out)
    total = expected.sum(0)
    # the counterfactual: "before" is the placement SGLang ran with, "after" the plan, on the same loads
    assert result["devices"] == D and result["slots_per_device"] == LOCAL
    assert result["balancedness_before"] == pytest.approx(balance(device_loads(P2L.reshape(L, D, LOCAL), total)))
    slots = np.array(result["placement"]["layers"])
    assert result["balancedness_after"] == pytest.approx(balance(device_loads(slots, total)))
    assert result["predicted"] is None and "no step times" in result["predicted_absent"]
    assert result["imported"]["engine"] == "sglang"
    # the file: compute_initial_expert_location_metadata loads it (.pt with weights_only) and calls
    # init_by_mapping(server_args, model_config, **data_dict): the one key it may hold
    if suffix == ".pt":
        data = torch.load(out, weights_only=True)
        assert data["physical_to_logical_map"].dtype == torch.int64
        p2l = data["physical_to_logical_map"].numpy()
    else:
        data = json.loads(out.read_text())
        p2l = np.array(data["physical_to_logical_map"])
        assert p2l.dtype.kind == "i"
    assert set(data) == {"physical_to_logical_map"}
    assert p2l.shape == (L, D * LOCAL)  # [layers, num_logical + ep_num_redundant_experts]
    assert all(set(row.tolist()) == set(range(E)) for row in p2l)  # every logical expert has a physical slot
    # round trip: SGLang puts physical expert p on rank p // num_local_physical_experts
    np.testing.assert_array_equal(p2l.reshape(L, D, LOCAL), slots)
    assert result["export"]["flags"] == (f"--init-expert-location {out} --ep-size {D} "
                                         f"--ep-num-redundant-experts {D * LOCAL - E}")


def test_trace_report_replays_the_imported_routing_on_the_plan(sglang_trace, tmp_path):
    trace, expected = sglang_trace
    result = plan(trace, "--redundant", 1)
    placement = tmp_path / "plan.json"
    placement.write_text(json.dumps(result["placement"]))
    res = run("trace", "report", trace, "--placement", placement, "--json")
    assert res.exit_code == 0, res.output
    counterfactual = json.loads(res.stdout)["counterfactual"]
    assert counterfactual["overall"] == pytest.approx(result["balancedness_after"])
    np.testing.assert_allclose(counterfactual["device_totals"],
                               device_loads(np.array(result["placement"]["layers"]), expected.sum(0)).sum(0))


def test_plan_on_an_imported_vllm_trace_exports_its_closest_file(tmp_path):
    rng = np.random.default_rng(5)
    window = rng.integers(1, 60, size=(6, L, D * LOCAL))
    trace = tmp_path / "vllm.trace"
    res = run("trace", "import", vllm_state(tmp_path, 0, window, 0), "-o", trace)
    assert res.exit_code == 0, res.output
    out = tmp_path / "vllm_plan.json"
    result = plan(trace, "--redundant", 1, "--export", "vllm", "-o", out)
    data = json.loads(out.read_text())
    assert data["loadable_by_vllm"] is False and data["ep_size"] == D
    p2l = np.array(data["physical_to_logical_map"])  # EplbModelState's [num_moe_layers, num_physical_experts]
    assert p2l.shape == (L, D * LOCAL) and all(set(row.tolist()) == set(range(E)) for row in p2l)
    np.testing.assert_array_equal(p2l.reshape(L, D, LOCAL), result["placement"]["layers"])
    loads = np.zeros((L, E), np.int64)
    for layer in range(L):
        for p in range(D * LOCAL):
            loads[layer, P2L[layer, p]] += window[:, layer, p].sum()
    assert data["global_expert_load"] == loads.tolist()  # what EplbState.add_model takes, int64 counts
    assert data["num_redundant_experts"] == data["eplb_config"]["num_redundant_experts"] == D * LOCAL - E
    res = run("plan", "rebalance", trace, "--export", "sglang", "-o", tmp_path / "x.json")
    assert res.exit_code == 2 and "per MoE layer" in res.stderr  # vLLM's rows are not SGLang's model layers


def test_export_fills_the_slots_a_plan_leaves_empty_without_changing_its_balance(tmp_path):
    # a recorded moectl trace: layers already balanced keep their placement, redundant slots empty
    trace = TRACES / "steady_rebalance.trace"
    kept = plan(trace, "--redundant", 1)
    assert (np.array(kept["placement"]["layers"]) < 0).any()
    out = tmp_path / "location.json"
    result = plan(trace, "--redundant", 1, "--export", "sglang", "-o", out)
    slots = np.array(result["placement"]["layers"])
    p2l = np.array(json.loads(out.read_text())["physical_to_logical_map"])
    assert not (p2l < 0).any() and result["slots_filled_for_export"] == (np.array(kept["placement"]["layers"]) < 0).sum()
    np.testing.assert_array_equal(p2l.reshape(slots.shape), slots)
    planned = np.array(kept["placement"]["layers"])
    assert (slots[planned >= 0] == planned[planned >= 0]).all()  # the plan's experts stay where it put them
    assert result["balancedness_after"] == pytest.approx(kept["balancedness_after"])
    with TraceReader(trace) as reader:
        loads = sum(r["routing"].astype(np.int64) for r in reader.steps())
    assert result["balancedness_after"] == pytest.approx(balance(device_loads(slots, loads)))


def test_export_refuses_bad_options(tmp_path):
    for args, option in ((["--export", "sglang"], "--output"), (["--export", "trtllm", "-o", tmp_path / "y.json"], "--export"),
                         (["--export", "sglang", "-o", tmp_path / "y.txt"], ".pt or .json"),
                         (["--export", "vllm", "-o", tmp_path / "y.pt"], ".json")):
        res = run("plan", "rebalance", "--synthetic", "--layers", 2, "--experts", 8, *args)
        assert res.exit_code == 2 and option in res.stderr and res.stderr.count("\n") == 1, res.output
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("args, option", [
    (["--layers", 100000, "--experts", 100000], "--layers"),
    (["--layers", 4, "--experts", 100000], "--experts"),
    (["--layers", 0], "--layers"),
    (["--devices", 0], "--devices"),
    (["--devices", 257], "--devices"),
    (["--redundant", -1], "--redundant"),
])
def test_plan_rebalance_bounds_its_sizes(args, option):
    res = run("plan", "rebalance", "--synthetic", *args)
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith(f"moectl: error: {option}:") and res.stderr.count("\n") == 1


def test_plan_on_an_imported_trace_keeps_the_sources_slot_count_by_default(tmp_path):
    """vLLM with 8 slots per device for 8 experts on 2 ranks (4 redundant each): the default
    --redundant was 1, which planned 5 slots per device, lowered the balance the source reached
    and reported the change as 0 bytes moved. Default: the recorded placement's redundant slots."""
    rng = np.random.default_rng(6)
    p2l = np.array([list(range(E)) * 2] * L)  # [L, 16]: every expert twice, once per rank
    window = rng.integers(1, 60, size=(6, L, 2 * E))
    path = tmp_path / "eplb_rank0.pt"
    torch.save({"physical_to_logical_map": torch.tensor(p2l), "expert_load_window": torch.tensor(window, dtype=torch.int32),
                "expert_load_window_step": 0, "ep_size": 2, "rank": 0, "vllm_version": "0.11.1"}, path)
    trace = tmp_path / "vllm.trace"
    res = run("trace", "import", path, "-o", trace)
    assert res.exit_code == 0, res.output
    result = plan(trace)
    assert result["slots_per_device"] == E and result["redundant_per_device"] == E - E // 2
    assert result["balancedness_after"] >= result["balancedness_before"] - 1e-9
    assert plan(trace, "--redundant", 1)["slots_per_device"] == E // 2 + 1  # an explicit value still rules
    # a moectl trace recorded with 1 redundant slot per device: the default plans with 1 too
    recorded = plan(TRACES / "steady_rebalance.trace")
    with TraceReader(TRACES / "steady_rebalance.trace") as reader:
        source = reader.header["devices"]["placement"]
    assert recorded["slots_per_device"] == source["slots_per_device"]
    assert plan(TRACES / "steady_rebalance.trace", "--redundant", 3)["slots_per_device"] == \
        source["slots_per_device"] - recorded["redundant_per_device"] + 3
