"""The one alert computation every front end runs: its devices mapping, its fallback and its cadence."""

from __future__ import annotations

import numpy as np

from moectl.placement.placement import Placement
from moectl.placement.topology import Topology
from moectl.profiler import analysis
from moectl.profiler.alert_feed import AlertCadence, window_alerts
from tests.records import CONTIGUOUS, make_record

DEVICES = {"topology": Topology(num_devices=2, devices_per_node=2).as_dict(), "expert_bytes": 1000,
           "redundant_slots": 1}


def two_steps() -> list[dict]:
    return [make_record(s, busy_s=[0.08, 0.04], tokens=[14, 6]) for s in (1, 2)]


def test_window_alerts_reads_the_devices_as_a_trace_header_has_them():
    expected = analysis.alerts(two_steps(), CONTIGUOUS, Topology(num_devices=2, devices_per_node=2), 1000, 1)
    assert window_alerts(two_steps(), CONTIGUOUS, DEVICES) == expected
    assert expected[0]["predicted"]["redundant_per_device"] == 1
    # no devices: the analysis still runs, without a plan to predict from
    (alone,) = window_alerts(two_steps(), CONTIGUOUS, None)
    assert alone["kind"] == "imbalance" and "balancedness_after" not in alone["predicted"]


def test_an_analysis_failure_is_an_alert_not_an_exception():
    wrong_shape = Placement.contiguous(3, 4, 2)  # 3 layers; the records route 2
    (alert,) = window_alerts(two_steps(), wrong_shape, DEVICES)
    assert alert["kind"] == "analysis" and alert["severity"] == "error"
    assert alert["message"].startswith("alerts failed: ")


def test_the_cadence_waits_for_time_and_for_new_steps():
    now = [100.0]
    cadence = AlertCadence(every_s=2.0, clock=lambda: now[0])
    assert cadence.due(5)  # the first steps: at once
    now[0] += 1.0
    assert not cadence.due(9)  # too soon
    now[0] += 1.5
    assert not cadence.due(5)  # no new steps since the last
    assert cadence.due(9)
    assert cadence.computed == 2


def timed_steps(routing, cost_model: dict, other_s: float = 0.01) -> list[dict]:
    """Steps that carry the engine's step-time split and calibrated cost model, as live records do."""
    records = []
    for s in range(1, 9):
        rec = make_record(s, routing=routing, busy_s=[0.02, 0.0], tokens=[int(routing.sum()), 0])
        rec["batch"]["decode_tokens"] = int(routing.sum())
        rec["devices"]["step_time"] = {"step_s": 0.05, "modeled": True, "other_s": other_s,
                                       "expert_critical_s": 0.02, "link_s": 0.0, "cost_model": cost_model}
        records.append(rec)
    return records


def costs(per_call, per_expert, per_row, per_row_loop) -> dict:
    return {"per_call_s": per_call, "per_expert_s": per_expert, "per_row_s": per_row, "per_row_loop_s": per_row_loop,
            "switch_rows": 4, "samples": 100, "residuals": [-0.02, 0.0, 0.02]}


def test_an_imbalance_that_does_not_pay_is_reported_as_such():
    # device 0 computes 6 rows to device 1's 1, one expert each; an expert costs as much as 300
    # rows, so no placement of these rows shortens the slowest device by much
    routing = np.array([[6, 0, 1, 0], [6, 0, 1, 0]], np.int32)
    devices = {**DEVICES, "expert_bytes": 1 << 20}
    (alert,) = [a for a in window_alerts(timed_steps(routing, costs(1e-5, 3e-4, 1e-6, 1e-6)), CONTIGUOUS, devices)
                if a["kind"] == "imbalance"]
    assert alert["severity"] == "info" and alert["message"].startswith("balancedness 0.58, but ")
    assert "fixed per-expert costs are" in alert["message"] and alert["action"] == "none: keep the placement"
    assert not alert["predicted"]["acts"]


def test_an_imbalance_that_pays_proposes_the_plan_with_its_saving():
    routing = np.array([[400, 400, 0, 0], [400, 400, 0, 0]], np.int32)  # rows dominate
    (alert,) = [a for a in window_alerts(timed_steps(routing, costs(1e-6, 1e-6, 2e-5, 2e-5)), CONTIGUOUS, DEVICES)
                if a["kind"] == "imbalance"]
    p = alert["predicted"]
    assert alert["severity"] in ("warning", "critical") and p["acts"] and p["gain_low"] >= 0.03
    assert "ms a step saved" in alert["message"] and alert["action"].startswith("rebalance (")
    assert p["step_s_after"] < p["step_s_before"]
