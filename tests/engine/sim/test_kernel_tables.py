"""Kernel cost tables (engine/sim/kernel_tables.py), the two all-to-all modes, overlap as a
schedule (engine/sim/overlap.py) and MTP: each priced as its source says, and each changing the
simulated step the way the published measurements do."""

from __future__ import annotations

import json
from dataclasses import replace
from importlib import resources

import numpy as np
import pytest

from moectl.engine.sim.hardware import ProfileError, load_profile
from moectl.engine.sim.kernel_tables import SmallOp, fit_low_latency
from moectl.engine.sim.model_shape import load_sim_model
from moectl.engine.sim.overlap import mtp_tokens_per_step
from moectl.engine.sim.routing import balanced
from moectl.engine.sim.step_model import SimSpec, layer_times, simulate, uniform_load
from tests.paths import DOCS

DSV3 = load_sim_model(DOCS / "configs" / "deepseek-v3.json")
H800, H100 = load_profile("h800"), load_profile("h100")
EVEN = balanced(DSV3.shape.num_sparse, DSV3.shape.num_experts)


def spec(hw=H800, **kw) -> SimSpec:
    return SimSpec(DSV3, hw, kw.pop("devices", 128), EVEN, **kw)


def test_the_low_latency_fit_reproduces_deepeps_published_table():
    raw = json.loads(resources.files("moectl.engine.sim").joinpath("profiles", "h800.json").read_text())
    low = raw["kernels"]["comm"]["low_latency"]
    for which in ("dispatch", "combine"):
        table = {**low, **low[which]}
        latency, gbps = fit_low_latency(table, 8)
        assert 0 <= latency < 60 and 35 < gbps < 55  # about the CX7's 50 GB/s, as DeepEP reports it
        for ep, us in table["points"]:
            if ep > 8:  # latency + each device's rows leaving its node over the NIC
                remote = table["tokens"] * table["top_k"] * table["row_bytes"] * (ep - 8) / ep
                assert latency + remote / (gbps * 1e3) == pytest.approx(us, rel=0.08)
    with pytest.raises(ValueError, match="two or more ep"):
        fit_low_latency({"tokens": 128, "top_k": 8, "row_bytes": 7392, "points": [[8, 77], [16, 118]]}, 8)


def test_decode_runs_the_low_latency_mode_without_node_dedup():
    ll = simulate(spec(tokens_per_device=128))
    normal = simulate(spec(tokens_per_device=128, comm="normal"))
    assert (ll["comm"], normal["comm"]) == ("low-latency", "normal")
    # at DeepEP's own benchmark shape (EP128, 128 tokens, top-8, 7,168 hidden) its table is the price
    times = layer_times(spec(tokens_per_device=128), uniform_load(spec(tokens_per_device=128)))
    assert times.dispatch[0] * 1e6 == pytest.approx(192, rel=0.1)
    assert times.combine[0] * 1e6 == pytest.approx(369, rel=0.1)
    # no node dedup: a copy per chosen expert, so twice the tokens carry twice the rows over the
    # wire above the latency, where normal mode sends a token once per node its choices hit
    low = H800.kernels.low_latency
    double = layer_times(spec(tokens_per_device=256), uniform_load(spec(tokens_per_device=256)))
    assert double.dispatch[0] - low.dispatch_latency_us * 1e-6 == pytest.approx(
        2 * (times.dispatch[0] - low.dispatch_latency_us * 1e-6), rel=1e-6)
    dedup = layer_times(spec(tokens_per_device=128, comm="normal"), uniform_load(spec(tokens_per_device=128)))
    assert dedup.dispatch[0] < times.dispatch[0] - low.dispatch_latency_us * 1e-6
    # a batch holding prompt tokens runs normal mode, as DeepEP's "auto" picks it
    assert simulate(spec(tokens_per_device=128, phase="prefill", context=4096))["comm"] == "normal"


def test_small_ops_and_floors_price_a_decode_layer_the_roofline_misses():
    tabled = simulate(spec(tokens_per_device=64))
    roofline = simulate(spec(replace(H800, kernels=None), tokens_per_device=64))
    assert tabled["breakdown_ms"]["small_ops"] > 0 and roofline["breakdown_ms"]["small_ops"] == 0
    assert tabled["step_ms"] > roofline["step_ms"]
    op = SmallOp(kernels=4, floor_us=2.0, us_per_token=0.5)
    assert op.seconds(np.array([0, 10]))[0] == 0 and op.seconds(10) * 1e6 == pytest.approx(4 * 2.0 + 5.0)


def test_normal_mode_takes_its_sms_from_the_compute_beside_it():
    base = spec(phase="prefill", tokens_per_device=16384, context=4096, devices=32, overlap="two-batch")
    fewer = simulate(replace(base, comm_sms=0))["step_ms"]
    deployed = simulate(base)["step_ms"]  # h800.json: DeepSeek's 24 of 132 SMs
    more = simulate(replace(base, comm_sms=48))["step_ms"]
    assert fewer < deployed < more
    # prefill at 16K tokens is compute-bound: the step grows about as 132 / (132 - SMs)
    assert deployed / fewer == pytest.approx(132 / 108, rel=0.05)


