"""The seeds' model class end to end: the 3T config read like any checkpoint, a scaled-down random
checkpoint of it (`model make-tiny --like`) in the engine, the console, the server and a trace."""

from __future__ import annotations

import json

import openai
import pytest
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.console.app import MoectlApp
from moectl.engine.core.config import EngineConfig
from moectl.engine.core.driver import EngineDriver
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.models.config import ModelConfig
from moectl.server.app import ServerThread
from tests.paths import DOCS
from tests.pilot import run_app, text_of, until

CONFIG_3T = DOCS / "configs" / "k3-3t-1m.json"
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def tiny_k3(tmp_path_factory):
    out = tmp_path_factory.mktemp("k3") / "tiny"
    res = run("model", "make-tiny", "--like", CONFIG_3T, "--out", out, "--json")
    assert res.exit_code == 0, res.output
    return out


def test_3t_config_is_a_deepseek_v3_config_json():
    res = run("model", "info", "--model", CONFIG_3T, "--json")
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["architecture"] == "DeepseekV3ForCausalLM" and info["attention"] == "mla"
    assert (info["layers"], info["experts"], info["top_k"]) == (80, 512, 8)
    assert 2.9e12 < info["params_total"] < 3.1e12
    assert info["kv_values_per_token_per_layer"] == 512 + 64
    res = run("plan", "rebalance", "--synthetic", "--model", CONFIG_3T, "--devices", 64, "--json")
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)
    # a row for each of the 80 layers (3 dense, routing nothing) and the experts of the config
    assert (plan["layers"], plan["experts"], plan["devices"]) == (80, 512, 64)
    assert sum(plan["placement"]["model"]["sparse_layers"]) == 77
    assert plan["expert_bytes"] == 3 * 8192 * 3072 * 2
    assert plan["balancedness_after"] > plan["balancedness_before"]


def test_make_tiny_keeps_the_layer_kinds(tiny_k3):
    big, tiny = ModelConfig.from_dir(CONFIG_3T), ModelConfig.from_dir(tiny_k3)
    assert tiny.architecture == big.architecture == "deepseek_v3"
    for field in ("attention", "router", "shared_expert_gated", "rope_interleave", "norm_topk_prob",
                  "routed_scaling_factor"):
        assert getattr(tiny, field) == getattr(big, field), field
    assert tiny.rope_scaling.kind == "yarn" and tiny.rope_scaling.factor == big.rope_scaling.factor
    assert bool(tiny.q_lora_rank) == bool(big.q_lora_rank) and tiny.n_group > 1
    assert not tiny.sparse_layers[0] and all(tiny.sparse_layers[1:])  # a dense first layer, then MoE
    assert tiny.shared_expert_intermediate_size > 0
    assert (tiny_k3 / "tokenizer.json").is_file()
    res = run("generate", "--model", tiny_k3, "def f(", "--max-tokens", 6, "--ignore-eos", "--devices", 4, "--json")
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.stdout)["token_ids"]) == 6


@pytest.mark.parametrize("args, needle", [
    (("--like", "/nonexistent/config.json"), "--like"),
    (("--like", CONFIG_3T, "--experts", "1"), "--experts"),
    (("--like", CONFIG_3T, "--hidden", "40"), "--hidden"),
])
def test_make_tiny_bad_input_is_one_line(tmp_path, args, needle):
    res = run("model", "make-tiny", "--out", tmp_path / "x", *args)
    assert res.exit_code == 2 and needle in res.output and len(res.output.strip().splitlines()) == 1, res.output


def test_console_runs_on_the_tiny_3t(tiny_k3):
    """The console on an engine process (as `moectl run` starts it) of the scaled-down 3T: a
    rebalance previewed and applied there moves routed experts only."""
    import numpy as np

    from tests.console.test_console import live

    source = live(tiny_k3, "--devices", "4")

    async def body(app, pilot):
        await until(pilot, lambda: app.state.steps_seen > 5 and app.state.throughput() > 0, timeout=90)
        await until(pilot, lambda: "tok/s" in text_of(app, "#ov-metrics"), timeout=5)
        assert text_of(app, "#ov-load").count("d") >= 4
        before = app.state.placement
        source.act("auto_rebalance", enabled=False, objective="balance").result(timeout=30)  # a plan that moves
        await pilot.press("2")  # the Experts panel: the routed experts of the MoE layers only
        await pilot.press("r")
        await until(pilot, lambda: app.plan is not None, timeout=30)
        await pilot.press("A")
        await until(pilot, lambda: app.state.placement is not None and app.state.placement != before, timeout=30)
        # routed experts only: the dense first layer (no experts) is never part of a move
        np.testing.assert_array_equal(app.state.placement.slots[0], before.slots[0])
    run_app(MoectlApp(source), body)


def test_server_answers_on_the_tiny_3t(tiny_k3):
    driver = EngineDriver(lambda: LLMEngine(EngineConfig(model=str(tiny_k3), block_size=4, num_kv_blocks=128,
                                                         num_threads=1)))
    try:
        with ServerThread(driver) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            out = c.completions.create(model=c.models.list().data[0].id, prompt="def f(", max_tokens=5)
            assert out.usage.completion_tokens >= 1
    finally:
        driver.close()


def test_make_tiny_drops_token_ids_beyond_its_vocabulary_and_verify_passes(tmp_path):
    """Kimi's pad_token_id 163839 (gpt-oss: 199999) once went into a 4096-token vocabulary, and
    `verify` failed with "Padding_idx must be within num_embeddings"."""
    like = json.loads(CONFIG_3T.read_text())
    like.update(pad_token_id=163839, unk_token_id=[7, 163000])
    (tmp_path / "like.json").write_text(json.dumps(like))
    out = tmp_path / "tiny"
    res = run("model", "make-tiny", "--like", tmp_path / "like.json", "--out", out, "--layers", "2", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["token_ids_dropped"] == ["pad_token_id", "unk_token_id"]
    config = json.loads((out / "config.json").read_text())
    assert config["pad_token_id"] is None and config["unk_token_id"] is None and config["eos_token_id"] == 1
    assert "_dropped_token_ids" not in config
    res = run("verify", "--model", out, "--json")
    assert res.exit_code == 0, res.output
