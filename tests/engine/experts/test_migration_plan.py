"""One migration plan (Placement.migration): what a rebalance preview counts is what an apply
copies, on emulated devices and on distributed ranks. Emulated devices once counted a slot
re-filled from the same device as moved bytes while the preview counted it as free, and each
backend derived its moves its own way."""

from __future__ import annotations

import numpy as np
import pytest

from moectl.engine.core.config import EngineConfig
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.parallel.backends import Engines
from moectl.engine.parallel.rank_experts import migration_plan
from moectl.placement.placement import MIGRATION_FIELDS, Placement
from moectl.placement.topology import Topology
from tests.checkpoints import prompts, tiny_checkpoint


def test_the_plan_names_every_copy_and_whether_it_crosses_a_link():
    a = Placement([[[0, 1, -1], [2, 3, -1]]], 4)
    b = Placement([[[1, 0, 2], [3, 2, -1]]], 4)  # device 0 swaps 0 and 1 and gains 2; device 1 swaps
    plan = a.migration(b)
    rows = [dict(zip(MIGRATION_FIELDS, r)) for r in plan.tolist()]
    assert [(r["dst_device"], r["dst_slot"], r["expert"], r["over_link"]) for r in rows] == [
        (0, 0, 1, 0), (0, 1, 0, 0), (0, 2, 2, 1), (1, 0, 3, 0), (1, 1, 2, 0)]
    assert [(r["src_device"], r["src_slot"]) for r in rows] == [(0, 1), (0, 0), (1, 0), (1, 1), (1, 0)]
    assert a.bytes_to(b, 10) == 10 and a.local_copies(b) == 4
    assert a.move_array(b).tolist() == [[0, 2, 1, 0, 2]]  # the link copies, as Move fields
    # the ranks' plan is the same rows
    assert migration_plan(a, b, [0]) == [(0, 0, 0, 0, 1), (0, 0, 1, 0, 0), (0, 0, 2, 1, 0), (0, 1, 0, 1, 1),
                                         (0, 1, 1, 1, 0)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("migration"))


def _shuffled(placement: Placement) -> Placement:
    """Every layer's devices keep their experts, in other slots, and one expert moves across."""
    slots = placement.slots.copy()
    slots[:, :, :-1] = slots[:, :, -2::-1]  # reversed within each device (the spare slot kept)
    slots[:, 0, -1] = slots[:, 1, 0]  # device 0's spare slot: a replica of one of device 1's experts
    return Placement(slots, placement.num_experts)


@pytest.mark.parametrize("backend", ["local", "distributed"])
def test_what_a_preview_counts_is_what_the_apply_copies(ckpt, backend, single_thread):
    config = EngineConfig(model=str(ckpt), topology=Topology(num_devices=2), redundant_slots=1, num_threads=1)
    engines = Engines(config, backend)
    try:
        engine = engines.make_engine()
        engine.generate(prompts(4), SamplingParams(max_tokens=8))
        experts = engine.experts
        for target in (experts.preview().placement, _shuffled(experts.placement)):
            before = experts.placement
            link, local = before.bytes_to(target, 1), before.local_copies(target)
            assert link + local > 0
            future = experts.apply(target, kind="rebalance_apply")
            engine.generate(prompts(1), SamplingParams(max_tokens=2))  # the copy runs between steps
            result = future.result(timeout=60)
            size = experts.cluster.expert_bytes
            assert (result["bytes_moved"], result["bytes_local"]) == (link * size, local * size)
            if backend == "distributed":  # measured on the ranks: the bytes that crossed between them
                migration = result["migration"]
                assert migration["bytes_transferred"] == link * size
                assert sum(r["bytes_local"] for r in migration["per_rank"]) == local * size
            assert experts.placement == target
        assert np.array_equal(experts.placement.slots, target.slots)
    finally:
        engines.close()
