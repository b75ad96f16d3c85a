"""The modeled link time of an all-to-all: every off-diagonal transfer over its link, both ends."""

from __future__ import annotations

import numpy as np
import pytest

from moectl.engine.core.topology import Topology
from moectl.engine.experts.cluster import LocalCluster


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
