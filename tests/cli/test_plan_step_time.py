"""`moectl plan rebalance TRACE` on a trace that carries step times: the plan that minimises the
predicted step time, gated; options the recorded cluster cannot honour go to the token balancer."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from moectl.cli.main import app
from tests.paths import TRACES

TRACE = TRACES / "dsv3_ranks_rebalance.trace"  # recorded on 2 ranks, with the calibrated cost model


def run(*args):
    return CliRunner().invoke(app, ["plan", "rebalance", str(TRACE), *args])


def test_a_trace_with_step_times_is_planned_for_the_step_time_and_gated():
    result = run("--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    predicted = out["predicted"]
    assert out["objective"] == "predicted step time"
    assert predicted["gain_low"] <= predicted["gain"] <= predicted["gain_high"]
    assert predicted["step_s_after"] <= predicted["step_s_before"]  # never a plan predicted slower
    assert isinstance(predicted["acts"], bool) and "expert work is" in predicted["reason"]
    text = run()
    assert "objective: predicted step time" in text.output
    assert ("keep the placement: " in text.output) != ("apply it: " in text.output)


def test_slots_or_nodes_asked_for_go_to_the_token_balancer():
    out = json.loads(run("--redundant", "2", "--json").output)
    assert out["objective"] == "token balance" and out["redundant_per_device"] == 2