def test_two_batch_overlap_loses_on_small_decode_batches_and_wins_on_large_ones():
    # SGLang's ablation (bench/sim_validation.py holds it to its target): -27% at 32 tokens per GPU,
    # +25.5% at 256: each half pays every kernel's floor, which only a large batch hides
    def gain(tokens):
        steps = [simulate(spec(H100, devices=72, tokens_per_device=tokens, context=2000, overlap=o))
                 for o in ("none", "two-batch")]
        return steps[0]["step_ms"] / steps[1]["step_ms"] - 1, steps[1]
    (small, slow), (large, fast) = gain(32), gain(256)
    assert small < -0.15 and large > 0.15
    assert slow["breakdown_ms"]["overlap_cost"] > 0 and slow["overlap_hidden_ms"] == 0  # not idle: the halves' cost
    assert fast["breakdown_ms"]["overlap_cost"] == 0 and fast["overlap_hidden_ms"] > 0


def test_the_five_stage_schedule_is_bounded_by_its_halves_and_its_serial_sum():
    from moectl.engine.sim.overlap import micro_batch_schedule

    s = spec(tokens_per_device=128)
    half = layer_times(s, uniform_load(s).half())
    layers = micro_batch_schedule(half, "five-stage", 1.0, 0.0)
    compute = [2 * (half.pre_moe + e) for e in half.expert]
    comm = [2 * (d + c) for d, c in zip(half.dispatch, half.combine)]
    assert len(layers) == DSV3.shape.num_sparse
    # a steady layer takes at least the longer of both halves' compute and all-to-alls, at most both
    for got, c, m in list(zip(layers, compute, comm))[1:-1]:
        assert max(c, m) * (1 - 1e-9) <= got <= c + m
    assert sum(compute) <= sum(layers) <= sum(compute) + sum(comm)
    # the drain: the lagging micro-batch's last experts and combine are in the last layer
    assert layers[-1] > layers[-2]
    # held SMs: compute waits for each all-to-all's sending and receiving
    assert sum(micro_batch_schedule(half, "five-stage", 1.0, 0.0, held=0.5)) > sum(layers)
    # a partitioned card: compute on 108 of 132 SMs
    assert sum(micro_batch_schedule(half, "five-stage", 108 / 132, 0.0)) > sum(layers)


def test_mtp_verifies_draft_tokens_and_counts_the_accepted_ones():
    assert mtp_tokens_per_step(1, 0.85) == pytest.approx(1.85)
    assert mtp_tokens_per_step(2, 0.5) == pytest.approx(1.75)
    plain = simulate(spec(tokens_per_device=64, overlap="five-stage"))
    mtp = simulate(spec(tokens_per_device=64, overlap="five-stage", mtp_draft=1, mtp_accept=0.85))
    assert mtp["step_ms"] > plain["step_ms"] and mtp["breakdown_ms"]["mtp"] > 0
    # 128 devices x 64 sequences, each 1.85 tokens a step
    assert mtp["tokens_per_s"] * mtp["step_ms"] * 1e-3 == pytest.approx(128 * 64 * 1.85)
    assert plain["tokens_per_s"] * plain["step_ms"] * 1e-3 == pytest.approx(128 * 64)
    # verifying 2 tokens costs less than twice the step (weights read once), so MTP pays at 85%
    assert mtp["tokens_per_s"] > plain["tokens_per_s"]


def test_a_bad_kernel_table_is_one_line_naming_it(tmp_path):
    raw = json.loads(resources.files("moectl.engine.sim").joinpath("profiles", "h800.json").read_text())
    for edit, message in ((lambda k: k["small_ops"]["classes"].update(norms={}), "small_ops.classes.norms: not one of"),
                          (lambda k: k["small_ops"]["classes"]["norm"].update(floor_us=-1), "floor_us must be a number"),
                          (lambda k: k["small_ops"].update(classes=["norm"]), "classes must be an object of classes"),
                          (lambda k: k["comm"]["low_latency"].update(sm_share=3), "sm_share must be a fraction"),
                          (lambda k: k["comm"]["low_latency"].update(tokens=0), "tokens must be a positive number"),
                          (lambda k: k["comm"]["low_latency"]["dispatch"].update(points=[[16, 100], [16, 120]]),
                           "two or more ep"),
                          (lambda k: k["comm"]["low_latency"]["combine"].update(points="fast"), "points must be"),
                          (lambda k: k["comm"]["low_latency"].update(dispatch=None), "dispatch must be an object"),
                          (lambda k: k["comm"].update(normal_sms=200), "normal_sms \\(200\\) needs device_sms above"),
                          (lambda k: k["attention_prefill"].update(compute=1.5), "must be a fraction in"),
                          (lambda k: k.update(dense_gemm={"points": [[1, 0.5]]}), "dense_gemm must be an object with")):
        bad = json.loads(json.dumps(raw))
        edit(bad["kernels"])
        path = tmp_path / "mine.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(ProfileError, match=message) as info:
            load_profile(path)
        assert "\n" not in str(info.value)


def test_the_seeds_card_runs_on_its_roofline_and_says_so():
    s5000 = load_profile("mtt-s5000")
    assert s5000.kernels is None and s5000.hbm_gbps == 1600 and "peak_tflops.bf16" in s5000.assumed
    out = simulate(SimSpec(DSV3, s5000, 64, EVEN, tokens_per_device=128, overlap="two-batch"))
    assert out["kernel_tables"] is False and out["comm"] == "normal" and out["step_ms"] > 0
