"""A new card's kernel tables from a PyTorch-profiler (Kineto) trace of a few layers on it: the
seeds' Day-0 step (profile one layer on the new card, predict the cluster), behind `moectl sim
calibrate --from-trace`.

The trace's kernels (its CPU ops on a CPU run) are read with kineto.py's reader and classed by
calibration_classes.json into the simulator's kernel tables (engine/sim/kernel_tables.py). What a
trace cannot give (peaks, memory, links, the all-to-all's tables) comes from a base profile: the
card's datasheet figures. Per layer pass (the trace's time of a class over the passes it covers)
at the trace's tokens per pass:

* GEMMs: the achieved fraction of the peak, the model's multiply-accumulates over the kernels'
  time; the base profile's curve is scaled through that point (the shape of the curve in rows
  is the base's, its height the trace's);
* the prefill attention core the same, on causal attention over the trace's context;
* the kernel floor: the 5th percentile of the small ops' kernel times (the card's launch and tail);
* each small-op class its kernels per pass, a floor each (its shortest kernel's time, at most the
  card's floor: a class whose kernels all ran long at the trace's tokens shows no floor of its
  own) and the rest of its time per token (kernel_tables.SmallOp: exact at the trace's tokens).
Compute that ran beside an all-to-all holding SMs (--comm-sms: DeepEP's normal mode) ran on the
rest of the card: its times above the floors are scaled to the whole card's (times x (1 - comm
SMs / the card's)), so that step_model takes the deployment's own SMs away again.

A training trace (--training) runs the forward's kernels and the backward's: kernels that exist
only in training (classed training_only: weight gradients, backward kernels, their casts and
transposes) are dropped and listed; the classes whose kernels the backward pass runs again under
the forward's names (the GEMMs' data gradients, the gradients' casts, recomputed norms: the
rules file's halved_in_training, with why) count half their time and kernels.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from moectl.engine.sim.kernel_tables import SMALL_OP_CLASSES
from moectl.profiler.kineto import Rules, read_ranks, trace_files

RULES_FILE = "calibration_classes.json"
FLOOR_PERCENTILE = 5


class CalibrationError(ValueError):
    """A trace or an input the calibration cannot use; the message says which and why."""


@dataclass
class TraceShape:
    """What the trace ran: `layers` layer passes of `tokens` tokens each per device, prompts of
    `context` tokens (prefill), `ep` devices sharing the experts (balanced routing)."""
    tokens: int
    context: int
    ep: int
    layers: int | None = None  # None: counted, one attention core kernel per pass
    training: bool = False
    comm_sms: int = 0  # SMs the trace's all-to-all held while its compute ran (DeepEP's normal mode)

    def __post_init__(self):
        for name in ("tokens", "context", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CalibrationError(f"--{name}: must be a positive integer, got {value!r}")
        if isinstance(self.comm_sms, bool) or not isinstance(self.comm_sms, int) or self.comm_sms < 0:
            raise CalibrationError(f"--comm-sms: must be an integer >= 0, got {self.comm_sms!r}")
        if self.layers is not None and (isinstance(self.layers, bool) or not isinstance(self.layers, int)
                                        or self.layers < 1):
            raise CalibrationError(f"--layers: must be a positive integer, got {self.layers!r}")


def class_times(trace: Path, training: bool) -> dict:
    """Per class: summed seconds, kernel count and kernel durations of the trace's first rank;
    the training-only kernels' names and time; what no rule classed."""
    rules = Rules.load(shipped_file=RULES_FILE)
    try:  # one rank's trace is the card's (a folder's first file)
        ranks = read_ranks(trace_files(trace)[:1], rules)
    except OSError as exc:
        raise CalibrationError(f"--from-trace: cannot read {trace} ({exc.strerror or exc})") from None
    if not ranks:
        raise CalibrationError(f"--from-trace: {trace} holds no trace file")
    rank = ranks[0]
    cls = np.array(rank.classes, dtype=object)[rank.name_id] if len(rank.name_id) else np.array([], dtype=object)
    out: dict = {"classes": {}, "training_only": {}, "unclassed_s": 0.0, "source": rank.source}
    for name in set(cls):
        durations = rank.dur[cls == name]
        if name == "training_only":
            for i in np.unique(rank.name_id[cls == name]):
                out["training_only"][rank.names[i][:120]] = float(rank.dur[rank.name_id == i].sum())
            if not training:  # an inference trace with backward kernels: a training trace, say so
                raise CalibrationError(f"--from-trace: {trace} holds training-only kernels "
                                       f"({next(iter(out['training_only']))[:60]}...); pass --training")
            continue
        if name == "unclassed":
            out["unclassed_s"] = float(durations.sum())
            continue
        out["classes"][name] = {"seconds": float(durations.sum()), "kernels": int(len(durations)),
                                "durations": durations}
    return out


