"""The activation watch's analysis (profiler/analysis.py): a record's numerics read and checked,
the window's peak per layer and point, the headroom to each point's dtype limit and to fp16's, and
the alerts: a warning naming the layer, the point and the headroom once a point's max reaches half
its dtype's limit, a critical one on an inf or NaN; none without the field or far from the limit."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moectl.profiler import analysis
from moectl.profiler.alert_feed import window_alerts
from moectl.profiler.analysis import HEADROOM_WARN, numerics_headroom, numerics_peak, step_numerics
from moectl.server.telemetry import to_jsonable
from moectl.wire.protocol import LENGTH, Alerts, decode, encode
from tests.profiler.numerics_records import BF16_LIMIT, flat, record
from tests.records import make_record

FP16 = 65504.0
RESIDUAL, SUMSQ, LOGITS, EXPERT = range(4)


def kinds(alerts: list[dict]) -> list[str]:
    return [a["kind"] for a in alerts]


def test_a_record_without_the_field_has_no_numerics_and_no_alert():
    rec = make_record(1)
    assert step_numerics(rec) is None and numerics_peak([None, step_numerics(rec)]) is None
    assert analysis.alerts([make_record(s) for s in range(1, 4)]) == []


def test_the_field_read_per_point_with_the_residual_streams_own_limit():
    peak = flat(3)
    peak[1, EXPERT] = 16376.0  # 65504 / 4
    peak[2, RESIDUAL] = 0.0
    got = step_numerics(record(1, peak, residual_dtype="float32"))
    assert got["dtype"] == "float16" and got["residual_dtype"] == "float32"
    assert got["points"] == ["residual", "norm_sumsq", "attn_logits", "expert_out"]
    assert got["bound"] == [False, False, True, False]
    fp32 = analysis.DTYPE_LIMITS["float32"]
    # the stream and its sum of squares in the stream's dtype, logits and expert outputs in the activations'
    assert got["limits"].tolist() == [fp32, fp32, FP16, FP16]
    assert got["point_dtypes"] == ["float32", "float32", "float16", "float16"]
    found = numerics_headroom(got)
    assert found["headroom"][1, EXPERT] == pytest.approx(4.0)
    assert found["headroom"][0, LOGITS] == pytest.approx(655.04)
    assert found["headroom"][0, SUMSQ] == pytest.approx(fp32 / 100)
    assert found["headroom"][2, RESIDUAL] == np.inf  # nothing flowed: nothing to overflow
    assert found["tightest"] == (1, EXPERT) and found["nonfinite_at"] == []
    # in fp16 the stream would have 65504 too: what serving in fp16 would leave
    assert found["fp16_headroom"][0, RESIDUAL] == pytest.approx(655.04)


def test_the_records_own_limits_win_and_older_fields_without_them_are_derived():
    rec = record(1, flat(2), residual_dtype="float32")
    rec["numerics"]["limits"] = [1.0, 2.0, 3.0, 4.0]
    assert step_numerics(rec)["limits"].tolist() == [1.0, 2.0, 3.0, 4.0]
    del rec["numerics"]["limits"]
    assert step_numerics(rec)["limits"].tolist() == [analysis.DTYPE_LIMITS["float32"]] * 2 + [FP16] * 2
    rec["numerics"]["limits"] = [1.0]  # not one per point: derived
    assert step_numerics(rec)["limits"].tolist()[2:] == [FP16, FP16]


def test_a_partial_or_malformed_field_is_read_or_ignored_never_fatal():
    rec = make_record(1)
    rec["numerics"] = {"dtype": "bfloat16", "max": [[1.0, 2.0, 3.0, 4.0]]}  # no limit, points, bound, flags
    got = step_numerics(rec)
    assert got["limit"] == BF16_LIMIT and got["bound"] == [False, False, True, False]
    assert not got["nonfinite"].any()
    for bad in ({"max": [1.0, 2.0]}, {"max": "lots"}, {"max": [[1.0]], "limit": "high"}, {"max": []}, "on", None):
        rec["numerics"] = bad
        assert step_numerics(rec) is None
        assert analysis.alerts([rec]) == []


def test_json_nulls_read_as_nonfinite():
    """Over the telemetry websocket an inf or NaN arrives as null (server/telemetry.py)."""
    peak = flat(2)
    peak[1, LOGITS] = np.inf
    sent = json.loads(json.dumps(to_jsonable(record(1, peak))))
    assert sent["numerics"]["max"][1][LOGITS] is None
    got = step_numerics(sent)
    assert got["nonfinite"].tolist() == [[False] * 4, [False, False, True, False]]
    assert numerics_headroom(got)["headroom"][1, LOGITS] == 0.0


def test_the_windows_peak_per_cell_keeps_an_inf_seen_once():
    first, second = flat(2, 10.0), flat(2, 5.0)
    second[0, EXPERT] = 900.0
    flags = np.zeros((2, 4), bool)
    flags[1, SUMSQ] = True  # an inf with a finite max beside it
    steps = [step_numerics(record(1, first, nonfinite=flags)), None, step_numerics(record(2, second))]
    peak = numerics_peak(steps)
    assert peak["steps"] == 2
    assert peak["max"][0].tolist() == [10.0, 10.0, 10.0, 900.0]
    assert peak["nonfinite"].tolist() == [[False] * 4, [False, True, False, False]]
    assert numerics_headroom(peak)["nonfinite_at"] == [(1, SUMSQ)]
    # another dtype (an engine restarted in bf16): only the newest kind's steps count
    other = step_numerics(record(3, flat(2, 1.0), dtype="bfloat16"))
    assert numerics_peak(steps + [other])["steps"] == 1


def test_headroom_alert_fires_near_the_limit_naming_layer_point_and_headroom():
    near = flat(4)
    near[2, EXPERT] = 40000.0  # 65504 / 40000 = 1.64x
    near[3, SUMSQ] = 32752.0  # exactly half: 2x, the threshold itself
    records = [record(1, flat(4)), record(2, near), record(3, flat(4))]  # the peak over the window counts
    alerts = analysis.alerts(records)
    (alert,) = alerts
    assert alert["kind"] == "numerics_headroom" and alert["severity"] == "warning"
    assert "layer 2 expert_out" in alert["message"] and "40000" in alert["message"]
    assert "headroom 1.64x" in alert["message"] and "float16" in alert["message"]
    assert "1 more (layer, point) pair" in alert["message"]
    p = alert["predicted"]
    assert (p["layer"], p["point"], p["max"], p["limit"], p["dtype"]) == (2, "expert_out", 40000.0, FP16, "float16")
    assert p["headroom"] == pytest.approx(FP16 / 40000) and p["pairs_under"] == 2


def test_no_alert_far_from_the_limit():
    far = flat(4, 1000.0)
    far[1, EXPERT] = 32000.0  # 2.05x: not yet half the limit
    assert FP16 / 32000.0 > HEADROOM_WARN
    assert analysis.alerts([record(1, far)]) == []


def test_the_attention_bound_is_said_to_be_one():
    peak = flat(2)
    peak[0, LOGITS] = 50000.0
    (alert,) = analysis.alerts([record(1, peak)])
    assert "layer 0 attn_logits" in alert["message"] and "an upper bound" in alert["message"]
    assert alert["predicted"]["bound"] is True


def test_each_point_against_its_own_dtype():
    """bf16 activations at 70000 are far from bf16's limit (only fp16 would overflow): no alert; a
    float32 residual stream beside fp16 activations is measured against float32's limit."""
    assert analysis.alerts([record(1, flat(2, 70000.0), dtype="bfloat16")]) == []
    mixed = flat(2)
    mixed[1, RESIDUAL] = 60000.0
    assert analysis.alerts([record(1, mixed, residual_dtype="float32")]) == []
    mixed[0, EXPERT] = 60000.0
    (alert,) = analysis.alerts([record(1, mixed, residual_dtype="float32")])
    assert alert["predicted"]["point"] == "expert_out" and alert["predicted"]["layer"] == 0


