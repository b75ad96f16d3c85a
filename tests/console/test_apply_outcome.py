"""The outcome the Experts tab shows after an apply: throughput on the population (batch shape and
context) both sides of the apply ran, so a change of traffic across it is not read as the
placement's doing; its interval, its parts, and whether it resolves the preview's prediction."""

from __future__ import annotations

import pytest

from moectl.console.state import ConsoleState
from moectl.profiler.outcome import matched_outcome, step_timing
from tests.records import BALANCED, make_record


def timed_record(step: int, prefill: int, decode: int, step_s: float, modeled: bool = True,
                 critical_s: float = 0.0, kv_used: int = 10) -> dict:
    record = make_record(step, busy_s=[0.01, 0.01], decode_tokens=decode, kv=(kv_used, 100))
    record["batch"]["prefill_tokens"] = prefill
    record["devices"]["step_time"] = {"step_s": step_s, "modeled": modeled, "expert_critical_s": critical_s,
                                      "link_s": 0.0}
    return record


def timed(*args) -> tuple:
    return step_timing(timed_record(*args))


def overall_throughput(timings: list) -> float:
    return sum(t.tokens for t in timings) / sum(t.step_s for t in timings)


def test_a_traffic_change_with_the_same_step_times_is_no_gain():
    # before: mostly small decode batches; after: mostly big ones, each shape as fast as before
    before = [timed(i, 0, 4, 0.010) for i in range(12)] + [timed(20 + i, 0, 16, 0.020) for i in range(2)]
    after = [timed(40 + i, 0, 4, 0.010) for i in range(2)] + [timed(50 + i, 0, 16, 0.020) for i in range(12)]
    matched = matched_outcome(before, after)
    assert matched["after"] / matched["before"] - 1 == pytest.approx(0.0)
    assert matched["steps"] == 4 and matched["shapes"] == 2 and matched["modeled"]
    # whereas all tokens over all step time would have called the bigger batches a 54% gain
    assert overall_throughput(after) / overall_throughput(before) - 1 == pytest.approx(0.54, abs=0.01)


def test_faster_steps_of_the_same_shapes_are_the_gain_and_unshared_shapes_are_left_out():
    before = [timed(i, 0, 8, 0.011) for i in range(5)] + [timed(10 + i, 128, 8, 0.050) for i in range(3)]
    after = [timed(20 + i, 0, 8, 0.010) for i in range(9)] + [timed(30, 256, 0, 0.090)]  # 256+0: after only
    matched = matched_outcome(before, after)
    assert matched["shapes"] == 1 and matched["steps"] == 5
    assert matched["before"] == pytest.approx(8 / 0.011) and matched["after"] == pytest.approx(8 / 0.010)


def test_no_shared_shape_or_no_step_time_gives_nothing():
    assert matched_outcome([timed(1, 0, 4, 0.01)], [timed(2, 0, 5, 0.01)]) is None
    assert step_timing(make_record(1, decode_tokens=4)) is None  # no devices, so no step time


def test_the_console_waits_for_matching_steps_then_shows_the_outcome():
    header = {"model": {"num_layers": 2, "num_experts": 4}, "devices": {"topology": {"num_devices": 2}}}
    state = ConsoleState(header, "live")
    state.apply([timed_record(i, 0, 20, 0.020) for i in range(1, 101)])  # a burst: 20 decoding
    apply = {"kind": "rebalance_apply", "time": 1000.0, "step": 100,
             "result": {"placement": BALANCED.to_dict(), "bytes_moved": 1, "predicted": {"gain": 0.1}}}
    state.apply([], [apply])
    later = [timed_record(i, 0, 10, 0.010) for i in range(101, 201)]  # then 10, a different shape
    for record in later:
        record["t_start"] += 1000.0
    state.apply(later)
    waiting = state.apply_outcome()
    assert waiting["outcome"] is None and waiting["matched"] == 0 and waiting["steps_after"] == 100
    back = [timed_record(i, 0, 20, 0.018) for i in range(201, 211)]  # the burst's shape again, faster
    for record in back:
        record["t_start"] += 1000.0
    state.apply(back)
    result = state.apply_outcome()
    assert result["matched"] == 10 and result["outcome"]["gain"] == pytest.approx(0.020 / 0.018 - 1)


def test_the_experts_only_outcome_holds_the_rest_of_the_step_at_its_time_before():
    # after the apply the experts' critical path drops 4 -> 3 ms, while everything else got 2 ms
    # slower (the machine drifted): the whole step says -10%, the experts alone +10%
    before = [timed(i, 0, 8, 0.010, True, 0.004) for i in range(5)]
    after = [timed(10 + i, 0, 8, 0.011, True, 0.003) for i in range(5)]
    matched = matched_outcome(before, after)
    assert matched["gain"] == pytest.approx(0.010 / 0.011 - 1)
    assert matched["gain_experts_only"] == pytest.approx(0.010 / 0.009 - 1)
    parts = matched["parts"]
    assert parts["expert_critical_s"]["change_s"] == pytest.approx(-0.001)
    assert parts["rest_s"]["change_s"] == pytest.approx(0.002)  # the drift, shown apart


