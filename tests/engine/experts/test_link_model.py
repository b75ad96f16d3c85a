"""The modeled link time of an all-to-all: every off-diagonal transfer over its link, both ends."""

from __future__ import annotations

import numpy as np
import pytest

from moectl.engine.experts.cluster import LocalCluster
from moectl.placement.topology import Topology
from moectl.wire.link_spans import LINKS, with_link_spans


@pytest.mark.parametrize("per_node", [8, 4])
def test_link_seconds_counts_each_transfer_on_both_ends_over_its_link(per_node):
    cluster = object.__new__(LocalCluster)  # only the topology matters here
    cluster.topology = Topology(num_devices=8, devices_per_node=per_node)
    traffic = np.zeros((8, 8), dtype=np.int64)
    traffic[0, 1] = 4e9  # same node
    traffic[0, 5] = 1e9  # another node when per_node is 4
    traffic[3, 3] = 7e9  # to itself: no link
    got = cluster.link_seconds(traffic)
    t = cluster.topology
    same, cross = 4 / t.intra_node_gbps, 1 / t.link_gbps(0, 5)
    want = np.zeros(8)
    want[[0, 1]] += same
    want[[0, 5]] += cross
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert got[3] == 0


def test_a_stack_of_layers_is_priced_as_each_layer_alone(per_node=4):
    cluster = object.__new__(LocalCluster)
    cluster.topology = Topology(num_devices=8, devices_per_node=per_node)
    stack = np.random.default_rng(0).integers(0, 10**6, size=(3, 8, 8))
    np.testing.assert_allclose(cluster.link_seconds(stack), [cluster.link_seconds(t) for t in stack], rtol=1e-12)


@pytest.fixture(scope="module")
def profiled_engine():
    from moectl.engine import sample_model_dir
    from moectl.engine.core.config import EngineConfig
    from moectl.engine.core.sampling import SamplingParams
    from moectl.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(sample_model_dir()), profile_spans=True,
                                    topology=Topology(num_devices=4)))
    engine.generate([[1, 2, 3, 4, 5, 6, 7, 8]] * 4, SamplingParams(max_tokens=2, ignore_eos=True))
    return engine


def test_the_engine_records_link_traffic_and_builds_no_modeled_span(profiled_engine):
    """The engine thread only copies each MoE layer's traffic and all-to-all starts out of its
    arrays; the spans are the readers' to derive."""
    spans = profiled_engine.step_log[-1].as_record()["spans"]
    links = spans[LINKS]
    assert not spans["modeled"].any() and "all_to_all dispatch" not in spans["names"]
    assert links["layer"].tolist() == profiled_engine.experts.cluster.moe_layers
    assert links["traffic"].shape == (len(links["layer"]), 4, 4) and links["s_per_byte"].shape == (4, 4)
    assert (0 < links["dispatch_s"]).all() and (links["dispatch_s"] < links["combine_s"]).all()


def test_a_steps_link_spans_are_each_moe_layers_all_to_all_modeled(profiled_engine):
    """One span per MoE layer, device and direction on the link lanes, flagged modeled; as link
    time is linear in bytes, a device's dispatch spans add up to the step's link time over two."""
    engine = profiled_engine
    record = with_link_spans(engine.step_log[-1].as_record())
    spans, devices = record["spans"], record["devices"]
    assert LINKS not in spans
    names = [spans["names"][i] for i in spans["name"]]
    link_lane = {spans["lanes"].index(f"link {d}"): d for d in range(4)}
    dispatch = [i for i, n in enumerate(names) if n == "all_to_all dispatch"]
    assert dispatch and all(spans["modeled"][i] for i in dispatch)
    assert {int(spans["layer"][i]) for i in dispatch} == set(engine.experts.cluster.moe_layers)
    per_lane: dict[int, float] = {}
    for i in dispatch:
        lane = int(spans["lane"][i])
        assert lane in link_lane
        per_lane[lane] = per_lane.get(lane, 0.0) + float(spans["dur_s"][i])
    link_s = np.asarray(devices["link_s"])
    for lane, total in per_lane.items():
        # (to float rounding: a span keeps its start and end on the engine clock, ~1e5 s)
        assert total == pytest.approx(link_s[link_lane[lane]] / 2, rel=1e-2)
    assert sum(n == "all_to_all combine" for n in names) == len(dispatch)


def test_a_steps_link_record_holds_only_the_layers_that_ran_in_it():
    """The arrays are reused across steps: a layer that did not run this step still holds an
    earlier step's all-to-all, which must not be handed over as this one's."""
    import torch

    from moectl.engine.core.spans import SpanRecorder
    from moectl.engine.experts.placed_experts import StepDeviceStats

    stats = StepDeviceStats(2, torch.device("cpu"), 4)
    stats.tracer = SpanRecorder(2)
    stats.set_links([1, 3], np.ones((2, 2)))
    traffic = np.array([[0, 5], [7, 0]], np.int64)
    stats.tracer.begin_step(10.0)
    stats.note_link(1, 10.1, 10.2, traffic)
    stats.note_link(3, 10.3, 10.4, 2 * traffic)
    first = stats.tracer.collect()[LINKS]
    assert first["layer"].tolist() == [1, 3] and first["traffic"][1].tolist() == (2 * traffic).tolist()
    np.testing.assert_allclose(first["dispatch_s"], [0.1, 0.3])
    np.testing.assert_allclose(first["combine_s"], [0.2, 0.4])
    stats.tracer.begin_step(20.0)
    stats.note_link(3, 20.5, 20.6, traffic)  # layer 1 did not run in this step
    second = stats.tracer.collect()[LINKS]
    assert second["layer"].tolist() == [3] and second["traffic"][0].tolist() == traffic.tolist()
    assert first["traffic"][1].tolist() == (2 * traffic).tolist()  # handed over as a copy
