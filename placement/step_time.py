"""Step time across parallel devices: what a step costs when the devices run at once, and what
it would cost under another placement.

Expert parallelism synchronises at every MoE layer (dispatch, then combine), so a step takes

    other + sum over MoE layers of (the slowest device's expert time in that layer) + link time

where `other` is everything that is not routed-expert compute (attention, router, norms,
sampling, the dispatch and combine bookkeeping). The emulated devices of the local backend run
one after another, so there the serial step is measured and the parallel step is *modeled*
from the same measurements: other = serial wall - the sum of every device's expert time. On
the distributed backend the ranks really run at once and the step is measured: other = wall -
the per-layer critical path.

A prediction for another placement needs each device's expert time under loads it never ran,
so a cost model is calibrated from what the devices did measure: per (device, layer),

    busy = per_expert_s * active experts + per_row_s * (token, choice) rows

fitted by least squares over recent steps (exponentially forgotten), so it follows a machine
whose speed drifts. The calibration error against the measurements is reported with it.
"""

from __future__ import annotations

import numpy as np

from moectl.placement.placement import Placement

CALIBRATION_DECAY = 0.98  # per step: a sample half a minute old at 20 steps/s weighs almost nothing
# The fit moves slowly (its samples decay over ~50 steps): each step's record and error use the
# coefficients refitted at most this many observed steps ago; predictions refit first.
REFIT_EVERY = 8


class ExpertCostModel:
    """busy ~ per_expert_s * active + per_row_s * rows, calibrated from measured (device, layer) samples."""

    def __init__(self, decay: float = CALIBRATION_DECAY):
        self.decay = decay
        self._fixed: np.ndarray | None = None  # coefficients taken from a record (`fixed`), not fitted
        self._gram = np.zeros((2, 2))  # decayed sums of x x^T, x = (active, rows)
        self._xy = np.zeros(2)  # decayed sums of x * busy
        self._abs_err = 0.0  # decayed sum of |predicted - measured| per sample (with the coefficients then)
        self._busy = 0.0  # decayed sum of measured busy
        self.samples = 0
        self._coef: np.ndarray | None = None  # the last fit (refitted every REFIT_EVERY observed steps)
        self._observed_since_fit = 0

    @classmethod
    def fixed(cls, per_expert_s: float, per_row_s: float) -> ExpertCostModel:
        """A model with these coefficients (from a record), not calibrated further."""
        model = cls()
        model._fixed = np.array([per_expert_s, per_row_s], dtype=np.float64)
        model.samples = int(per_expert_s > 0 or per_row_s > 0)
        return model

    def observe(self, rows: np.ndarray, active: np.ndarray, busy: np.ndarray) -> None:
        """One step's per (device, layer) rows computed, distinct experts run and measured seconds."""
        mask = rows > 0
        if not mask.any():
            return
        x = np.stack([active[mask], rows[mask]]).astype(np.float64)
        y = np.asarray(busy, dtype=np.float64)[mask]
        if self.samples:
            self._abs_err = self.decay * self._abs_err + float(np.abs(self.coefficients() @ x - y).sum())
            self._busy = self.decay * self._busy + float(y.sum())
        self._gram = self.decay * self._gram + x @ x.T
        self._xy = self.decay * self._xy + x @ y
        self.samples += int(mask.sum())
        self._observed_since_fit += 1

    def coefficients(self) -> np.ndarray:
        """(per_expert_s, per_row_s), both >= 0 (a per-row or per-expert cost is never negative),
        as last fitted: at most REFIT_EVERY observed steps old (the engine thread's; see predict)."""
        if self._fixed is not None:
            return self._fixed
        if not self.samples:
            return np.zeros(2)
        if self._coef is None or self._observed_since_fit >= REFIT_EVERY:
            self._coef = self._fit()
            self._observed_since_fit = 0
        return self._coef

    def _fit(self) -> np.ndarray:
        gram = self._gram + np.eye(2) * 1e-12 * max(np.trace(self._gram), 1.0)
        coef = np.linalg.solve(gram, self._xy)
        if (coef < 0).any():  # then the one term whose fit alone explains most (largest xy^2 / xx)
            diag = np.diag(gram)
            i = int(np.argmax(self._xy ** 2 / diag))
            coef = np.zeros(2)
            coef[i] = max(self._xy[i] / diag[i], 0.0)
        return coef

    def predict(self, rows: np.ndarray, active: np.ndarray) -> np.ndarray:
        # a fit of every sample so far, not cached: predictions run on operator threads too, and
        # the cache (read by the engine thread's records) is the engine thread's alone
        per_expert, per_row = self._fixed if self._fixed is not None else (self._fit() if self.samples else np.zeros(2))
        return np.where(rows > 0, per_expert * active + per_row * rows, 0.0)

    def summary(self) -> dict:
        per_expert, per_row = self.coefficients()
        return {"per_expert_s": float(per_expert), "per_row_s": float(per_row), "samples": self.samples,
                "relative_error": (self._abs_err / self._busy) if self._busy > 0 else None}


