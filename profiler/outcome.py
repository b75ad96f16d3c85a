"""What an apply did, on the preview's basis: the steps on either side of it that ran the same
population (batch shape and context), their throughput and the parts of their step, with
intervals, beside the preview's own prediction.

A step's timing (`step_timing`) is its population key, its parallel step seconds and the parts
the prediction names: the experts' critical path, routing and dispatch (the engine's "dispatch"
spans: replica choice, sort, gather), link time, and the rest (attention, sampler, scheduling).
Each shared key counts min(n_before, n_after) steps on both sides at each side's mean, so both
figures cover the same tokens and a change of traffic across the apply is not read as the
placement's doing. The interval is a bootstrap over the steps within each key. The prediction it
is held against is the preview's own, on the same population (`predicted_on`: the preview's
per-step predictions of its window's steps in those keys). The outcome is "resolved" once the
measured gain's interval tells the prediction right or wrong: its half-width at most max(1 point,
20% of the predicted gain), or the prediction outside it by more than that.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

PARTS = ("expert_critical_s", "dispatch_s", "link_s", "rest_s")
PART_LABELS = {"expert_critical_s": "experts' critical path", "dispatch_s": "routing and dispatch",
               "link_s": "link", "rest_s": "the rest"}
ROUNDS = 200
INTERVAL = (0.05, 0.95)


@dataclass(frozen=True)
class StepTiming:
    key: tuple  # (prompt tokens, decode tokens, context bin): the population a step belongs to
    tokens: int
    step_s: float
    modeled: bool
    parts: dict  # PARTS -> seconds (None where the record lacks it)
    t_start: float


def step_timing(record: dict) -> StepTiming | None:
    """A step record's timing; None without a step time (no devices, or an older record)."""
    step_time = (record.get("devices") or {}).get("step_time")
    if not step_time or step_time["step_s"] <= 0:
        return None
    batch = record["batch"]
    used = (record.get("cache") or {}).get("kv_blocks_used") or 0
    context_bin = int(math.log2(used + 1))  # the KV in use, in powers of two: attention's cost follows it
    critical = step_time.get("expert_critical_s")
    link = step_time.get("link_s")
    dispatch = _span_seconds(record.get("spans"), "dispatch")
    step_s = float(step_time["step_s"])
    known = [v for v in (critical, link, dispatch) if v is not None]
    rest = step_s - sum(known) if critical is not None else None
    return StepTiming((batch["prefill_tokens"], batch["decode_tokens"], context_bin),
                      batch["prefill_tokens"] + batch["decode_tokens"], step_s, bool(step_time.get("modeled")),
                      {"expert_critical_s": critical, "dispatch_s": dispatch, "link_s": link, "rest_s": rest},
                      record["t_start"])


def _span_seconds(spans, name: str) -> float | None:
    if not spans or name not in spans.get("names", ()):
        return None
    index = spans["names"].index(name)
    return float(np.asarray(spans["dur_s"])[np.asarray(spans["name"]) == index].sum())