def _curve_through(points: list, rows: float, efficiency: float) -> list:
    """The base curve's points scaled so the curve passes through (rows, efficiency), capped at 1."""
    xs = np.log2([x for x, _ in points])
    base = float(np.interp(np.log2(rows), xs, [y for _, y in points]))
    scale = efficiency / base
    return [[x, round(min(1.0, y * scale), 4)] for x, y in points]


def calibrate_from_trace(trace: Path, model, base: dict, shape: TraceShape) -> tuple[dict, dict]:
    """(the profile JSON: `base` with the trace's kernel tables, the per-layer class times it was
    fitted on). `model`: engine.sim.model_shape.SimModel; `base`: a profile's raw JSON."""
    from moectl.engine.sim.hardware import parse_profile

    found = class_times(Path(trace), shape.training)
    classes = found["classes"]
    layers = shape.layers or classes.get("attention_core", {}).get("kernels", 0)
    if not layers:
        raise CalibrationError("--layers: the trace has no attention kernel to count its layer passes by; give "
                               "--layers")
    for needed in ("attention_core", "grouped_gemm", "dense_gemm"):
        if needed not in classes:
            raise CalibrationError(f"--from-trace: {trace} has no {needed.replace('_', ' ')} kernels: not a trace of "
                                   f"a MoE model's layers (calibration_classes.json names what is looked for)")
        if classes[needed]["seconds"] <= 0:
            raise CalibrationError(f"--from-trace: {trace}'s {needed.replace('_', ' ')} kernels take no time")
    profile = parse_profile("base", base)
    halved = set(json.loads(resources.files("moectl.profiler").joinpath(RULES_FILE).read_text())["halved_in_training"]) \
        if shape.training else set()
    device_sms = ((base.get("kernels") or {}).get("comm") or {}).get("device_sms")
    if shape.comm_sms and not device_sms:
        raise CalibrationError("--comm-sms: the base profile gives no kernels.comm.device_sms to scale by")
    # compute that ran beside an all-to-all holding SMs had the rest of them: what the whole card does
    full_card = 1 - shape.comm_sms / device_sms if shape.comm_sms else 1.0
    if full_card <= 0:
        raise CalibrationError(f"--comm-sms: {shape.comm_sms} is not fewer than the card's {device_sms} SMs")
    traced = {name: c["seconds"] / layers * (0.5 if name in halved else 1.0) for name, c in classes.items()}
    per_layer = {name: t * (1.0 if name == "all_to_all" else full_card) for name, t in traced.items()}
    m, T = model, shape.tokens
    sh = m.shape
    peak = profile.peak_tflops(m.gemm_dtype) * 1e12
    bf16 = profile.peak_tflops("fp32" if m.gemm_dtype == "fp32" else "bf16") * 1e12
    rows_per_expert = T * sh.top_k * shape.ep / sh.num_experts
    grouped_eff = 2 * T * sh.top_k * m.expert_macs() / (per_layer["grouped_gemm"] * peak)
    dense_macs = T * (m.attention_projection_macs(1) + m.shared_macs() + m.router_macs())
    dense_eff = 2 * dense_macs / (per_layer["dense_gemm"] * peak)
    macs_prefill, _ = m.attention_core(1, 1, False)
    attention_eff = 2 * T * shape.context / 2 * macs_prefill / (per_layer["attention_core"] * bf16)
    for label, value in (("grouped GEMM", grouped_eff), ("dense GEMM", dense_eff), ("attention", attention_eff)):
        if not 0 < value <= 1:
            raise CalibrationError(f"{label}: the trace's time gives {value:.2f} of the base profile's peak at "
                                   f"--tokens {T} (above 1: --tokens, --context, --layers or --ep do not match the trace)")
    # floors from the kernels that ran: a copy engine's zero-length memset or a duration under the
    # trace's microsecond quantum says nothing about a launch. Not scaled by --comm-sms: a launch
    # and its tail take as long with fewer SMs
    durations = [d[d > 0] for d in (classes[name]["durations"] for name in SMALL_OP_CLASSES if name in classes)]
    durations = [d for d in durations if len(d)]
    card_floor = float(np.percentile(np.concatenate(durations), FLOOR_PERCENTILE)) * 1e6 if durations else 0.0
    small = {}
    for name in SMALL_OP_CLASSES:
        c = classes.get(name)
        ran = c["durations"][c["durations"] > 0] if c is not None else ()
        if c is None or not len(ran):
            continue
        kernels = c["kernels"] / layers * (0.5 if name in halved else 1.0)
        floor_us = min(float(ran.min()) * 1e6, card_floor)
        rest_us = (traced[name] * 1e6 - kernels * floor_us) * full_card
        small[name] = {"kernels": round(kernels, 3), "floor_us": round(floor_us, 3),
                       "us_per_token": round(max(0.0, rest_us) / T, 6)}
        per_layer[name] = (kernels * floor_us + max(0.0, rest_us)) * 1e-6  # on the whole card, as tabled
    notes = [f"{Path(trace).name}: {layers} layer passes of {T} tokens per device, context {shape.context}, EP{shape.ep}"]
    if shape.comm_sms:
        notes.append(f"compute beside an all-to-all on {shape.comm_sms} of {device_sms} SMs (scaled to the whole card)")
    if shape.training:
        notes.append("a training trace (training-only kernels dropped, the classes the backward re-runs halved)")
    where = ", ".join(notes) + "; moectl sim calibrate --from-trace"
    grouped_points = base["efficiency"]["grouped_gemm"]["points"]
    out = copy.deepcopy(base)
    kernels = out.setdefault("kernels", {})
    kernels["grouped_gemm"] = {"by": "rows per expert", "points": _curve_through(grouped_points, rows_per_expert,
                                                                                   grouped_eff),
                               "source": f"{where}: {grouped_eff:.3f} of the {m.gemm_dtype} peak at "
                                         f"{rows_per_expert:,.0f} rows per expert; the curve's shape is the base "
                                         f"profile's efficiency.grouped_gemm"}
    kernels["dense_gemm"] = {"by": "rows", "points": _curve_through(grouped_points, T, dense_eff),
                             "source": f"{where}: the projections, shared expert and router at {dense_eff:.3f} of the "
                                       f"{m.gemm_dtype} peak at {T:,} rows; the curve's shape is the base profile's "
                                       f"grouped GEMM's"}
    kernels["attention_prefill"] = {"compute": round(attention_eff, 4),
                                    "source": f"{where}: causal attention over {shape.context:,} keys"}
    kernels["small_ops"] = {"classes": small, "source": f"{where}: per class, its kernels per layer pass, each "
                                                        f"at least the card's floor (or the class's shortest kernel), "
                                                        f"the rest per token"}
    if card_floor > 0:
        kernels["kernel_floor_us"] = {"value": round(card_floor, 3),
                                      "source": f"{where}: the {FLOOR_PERCENTILE}th percentile of the small ops' "
                                                f"kernel times"}
    fitted = {"layers": layers, "per_layer_us": {k: v * 1e6 for k, v in per_layer.items()},
              "training_only_us": {k: v / layers * 1e6 for k, v in found["training_only"].items()},
              "unclassed_us": found["unclassed_s"] / layers * 1e6}
    return out, fitted


