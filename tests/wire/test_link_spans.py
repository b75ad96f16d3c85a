"""The readers' modeled link spans: derived from a step record's link traffic, the same for every
reader, flagged modeled, without changing the record they were given."""

from __future__ import annotations

import numpy as np
import pytest

from moectl.wire.link_spans import COMBINE, DISPATCH, LINKS, link_seconds, with_link_spans
from moectl.wire.records import lanes_for


def record_with_links() -> dict:
    per_byte = np.array([[0.0, 1e-9], [2e-9, 0.0]])
    traffic = np.zeros((2, 2, 2), dtype=np.int64)
    traffic[0, 0, 1] = 1000  # layer 1: device 0 -> 1 only
    traffic[1, 1, 0] = 500  # layer 3: device 1 -> 0 only
    traffic[1, 1, 1] = 7  # to itself: no link
    links = {"layer": np.array([1, 3], np.int16), "dispatch_s": np.array([0.1, 0.3]),
             "combine_s": np.array([0.2, 0.4]), "traffic": traffic, "s_per_byte": per_byte}
    spans = {"lanes": lanes_for(2), "names": ["attention"], "lane": np.array([0], np.int16),
             "name": np.array([0], np.int16), "layer": np.array([1], np.int16), "start_s": np.array([0.0]),
             "dur_s": np.array([0.05]), "modeled": np.array([False]), LINKS: links}
    return {"step": 1, "t_start": 0.0, "t_end": 1.0, "spans": spans}


def test_each_layers_all_to_all_is_a_modeled_span_on_both_ends_of_each_link():
    record = record_with_links()
    spans = with_link_spans(record)["spans"]
    assert LINKS not in spans and spans["names"] == ["attention", DISPATCH, COMBINE]
    names = [spans["names"][i] for i in spans["name"]]
    assert names == ["attention"] + [DISPATCH] * 4 + [COMBINE] * 4
    assert spans["modeled"].tolist() == [False] + [True] * 8
    # layer 1: 1000 B over the 0 -> 1 link (1 ns/B) on lanes "link 0" and "link 1"; layer 3: 500 B at 2 ns/B
    assert spans["lane"].tolist() == [0, 3, 4, 3, 4, 3, 4, 3, 4]
    assert spans["layer"].tolist() == [1, 1, 1, 3, 3, 1, 1, 3, 3]
    np.testing.assert_allclose(spans["dur_s"][1:], [1e-6, 1e-6, 1e-6, 1e-6] * 2)
    np.testing.assert_allclose(spans["start_s"][1:], [0.1, 0.1, 0.3, 0.3, 0.2, 0.2, 0.4, 0.4])
    assert spans["lane"].dtype == spans["name"].dtype == spans["layer"].dtype == np.int16


def test_the_given_record_and_its_spans_are_left_as_they_were():
    record = record_with_links()
    spans = record["spans"]
    before = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in spans.items()}
    out = with_link_spans(record)
    assert out is not record and record["spans"] is spans and LINKS in spans
    assert len(spans["dur_s"]) == 1 and spans["names"] == before["names"] == ["attention"]
    assert with_link_spans(out) is out  # derived once: a second reader adds nothing


def test_a_record_without_link_traffic_is_returned_as_it_is():
    plain = {"step": 1, "spans": {"lanes": ["engine"], "names": [], "lane": np.zeros(0, np.int16)}}
    assert with_link_spans(plain) is plain
    assert with_link_spans({"step": 1, "spans": None})["spans"] is None


def test_a_json_records_lists_derive_the_same_spans():
    """The server's websocket sends lists (console/sources.py turns only the span columns back)."""
    record = record_with_links()
    spans = record["spans"]
    as_json = {**record, "spans": {**{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in spans.items()},
                                   LINKS: {k: v.tolist() for k, v in spans[LINKS].items()}}}
    a, b = with_link_spans(record)["spans"], with_link_spans(as_json)["spans"]
    for key in ("lane", "name", "layer", "start_s", "dur_s", "modeled"):
        assert np.array_equal(a[key], b[key]) and a[key].dtype == b[key].dtype, key


def test_link_seconds_prices_a_stack_of_layers_as_each_alone():
    rng = np.random.default_rng(0)
    per_byte = rng.uniform(1e-10, 1e-9, (4, 4))
    np.fill_diagonal(per_byte, 0.0)
    stack = rng.integers(0, 10**6, size=(3, 4, 4))
    np.testing.assert_allclose(link_seconds(stack, per_byte), [link_seconds(t, per_byte) for t in stack])
    one = np.zeros((4, 4), np.int64)
    one[0, 2] = 10**9
    assert link_seconds(one, per_byte).tolist() == pytest.approx([per_byte[0, 2] * 1e9, 0, per_byte[0, 2] * 1e9, 0])
