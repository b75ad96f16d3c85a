"""`moectl sim calibrate` (engine/tools/sim_calibrate.py) and what the validation against this
machine prices with it: a profile every figure of which was measured here and says so, moectl's
ranks' all-reduce exchange worked by hand, and a recorded distributed step priced from its record."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.engine.sim.hardware import load_profile
from moectl.engine.sim.model_shape import load_sim_model
from moectl.engine.sim.routing import balanced
from moectl.engine.sim.step_model import SimSpec, allreduce_seconds, simulate
from moectl.engine.sim.trace_load import load_from_record, mean_prompt
from moectl.engine.tools.sim_calibrate import OVERHEAD_FLOOR_US
from moectl.placement.placement import Placement
from moectl.profiler.trace_queries import placement_timeline
from moectl.profiler.trace_store import TraceReader
from tests.paths import TRACES

runner = CliRunner()


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("calibrate") / "here.json"
    out = runner.invoke(app, ["sim", "calibrate", "--out", str(path), "--model", "sample-dsv3", "--json"])
    assert out.exit_code == 0, out.output
    return path


def test_every_figure_is_measured_here_and_the_profile_loads(profile):
    raw = json.loads(profile.read_text())
    hw = load_profile(profile)
    assert hw.sources and all("measured by `moectl sim calibrate --ranks 2`" in s for s in hw.sources.values())
    assert hw.fp32_tflops > 0 and hw.hbm_gbps > 0 and hw.intra_node_gbps > 0 and hw.gpus_per_node == 2
    assert hw.inter_node_gbps is None
    # an overhead is what the ranks measured beyond the step model's price; a run where the model
    # already prices more (timing noise decides, on a shared machine) writes the floor and says so
    for field in ("layer_overhead_us", "sequence_overhead_us", "prompt_token_overhead_us", "micro_batch_overhead_us"):
        value, source = raw[field]["value"], raw[field]["source"]
        assert getattr(hw, field) == value and value >= OVERHEAD_FLOOR_US
        assert ("floored at" in source) == (value == OVERHEAD_FLOOR_US), (field, value, source)
    points = raw["efficiency"]["grouped_gemm"]["points"]
    assert [r for r, _ in points] == sorted(r for r, _ in points)
    assert points[-1][1] > points[0][1]  # more rows per expert, a larger share of the peak
    out = runner.invoke(app, ["sim", "--model", "sample-dsv3", "--hardware", str(profile), "--devices", "2",
                              "--tp", "2", "--dtype", "fp32", "--batch-seqs", "8", "--context", "128", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["breakdown_ms"]["overhead"] > 0
    assert "as two micro-batches" in raw["micro_batch_overhead_us"]["source"]


def test_two_micro_batches_pay_the_measured_second_pass_and_hide_the_all_reduce(profile):
    """On this machine's profile: a decode step as two micro-batches costs the calibrated
    micro-batch overhead per layer beyond the halves' kernels; a prefill step hides part of its
    outputs' all_reduce under the other micro-batch's compute."""
    model = load_sim_model("engine/sample_model_dsv3", "fp32")
    shape, hw = model.shape, load_profile(profile)
    spec = SimSpec(model, hw, 2, balanced(shape.num_sparse, shape.num_experts), tokens_per_device=16, context=64,
                   tp=2, exchange="all-reduce")
    one, two = simulate(spec), simulate(replace(spec, overlap="two-batch"))
    assert two["breakdown_ms"]["overhead"] - one["breakdown_ms"]["overhead"] == pytest.approx(
        shape.num_layers * hw.micro_batch_overhead_us * 1e-3)
    prefill = replace(spec, phase="prefill", tokens_per_device=512, context=512)
    one, two = simulate(prefill), simulate(replace(prefill, overlap="two-batch"))
    assert 0 < two["overlap_hidden_ms"] <= one["breakdown_ms"]["combine"] + 1e-9


def test_bad_calibrate_input_is_one_line(tmp_path):
    existing = tmp_path / "p.json"
    existing.write_text("{}")
    for args, message in ((["--out", str(existing)], "exists"), (["--out", str(tmp_path / "q.json"), "--ranks", "1"],
                                                                  "--ranks"),
                          (["--out", str(tmp_path / "none" / "q.json")], "not an existing directory")):
        out = runner.invoke(app, ["sim", "calibrate", *args])
        assert out.exit_code == 2 and message in out.output and len(out.output.strip().splitlines()) == 1
    assert existing.read_text() == "{}"


def test_the_all_reduce_exchange_is_a_ring_over_the_ranks(profile):
    model = load_sim_model("engine/sample_model_dsv3", "fp32")
    shape, hw = model.shape, load_profile(profile)
    spec = SimSpec(model, hw, 2, balanced(shape.num_sparse, shape.num_experts), tokens_per_device=16, context=64,
                   tp=2, exchange="all-reduce")
    out = simulate(spec, detail=True)
    layers = out["detail"]["layers"]
    nbytes = 32 * shape.top_k * shape.hidden_size * 4  # the 2 ranks' 32 tokens, fp32 outputs
    by_hand = 2 * 1 / 2 * nbytes / (hw.intra_node_gbps * 1e9) + 2 * 2 * 1 * hw.a2a_latency_us * 1e-6
    assert allreduce_seconds(spec, nbytes) == pytest.approx(by_hand)
    assert layers.combine == [pytest.approx(by_hand)] * shape.num_sparse and not any(layers.dispatch)


def test_a_recorded_distributed_step_is_priced_from_its_record(profile):
    with TraceReader(TRACES / "dsv3_ranks_rebalance.trace") as reader:
        header, records = reader.header, list(reader.steps())
        timeline = placement_timeline(reader)
    model = load_sim_model("engine/sample_model_dsv3", "fp32")
    shape = model.shape
    moe = [i for i, s in enumerate(shape.sparse_layers) if s]
    record = records[len(records) // 2]
    load = load_from_record(record, shape, moe, header["engine_config"]["block_size"],
                            mean_prompt(e for r in records for e in r.get("requests") or ()))
    tokens = record["batch"]["prefill_tokens"] + record["batch"]["decode_tokens"]
    assert load.tokens.tolist() == [tokens]
    np.testing.assert_array_equal(load.pairs, record["routing"][moe])
    spec = SimSpec(model, load_profile(profile), 2, balanced(shape.num_sparse, shape.num_experts),
                   tokens_per_device=1, context=1, tp=2, exchange="all-reduce",
                   placement=Placement(timeline[0][1].slots[moe], shape.num_experts))
    assert simulate(spec, load)["step_ms"] > 0