def test_nonfinite_is_critical_and_names_where_it_started():
    peak = flat(6)
    flags = np.zeros((6, 4), bool)
    flags[3, LOGITS] = True
    flags[4, RESIDUAL] = flags[4, EXPERT] = flags[5, RESIDUAL] = True  # downstream of layer 3
    peak[flags] = np.inf
    peak[1, EXPERT] = 50000.0
    alerts = analysis.alerts([record(1, peak, nonfinite=flags)])
    assert kinds(alerts) == ["numerics_nonfinite", "numerics_headroom"]
    loud = alerts[0]
    assert loud["severity"] == "critical"
    assert "L3 attn_logits (a bound), L4 residual, L4 expert_out and 1 more" in loud["message"]
    assert "first appears at layer 3, attn_logits" in loud["message"]
    assert (loud["predicted"]["layer"], loud["predicted"]["point"]) == (3, "attn_logits")
    assert alerts[1]["predicted"]["layer"] == 1  # the headroom alert names a finite pair, not the infs


def test_the_alerts_travel_as_every_front_end_gets_them():
    """window_alerts (the engine host's and a console's one computation) passes them through, and
    they survive the engine protocol's encoding (what an attached console receives)."""
    peak = flat(2)
    peak[1, EXPERT] = 60000.0
    flags = np.zeros((2, 4), bool)
    flags[0, SUMSQ] = True
    found = window_alerts([record(1, peak, nonfinite=flags)], None, None)
    assert kinds(found) == ["numerics_nonfinite", "numerics_headroom"]
    back = decode(encode(Alerts(step=1, alerts=found))[LENGTH.size:])  # the frame less its length
    assert back.alerts == json.loads(json.dumps(found))
