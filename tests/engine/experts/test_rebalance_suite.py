"""`moectl bench --suite rebalance` (engine/tools/rebalance_bench.py): its keys say which kind of
figure each one is, its phases run the same batches, and the plan comes from other requests of
the same workload than the ones measured."""

from __future__ import annotations

import numpy as np
import pytest

from moectl.engine.tools.rebalance_bench import (
    batch_shapes,
    interval95,
    run_rebalance_bench,
    split_workload,
    workload,
)
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


def test_the_regimes_draw_short_long_or_both():
    decode, prefill, mixed = (workload(6, 0, regime) for regime in ("decode", "prefill", "mixed"))
    lines = lambda items: [p.count("\n") for p, _ in items]  # noqa: E731
    assert max(lines(decode)) < 25 and min(lines(prefill)) >= 200  # about 1-2K tokens
    assert all(params.max_tokens <= 4 for _, params in prefill)
    assert lines(mixed)[0::2] == lines(decode)[0::2] and lines(mixed)[1::2] == lines(prefill)[1::2]
    with pytest.raises(ValueError, match="--regime"):
        workload(2, 0, "burst")


def test_a_given_workload_is_split_into_planned_and_measured_requests():
    items = [(f"prompt {i}", i) for i in range(7)]
    plan, measured, settling = split_workload(items, 48)
    assert plan == items[0::2] and measured == items[1::2] and settling == measured
    assert split_workload(items, 2)[0] == items[0:4:2]
    with pytest.raises(ValueError, match="at least 2"):
        split_workload(items[:1], 48)


def test_the_suite_reports_the_previews_interval_and_the_gates_verdict(ckpt, single_thread, tmp_path):
    import json

    from moectl.engine.tools.workload import WorkloadSpec

    path = tmp_path / "work.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"import os\nimport sys{i}\n" * (1 + i % 3), "max_tokens": 6}) + "\n"
                            for i in range(12)))
    result = run_rebalance_bench(ckpt, backend="local", devices=2, requests=6, rounds=1, concurrency=4,
                                 redundant=1, spec=WorkloadSpec.from_option(str(path)), log=lambda line: None)
    assert result["regime"] == "given workload" and result["same_batches"]
    assert result["predicted_gain_low"] <= result["predicted_gain"] <= result["predicted_gain_high"]
    assert isinstance(result["gate_acts"], bool) and result["gate_reason"]
    assert result["prediction_within_bar"] in (True, False)


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
