"""The ranks' per-step figures: a gather posted after rank 0's forward and awaited at its step
record (DistributedCluster.collect / end_step). These cover its waits without rank processes."""

from __future__ import annotations

import pytest
import torch

from moectl.engine.parallel.cluster import DistributedCluster
from moectl.engine.parallel.distributed import DistributedError


class _Work:
    def __init__(self, error: Exception | None = None):
        self.error, self.waited = error, 0

    def wait(self):
        self.waited += 1
        if self.error is not None:
            raise self.error


class _Stats:
    def __init__(self):
        self.filled = []

    def fill(self, gathered, world, layers):
        self.filled.append(gathered.copy())


def _cluster(work: _Work, health=None) -> DistributedCluster:
    # only what the wait touches: a whole cluster needs rank processes (tests/engine/parallel/test_distributed.py)
    cluster = DistributedCluster.__new__(DistributedCluster)
    cluster.world, cluster.num_layers, cluster.health = 2, 1, health
    cluster.stats, cluster.telemetry_s = _Stats(), 0.0
    cluster._gather = (work, [torch.full((3,), 1.0), torch.full((3,), 2.0)], torch.zeros(3), 0.25)
    return cluster


def test_the_wait_fills_the_figures_and_counts_posting_and_waiting():
    work = _Work()
    cluster = _cluster(work)
    waited = cluster._await_gather()
    assert work.waited == 1 and cluster._gather is None
    assert cluster.stats.filled[0].tolist() == [[1.0] * 3, [2.0] * 3]
    assert cluster.telemetry_s == pytest.approx(0.25 + waited)
    assert cluster._await_gather() == 0.0  # nothing posted: nothing to wait for


def test_a_gather_left_by_a_failed_step_is_drained_unread():
    work = _Work()
    cluster = _cluster(work)
    cluster._await_gather(use=False)
    assert work.waited == 1 and cluster.stats.filled == [] and cluster.telemetry_s == 0.0


def test_a_rank_lost_at_the_wait_is_named():
    def health(exc=None):
        raise DistributedError(f"distributed: rank 1 exited with code -9 ({exc})")

    cluster = _cluster(_Work(RuntimeError("Connection closed by peer")), health)
    with pytest.raises(DistributedError, match="rank 1 exited"):
        cluster.end_step(0.01)
    assert cluster._gather is None  # not waited on again
    without_health = _cluster(_Work(RuntimeError("Connection closed by peer")))
    with pytest.raises(RuntimeError, match="Connection closed"):
        without_health._await_gather()