def test_no_steps_before_the_apply_in_view_shows_nothing_and_old_records_no_experts_only():
    header = {"model": {"num_layers": 2, "num_experts": 4}, "devices": {"topology": {"num_devices": 2}}}
    apply = {"kind": "rebalance_apply", "time": 1000.0, "step": 100,
             "result": {"placement": BALANCED.to_dict(), "bytes_moved": 1, "predicted": {"gain": 0.1}}}
    state = ConsoleState(header, "live")
    state.apply([], [apply])  # a replay seeked past the apply: its steps before are out of view
    assert state.apply_outcome() is None
    old = timed_record(1, 0, 8, 0.010)
    del old["devices"]["step_time"]["expert_critical_s"]  # a trace from before the critical path was recorded
    assert step_timing(old).parts["expert_critical_s"] is None
    later = timed_record(2, 0, 8, 0.009)
    del later["devices"]["step_time"]["expert_critical_s"]
    matched = matched_outcome([step_timing(old)], [step_timing(later)])
    assert matched["gain_experts_only"] is None and matched["after"] > matched["before"]
    assert "expert_critical_s" not in matched["parts"]


def test_steps_of_another_context_are_another_population():
    # the same batch shape, but the KV in use grew 16x across the apply: attention costs more, and
    # that is not the placement's doing, so those steps are not compared
    before = [timed(i, 0, 8, 0.010, True, 0.004, 10) for i in range(6)]
    after = [timed(10 + i, 0, 8, 0.014, True, 0.004, 200) for i in range(6)]
    assert matched_outcome(before, after) is None
    after += [timed(20 + i, 0, 8, 0.009, True, 0.003, 12) for i in range(6)]
    assert matched_outcome(before, after)["gain"] == pytest.approx(0.010 / 0.009 - 1)


def test_an_outcome_is_shown_once_its_interval_resolves_the_prediction():
    header = {"model": {"num_layers": 2, "num_experts": 4}, "devices": {"topology": {"num_devices": 2}}}
    state = ConsoleState(header, "live")
    wobble = [0.7, 1.3]  # +-30% around the mean, step after step
    state.apply([timed_record(i, 0, 8, 0.010 * wobble[i % 2]) for i in range(1, 41)])
    apply = {"kind": "rebalance_apply", "time": 1000.0, "step": 40,
             "result": {"placement": BALANCED.to_dict(), "bytes_moved": 1, "predicted": {"gain": 0.11}}}
    state.apply([], [apply])
    noisy = [timed_record(i, 0, 8, 0.009 * wobble[i % 2]) for i in range(41, 51)]
    for record in noisy:
        record["t_start"] += 1000.0
    state.apply(noisy)
    waiting = state.apply_outcome()  # 10 matched steps at 30% noise: an interval far wider than +-2.2%
    so_far = waiting["so_far"]
    assert waiting["outcome"] is None and waiting["matched"] == 10 and not so_far["resolved"]
    assert so_far["gain_low"] < 0.11 < so_far["gain_high"]
    quiet = [timed_record(i, 0, 4, 0.009) for i in range(51, 61)]  # a shape never run before
    for record in quiet:
        record["t_start"] += 1000.0
    state.apply(quiet)
    assert state.apply_outcome()["matched"] == 10


def test_an_outcome_clear_of_its_prediction_is_resolved():
    before = [timed(i, 0, 8, 0.010 * (1 + 0.01 * (i % 3))) for i in range(12)]
    after = [timed(20 + i, 0, 8, 0.014 * (1 + 0.01 * (i % 3))) for i in range(12)]  # 30% slower
    assert matched_outcome(before, after, {"gain": 0.10})["resolved"]  # predicted +10%: clearly wrong
    confirmed = matched_outcome(before, after, {"gain": -0.28})  # within a point of what ran: precise enough
    assert confirmed["resolved"] and confirmed["gain_high"] - confirmed["gain_low"] < 0.02


def test_the_prediction_held_against_an_outcome_is_the_previews_own_on_its_populations():
    # the preview's window mixed prefill steps (predicted 25% faster) and decode steps (unchanged);
    # the steps both sides of the apply ran are decode steps: the prediction on them is 0%, not the window's
    before = [timed(i, 0, 8, 0.010) for i in range(6)] + [timed(10 + i, 512, 8, 0.100) for i in range(2)]
    per_step = {"t_start": [t.t_start for t in before],
                "before_s": [t.step_s for t in before],
                "after_s": [t.step_s if t.key[0] == 0 else t.step_s / 1.25 for t in before]}
    window_gain = sum(per_step["before_s"]) / sum(per_step["after_s"]) - 1
    after = [timed(20 + i, 0, 8, 0.010) for i in range(6)]
    matched = matched_outcome(before, after, {"gain": window_gain, "per_step": per_step})
    assert window_gain > 0.15
    assert matched["predicted_gain"] == pytest.approx(0.0) and matched["predicted_steps"] == 6
    assert matched["resolved"]  # the same step times: right to within the bar at once
    # without per-step predictions the window's gain is what it is held against
    assert matched_outcome(before, after, {"gain": window_gain})["predicted_gain"] == pytest.approx(window_gain)
