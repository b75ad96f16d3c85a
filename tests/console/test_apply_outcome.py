"""The outcome the Experts tab shows after an apply: throughput on the batch shapes both sides of
the apply ran, so a change of traffic across it is not read as the placement's doing."""

from __future__ import annotations

import pytest

from moectl.console.state import ConsoleState, same_shape_throughput, step_timing
from tests.records import BALANCED, make_record


def timed_record(step: int, prefill: int, decode: int, step_s: float, modeled: bool = True,
                 critical_s: float = 0.0) -> dict:
    record = make_record(step, busy_s=[0.01, 0.01], decode_tokens=decode)
    record["batch"]["prefill_tokens"] = prefill
    record["devices"]["step_time"] = {"step_s": step_s, "modeled": modeled, "expert_critical_s": critical_s}
    return record


def timed(*args) -> tuple:
    return step_timing(timed_record(*args))


def overall_throughput(timings: list[tuple]) -> float:
    return sum(t[0][0] + t[0][1] for t in timings) / sum(t[1] for t in timings)


def test_a_traffic_change_with_the_same_step_times_is_no_gain():
    # before: mostly small decode batches; after: mostly big ones, each shape as fast as before
    before = [timed(i, 0, 4, 0.010) for i in range(12)] + [timed(20 + i, 0, 16, 0.020) for i in range(2)]
    after = [timed(40 + i, 0, 4, 0.010) for i in range(2)] + [timed(50 + i, 0, 16, 0.020) for i in range(12)]
    matched = same_shape_throughput(before, after)
    assert matched["after"] / matched["before"] - 1 == pytest.approx(0.0)
    assert matched["steps"] == 4 and matched["shapes"] == 2 and matched["modeled"]
    # whereas all tokens over all step time would have called the bigger batches a 54% gain
    assert overall_throughput(after) / overall_throughput(before) - 1 == pytest.approx(0.54, abs=0.01)


def test_faster_steps_of_the_same_shapes_are_the_gain_and_unshared_shapes_are_left_out():
    before = [timed(i, 0, 8, 0.011) for i in range(5)] + [timed(10 + i, 128, 8, 0.050) for i in range(3)]
    after = [timed(20 + i, 0, 8, 0.010) for i in range(9)] + [timed(30, 256, 0, 0.090)]  # 256+0: after only
    matched = same_shape_throughput(before, after)
    assert matched["shapes"] == 1 and matched["steps"] == 5
    assert matched["before"] == pytest.approx(8 / 0.011) and matched["after"] == pytest.approx(8 / 0.010)


def test_no_shared_shape_or_no_step_time_gives_nothing():
    assert same_shape_throughput([timed(1, 0, 4, 0.01)], [timed(2, 0, 5, 0.01)]) is None
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
    matched = same_shape_throughput(before, after)
    assert matched["after"] / matched["before"] - 1 == pytest.approx(0.010 / 0.011 - 1)
    assert matched["after_experts_only"] / matched["before"] - 1 == pytest.approx(0.010 / 0.009 - 1)


def test_no_steps_before_the_apply_in_view_shows_nothing_and_old_records_no_experts_only():
    header = {"model": {"num_layers": 2, "num_experts": 4}, "devices": {"topology": {"num_devices": 2}}}
    apply = {"kind": "rebalance_apply", "time": 1000.0, "step": 100,
             "result": {"placement": BALANCED.to_dict(), "bytes_moved": 1, "predicted": {"gain": 0.1}}}
    state = ConsoleState(header, "live")
    state.apply([], [apply])  # a replay seeked past the apply: its steps before are out of view
    assert state.apply_outcome() is None
    old = timed_record(1, 0, 8, 0.010)
    del old["devices"]["step_time"]["expert_critical_s"]  # a trace from before the critical path was recorded
    assert step_timing(old)[3] is None
    later = timed_record(2, 0, 8, 0.009)
    del later["devices"]["step_time"]["expert_critical_s"]
    matched = same_shape_throughput([step_timing(old)], [step_timing(later)])
    assert matched["after_experts_only"] is None and matched["after"] > matched["before"]
