"""Expert loads for a simulated step: for each MoE layer, the fraction of its (token, choice)
pairs that each routed expert takes.

* balanced: every expert the same share;
* zipf:S: shares proportional to 1 / rank**S, the ranks shuffled per layer (seeded), so each
  layer has its own hot experts;
* sample: the routing moectl's engine recorded on the shipped sample-dsv3 model
  (recorded/sample-dsv3.json, from sample_traces/dsv3_ranks_rebalance.trace), scaled as a trace is;
* a moectl trace (recorded, or imported from SGLang / vLLM with `moectl trace import`): its
  routing summed over the steps. A trace of another model is scaled to this one: each recorded
  layer's loads, sorted, give a share-by-rank curve; the curve's cumulative share is resampled at
  this model's expert count (linear in the normalised rank), handed to the experts in a seeded
  shuffle, and the recorded layers are reused in turn when this model has more. The skew (the
  hottest experts' share of the layer) is kept; which expert is hot is not.
"""

from __future__ import annotations

import numpy as np

ROUTINGS = "balanced | zipf:S | sample | TRACE"
SHIPPED = "sample"  # recorded/sample-dsv3.json


def shipped_recording() -> tuple[np.ndarray, str]:
    """The shipped recording's [MoE layers, experts] counts and where they came from."""
    import json
    from importlib import resources

    raw = json.loads(resources.files("moectl.engine.sim").joinpath("recorded", "sample-dsv3.json").read_text())
    return np.array(raw["counts"], dtype=np.float64), raw["source"].split(":")[0]


def balanced(num_layers: int, num_experts: int) -> np.ndarray:
    return np.full((num_layers, num_experts), 1.0 / num_experts)


def zipf(num_layers: int, num_experts: int, skew: float, seed: int = 0) -> np.ndarray:
    if not 0 <= skew <= 4:
        raise ValueError(f"--routing: zipf skew must be in [0, 4], got {skew:g}")
    rng = np.random.default_rng(seed)
    shares = 1.0 / np.arange(1, num_experts + 1) ** skew
    shares /= shares.sum()
    return np.stack([rng.permutation(shares) for _ in range(num_layers)])


def scaled(recorded: np.ndarray, num_layers: int, num_experts: int, seed: int = 0) -> np.ndarray:
    """[recorded layers, recorded experts] token counts -> [num_layers, num_experts] shares, by
    resampling each layer's sorted share curve (see the module's docstring)."""
    rng = np.random.default_rng(seed)
    layers = recorded[recorded.sum(1) > 0].astype(np.float64)
    if not len(layers):
        raise ValueError("--routing: the trace routed no tokens")
    out = np.empty((num_layers, num_experts))
    for i in range(num_layers):
        loads = np.sort(layers[i % len(layers)])[::-1]
        if len(loads) == num_experts and num_layers == len(layers):
            out[i] = layers[i] / layers[i].sum()  # the same model's routing, as recorded
            continue
        cumulative = np.concatenate([[0.0], np.cumsum(loads) / loads.sum()])
        ranks = np.linspace(0.0, 1.0, len(cumulative))
        at = np.interp(np.linspace(0.0, 1.0, num_experts + 1), ranks, cumulative)
        out[i] = rng.permutation(np.diff(at))
    return out


def routing_from(spec: str, num_layers: int, num_experts: int, seed: int = 0,
                 recorded: np.ndarray | None = None) -> tuple[np.ndarray, str]:
    """--routing -> ([MoE layers, experts] shares, a line saying where they came from). For a
    trace, the caller reads it (the profiler's reader) and passes its summed routing as
    `recorded` ([layers, experts] token counts; dense layers are rows of zeros)."""
    if spec == "balanced":
        return balanced(num_layers, num_experts), "balanced (every expert the same share)"
    if spec.startswith("zipf:"):
        try:
            skew = float(spec[5:])
        except ValueError:
            raise ValueError(f"--routing: {spec!r} is not zipf:S with a number S") from None
        return zipf(num_layers, num_experts, skew, seed), f"Zipf, skew {skew:g} (synthetic)"
    if spec == SHIPPED:
        recorded, where = shipped_recording()
        shares = scaled(recorded, num_layers, num_experts, seed)
        return shares, (f"recorded by moectl on sample-dsv3 ({where}, {recorded.shape[0]} MoE layers x "
                        f"{recorded.shape[1]} experts), scaled to {num_layers} x {num_experts} by its share-by-rank "
                        f"curves")
    if recorded is None:
        raise ValueError(f"--routing: {spec!r} is not {ROUTINGS}")
    moe = recorded[recorded.sum(1) > 0]
    line = f"recorded in {spec}" if moe.shape == (num_layers, num_experts) else (
        f"recorded in {spec} ({moe.shape[0]} MoE layers x {moe.shape[1]} experts), scaled to {num_layers} x "
        f"{num_experts} by its share-by-rank curves")
    return scaled(recorded, num_layers, num_experts, seed), line
