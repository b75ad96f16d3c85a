"""Options of `plan` that apply to one mode only are refused in the other, naming the option and
what it applies to (exit 2), not accepted and ignored: --layers, --experts, --skew and --seed shape
`plan rebalance --synthetic`'s loads, a trace or loads file has its own; --host-mem sizes the host
tier of `plan memory --offload`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moectl.cli.main import app
from tests.paths import DOCS, TRACES

runner = CliRunner()
TRACE = TRACES / "steady_rebalance.trace"


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(res, starts: str) -> str:
    assert res.exit_code == 2, res.output
    assert res.stderr.count("\n") == 1 and res.stderr.startswith(f"moectl: error: {starts}"), res.stderr
    return res.stderr


@pytest.mark.parametrize("option, value", [("--layers", 4), ("--experts", 16), ("--skew", 2.0), ("--seed", 3),
                                           ("--skew", 1.0), ("--seed", 0)])  # the defaults, given, too
def test_synthetic_only_options_are_refused_with_a_trace(option, value):
    message = one_line_error(run("plan", "rebalance", TRACE, option, value), f"{option}: ")
    assert "applies only to --synthetic" in message and str(TRACE) in message


def test_synthetic_only_options_are_refused_with_a_loads_file(tmp_path):
    loads = tmp_path / "loads.json"
    loads.write_text(json.dumps([[1, 2, 3, 4], [4, 3, 2, 1]]))
    assert run("plan", "rebalance", loads, "--devices", 2, "--json").exit_code == 0
    one_line_error(run("plan", "rebalance", loads, "--devices", 2, "--skew", 1.5), "--skew: applies only to --synthetic")


def test_synthetic_options_still_shape_synthetic_loads():
    res = run("plan", "rebalance", "--synthetic", "--layers", 3, "--experts", 32, "--skew", 1.5, "--seed", 2, "--json")
    assert res.exit_code == 0, res.output
    assert (json.loads(res.stdout)["layers"], json.loads(res.stdout)["experts"]) == (3, 32)


def test_host_mem_applies_only_with_offload():
    config = DOCS / "configs" / "mixtral-8x7b.json"
    message = one_line_error(run("plan", "memory", "--model", config, "--context", 1024, "--host-mem", "1TiB"),
                             "--host-mem: ")
    assert "only with --offload" in message
    res = run("plan", "memory", "--model", config, "--context", 1024, "--host-mem", "1TiB", "--offload", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["offload"]["host_bytes_per_node"] == 1 << 40
