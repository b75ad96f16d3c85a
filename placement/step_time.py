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
so a cost model is calibrated from what the devices did measure: per (device, layer) call,

    busy = per_call_s + per_expert_s * active experts + per_row_s * rows

with each term the grouped GEMM's from `switch_rows` rows a call up and the per-expert loop's
below (the kernel the engine picks: engine/models/moe.py), fitted by non-negative least squares over
recent steps (exponentially forgotten), so it follows a machine whose speed drifts. What routing
a layer with replicas adds (route_call_s + route_entry_s * entries, per layer call) is measured
once, at the first plan, not fitted: it is outside the devices' busy time. Its features
come from the runtime's own replica rule (replica_policy.expected_work), not an even split. The
calibration error against the measurements is reported with it.
"""

from __future__ import annotations

import threading
from collections import deque
from itertools import combinations

import numpy as np

from moectl.placement.placement import Placement
from moectl.placement.replica_policy import expected_work

CALIBRATION_DECAY = 0.98  # per step: a sample half a minute old at 20 steps/s weighs almost nothing
# The fit moves slowly (its samples decay over ~50 steps): each step's record and error use the
# coefficients refitted at most this many observed steps ago; predictions refit first.
REFIT_EVERY = 8
RESIDUAL_STEPS = 64  # steps of residuals kept (a window's worth)
RESIDUAL_QUANTILES = np.linspace(0, 1, 21)  # what a record carries of them: 5% steps
# per call, per active expert and per row, on the grouped kernel and (the _loop terms) on the
# per-expert loop below the switch: the loop pays a matmul launch per expert where the grouped
# GEMM pays one call, so one per-expert term fitted over both misprices each
# per_row_large_s: the grouped kernel's rows beyond LARGE_CALL_ROWS a call, where a GEMM of many
# rows runs at a better rate per row than a decode-sized one (a line through both misprices each)
COEFFICIENTS = ("per_call_s", "per_expert_s", "per_row_s", "per_row_loop_s", "per_call_loop_s", "per_expert_loop_s",
                "per_row_large_s")
KERNEL_PAIRS = ((0, 4), (1, 5), (2, 3))  # (grouped, loop) indices of the same term
LARGE_CALL_ROWS = 64


class ExpertCostModel:
    """busy ~ per_call_s + per_expert_s * active + per_row_s * rows (the _loop terms under the
    kernel switch), calibrated from measured (device, layer) samples.

    switch_rows: the rows of one call from which the grouped GEMM runs; None: the kernel never
    switches (one per-row term, per_row_s)."""

    def __init__(self, decay: float = CALIBRATION_DECAY, switch_rows: int | None = None):
        self.decay = decay
        self.switch_rows = switch_rows
        self._fixed: np.ndarray | None = None  # coefficients taken from a record (`fixed`), not fitted
        n = len(COEFFICIENTS)
        self._gram = np.zeros((n, n))  # decayed sums of x x^T
        self._xy = np.zeros(n)  # decayed sums of x * busy
        self._abs_err = 0.0  # decayed sum of |predicted - measured| per sample (with the coefficients then)
        self._busy = 0.0  # decayed sum of measured busy
        self.samples = 0
        self._coef: np.ndarray | None = None  # the last fit (refitted every REFIT_EVERY observed steps)
        self._observed_since_fit = 0
        # (measured - predicted) / predicted of recent samples, with the coefficients then: the
        # error a prediction carries (decision.py's interval draws from it)
        self._residuals: deque[np.ndarray] = deque(maxlen=RESIDUAL_STEPS)
        self._fixed_residuals: np.ndarray | None = None
        self._quantiles: list[float] = []  # the residuals' quantiles, recomputed with each refit
        # what routing a layer with replicas adds to a step over one without (the compiled replica
        # rule, engine/experts/replica_routing.routing_overhead): measured at the first plan, not fitted; 0 until then
        self.route_call_s = 0.0
        self.route_entry_s = 0.0
        # observe() runs on the engine thread, frozen() and summary() on any: the sums and the fit
        # change together under this lock
        self._lock = threading.Lock()

    @classmethod
    def fixed(cls, per_expert_s: float, per_row_s: float, per_call_s: float = 0.0,
              per_row_loop_s: float | None = None, switch_rows: int | None = None,
              per_call_loop_s: float | None = None, per_expert_loop_s: float | None = None,
              per_row_large_s: float | None = None) -> ExpertCostModel:
        """A model with these coefficients (from a record), not calibrated further; a _loop term
        not given is its grouped kernel's (older records fitted one term for both)."""
        model = cls(switch_rows=switch_rows)
        model._fixed = np.array([per_call_s, per_expert_s, per_row_s,
                                 per_row_s if per_row_loop_s is None else per_row_loop_s,
                                 per_call_s if per_call_loop_s is None else per_call_loop_s,
                                 per_expert_s if per_expert_loop_s is None else per_expert_loop_s,
                                 per_row_s if per_row_large_s is None else per_row_large_s], dtype=np.float64)
        model.samples = int((model._fixed > 0).any())
        return model

    @classmethod
    def from_summary(cls, summary: dict) -> ExpertCostModel:
        """The model a record's "cost_model" (summary()) describes."""
        model = cls.fixed(summary.get("per_expert_s", 0.0), summary.get("per_row_s", 0.0),
                          summary.get("per_call_s", 0.0), summary.get("per_row_loop_s"), summary.get("switch_rows"),
                          summary.get("per_call_loop_s"), summary.get("per_expert_loop_s"), summary.get("per_row_large_s"))
        model.route_call_s = float(summary.get("route_call_s") or 0.0)
        model.route_entry_s = float(summary.get("route_entry_s") or 0.0)
        if summary.get("residuals"):
            model._fixed_residuals = np.asarray(summary["residuals"], dtype=np.float64)
        return model

    def residuals(self) -> np.ndarray:
        """Relative errors of recent predictions ((measured - predicted) / predicted): the samples
        themselves, or from a record the quantiles it carries."""
        if self._fixed_residuals is not None:
            return self._fixed_residuals
        with self._lock:
            return np.concatenate(list(self._residuals)) if self._residuals else np.zeros(0)

    def features(self, rows: np.ndarray, active: np.ndarray) -> np.ndarray:
        """[7, ...], COEFFICIENTS' order: a call, its active experts and its rows up to
        LARGE_CALL_ROWS on the grouped kernel, then rows, a call and active experts on the loop,
        then the grouped kernel's rows beyond LARGE_CALL_ROWS (a continuous line with a knot)."""
        rows = np.asarray(rows, dtype=np.float64)
        called = (rows > 0).astype(np.float64)
        grouped = rows >= self.switch_rows if self.switch_rows is not None else np.ones(rows.shape, bool)
        experts = np.asarray(active, dtype=np.float64) * called
        return np.stack([np.where(grouped, called, 0.0), np.where(grouped, experts, 0.0),
                         np.where(grouped, np.minimum(rows, LARGE_CALL_ROWS), 0.0),
                         np.where(grouped, 0.0, rows), np.where(grouped, 0.0, called), np.where(grouped, 0.0, experts),
                         np.where(grouped, np.maximum(rows - LARGE_CALL_ROWS, 0.0), 0.0)])

    def fixed_part(self, rows: np.ndarray, active: np.ndarray) -> np.ndarray:
        """The per-call and per-expert part of predict(): what a balance of rows does not move."""
        coef = self.coefficients().copy()
        coef[[2, 3, 6]] = 0.0
        return np.tensordot(coef, self.features(rows, active), axes=1)

    def observe(self, rows: np.ndarray, active: np.ndarray, busy: np.ndarray) -> None:
        """One step's per (device, layer) rows computed, distinct experts run and measured seconds."""
        mask = np.asarray(rows) > 0
        if not mask.any():
            return
        x = self.features(np.asarray(rows)[mask], np.asarray(active)[mask])
        y = np.asarray(busy, dtype=np.float64)[mask]
        with self._lock:
            if self.samples:
                predicted = self._current() @ x
                self._abs_err = self.decay * self._abs_err + float(np.abs(predicted - y).sum())
                self._busy = self.decay * self._busy + float(y.sum())
                ok = predicted > 0
                self._residuals.append((y[ok] - predicted[ok]) / predicted[ok])
            self._gram = self.decay * self._gram + x @ x.T
            self._xy = self.decay * self._xy + x @ y
            self.samples += int(mask.sum())
            self._observed_since_fit += 1

    def coefficients(self) -> np.ndarray:
        """COEFFICIENTS' values, all >= 0 (no cost is negative), as last fitted: at most
        REFIT_EVERY observed steps old."""
        if self._fixed is not None:
            return self._fixed
        with self._lock:
            return self._current()

    def _current(self) -> np.ndarray:
        """The fit in force, refitted when REFIT_EVERY steps were observed since (under the lock)."""
        if not self.samples:
            return np.zeros(len(COEFFICIENTS))
        if self._coef is None or self._observed_since_fit >= REFIT_EVERY:
            self._coef = self._fit()
            self._observed_since_fit = 0
            residuals = np.concatenate(list(self._residuals)) if self._residuals else np.zeros(0)
            self._quantiles = np.quantile(residuals, RESIDUAL_QUANTILES).tolist() if residuals.size else []
        return self._coef

    def frozen(self) -> ExpertCostModel:
        """A copy with today's coefficients and residuals, not calibrated further: what one plan
        is priced with, so every placement it compares is priced alike while the engine observes on."""
        per_call, per_expert, per_row, per_row_loop, per_call_loop, per_expert_loop, per_row_large = \
            self.coefficients()
        model = ExpertCostModel.fixed(per_expert, per_row, per_call, per_row_loop, self.switch_rows, per_call_loop,
                                      per_expert_loop, per_row_large)
        model._fixed_residuals = self.residuals()
        model.route_call_s, model.route_entry_s = self.route_call_s, self.route_entry_s
        return model

    def _fit(self) -> np.ndarray:
        """Non-negative least squares on the decayed normal equations: the best of the least-squares
        fits over every subset of the terms whose coefficients all come out non-negative (127
        subsets of 7 terms: exact, where an active-set method iterates)."""
        n = len(COEFFICIENTS)
        gram = self._gram + np.eye(n) * 1e-12 * max(np.trace(self._gram), 1e-30)
        best, best_loss = np.zeros(n), 0.0  # all zero: loss 0 relative to sum y^2
        for size in range(1, n + 1):
            for subset in combinations(range(n), size):
                idx = list(subset)
                if not np.diag(self._gram)[idx].all():
                    continue  # a term never seen (no loop-kernel calls, say) stays 0
                coef = np.linalg.solve(gram[np.ix_(idx, idx)], self._xy[idx])
                if (coef < 0).any():
                    continue
                loss = float(coef @ gram[np.ix_(idx, idx)] @ coef - 2 * coef @ self._xy[idx])
                if loss < best_loss:
                    best, best_loss = np.zeros(n), loss
                    best[idx] = coef
        # a kernel never run (only decode-sized calls so far, say) is priced as the other one
        seen = np.diag(self._gram) > 0
        for grouped, loop in KERNEL_PAIRS:
            if not seen[grouped] and seen[loop]:
                best[grouped] = best[loop]
            elif not seen[loop] and seen[grouped]:
                best[loop] = best[grouped]
        if not seen[6]:  # no call beyond the knot yet: its rows at the rate below it
            best[6] = best[2]
        return best

    def predict(self, rows: np.ndarray, active: np.ndarray) -> np.ndarray:
        return np.tensordot(self.coefficients(), self.features(rows, active), axes=1)

    def routing_s(self, entries: np.ndarray) -> np.ndarray:
        """Seconds replica routing adds to a layer call with replicas, for its entries (every
        rank routes the whole batch of the layer, so it is on the critical path)."""
        return self.route_call_s + self.route_entry_s * np.asarray(entries, dtype=np.float64)

    def summary(self) -> dict:
        coef = self.coefficients()
        if self._fixed_residuals is not None:
            quantiles = np.quantile(self._fixed_residuals, RESIDUAL_QUANTILES).tolist() if self._fixed_residuals.size \
                else []
        else:
            quantiles = self._quantiles  # recomputed with the fit, not every step
        return {**{name: float(v) for name, v in zip(COEFFICIENTS, coef)}, "switch_rows": self.switch_rows,
                "samples": self.samples, "residuals": quantiles,
                "route_call_s": self.route_call_s, "route_entry_s": self.route_entry_s,
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


def device_work(placement: Placement, step_loads: np.ndarray, moe_layers: list[int],
                policy: str = "locality") -> tuple[np.ndarray, np.ndarray]:
    """(rows, active experts) per [step, device, layer] that `placement` gives these per-step
    [S, L, E] routing counts under the runtime's replica rule, over the MoE layers only."""
    rows, active, _ = expected_work(placement, step_loads, moe_layers, policy)
    return rows, active


def predict_step_times(model: ExpertCostModel, placement: Placement, step_loads: np.ndarray, moe_layers: list[int],
                       other_s: float, link_s: float, tokens_per_step: float, policy: str = "locality",
                       link_basis: Placement | None = None) -> dict:
    """Predicted mean step time and throughput under `placement` for recorded per-step routing.

    other_s: the mean time no placement changes (attention, sampler, the rest), kept as measured.
    link_s: the mean link time of the same steps under `link_basis` (the placement they ran
    under; None: `placement`), scaled by the entries the busiest device's links carry under each."""
    if len(step_loads) == 0:
        raise ValueError("predict: no routing observed yet")
    rows, active, remote = expected_work(placement, step_loads, moe_layers, policy)
    if link_basis is not None and link_basis is not placement and link_s > 0:
        _, _, basis_remote = expected_work(link_basis, step_loads, moe_layers, policy)
        link_s *= float(remote.sum() / basis_remote.sum()) if basis_remote.sum() > 0 else 1.0
    busy = model.predict(rows, active)  # [S, D, M]
    critical = busy.max(1).sum(1)  # per step
    replicated = [layer for layer in moe_layers if (placement._counts[layer] > 1).any()]
    routing = float(model.routing_s(np.asarray(step_loads)[:, replicated].sum(2)).sum(1).mean()) if replicated else 0.0
    step_s = other_s + float(critical.mean()) + link_s + routing
    device_busy = busy.sum(2).mean(0)
    return {"step_s": step_s, "throughput_tok_s": tokens_per_step / step_s if step_s > 0 else 0.0,
            "expert_critical_s": float(critical.mean()), "link_s": link_s,
            "utilisation": (device_busy / step_s).tolist() if step_s > 0 else [0.0] * len(device_busy)}