def reproduce(profile, model, shape: TraceShape) -> dict:
    """Per table class, the simulator's time of one layer pass at the trace's shape under
    `profile` (a HardwareProfile), and "small_ops": all small ops as step_model.layer_times
    prices them (before the dispatch on the device's tokens, around the experts on the rows it
    receives): what `calibrate_from_trace`'s tables price back."""
    from moectl.engine.sim.routing import balanced
    from moectl.engine.sim.step_model import SimSpec, layer_times, uniform_load

    sh = model.shape
    spec = SimSpec(model, profile, shape.ep, balanced(sh.num_sparse, sh.num_experts), phase="prefill",
                   tokens_per_device=shape.tokens, context=shape.context, ep=shape.ep)
    times = layer_times(spec, uniform_load(spec))
    core = float(times.attention_core[0])
    out = {"attention_core": core,
           "dense_gemm": float(times.attention[0] - core + times.router[0] + times.shared[0]),
           "grouped_gemm": float(times.layer_expert[0, 0] - times.small_expert[0, 0]),
           "small_ops": float(times.small_moe[0] + times.small_expert[0, 0])}
    for name, op in profile.kernels.small_ops.items():
        out[name] = float(op.seconds(shape.tokens))
    return {k: v * 1e6 for k, v in out.items()}