def matched_outcome(before: list[StepTiming], after: list[StepTiming], predicted: dict | None = None,
                    seed: int = 0) -> dict | None:
    """Throughput before and after over the population both sides ran, the gain with its 90%
    interval, each part's seconds per step before and after with the interval of its change,
    the gain with only the experts' critical path taken from after ("gain_experts_only": a drift
    of the rest across the apply left out), and whether the gain is resolved against `predicted`
    (the preview's own). None when no population is shared."""
    b, a = _by_key(before), _by_key(after)
    shared = sorted((key, min(len(b[key]), len(a[key]))) for key in b.keys() & a.keys() if key[0] + key[1])
    if not shared:
        return None
    rng = np.random.default_rng(seed)
    weights = np.array([n for _, n in shared], dtype=np.float64)
    n_steps = float(weights.sum())
    tokens = sum((key[0] + key[1]) * n for key, n in shared)

    def means(side: dict, field) -> tuple[np.ndarray, np.ndarray]:
        """Per shared key: the mean, and ROUNDS bootstrap means ([K], [K, ROUNDS])."""
        point, boot = [], []
        for key, _ in shared:
            values = np.array([field(t) for t in side[key]], dtype=np.float64)
            point.append(values.mean())
            boot.append(values[rng.integers(0, values.size, (ROUNDS, values.size))].mean(1))
        return np.array(point), np.array(boot)

    step_b, boot_b = means(b, lambda t: t.step_s)
    step_a, boot_a = means(a, lambda t: t.step_s)
    seconds_b, seconds_a = float(weights @ step_b), float(weights @ step_a)
    gain = seconds_b / seconds_a - 1
    rounds = (weights @ boot_b) / (weights @ boot_a) - 1
    low, mid, high = np.quantile(rounds, (INTERVAL[0], 0.5, INTERVAL[1]))
    low, high = gain - (mid - low), gain + (high - mid)
    parts = {}
    for part in PARTS:
        if any(t.parts[part] is None for key, _ in shared for t in (*b[key], *a[key])):
            continue
        pb, qb = means(b, lambda t, part=part: t.parts[part])
        pa, qa = means(a, lambda t, part=part: t.parts[part])
        change = float(weights @ (pa - pb)) / n_steps
        spread = (weights @ (qa - qb)) / n_steps
        c_low, c_mid, c_high = np.quantile(spread, (INTERVAL[0], 0.5, INTERVAL[1]))
        parts[part] = {"before_s": float(weights @ pb) / n_steps, "after_s": float(weights @ pa) / n_steps,
                       "change_s": change, "change_low_s": float(change - (c_mid - c_low)),
                       "change_high_s": float(change + (c_high - c_mid))}
    critical = parts.get("expert_critical_s")
    experts_only = (None if critical is None
                    else seconds_b / (seconds_b + critical["change_s"] * n_steps) - 1)
    on_population = predicted_on(shared, before, predicted)
    expected = on_population[0] if on_population else predicted.get("gain") if predicted else None
    target = max(0.01, 0.2 * abs(expected)) if expected is not None else 0.01
    # resolved: precise enough to confirm the prediction, or clear of it (wrong by more than the bar)
    clear_of = expected is not None and (expected < low - target or expected > high + target)
    return {"before": tokens / seconds_b, "after": tokens / seconds_a, "gain": gain, "gain_low": float(low),
            "gain_high": float(high), "gain_experts_only": experts_only,
            "resolved": bool((high - low) / 2 <= target or clear_of), "resolution_needed": target,
            "modeled": before[0].modeled, "steps": int(n_steps), "shapes": len(shared), "parts": parts,
            "predicted_gain": expected, "predicted_steps": on_population[1] if on_population else None}


def predicted_on(shared: list[tuple[tuple, int]], before: list[StepTiming], predicted: dict | None
                 ) -> tuple[float, int] | None:
    """The preview's own prediction on the population the outcome compares: its per-step
    predictions (prediction "per_step", named by t_start) of the window steps that fall in each
    shared (batch shape, context) key, weighted as the outcome weighs the keys. A window mixes
    prefill and decode steps whose gains differ several-fold, and the steps both sides of an apply
    ran are rarely the window's mix. None without per-step predictions or a key they cover;
    else (gain, the outcome's steps it covers)."""
    per_step = (predicted or {}).get("per_step")
    if not per_step:
        return None
    key_of = {t.t_start: t.key for t in before}
    sums: dict[tuple, list[float]] = {}
    for t0, step_b, step_a in zip(per_step["t_start"], per_step["before_s"], per_step["after_s"]):
        key = key_of.get(t0)
        if key is not None:
            acc = sums.setdefault(key, [0.0, 0.0, 0])
            acc[0], acc[1], acc[2] = acc[0] + step_b, acc[1] + step_a, acc[2] + 1
    covered = [(sums[key], n) for key, n in shared if key in sums]
    if not covered:
        return None
    seconds_b = sum(n * acc[0] / acc[2] for acc, n in covered)
    seconds_a = sum(n * acc[1] / acc[2] for acc, n in covered)
    return seconds_b / seconds_a - 1, int(sum(n for _, n in covered))


def _by_key(timings: list[StepTiming]) -> dict[tuple, list[StepTiming]]:
    out: dict[tuple, list[StepTiming]] = {}
    for t in timings:
        out.setdefault(t.key, []).append(t)
    return out


def population(timings: list[StepTiming]) -> Counter:
    """Steps per population key."""
    return Counter(t.key for t in timings)
