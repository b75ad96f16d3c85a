"""Published quantized configs (DeepSeek-V3 and Kimi-K2 in block-scaled fp8, gpt-oss in mxfp4) are
read wherever a config is read for its shapes: `model info`, `plan memory` (their weights counted
as the config stores them, scales included), `plan rebalance --synthetic` and `model make-tiny
--like` (a float32 checkpoint, saying so). They were refused ("'fp8' checkpoints are not
supported"), which only the engine loading weights must still say. And `sim` and the simulated
backend place experts and count their bytes with one rule: they once disagreed on DeepSeek-V3 at
16 devices with --redundant 0 (16 vs 32 slots a device)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.engine.planning.memory_plan import load_plan_model
from tests.checkpoints import tiny_checkpoint
from tests.paths import DOCS

CONFIGS = DOCS / "configs"
DSV3 = CONFIGS / "deepseek-v3.json"
GPT_OSS = CONFIGS / "gpt-oss-120b.json"
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def run_json(*args) -> dict:
    res = run(*args, "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def fp8(rows: int, cols: int) -> int:
    """transformers' FP8Linear: e4m3 values and weight_scale_inv, one fp32 per 128 x 128 block."""
    return rows * cols + -(-rows // 128) * -(-cols // 128) * 4


def mxfp4(rows: int, cols: int) -> int:
    """Mxfp4GptOssExperts: 16 bytes of 4-bit values and one e8m0 scale byte per 32 values of a row."""
    return rows * (cols // 32) * (16 + 1)


@pytest.mark.parametrize("name, method", [("deepseek-v3", "fp8"), ("kimi-k2", "fp8"), ("gpt-oss-120b", "mxfp4")])
def test_model_info_reads_a_quantized_config(name, method):
    info = run_json("model", "info", "--model", CONFIGS / f"{name}.json")
    assert info["quantization"].startswith(method) and info["params_total"] > 1e11


def test_plan_memory_counts_deepseeks_fp8_weights_with_their_block_scales():
    plan = run_json("plan", "memory", "--model", DSV3, "--devices", 16, "--context", 4096)
    assert plan["deployment"]["dtype"] == "fp8"
    h, i, heads, ql, r, rope, nope, v = 7168, 2048, 128, 1536, 512, 64, 128, 128
    expert = fp8(i, h) * 2 + fp8(h, i)
    attention = (fp8(ql, h) + fp8(heads * (nope + rope), ql) + fp8(r + rope, h) + fp8(heads * (nope + v), r)
                 + fp8(h, heads * v) + (ql + r) * 2)  # the two latent norms in bf16
    worst = plan["bytes"]
    assert worst["experts"] == 58 * 16 * expert  # 256 experts / 16 devices, 58 MoE layers
    assert worst["attention"] == 61 * attention
    assert worst["embeddings"] == 2 * 129280 * h * 2  # embedding and LM head stay bf16
    assert any("fp32 scale per 128x128 block" in n for n in plan["notes"])
    # --dtype replaces the config's quantization
    bf16 = run_json("plan", "memory", "--model", DSV3, "--devices", 16, "--context", 4096, "--dtype", "bf16")
    assert bf16["bytes"]["experts"] == 58 * 16 * 3 * h * i * 2


def test_plan_memory_counts_gpt_oss_mxfp4_experts_and_leaves_the_rest_bf16():
    plan = run_json("plan", "memory", "--model", GPT_OSS, "--devices", 16, "--context", 4096)
    h = i = 2880
    expert = mxfp4(2 * i, h) + mxfp4(h, i) + (2 * i + h) * 2  # gate_up, down; the biases in bf16
    assert plan["deployment"]["dtype"] == "mxfp4"
    assert plan["bytes"]["experts"] == 36 * 8 * expert  # 128 experts / 16 devices, every layer MoE
    # modules_to_not_convert keeps attention, router, embeddings and lm_head unquantized
    assert plan["bytes"]["attention"] == 36 * load_plan_model(GPT_OSS).attention_params() * 2


def test_modules_to_not_convert_decides_what_fp8_converts(tmp_path):
    raw = json.loads(DSV3.read_text())
    raw["quantization_config"]["modules_to_not_convert"] = ["model.layers.*.self_attn", "lm_head"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    plan = run_json("plan", "memory", "--model", tmp_path, "--devices", 16, "--context", 4096)
    full = run_json("plan", "memory", "--model", DSV3, "--devices", 16, "--context", 4096)
    assert plan["bytes"]["attention"] == 61 * load_plan_model(DSV3).attention_params() * 2
    assert plan["bytes"]["experts"] == full["bytes"]["experts"]


def test_a_quantization_this_cannot_read_is_one_line_naming_the_field(tmp_path):
    raw = json.loads(DSV3.read_text())
    raw["quantization_config"] = {"quant_method": "awq"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    res = run("plan", "memory", "--model", tmp_path, "--context", 4096)
    assert res.exit_code == 2 and res.stderr.startswith("moectl: error: quantization_config.quant_method: 'awq'")
    assert res.stderr.count("\n") == 1


def test_a_synthetic_plan_moves_experts_of_the_checkpoints_bytes():
    plan = run_json("plan", "rebalance", "--synthetic", "--model", DSV3, "--devices", 16)
    assert plan["expert_bytes"] == fp8(2048, 7168) * 2 + fp8(7168, 2048)


@pytest.mark.parametrize("name, method", [("deepseek-v3", "fp8"), ("gpt-oss-120b", "mxfp4")])
def test_make_tiny_like_a_quantized_config_writes_the_engines_dtype_and_says_so(tmp_path, name, method):
    from moectl.engine.models.config import ModelConfig

    out = tmp_path / "tiny"
    info = run_json("model", "make-tiny", "--like", CONFIGS / f"{name}.json", "--out", out, "--layers", 2)
    assert info["dtype"] == "float32" and method in info["quantization"] and "not kept" in info["quantization"]
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert ModelConfig.from_dir(out).quantization is None  # read as the engine reads it: no refusal


def test_the_engine_still_refuses_a_quantized_checkpoint(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "m", "deepseek_v3")
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = json.loads(DSV3.read_text())["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(config))
    res = run("generate", "--model", ckpt, "hi", "--max-tokens", 1)
    assert res.exit_code == 2 and res.stderr.count("\n") == 1, res.output
    assert "quantization_config.quant_method: 'fp8' checkpoints are not supported" in res.stderr
    assert run_json("model", "info", "--model", ckpt)["quantization"].startswith("fp8")  # its shapes still read


def test_sim_and_the_simulated_backend_place_and_count_alike():
    """One rule (step_model.cluster_placement) and one byte count (PlanModel.weight_bytes), which
    plan memory shares: with no spare slot and 256 / 16 experts a device, all three agree."""
    from moectl.engine.sim.cluster_config import SimClusterConfig
    from moectl.engine.sim.cluster_engine import SimulatedEngine

    sim = run_json("sim", "--model", DSV3, "--hardware", "h800", "--devices", 16, "--redundant", 0)
    engine = SimulatedEngine(SimClusterConfig(model=DSV3, hardware="h800", devices=16, redundant_slots=0,
                                              routing="balanced"))
    assert sim["placement_slots_per_device"] == engine.spec.placement.slots_per_device == 16
    assert sim["memory"]["weights_bytes"] == engine.memory_plan["weights"]
    plan = run_json("plan", "memory", "--model", DSV3, "--devices", 16, "--context", 4096)
    assert plan["weights_bytes"] == engine.memory_plan["weights"]


def test_sim_and_the_simulated_backend_take_the_plan_rebalance_placement_file(tmp_path):
    """A plan for the model has a row for every layer (dense ones too): `sim` once refused it
    (it took MoE rows only), and a plan for another model was taken by shape."""
    plan = run_json("plan", "rebalance", "--synthetic", "--model", DSV3, "--devices", 16)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    sim = run_json("sim", "--model", DSV3, "--hardware", "h800", "--devices", 16, "--placement", path)
    assert sim["placement_slots_per_device"] == plan["slots_per_device"]
    res = run("record", tmp_path / "sim.trace", "--backend", "simulated", "--model", DSV3, "--devices", 16,
              "--placement", path, "--steps", 2, "--routing", "balanced")
    assert res.exit_code == 0, res.output
    kimi = run("sim", "--model", CONFIGS / "kimi-k2.json", "--hardware", "h800", "--devices", 16, "--placement", path)
    assert kimi.exit_code == 2 and kimi.stderr.startswith(f"moectl: error: --placement: {path}: planned for")
    res = run("record", tmp_path / "kimi.trace", "--backend", "simulated", "--model", CONFIGS / "kimi-k2.json",
              "--devices", 16, "--placement", path, "--steps", 2)
    assert res.exit_code == 2 and res.stderr.startswith(f"moectl: error: --placement: {path}: planned for"), res.output
