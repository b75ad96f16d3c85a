"""The SpanRecorder: spans closed into preallocated arrays reused across steps, collected as the
record's columns; the CUDA path's events resolved into the same arrays; link traffic passed on."""

from __future__ import annotations

import numpy as np
import pytest

from moectl.engine.core import spans as spans_module
from moectl.engine.core.spans import SpanRecorder
from moectl.wire.link_spans import LINKS


def names_of(spans: dict) -> list[str]:
    return [spans["names"][i] for i in spans["name"]]


def test_closed_spans_come_back_as_columns_relative_to_the_steps_start():
    rec = SpanRecorder(2)
    rec.begin_step(10.0)
    rec.add_measured("experts", 1, 3, 10.5, 10.75)
    rec.close(rec.mark(), "sampler")
    spans = rec.collect()
    assert spans["lanes"] == ["engine", "device 0", "device 1", "link 0", "link 1"]
    assert names_of(spans) == ["experts", "sampler"] and spans["lane"].tolist() == [1, 0]
    assert spans["layer"].tolist() == [3, -1] and spans["layer"].dtype == np.int16
    assert spans["start_s"][0] == pytest.approx(0.5) and spans["dur_s"][0] == pytest.approx(0.25)
    assert not spans["modeled"].any() and LINKS not in spans


def test_the_arrays_are_reused_and_a_step_sees_only_its_own_spans():
    rec = SpanRecorder(1)
    rec.begin_step(0.0)
    for layer in range(5):
        rec.add_measured("attention", 0, layer, 1.0, 2.0)
    first = rec.collect()
    rec.begin_step(0.0)
    rec.add_measured("router", 0, 7, 3.0, 3.5)
    second = rec.collect()
    assert names_of(second) == ["router"] and second["layer"].tolist() == [7]
    assert first["layer"].tolist() == [0, 1, 2, 3, 4]  # a collected step is a copy: the next one does not change it
    assert first["dur_s"].tolist() == [1.0] * 5


def test_the_arrays_grow_past_their_capacity_keeping_the_step(monkeypatch):
    monkeypatch.setattr(spans_module, "_CAPACITY", 4)
    rec = SpanRecorder(1)
    rec.begin_step(0.0)
    for i in range(11):
        rec.add_measured("experts", 1, i, float(i), float(i) + 0.5)
    spans = rec.collect()
    assert spans["layer"].tolist() == list(range(11)) and spans["start_s"].tolist() == [float(i) for i in range(11)]
    assert (spans["dur_s"] == 0.5).all()


def test_modeled_blocks_are_appended_flagged():
    rec = SpanRecorder(2)
    rec.begin_step(1.0)
    rec.add_measured("experts", 1, 0, 1.0, 1.5)
    rec.add_modeled("all_to_all dispatch", np.array([3, 4]), np.array([0, 0]), np.array([1.25, 1.5]),
                    np.array([0.1, 0.2]))
    spans = rec.collect()
    assert names_of(spans) == ["experts", "all_to_all dispatch", "all_to_all dispatch"]
    assert spans["modeled"].tolist() == [False, True, True] and spans["lane"].tolist() == [1, 3, 4]
    np.testing.assert_allclose(spans["start_s"], [0.0, 0.25, 0.5])
    np.testing.assert_allclose(spans["dur_s"], [0.5, 0.1, 0.2])


def test_link_traffic_rides_with_the_step_and_not_into_the_next():
    rec = SpanRecorder(2)
    rec.begin_step(0.0)
    links = {"layer": np.array([1], np.int16)}
    rec.add_links(links)
    assert rec.collect()[LINKS] is links
    rec.begin_step(0.0)
    assert LINKS not in rec.collect()


class FakeEvent:
    """A CUDA timing event's interface, on a fake clock in milliseconds."""

    def __init__(self, ms: float):
        self.ms = ms
        self.synced = False

    def elapsed_time(self, other: FakeEvent) -> float:
        return other.ms - self.ms

    def synchronize(self) -> None:
        self.synced = True


def test_cuda_events_are_resolved_into_the_arrays_on_the_engine_clock():
    rec = SpanRecorder(1)  # the CUDA path without a GPU: its events, resolved at collect
    rec.begin_step(5.0)
    rec._t0_event = FakeEvent(0.0)
    key = rec._key_of("attention", 0, 2)
    last = FakeEvent(40.0)
    rec._events = [(key, FakeEvent(10.0), FakeEvent(30.0)), (key, FakeEvent(35.0), last)]
    rec.add_measured("experts", 1, 2, 5.001, 5.002)
    spans = rec.collect()
    assert last.synced and names_of(spans) == ["experts", "attention", "attention"]
    np.testing.assert_allclose(spans["start_s"], [0.001, 0.010, 0.035])
    np.testing.assert_allclose(spans["dur_s"], [0.001, 0.020, 0.005])
    assert rec._events == []
