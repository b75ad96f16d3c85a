"""`--backend simulated` on record, run and bench: a trace that says simulated and replays in
the console with simulated labels, the live console's engine process on a simulated cluster,
the rebalance suite's simulated gain on identical batches, and bad input as one line, exit 2."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.console.app import MoectlApp
from moectl.console.sources import ReplaySource, counterfactual_plan
from moectl.profiler.trace_store import TraceReader
from tests.paths import DOCS
from tests.pilot import run_app, text_of, until

runner = CliRunner()
DSV3 = str(DOCS / "configs" / "deepseek-v3.json")


def cli(*args):
    return runner.invoke(app, [*map(str, args)])


@pytest.fixture(scope="module")
def sim_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("sim") / "dsv3.trace"
    out = cli("record", path, "--backend", "simulated", "--model", DSV3, "--devices", 64, "--steps", 80,
              "--routing", "zipf:1.1", "--rebalance-at", 40, "--json")
    assert out.exit_code == 0, out.output
    return path, json.loads(out.stdout.strip().splitlines()[-1])


def test_record_writes_a_simulated_trace_with_its_rebalance(sim_trace):
    path, result = sim_trace
    assert result["simulated"] and result["steps"] == 80 and result["simulated_seconds"] > 0
    with TraceReader(path) as reader:
        header = reader.header
        assert header["clock"] == "simulated" and header["simulated"]["hardware"] == "NVIDIA H800 SXM5"
        assert header["devices"]["backend"] == "simulated" and header["devices"]["topology"]["num_devices"] == 64
        steps = list(reader.steps())
        actions = list(reader.actions())
    assert all(s["devices"]["simulated"] for s in steps)
    applied = [a for a in actions if a["kind"] == "rebalance_apply"]
    assert len(applied) == 1 and applied[0]["result"]["simulated"]
    predicted = applied[0]["result"]["predicted"]  # on the batch just run (a small one this early: either sign)
    assert predicted["simulated"] and predicted["step_s_before"] > 0 and predicted["step_s_after"] > 0
    stalled = [s for s in steps if s["devices"]["step_time"]["migration_stall_s"] > 0]
    assert [s["step"] for s in stalled] == [41]


def test_the_console_replays_a_simulated_trace_and_labels_every_figure_simulated(sim_trace):
    source = ReplaySource(sim_trace[0])

    async def body(console, pilot):
        await until(pilot, lambda: console.state.latest is not None, timeout=20)
        await until(pilot, lambda: "SIMULATED" in text_of(console, "#ov-title"), timeout=10)
        assert "simulated clock" in text_of(console, "#ov-metrics")
        assert "simulated" in text_of(console, "#ov-load-title")
        assert "simulated" in text_of(console, "#ov-hbm-title")
        assert console.state.simulated
        plan = counterfactual_plan(console.state)
        assert plan.prediction is None  # no model of that cluster in the console: balancedness only
    run_app(MoectlApp(source), body)


def test_the_live_console_starts_on_a_simulated_cluster():
    out = cli("run", "--backend", "simulated", "--model", DSV3, "--devices", 64, "--check-only")
    assert out.exit_code == 0, out.output


def test_the_rebalance_suite_simulates_the_gain_on_identical_batches():
    out = cli("bench", "--suite", "rebalance", "--backend", "simulated", "--model", DSV3, "--devices", 64,
              "--rounds", 1, "--requests", 2048, "--routing", "zipf:1.2", "--json")
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["gain_is"] == "simulated" and result["same_batches"]
    round_ = result["rounds"][0]
    assert round_["gain"] > 0.1 and round_["balancedness_after"] > round_["balancedness_before"]
    assert round_["predicted_gain"] > 0


@pytest.mark.parametrize("args, message", [
    (["run", "--hardware", "h100", "--check-only"], "--hardware: only with --backend simulated"),
    (["record", "{tmp}/x.trace", "--steps", "5", "--backend", "simulated", "--capture", "2"], "--capture"),
    (["record", "{tmp}/x.trace", "--steps", "5", "--backend", "simulated", "--devices", "300"], "--devices"),
    (["record", "{tmp}/x.trace", "--steps", "5", "--backend", "simulated", "--routing", "bogus"], "--routing"),
    (["record", "{tmp}/x.trace", "--steps", "5", "--backend", "simulated", "--hardware", "nope"], "hardware"),
    (["record", "{tmp}/x.trace", "--steps", "5", "--backend", "simulated", "--model", DSV3, "--devices", "8"],
     "no room for a KV cache"),
    (["record", "{tmp}/x.trace", "--steps", "5", "--backend", "simulated", "--hbm", "40GiB"], "--hbm"),
    (["bench", "--suite", "profiler", "--backend", "simulated"], "--backend simulated: runs --suite rebalance"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    out = cli(*[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert out.exit_code == 2, out.output
    assert message in out.output and "Traceback" not in out.output
    assert len(out.output.strip().splitlines()) == 1
    assert not (tmp_path / "x.trace").exists()
