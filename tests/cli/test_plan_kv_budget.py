"""`moectl plan memory --kv-budget N|P%`: the million-token KV table of the seeds' 3T config
under a retention budget, in the human table and in --json, and a bad budget as one line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moectl.cli.main import app
from tests.paths import DOCS

CONFIG_3T = DOCS / "configs" / "k3-3t-1m.json"
ARGS = ["plan", "memory", "-m", str(CONFIG_3T), "--devices", "256", "--context", "1000000", "--hbm", "141GiB"]
PER_BLOCK = 80 * 16 * (512 + 64) * 2  # MLA latent and RoPE key, bf16, 80 layers, 16 tokens

runner = CliRunner()


def plan_json(*extra: str) -> dict:
    result = runner.invoke(app, [*ARGS, *extra, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_a_quarter_budget_holds_about_a_quarter_of_the_kv():
    full, quarter = plan_json(), plan_json("--kv-budget", "25%")
    assert full["kv_retention"] is None and full["bytes"]["kv_cache"] == 62_500 * PER_BLOCK
    # 250,000 tokens kept plus a 1,024-token step chunk, in blocks of 16
    assert quarter["bytes"]["kv_cache"] == 15_689 * PER_BLOCK
    assert 0.25 < quarter["bytes"]["kv_cache"] / full["bytes"]["kv_cache"] < 0.252
    r = quarter["kv_retention"]
    assert (r["budget"], r["held_tokens_per_sequence"], r["blocks_per_sequence"]) == ("25%", 250_000, 15_689)
    assert r["saved_bytes_per_sequence"] == r["saved_bytes_per_device"] == (62_500 - 15_689) * PER_BLOCK
    assert quarter["total_bytes"] == full["total_bytes"] - (62_500 - 15_689) * PER_BLOCK
    tokens = plan_json("--kv-budget", "4096")["kv_retention"]
    assert (tokens["budget"], tokens["budget_tokens"], tokens["blocks_per_sequence"]) == ("4096", 4096, 320)


def test_the_table_says_the_budget_and_what_it_saves():
    result = runner.invoke(app, [*ARGS, "--kv-budget", "25%"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "KV budget 25%: keeps 250,000 of 1,000,000 tokens per sequence in the full-attention layers " \
           "(15,689 blocks, not 62,500): saves 64.29 GiB per sequence, 64.29 GiB per device " \
           "(KV cache 21.55 GiB, not 85.83 GiB, on device 0: 1 seq)" in out
    kv_row = next(line for line in out.splitlines() if line.startswith("KV cache"))
    assert kv_row.split()[2:4] == ["21.55", "GiB"]


@pytest.mark.parametrize("budget", ["25x", "0", "0%", "101%", ""])
def test_a_bad_budget_is_one_line(budget):
    result = runner.invoke(app, [*ARGS, "--kv-budget", budget])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0] == (f"moectl: error: --kv-budget: {budget!r} is not a token count (e.g. "
                                            "4096) or a percentage of the context (e.g. 25%)")
