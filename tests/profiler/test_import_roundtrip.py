"""bench/import_roundtrip.py: a trace the engine recorded, written as SGLang's per_pass dumps and
vLLM's saved EplbState and imported back by `moectl trace import`, gives the recorded routing
step for step and the same report and plan figures. The trace is recorded here on a tiny
Qwen2-MoE (one dense layer: SGLang counts model layers, vLLM MoE layers only) with a redundant
slot per device, so the placement has empty slots the engines' maps cannot have."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from bench.import_roundtrip import compare, engine_placement, main, read_trace, round_trip
from moectl.cli.main import app
from moectl.profiler.trace_store import TraceReader
from tests.checkpoints import tiny_checkpoint
from tests.cli.test_plan_export import balance, device_loads


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "qwen2_moe")
    path = tmp_path_factory.mktemp("trace") / "recorded.trace"
    res = CliRunner().invoke(app, ["record", str(path), "--steps", "6", "--model", str(ckpt), "--devices", "2",
                                   "--redundant", "1", "--workload", "rate=inf,requests=3,prompt=4-8,output=4-8"])
    assert res.exit_code == 0, res.output
    return path


def routing_of(path) -> np.ndarray:
    with TraceReader(path) as reader:
        return np.stack([r["routing"].astype(np.int64) for r in reader.steps()])


def placement_of(path) -> np.ndarray:
    with TraceReader(path) as reader:
        return np.array(reader.header["devices"]["placement"]["layers"])


def test_the_imports_give_back_the_recorded_routing_and_figures(recorded, tmp_path):
    result = round_trip(recorded, tmp_path)
    assert result["failed"] == []
    routing, _, placement, _, moe = read_trace(recorded)
    assert result["slots_filled"] > 0 and not all(moe)  # the fill and the MoE-only rows are exercised
    filled = engine_placement(placement).slots
    assert (filled >= 0).all() and (filled[placement.slots >= 0] == placement.slots[placement.slots >= 0]).all()
    # step for step: SGLang's records are model layers, vLLM's window rows MoE layers in the recorded order
    np.testing.assert_array_equal(routing_of(tmp_path / "sglang.trace"), routing)
    np.testing.assert_array_equal(routing_of(tmp_path / "vllm.trace"), routing[:, moe])
    np.testing.assert_array_equal(placement_of(tmp_path / "sglang.trace"), filled)
    np.testing.assert_array_equal(placement_of(tmp_path / "vllm.trace"), filled[moe])
    # the import's balancedness is the recorded trace's under its own placement, worked out slot by slot
    recorded_balance = balance(device_loads(placement.slots, routing.sum(0)))
    for engine in ("sglang", "vllm"):
        figures = result["imports"][engine]
        assert figures["balancedness"] == pytest.approx(recorded_balance, abs=1e-9)
        assert figures["tokens_routed"] == routing.sum()
        assert figures["hottest_experts"][0][2] == routing.sum(0).max()
    assert result["original"]["balancedness"] == pytest.approx(recorded_balance, abs=1e-9)
    # the export, read as SGLang's loader does: one key, [layers, physical slots], every expert in every layer
    data = torch.load(tmp_path / "location.pt", weights_only=True)
    assert set(data) == {"physical_to_logical_map"}
    p2l = data["physical_to_logical_map"].numpy()
    plan = np.array(result["imports"]["sglang"]["placement"]["layers"])
    assert p2l.shape == (plan.shape[0], plan.shape[1] * plan.shape[2])
    assert all(set(row.tolist()) == set(range(routing.shape[2])) for row in p2l)
    np.testing.assert_array_equal(p2l.reshape(plan.shape), plan)


def test_the_bench_names_a_figure_that_does_not_match(recorded, tmp_path):
    result = round_trip(recorded, tmp_path)
    reference, moe = result["reference"], read_trace(recorded)[-1]
    hottest = reference["hottest_experts"]
    for change, name in (({"balancedness": reference["balancedness"] + 1e-6}, "balancedness"),
                         ({"tokens_routed": reference["tokens_routed"] + 1}, "tokens routed"),
                         ({"hottest_experts": [hottest[1], hottest[0], *hottest[2:]]}, "hottest experts"),
                         ({"slots_moved": reference["slots_moved"] + 1}, "plan slots moved")):
        _, failed = compare(reference, {**result["imports"]["sglang"], **change}, moe)
        assert failed == [name]


def test_the_bench_command_prints_json_and_refuses_what_it_cannot_round_trip(recorded, tmp_path, capsys):
    assert main([str(recorded), "--json", "--keep", str(tmp_path / "kept")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["failed"] == [] and set(out["imports"]) == {"sglang", "vllm"}
    assert main([str(tmp_path / "kept" / "sglang.trace")]) == 2  # an import is not a recording
    assert "already an import of sglang" in capsys.readouterr().err
    (tmp_path / "not.trace").write_bytes(b"no")
    assert main([str(tmp_path / "not.trace")]) == 2
    assert "not a moectl trace" in capsys.readouterr().err