def parallel_step(wall_s: float, busy_layer: np.ndarray, link_s: float, measured_parallel: bool) -> dict:
    """A step's time split, from [D, L] per-device per-layer expert seconds.

    measured_parallel: the devices really ran at once (distributed): wall_s is the parallel step.
    Otherwise (emulated) they ran one after another and the parallel step is modeled."""
    critical = float(busy_layer.max(0).sum()) if busy_layer.size else 0.0
    if measured_parallel:
        other = max(wall_s - critical, 0.0)
        step = wall_s
    else:
        other = max(wall_s - float(busy_layer.sum()), 0.0)
        step = other + critical + link_s
    return {"step_s": step, "other_s": other, "expert_critical_s": critical, "link_s": link_s,
            "modeled": not measured_parallel}


def device_work(placement: Placement, step_loads: np.ndarray, moe_layers: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(rows, active experts) per [step, device, layer] that `placement` gives these per-step
    [S, L, E] routing counts, over the MoE layers only."""
    share = placement.replica_shares()[moe_layers]  # [M, E, D]: the one replica rule
    loads = np.asarray(step_loads, dtype=np.float64)[:, moe_layers]  # [S, M, E]
    rows = np.einsum("sme,med->sdm", loads, share)
    active = np.einsum("sme,med->sdm", (loads > 0).astype(np.float64), (share > 0).astype(np.float64))
    return rows, active


def predict_step_times(model: ExpertCostModel, placement: Placement, step_loads: np.ndarray, moe_layers: list[int],
                       other_s: float, link_s: float, tokens_per_step: float) -> dict:
    """Predicted mean step time and throughput under `placement` for recorded per-step routing.

    other_s and link_s: the mean non-expert and link time of the same steps (kept as measured or
    modeled: a new placement moves expert work, not attention)."""
    if len(step_loads) == 0:
        raise ValueError("predict: no routing observed yet")
    rows, active = device_work(placement, step_loads, moe_layers)
    busy = model.predict(rows, active)  # [S, D, M]
    critical = busy.max(1).sum(1)  # per step
    step_s = other_s + float(critical.mean()) + link_s
    device_busy = busy.sum(2).mean(0)
    return {"step_s": step_s, "throughput_tok_s": tokens_per_step / step_s if step_s > 0 else 0.0,
            "expert_critical_s": float(critical.mean()),
            "utilisation": (device_busy / step_s).tolist() if step_s > 0 else [0.0] * len(device_busy)}


def predict_from_records(records: list[dict], before: Placement, after: Placement) -> dict | None:
    """The preview's prediction (ClusterBase.predict_change) from recorded step records: their
    routing, their step-time split and the cost model's coefficients as the engine had calibrated
    them. None when the records carry no step time (older traces, no devices)."""
    timed = [r for r in records if (r.get("devices") or {}).get("step_time") and r.get("routing") is not None]
    if not timed:
        return None
    last = timed[-1]["devices"]["step_time"]
    coef = last.get("cost_model") or {}
    model = ExpertCostModel.fixed(coef.get("per_expert_s", 0.0), coef.get("per_row_s", 0.0))
    if not model.samples:
        return None
    loads = np.stack([np.asarray(r["routing"], dtype=np.float64) for r in timed])
    moe_layers = [int(i) for i in np.nonzero(loads.sum((0, 2)))[0]]
    splits = [r["devices"]["step_time"] for r in timed]
    other = float(np.mean([s["other_s"] for s in splits]))
    link = 0.0 if not last.get("modeled") else float(np.mean([s["link_s"] for s in splits]))
    tokens = float(np.mean([r["batch"]["prefill_tokens"] + r["batch"]["decode_tokens"] for r in timed]))
    return change(predict_step_times(model, before, loads, moe_layers, other, link, tokens),
                  predict_step_times(model, after, loads, moe_layers, other, link, tokens), coef,
                  "recorded per-expert costs; " + ("modeled" if last.get("modeled") else "measured") + " parallel step")


def change(before: dict, after: dict, calibration: dict, model: str) -> dict:
    """A preview's prediction: two predict_step_times results as before -> after."""
    return {"step_s_before": before["step_s"], "step_s_after": after["step_s"],
            "throughput_before": before["throughput_tok_s"], "throughput_after": after["throughput_tok_s"],
            "gain": before["step_s"] / after["step_s"] - 1 if after["step_s"] > 0 else 0.0,
            "min_util_before": min(before["utilisation"]), "min_util_after": min(after["utilisation"]),
            "calibration": calibration, "model": model}
