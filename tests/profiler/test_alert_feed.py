"""The one alert computation every front end runs: its devices mapping, its fallback and its cadence."""

from __future__ import annotations

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
