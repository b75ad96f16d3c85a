"""One even rule from replica shares to device load (Placement.slot_loads): the token planner's
device loads, the trace analysis and the console's per-device experts all derive from it, so they
agree on a placement with replicas (there were four implementations). The step-time prediction
follows the runtime's replica policy instead (placement/replica_policy.py): under round_robin it
is this even rule; under the others it moves rows, never loses any."""

from __future__ import annotations

import numpy as np
import pytest

from moectl.console.state import ConsoleState
from moectl.placement.placement import Placement
from moectl.placement.step_time import device_work
from moectl.profiler import analysis


def _placement() -> Placement:
    # 2 layers, 4 experts, 3 devices x 3 slots; expert 0 three times in layer 0 (twice on device 0)
    return Placement([[[0, 0, 1], [2, 0, -1], [3, -1, -1]],
                      [[1, 2, -1], [3, 0, 1], [2, -1, -1]]], 4)


def test_every_figure_splits_an_expert_evenly_over_its_replicas():
    p = _placement()
    routing = np.array([[30.0, 8.0, 5.0, 7.0], [4.0, 10.0, 6.0, 9.0]])
    expected = np.array([[20 + 8, 5 + 10, 7], [5 + 3, 9 + 4 + 5, 3]])  # by hand
    np.testing.assert_allclose(p.device_loads(routing), expected)
    np.testing.assert_allclose(analysis._device_loads(p, routing), expected)
    shares = p.replica_shares()
    assert shares.shape == (2, 4, 3)
    np.testing.assert_allclose(shares.sum(2), 1.0)  # every expert's load lands somewhere, once
    np.testing.assert_allclose(np.einsum("le,led->ld", routing, shares), expected)
    rows, active = device_work(p, routing[None], [0, 1], "round_robin")  # [step, device, layer]
    np.testing.assert_allclose(rows[0].T, expected)
    # device 0 computes experts 0 and 1 of layer 0; a replica dealt x entries runs with chance min(1, x)
    assert active[0, 0, 0] == pytest.approx(2, abs=1e-6)
    assert active[0, 2, 1] == pytest.approx(1.0)  # its replica of expert 2: 3 entries dealt, it runs
    for policy in ("locality", "least_loaded"):
        rows, _ = device_work(p, routing[None], [0, 1], policy)
        np.testing.assert_allclose(rows[0].sum(0), routing.sum(1))


def test_the_consoles_experts_per_device_follow_the_rule():
    p = _placement()
    header = {"model": {"num_layers": 2, "num_experts": 4},
              "devices": {"placement": p.to_dict(), "topology": {"num_devices": 3}}}
    state = ConsoleState(header, "replay")
    routing = np.array([[30, 8, 5, 7], [4, 10, 6, 9]], dtype=np.int32)
    state.apply([{"step": 0, "t_start": 0.0, "t_end": 1.0, "routing": routing,
                  "batch": {"prefill_tokens": 0, "decode_tokens": 0, "num_seqs": 0, "request_ids": [],
                            "preempted": []}}])
    top = state.top_experts_per_device(top=8)
    per_device = [sum(tokens for _, _, tokens in row) for row in top]
    np.testing.assert_allclose(per_device, p.device_loads(routing).sum(0))
