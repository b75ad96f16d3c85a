"""`moectl bench --suite rebalance` (engine/tools/rebalance_bench.py): its keys say which kind of
figure each one is, its phases run the same batches, and the plan comes from other requests of
the same workload than the ones measured."""

from __future__ import annotations

import numpy as np
import pytest

from moectl.engine.tools.rebalance_bench import batch_shapes, interval95, run_rebalance_bench, workload
from tests.checkpoints import tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("rebalance_suite"))


def test_emulated_devices_report_a_modeled_gain_never_a_measured_one(ckpt, single_thread):
    result = run_rebalance_bench(ckpt, backend="local", devices=2, requests=8, rounds=2, concurrency=4,
                                 redundant=0, log=lambda line: None)
    assert result["gain_is"] == result["throughput_is"] == "modeled"
    assert "measured_gain" not in result and result["modeled_gain"] == result["gain"]
    assert len(result["gain_rounds"]) == result["rounds"] == 2
    assert result["gain"] == pytest.approx(np.mean(result["gain_rounds"]))
    lo, hi = result["gain_ci95"]
    assert lo <= result["gain"] <= hi
    assert result["same_batches"] and result["same_steps"]


def test_the_plan_and_the_measured_phases_use_different_requests_of_one_workload():
    warm, measured = workload(16, 0), workload(16, 1)
    assert [p for p, _ in warm] != [p for p, _ in measured]
    assert all(p.startswith(("import ", "from ")) for p, _ in warm + measured)  # one domain
    assert workload(16, 1) == measured  # a seed draws the same requests again


def test_interval95_and_batch_shapes():
    assert interval95([0.1]) is None
    lo, hi = interval95([0.10, 0.12, 0.14, 0.16])
    assert lo < 0.13 < hi and hi - lo == pytest.approx(2 * 3.182 * np.std([0.10, 0.12, 0.14, 0.16], ddof=1) / 2)
    records = [{"batch": {"prefill_tokens": 5, "decode_tokens": 2, "num_seqs": 3}}]
    assert batch_shapes(records) == [(5, 2, 3)]


def test_step_breakdown_estimates_what_even_expert_time_saves():
    from bench.step_breakdown import breakdown
    from tests.records import make_spans

    def record(busy, critical, step_s):
        spans = make_spans([("engine", "attention", 0.0, 0.004, False, 0),
                            ("device 0", "experts", 0.004, busy[0], False, 1)])
        step_time = {"step_s": step_s, "modeled": False, "expert_critical_s": critical}
        return {"spans": spans, "t_start": 0.0, "t_end": step_s, "devices": {"busy_s": busy, "step_time": step_time}}

    # two steps of 10 ms: the busiest rank's experts 3 and 4 ms, the mean rank's 2 and 3 ms
    out = breakdown([record([0.003, 0.001], 0.003, 0.010), record([0.004, 0.002], 0.004, 0.010)])
    assert out["balance_saves_share"] == pytest.approx(0.1)  # (1 + 1) ms of 20 ms
    assert out["gain_estimate"] == pytest.approx(0.1 / 0.9)
    assert out["expert_critical_share"] == pytest.approx(0.35)
    assert out["utilisation"] == pytest.approx([0.35, 0.15])
    assert out["spans"]["engine: attention"] == pytest.approx(0.008)
    assert list(out["spans"])[0] == "engine: attention"  # largest first
