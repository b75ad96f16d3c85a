"""The alerts every front end shows: one computation over the recent window, one cadence, one fallback.

The engine process runs it once for all its clients (server/engine_host.py); a console runs it
itself only where no engine process does: replay, and the in-process live baseline.
"""

from __future__ import annotations

import math
import time

from moectl.placement.placement import Placement
from moectl.placement.topology import Topology
from moectl.profiler.analysis import alerts

ALERT_EVERY_S = 2.0  # recomputed this often while steps arrive


def window_alerts(records: list[dict], placement: Placement | None, devices: dict | None) -> list[dict]:
    """profiler.analysis.alerts over `records` under `placement`, for the devices a trace header
    (or ExpertControl.header()) describes. An analysis bug becomes an alert of its own: it must not
    stop the stream nor take a console down."""
    devices = devices or {}
    try:
        topology = Topology.from_mapping(devices["topology"]) if devices.get("topology") else None
        return alerts(records, placement, topology, devices.get("expert_bytes"),
                      devices.get("redundant_slots") or None, devices.get("routing_policy") or "locality")
    except Exception as exc:  # noqa: BLE001 - see the docstring
        return [{"kind": "analysis", "severity": "error", "message": f"alerts failed: {exc}", "action": "-",
                 "predicted": {}}]


class AlertCadence:
    """When the alerts are due: every `every_s` seconds, and only once new steps have arrived."""

    def __init__(self, every_s: float = ALERT_EVERY_S, clock=time.monotonic):
        self.every_s = every_s
        self._clock = clock
        self._at = -math.inf
        self._steps: int | None = None
        self.computed = 0  # times it has said "due"

    def due(self, steps_seen: int) -> bool:
        """True (and the clock restarts) when `every_s` has passed and steps_seen has moved on."""
        now = self._clock()
        if now - self._at < self.every_s or steps_seen == self._steps:
            return False
        self._at, self._steps = now, steps_seen
        self.computed += 1
        return True
