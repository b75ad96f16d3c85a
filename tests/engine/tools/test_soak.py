"""The soak suite on a few requests: it runs, and its figures are well formed; bad options are refused."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.engine.tools.soak import check_options, format_soak, run_soak


def test_soak_reports_well_formed_figures(tiny_engine_checkpoint, single_thread):
    r = run_soak(tiny_engine_checkpoint, num_requests=40, warmup=8, samples=4, devices=2, heap_requests=4,
                 log=lambda _line: None)
    assert r["requests"] == 40 and r["warmup_requests"] >= 8
    assert r["output_tokens"] >= 40 and r["prompt_tokens"] >= 40 and r["steps"] > 0 and r["wall_s"] > 0
    curve = [p["requests"] for p in r["curve"]]
    assert curve == sorted(curve) and curve[0] == r["warmup_requests"] and curve[-1] == 40
    assert r["rss_warm_bytes"] == r["curve"][0]["rss_bytes"] > 0 and r["rss_end_bytes"] == r["curve"][-1]["rss_bytes"]
    assert r["rss_growth_ratio"] == pytest.approx(r["rss_end_bytes"] / r["rss_warm_bytes"] - 1)
    assert r["meets_target"] == (r["rss_growth_ratio"] <= r["target_growth_ratio"])
    heap = r["python_heap"]
    assert heap["gc_objects_end"] > 0 and heap["pymalloc_blocks_end"] > 0
    assert heap["tracemalloc_tail"]["requests"] == 4 and isinstance(heap["tracemalloc_tail"]["retained_bytes"], int)
    json.dumps(r)  # the CLI's --json
    assert "requests" in format_soak(r)


@pytest.mark.parametrize("kwargs, option", [
    (dict(num_requests=5), "--requests"), (dict(num_requests=20, warmup=20), "warmup"),
    (dict(num_requests=20, samples=1), "samples"), (dict(num_requests=20, devices=-1), "--devices"),
    (dict(num_requests=20, heap_requests=21), "heap_requests"),
])
def test_bad_options_name_the_option(kwargs, option):
    args = dict(num_requests=20, warmup=None, samples=10, devices=2, heap_requests=0) | kwargs
    with pytest.raises(ValueError, match=f"^{option}:"):
        check_options(**args)


def test_cli_soak_json_and_bad_input(tiny_engine_checkpoint):
    runner = CliRunner()
    res = runner.invoke(app, ["bench", "--suite", "soak", "--model", str(tiny_engine_checkpoint), "--requests", "12",
                              "--devices", "0", "--json"])
    assert res.exit_code == 0, res.output
    result = json.loads(res.stdout)
    assert result["requests"] == 12 and result["devices"] == 0 and result["curve"][-1]["requests"] == 12
    for args, option in ((["--requests", "3"], "--requests"), (["--devices", "99"], "--devices"),
                         (["--backend", "distributed"], "--backend")):
        bad = runner.invoke(app, ["bench", "--suite", "soak", "--model", str(tiny_engine_checkpoint), *args])
        assert bad.exit_code == 2, bad.output
        err = bad.stderr.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"moectl: error: {option}:")
