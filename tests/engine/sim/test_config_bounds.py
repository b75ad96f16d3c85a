"""Every size a config.json gives is bounded (engine/models/config.py SIZE_LIMITS) before anything
is built from it: `sim` on `num_hidden_layers: 1000000000` once ran out of memory building a layer
table (MemoryError, exit 1). The error is one line naming the field and its range, exit 2, from
`sim`, the simulated backend, `plan memory` and `model info` alike."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moectl.cli.main import app
from tests.paths import DOCS

runner = CliRunner()
CONFIGS = DOCS / "configs"


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("config, field, value, bound", [
    ("deepseek-v3", "num_hidden_layers", 10**9, "[1, 1,024]"),
    ("mixtral-8x7b", "num_hidden_layers", 10**9, "[1, 1,024]"),
    ("deepseek-v3", "n_routed_experts", 10**6, "[1, 4,096]"),
    ("mixtral-8x7b", "num_local_experts", 10**6, "[1, 4,096]"),
    ("deepseek-v3", "hidden_size", 10**9, "[1, 1,048,576]"),
    ("deepseek-v3", "moe_intermediate_size", 10**9, "[1, 1,048,576]"),
    ("deepseek-v3", "kv_lora_rank", 10**9, "[1, 1,048,576]"),
    ("deepseek-v3", "vocab_size", 10**12, "[1, 16,777,216]"),
    ("deepseek-v3", "num_attention_heads", 10**9, "[1, 65,536]"),
    ("deepseek-v3", "first_k_dense_replace", 10**9, "[0, 1,024]"),
    ("mixtral-8x7b", "max_position_embeddings", 10**20, "[1, 17,179,869,184]"),
])
def test_a_config_size_out_of_bounds_is_one_line_naming_the_field_and_its_range(tmp_path, config, field, value, bound):
    raw = json.loads((CONFIGS / f"{config}.json").read_text())
    raw[field] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    expected = f"{field}: must be in {bound}, got {value:,}\n"
    for args, prefix in ((["sim", "--model", path, "--hardware", "h800"], ""),
                         (["record", tmp_path / "sim.trace", "--backend", "simulated", "--model", path, "--steps", 1],
                          "--backend simulated: "),
                         (["plan", "memory", "--model", path, "--context", 1024], ""),
                         (["model", "info", "--model", path], "")):
        res = run(*args)
        assert res.exit_code == 2 and res.stderr == f"moectl: error: {prefix}{expected}", (args, res.output)


def test_a_config_that_is_not_json_is_named_by_its_file(tmp_path):
    path = tmp_path / "weights.pt"
    path.write_bytes(b"\x80\x02}q\x00.")
    res = run("model", "info", "--model", path)
    assert res.exit_code == 2 and res.stderr.startswith("moectl: error: weights.pt: unreadable"), res.output
