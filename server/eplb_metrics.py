"""The expert-load-balance metrics vLLM's and SGLang's dashboards read, exported by /metrics under
their names and types beside moectl's own, from the same record stream (docs/metrics.md names the
sources and commits each was checked against).

* vllm:eplb_balancedness_{min,p50,p90,avg} (Gauges; labels model_name, engine): over the MoE
  layers, each layer's balancedness (mean device load / the busiest device's) in the engine's
  load window: the worst layer, the median, the 10th percentile (the name says p90; its help
  says: 90% of the layers are at least this balanced) and the mean.
* vllm:eplb_rearrangements_total (Counter) and vllm:eplb_rearrangement_seconds (Gauge: the
  most recent one's duration, where it has one), for every change of the placement: rebalances
  (the operator's and automatic), edits that move experts (move, swap, replicate, drop a
  replica) and applied placements; a pin moves none.
* sglang:eplb_balancedness (Summary; labels model_name, engine_type, tp_rank, pp_rank,
  moe_ep_rank, forward_mode): one observation per step that routed tokens to experts, that
  step's balancedness as SGLang computes a forward pass's: per MoE layer (mean + 1e-5) /
  (max + 1e-5) of the devices' loads, averaged over the layers. moectl maps the step's routing
  over the placement in force (replicas share evenly); SGLang counts the physical experts its
  dispatch chose.

A moectl engine is one process with one engine: engine "0", and every rank label "0".
"""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Summary

from moectl.placement.placement import Placement

VLLM_QUANTILES = (("min", None), ("p50", 0.5), ("p90", 0.1), ("avg", None))
SGLANG_EPSILON = 1e-5  # SGLang's, so that an idle layer counts 1
FORWARD_MODES = ("extend", "decode", "mixed")


def forward_mode(batch: dict) -> str:
    """SGLang's ForwardMode name (lower case) for a step: extend, decode or mixed."""
    prefill, decode = batch.get("prefill_tokens") or 0, batch.get("decode_tokens") or 0
    return "mixed" if prefill and decode else "extend" if prefill else "decode"


class EplbMetrics:
    def __init__(self, registry: CollectorRegistry, header: dict, model_name: str):
        vllm_labels = {"model_name": model_name, "engine": "0"}
        self._sglang_labels = {"model_name": model_name, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0",
                               "moe_ep_rank": "0"}
        helps = {"min": "Minimum per-layer EPLB balancedness (worst MoE layer, avg/max token load across EP ranks).",
                 "p50": "Median per-layer EPLB balancedness across MoE layers.",
                 "p90": "10th-percentile EPLB balancedness (90% of MoE layers are at least this balanced).",
                 "avg": "Mean EPLB balancedness across MoE layers."}
        self._gauges = {key: Gauge(f"vllm:eplb_balancedness_{key}", helps[key], list(vllm_labels), registry=registry)
                        for key, _ in VLLM_QUANTILES}
        self._vllm_labels = vllm_labels
        self.rearrangements = Counter("vllm:eplb_rearrangements", "Total number of EPLB expert rearrangements.",
                                      list(vllm_labels), registry=registry).labels(**vllm_labels)
        self.rearrangement_seconds = Gauge("vllm:eplb_rearrangement_seconds", "Duration of the most recent EPLB "
                                           "expert rearrangement in seconds.", list(vllm_labels),
                                           registry=registry).labels(**vllm_labels)
        self._balancedness = Summary("sglang:eplb_balancedness", "Balancedness of MoE in expert parallelism.",
                                     [*self._sglang_labels, "forward_mode"], registry=registry)
        devices = header.get("devices") or {}
        self.placement = Placement.from_dict(devices["placement"]) if devices.get("placement") else None
        if self.placement is not None:  # every series from the start: a scrape's series count stays fixed
            for mode in FORWARD_MODES:
                self._balancedness.labels(**self._sglang_labels, forward_mode=mode)
        model = header.get("model") or {}
        self._sparse = np.asarray(model.get("sparse_layers") or [], dtype=bool)

    def moe_layers(self, per_layer: np.ndarray) -> np.ndarray:
        """The MoE layers' entries of a per-layer array (all of them where the header names none)."""
        if self._sparse.shape == per_layer.shape[:1] and self._sparse.any():
            return per_layer[self._sparse]  # dense layers have no experts to balance
        return per_layer

    def observe_step(self, rec: dict) -> None:
        """A step's balancedness under the placement in force, as SGLang observes a forward pass."""
        routing = rec.get("routing")
        if self.placement is None or routing is None:
            return
        loads = self.moe_layers(np.asarray(self.placement.device_loads(np.asarray(routing)), dtype=np.float64))
        if not loads.size or not loads.any():  # no token reached an expert: no MoE forward pass to observe
            return
        per_layer = (loads.mean(axis=1) + SGLANG_EPSILON) / (loads.max(axis=1) + SGLANG_EPSILON)
        self._balancedness.labels(**self._sglang_labels, forward_mode=forward_mode(rec.get("batch") or {})).observe(
            float(per_layer.mean()))

    def placement_changed(self, placement: dict) -> None:
        self.placement = Placement.from_dict(placement)

    def rearranged(self, seconds: float | None) -> None:
        self.rearrangements.inc()
        if seconds is not None:
            self.rearrangement_seconds.set(seconds)

    def set_window(self, moe: np.ndarray) -> None:
        """The engine's load window's balancedness of each MoE layer (moe_layers)."""
        figures = {"min": moe.min(), "p50": np.quantile(moe, 0.5), "p90": np.quantile(moe, 0.1), "avg": moe.mean()}
        for key, gauge in self._gauges.items():
            gauge.labels(**self._vllm_labels).set(float(figures[key]))
