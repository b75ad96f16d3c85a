"""The simulated step (engine/sim/step_model.py) and `moectl sim`: parts add up to the step,
skew slows it and a rebalance wins it back, the roofline's figures can be worked by hand, the
published configs all run, and bad input is one line with exit code 2."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.engine.sim.hardware import load_profile
from moectl.engine.sim.model_shape import load_sim_model
from moectl.engine.sim.routing import balanced, routing_from, scaled, zipf
from moectl.engine.sim.step_model import PARTS, Roofline, SimSpec, simulate
from moectl.placement.rebalancer import plan_rebalance
from tests.paths import DOCS, TRACES

CONFIGS = DOCS / "configs"
runner = CliRunner()


def run_cli(args: list[str]):
    return runner.invoke(app, args)
DSV3 = load_sim_model(CONFIGS / "deepseek-v3.json")
H800 = load_profile("h800")


def spec(routing=None, **kw) -> SimSpec:
    shape = DSV3.shape
    loads = balanced(shape.num_sparse, shape.num_experts) if routing is None else routing
    return SimSpec(DSV3, H800, kw.pop("devices", 64), loads, **kw)


def test_without_overlap_the_parts_add_up_to_the_step():
    out = simulate(spec(tokens_per_device=64, context=2048))
    parts = out["breakdown_ms"]
    assert set(parts) == set(PARTS)
    assert sum(parts.values()) == pytest.approx(out["step_ms"])
    assert parts["idle"] == pytest.approx(0.0, abs=1e-9)  # balanced: no device waits for another
    skewed = simulate(spec(zipf(DSV3.shape.num_sparse, DSV3.shape.num_experts, 1.0), tokens_per_device=64))
    assert skewed["breakdown_ms"]["idle"] > 0  # the mean device waits for the slowest one's experts
    assert out["tokens_per_s"] == pytest.approx(64 * 64 / (out["step_ms"] / 1e3))
    assert out["tokens_per_s_per_node"] == pytest.approx(out["tokens_per_s_per_device"] * 8)
    assert len(out["utilisation"]) == 64 and out["balancedness"] == pytest.approx(1.0)


def test_skew_slows_the_step_and_a_planned_placement_wins_it_back():
    shape = DSV3.shape
    hot = zipf(shape.num_sparse, shape.num_experts, 1.2, seed=3)
    naive = simulate(spec(hot))
    even = simulate(spec())
    planned = simulate(spec(hot, placement=plan_rebalance(hot, 64, 1).placement))
    assert naive["step_ms"] > even["step_ms"] and naive["balancedness"] < 0.6
    assert planned["balancedness"] > 0.9 and planned["step_ms"] < 0.8 * naive["step_ms"]
    assert min(naive["utilisation"]) < min(planned["utilisation"])  # the idle devices of a skewed step


def test_two_batch_overlap_hides_communication():
    plain = simulate(spec(tokens_per_device=256))
    overlapped = simulate(spec(tokens_per_device=256, overlap="two-batch"))
    assert overlapped["overlap_hidden_ms"] > 0 and overlapped["step_ms"] < plain["step_ms"]


def test_the_roofline_by_hand():
    roof = Roofline(DSV3, replace(H800, kernels=None))  # the peaks and efficiencies alone
    # a few rows stream the weights: bytes over (HBM x the memory-bound efficiency)
    assert roof.gemm(64, 1e3, 1e9) == pytest.approx(1e9 / (3350e9 * 0.66))
    # an expert expecting 0.5 rows is hit with probability 1 - exp(-0.5): so much of its weights
    assert roof.gemm(0.5, 1e3, 1e9) == pytest.approx((1 - np.exp(-0.5)) * 1e9 / (3350e9 * 0.66))
    # 8,192 rows of a big GEMM are compute bound: MACs x 2 over (FP8 peak x the curve's 0.61)
    assert roof.gemm(8192, 7168 * 2048 * 3, 44e6) == pytest.approx(2 * 8192 * 7168 * 2048 * 3 / (1979e12 * 0.61))
    # an all-to-all inside a node: bytes over (NVLink x 0.96); DeepEP's tables leave no latency
    assert roof.link(1.6e9, 0) == pytest.approx(1.6e9 / (160e9 * 0.96))
    assert roof.link(0, 5e8) == pytest.approx(5e8 / (50e9 * 0.86))


def test_quantization_config_sets_the_dtypes():
    # fp8: a byte a value and an fp32 scale per 128 x 128 block of gate, up [2048, 7168] and down
    assert (DSV3.gemm_dtype, DSV3.weights.name) == ("fp8", "fp8")
    assert DSV3.expert_bytes() == 3 * 7168 * 2048 + 3 * (2048 // 128) * (7168 // 128) * 4
    # mxfp4: the experts' 4.25 bits a value, their biases in bf16; BF16 GEMMs
    oss = load_sim_model(CONFIGS / "gpt-oss-120b.json")
    assert oss.gemm_dtype == "bf16" and oss.expert_bytes() == 3 * 2880 * 2880 * 4.25 / 8 + 3 * 2880 * 2
    bf16 = load_sim_model(CONFIGS / "deepseek-v3.json", "bf16")
    assert bf16.weights.quantization is None and bf16.expert_bytes() == 3 * 7168 * 2048 * 2
    with pytest.raises(ValueError, match="--dtype"):
        load_sim_model(CONFIGS / "mixtral-8x7b.json", "fp4")


def test_a_recorded_routing_scaled_to_a_bigger_model_keeps_its_skew():
    recorded = np.array([[0, 0, 0, 0], [40, 20, 20, 20], [10, 10, 10, 70]], dtype=float)  # a dense layer first
    out = scaled(recorded, 4, 16, seed=1)
    assert out.shape == (4, 16) and np.allclose(out.sum(1), 1.0)
    # the hottest quarter of the experts carries what the hottest expert did (40%, 70%), layers in turn
    assert [np.sort(row)[-4:].sum() for row in out] == pytest.approx([0.4, 0.7, 0.4, 0.7])
    same, line = routing_from("trace.trace", 2, 4, recorded=recorded)
    assert np.allclose(same, recorded[1:] / 100) and line == "recorded in trace.trace"


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2", "qwen3-235b-a22b", "gpt-oss-120b", "mixtral-8x7b",
                                  "k3-3t-1m"])
def test_every_published_config_runs_as_json(name):
    res = run_cli(["sim", "--model", str(CONFIGS / f"{name}.json"), "--hardware", "h100", "--devices", "16",
                   "--routing", "zipf:0.8", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["simulated"] is True and out["step_ms"] > 0 and len(out["utilisation"]) == 16
    for key in ("tokens_per_s", "tokens_per_s_per_device", "tokens_per_s_per_node", "balancedness", "memory"):
        assert key in out
    assert set(out["breakdown_ms"]) == set(PARTS)


def test_a_trace_routes_the_simulation_and_the_human_output_says_simulated():
    res = run_cli(["sim", "--model", str(CONFIGS / "deepseek-v3.json"), "--hardware", "h800", "--devices", "32",
                   "--routing", str(TRACES / "steady_rebalance.trace"), "--rebalance"])
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("SIMULATED: ") and "scaled to 58 x 256" in res.stdout


@pytest.mark.parametrize("args, message", [
    (["--devices", "2000"], "--devices: must be an integer in [1, 1024]"),
    (["--devices", "16", "--comm", "fast"], "--comm: 'fast' is not one of"),
    (["--devices", "16", "--comm-sms", "200"], "--comm-sms: must be an integer in [0, 132)"),
    (["--devices", "16", "--mtp-draft", "9"], "--mtp-draft: must be an integer in [0, 4]"),
    (["--devices", "16", "--mtp-accept", "1.5"], "--mtp-accept: must be a fraction"),
    (["--devices", "16", "--phase", "prefill", "--mtp-draft", "1"], "--mtp-draft: multi-token prediction is a decode"),
    (["--devices", "16", "--overlap", "three"], "--overlap: 'three' is not one of"),
    (["--devices", "16", "--hardware", "mtt-s5000", "--comm", "low-latency"], "has no low-latency all-to-all table"),
    (["--devices", "16", "--hardware", "mtt-s5000", "--comm-sms", "8"], "gives no SM count"),
    (["--devices", "16", "--redundant", "-1"], "--redundant"),
    (["--devices", "16", "--tp", "3"], "--tp: 3 must divide"),
    (["--devices", "16", "--tp", "2", "--dp-attention"], "--dp-attention"),
    (["--devices", "16", "--phase", "prefill", "--batch-seqs", "4"], "--batch-seqs: is for --phase decode"),
    (["--devices", "16", "--routing", "zipf:x"], "--routing: 'zipf:x' is not zipf:S"),
    (["--devices", "16", "--routing", "missing.trace"], "is neither balanced, zipf:S, sample nor a trace file"),
    (["--devices", "16", "--batch-seqs", "0"], "--batch-seqs: must be a positive integer"),
    (["--devices", "16", "--ep", "5", "--rebalance"], "--ep: 5 must divide the 16 devices"),
    (["--devices", "24", "--ep", "6"], "--ep: 6 must be a multiple or a divisor of the 8 devices per node"),
    (["--devices", "16", "--hardware", "b300"], "--hardware: 'b300' is neither a shipped profile"),
    (["--devices", "16", "--hardware", "ascend-910b"], "hbm_gbps has no sourced figure"),
    (["--devices", "16", "--context", "99999999"], "--context: must be in"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, message):
    base = ["sim", "--model", str(CONFIGS / "deepseek-v3.json")]
    if "--hardware" not in args:
        base += ["--hardware", "h800"]
    res = run_cli(base + args)
    assert res.exit_code == 2, res.output
    assert message in res.stderr and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr


def test_the_validation_bench_predicts_every_published_case_from_sourced_inputs():
    from bench.sim_validation import CASES, run_cases

    rows = run_cases()
    assert [r["case"] for r in rows] == [c[0] for c in CASES]
    for row in rows:
        assert row["source"].strip() and row["published_per_node"] > 0
        for variant in ("deployed", "deployed_recorded_eplb", "no_overlap", "roofline_only"):
            got = row[variant]
            assert got["predicted_per_node"] > 0
            assert got["error"] == pytest.approx(got["predicted_per_node"] / row["published_per_node"] - 1)
        # decode deployments run DeepEP's low-latency all-to-all, prefill its normal one
        assert row["deployed"]["comm"] == ("low-latency" if row["phase"] == "decode" else "normal")
    assert rows[0]["deployed_recorded_eplb"]["balancedness"] < 1.0  # recorded routing is not balanced, even under EPLB


def test_the_array_roofline_is_the_scalar_one():
    roof = Roofline(DSV3, H800)
    rows = np.array([[0.0, 0.3, 7.0], [64.0, 700.0, 9000.0]])
    many = roof.gemms(rows, 7168 * 2048 * 3, 44e6)
    assert many == pytest.approx(np.array([[roof.gemm(r, 7168 * 2048 * 3, 44e6) for r in row] for row in rows]))
    intra, inter = np.array([0.0, 1e6, 0.0, 3e8]), np.array([0.0, 0.0, 2e7, 1e8])
    assert roof.links(intra, inter) == pytest.approx([roof.link(a, b) for a, b in zip(intra, inter)])


def test_a_simulated_rebalance_says_what_it_wins_what_moving_costs_and_when_it_pays():
    from moectl.engine.sim.step_model import compare_rebalance, migration_stall
    from moectl.placement.placement import Placement

    shape = DSV3.shape
    hot = zipf(shape.num_sparse, shape.num_experts, 1.2, seed=3)
    naive = spec(hot, placement=Placement.contiguous(shape.num_sparse, shape.num_experts, 64, 1))
    planned = plan_rebalance(hot, 64, 1).placement
    out, after = compare_rebalance(naive, planned)
    assert after["step_ms"] == out["step_ms_after"] and after["balancedness"] == out["balancedness_after"]
    assert out["gain"] > 0.2 and out["balancedness_after"] > out["balancedness_before"]
    moved = out["migration"]
    assert moved["experts_moved"] > 0 and moved["bytes"] == pytest.approx(moved["experts_moved"] * DSV3.expert_bytes())
    assert moved["stall_ms"] > 0
    saved = out["step_ms_before"] - out["step_ms_after"]
    assert out["break_even_steps"] == pytest.approx(moved["stall_ms"] / saved)
    assert migration_stall(naive, planned, planned)["experts_moved"] == 0  # nothing to move

    res = run_cli(["sim", "--model", str(CONFIGS / "deepseek-v3.json"), "--hardware", "h800", "--devices", "64",
                   "--routing", "zipf:1.2", "--seed", "3", "--rebalance", "--json"])
    assert res.exit_code == 0, res.output
    result = json.loads(res.stdout)
    assert result["rebalance"]["gain"] > 0.2 and result["step_ms"] == pytest.approx(result["rebalance"]["step_ms_after"])
