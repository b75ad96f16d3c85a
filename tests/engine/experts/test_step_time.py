"""The parallel step time: split, calibrated cost model, predictions, and the local backend's
modeled parallel step in every step record."""

from __future__ import annotations

import numpy as np
import pytest

from moectl.engine.core.config import EngineConfig
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.llm_engine import LLMEngine
from moectl.placement.decision import predict_from_records
from moectl.placement.placement import Placement
from moectl.placement.step_time import (
    ExpertCostModel,
    device_work,
    parallel_step,
    predict_step_times,
)
from moectl.placement.topology import Topology
from tests.checkpoints import tiny_checkpoint


def test_emulated_step_is_other_plus_per_layer_critical_path_plus_links():
    busy = np.array([[0.010, 0.002], [0.004, 0.006]])  # [device, layer]
    split = parallel_step(0.050, busy, 0.001, measured_parallel=False)
    assert split["modeled"] and split["other_s"] == pytest.approx(0.050 - busy.sum())
    assert split["expert_critical_s"] == pytest.approx(0.010 + 0.006)
    assert split["step_s"] == pytest.approx(split["other_s"] + 0.016 + 0.001)
    measured = parallel_step(0.030, busy, 0.001, measured_parallel=True)
    assert not measured["modeled"] and measured["step_s"] == 0.030
    assert measured["other_s"] == pytest.approx(0.030 - 0.016)


def test_cost_model_recovers_its_coefficients_and_reports_its_error():
    rng = np.random.default_rng(0)
    model = ExpertCostModel(switch_rows=4)
    # each kernel its own terms: the loop launches a matmul per expert, the grouped GEMM one call
    truth = {"per_call_s": 5e-5, "per_expert_s": 2e-5, "per_row_s": 3e-6, "per_row_loop_s": 4e-5,
             "per_call_loop_s": 1e-5, "per_expert_loop_s": 9e-5}
    for _ in range(100):  # the error is taken with the fit then in force: early fits have fewer samples
        rows = rng.integers(1, 200, size=(4, 3)).astype(float)
        rows[0] = rng.integers(1, 4, size=3)  # some calls under the switch: the loop's costs
        active = np.minimum(rng.integers(1, 5, size=(4, 3)), rows).astype(float)
        grouped = rows >= 4
        busy = np.where(grouped, truth["per_call_s"] + truth["per_expert_s"] * active + truth["per_row_s"] * rows,
                        truth["per_call_loop_s"] + truth["per_expert_loop_s"] * active + truth["per_row_loop_s"] * rows)
        model.observe(rows, active, busy)
    summary = model.summary()
    for name, value in truth.items():
        assert summary[name] == pytest.approx(value, rel=1e-3), name
    assert summary["relative_error"] < 1e-3 and summary["switch_rows"] == 4
    assert np.all(model.predict(np.zeros((2, 2)), np.ones((2, 2))) == 0)  # no rows, no time
    again = ExpertCostModel.from_summary(summary)  # as a record carries it
    assert np.allclose(again.predict(np.array([2.0, 50.0]), np.array([1.0, 3.0])),
                       model.predict(np.array([2.0, 50.0]), np.array([1.0, 3.0])))


def test_a_kernel_never_run_is_priced_as_the_other():
    model = ExpertCostModel(switch_rows=64)  # decode-sized calls only: the loop
    rng = np.random.default_rng(1)
    for _ in range(20):
        rows = rng.integers(1, 40, size=(4, 2)).astype(float)
        active = np.minimum(rng.integers(1, 6, size=(4, 2)), rows).astype(float)
        model.observe(rows, active, 1e-5 + 8e-5 * active + 2e-6 * rows)
    s = model.summary()
    assert (s["per_call_s"], s["per_expert_s"], s["per_row_s"]) == (s["per_call_loop_s"], s["per_expert_loop_s"],
                                                                   s["per_row_loop_s"])
    assert s["per_expert_s"] == pytest.approx(8e-5, rel=1e-3)


def test_no_cost_comes_out_negative():
    # busy falls with active experts here: least squares would price an expert below zero
    model = ExpertCostModel()
    rows = np.array([[10.0, 20.0, 30.0, 40.0]])
    model.observe(rows, np.array([[4.0, 3.0, 2.0, 1.0]]), 1e-4 + 1e-5 * rows)
    assert (model.coefficients() >= 0).all()
    assert model.summary()["per_row_s"] == pytest.approx(1e-5, rel=0.3)


def test_a_balanced_placement_is_predicted_faster_than_a_skewed_one():
    model = ExpertCostModel.fixed(0.0, 1e-5)
    loads = np.zeros((4, 1, 4))
    loads[:, 0, :2] = 100  # experts 0 and 1 are hot: both on device 0 under the contiguous placement
    naive = Placement.contiguous(1, 4, 2)
    spread = Placement(np.array([[[0, 2], [1, 3]]]), 4)
    rows, _ = device_work(naive, loads, [0])
    assert rows[0, :, 0].tolist() == [200, 0]
    slow = predict_step_times(model, naive, loads, [0], 0.001, 0.0, 64)
    fast = predict_step_times(model, spread, loads, [0], 0.001, 0.0, 64)
    assert slow["step_s"] == pytest.approx(0.001 + 200e-5) and fast["step_s"] == pytest.approx(0.001 + 100e-5)
    assert fast["throughput_tok_s"] > slow["throughput_tok_s"] and min(slow["utilisation"]) == 0


def test_local_records_carry_the_modeled_parallel_step_and_previews_predict_time(tmp_path):
    config = EngineConfig(model=str(tiny_checkpoint(tmp_path / "m")), topology=Topology(num_devices=4),
                          redundant_slots=1, num_threads=1)
    engine = LLMEngine(config)
    engine.generate([list(range(3, 40)), [5, 6, 7], list(range(50, 70))], SamplingParams(max_tokens=12))
    records = [s.as_record() for s in engine.step_log]
    for rec in records:
        st = rec["devices"]["step_time"]
        busy = rec["devices"]["busy_s"]
        assert st["modeled"] and st["step_s"] <= rec["t_end"] - rec["t_start"] + 1e-9
        assert st["expert_critical_s"] <= sum(busy) + 1e-12 and len(st["wait_s"]) == 4
        assert st["utilisation"] == pytest.approx([b / st["step_s"] for b in busy])
    assert records[-1]["devices"]["step_time"]["cost_model"]["samples"] > 0
    plan = engine.experts.preview()
    predicted = plan.summary()["predicted"]
    assert predicted["step_s_before"] > 0 and predicted["step_s_after"] > 0
    assert predicted["throughput_before"] > 0 and "gain" in predicted
    # the same prediction from the records alone (what replay and `plan rebalance TRACE` use)
    again = predict_from_records(records, engine.experts.placement, plan.placement)
    assert again is not None and again["step_s_before"] > 0
