"""Hardware profiles: one JSON file per device type (profiles/NAME.json), each figure with the
source it was taken from, read into a validated `HardwareProfile`.

A figure is {"value": number, "source": text}; null where no source gives it (the simulator then
refuses what needs it, naming the figure, rather than guess). Efficiency figures are achieved
fractions of a peak, from public kernel benchmarks; a source that begins "assumed" borrows another
device's, and the profile lists those in `assumed`. Constants belong to a profile and are never
fitted per prediction.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from moectl.engine.sim.kernel_tables import KernelTables, TableError, parse_tables


class ProfileError(ValueError):
    """A hardware profile that cannot be read or lacks a figure; the message names it."""


def profile_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("moectl.engine.sim").joinpath("profiles").iterdir()
                  if p.name.endswith(".json"))


@dataclass(frozen=True)
class Curve:
    """An efficiency by a size (rows per expert, bytes, ...): linear in log2(size) between the
    points, flat beyond the ends."""
    points: tuple[tuple[float, float], ...]

    def __post_init__(self):
        if not self.points or any(x <= 0 or not 0 < y <= 1 for x, y in self.points):
            raise ProfileError(f"efficiency points: need (size > 0, fraction in (0, 1]) pairs, got {self.points!r}")
        if [x for x, _ in self.points] != sorted({x for x, _ in self.points}):
            raise ProfileError(f"efficiency points: sizes must increase, got {[x for x, _ in self.points]}")

    def at_many(self, sizes: np.ndarray) -> np.ndarray:
        """The efficiency at each size (sizes <= 0 give the first point's value)."""
        xs = np.log2([x for x, _ in self.points])
        ys = np.array([y for _, y in self.points])
        return np.interp(np.log2(np.maximum(sizes, 1e-12)), xs, ys)

    def at(self, size: float) -> float:
        return float(self.at_many(np.asarray(size, dtype=np.float64)))


@dataclass(frozen=True)
class HardwareProfile:
    key: str
    name: str
    bf16_tflops: float
    fp8_tflops: float | None
    hbm_bytes: int
    hbm_gbps: float | None
    gpus_per_node: int
    intra_node_gbps: float | None
    inter_node_gbps: float | None
    grouped_gemm: Curve  # achieved fraction of the GEMM dtype's peak, by rows per expert
    memory_bound_gemm: float  # achieved fraction of HBM bandwidth streaming weights at few rows
    attention_bandwidth: float  # decode attention's achieved fraction of HBM bandwidth
    attention_compute: float  # ... and of the BF16 peak, when compute-bound
    a2a_intra_node: float  # all-to-all's achieved fraction of the intra-node link
    a2a_inter_node: float  # ... and of the inter-node NIC
    a2a_latency_us: float  # per all-to-all, beyond its bytes over the bandwidth
    notes: str = ""
    fp32_tflops: float | None = None  # CPU profiles (`moectl sim calibrate`): the engine there runs fp32
    # per layer, beyond its kernels' work: launches, Python, small ops (calibrated profiles measure it;
    # the GPU profiles have no sourced figure: 0, not modeled)
    layer_overhead_us: float = 0.0
    sequence_overhead_us: float = 0.0  # per sequence sampled in a step: scheduler, sampler, bookkeeping
    prompt_token_overhead_us: float = 0.0  # per prompt token: a CPU prefill path's costs beyond its kernels
    # per layer, what running a step as two micro-batches adds beyond their kernels (the second pass's
    # launches and Python; calibrated profiles measure it on the ranks' two-batch overlap; 0 elsewhere)
    micro_batch_overhead_us: float = 0.0
    sources: dict[str, str] = field(default_factory=dict)
    assumed: tuple[str, ...] = ()  # figures borrowed from another device
    # kernel cost tables (kernel_tables.py): priced in place of the roofline where given; None:
    # the roofline alone, which the simulator's output labels
    kernels: KernelTables | None = None

    def peak_tflops(self, dtype: str) -> float:
        """The GEMM peak for `dtype` (fp8 falls back to bf16 on devices without FP8)."""
        if dtype == "fp8" and self.fp8_tflops:
            return self.fp8_tflops
        if dtype == "fp32":
            return self.need("fp32_tflops")
        return self.bf16_tflops

    def need(self, figure: str) -> float:
        """A figure the prediction needs; ProfileError naming it when the profile has none."""
        value = getattr(self, figure)
        if value is None:
            raise ProfileError(f"hardware {self.key}: {figure} has no sourced figure in its profile; give one in a "
                               f"copy of it (--hardware FILE)")
        return value


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A shipped profile by name (`profile_names()`) or a JSON file of the same form."""
    key, raw = _read(name_or_path)
    return _parse(key, raw)


def raw_profile(name_or_path: str | Path) -> dict:
    """A profile's JSON as written (checked: it parses as a profile)."""
    key, raw = _read(name_or_path)
    _parse(key, raw)
    return raw


def parse_profile(key: str, raw: dict) -> HardwareProfile:
    """A profile from its JSON as written (what load_profile reads from a file)."""
    return _parse(key, raw)


def _read(name_or_path: str | Path) -> tuple[str, dict]:
    text = str(name_or_path)
    if text.lower() in profile_names():
        key = text.lower()
        raw_text = resources.files("moectl.engine.sim").joinpath("profiles", f"{key}.json").read_text()
    else:
        path = Path(text)
        if not path.is_file():
            raise ProfileError(f"--hardware: {text!r} is neither a shipped profile ({', '.join(profile_names())}) "
                               f"nor a file")
        key = path.stem
        try:
            raw_text = path.read_text()
        except OSError as exc:
            raise ProfileError(f"--hardware: cannot read {path} ({exc.strerror})") from None
    try:
        raw = json.loads(raw_text)
    except ValueError as exc:
        raise ProfileError(f"hardware {key}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ProfileError(f"hardware {key}: top level must be an object")
    return key, raw


def _parse(key: str, raw: dict) -> HardwareProfile:
    sources: dict[str, str] = {}

    def figure(path: str, optional: bool = False, integer: bool = False):
        node = raw
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            if optional:
                return None
            raise ProfileError(f"hardware {key}: {path} is missing")
        if not isinstance(node, dict) or "value" not in node or not str(node.get("source") or "").strip():
            raise ProfileError(f"hardware {key}: {path} must be {{\"value\": number, \"source\": text}}")
        value = node["value"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 \
                or (integer and int(value) != value):
            raise ProfileError(f"hardware {key}: {path} must be a positive {'integer' if integer else 'number'}, "
                               f"got {value!r}")
        sources[path] = node["source"]
        return int(value) if integer else float(value)

    def efficiency(name: str) -> dict:
        node = (raw.get("efficiency") or {}).get(name)
        if not isinstance(node, dict) or not str(node.get("source") or "").strip():
            raise ProfileError(f"hardware {key}: efficiency.{name} is missing or has no source")
        sources[f"efficiency.{name}"] = node["source"]
        return node

    def fraction(node: dict, name: str, field_name: str) -> float:
        value = node.get(field_name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ProfileError(f"hardware {key}: efficiency.{name}.{field_name} must be a fraction in (0, 1], "
                               f"got {value!r}")
        return float(value)

    def curve_of(node: dict, name: str) -> Curve:
        try:
            return Curve(tuple((float(x), float(y)) for x, y in node.get("points") or ()))
        except (TypeError, ValueError) as exc:
            raise ProfileError(f"hardware {key}: {name}.points: {exc}") from None

    curve = curve_of(efficiency("grouped_gemm"), "efficiency.grouped_gemm")
    try:
        tables = parse_tables(key, raw["kernels"], figure, curve_of, figure("gpus_per_node", integer=True),
                              sources) if "kernels" in raw else None
    except TableError as exc:
        raise ProfileError(str(exc)) from None
    bound, attention, a2a = efficiency("memory_bound_gemm"), efficiency("attention_decode"), efficiency("all_to_all")
    latency = a2a.get("latency_us")
    if isinstance(latency, bool) or not isinstance(latency, (int, float)) or latency < 0:
        raise ProfileError(f"hardware {key}: efficiency.all_to_all.latency_us must be a number >= 0, got {latency!r}")
    profile = HardwareProfile(
        key=key, name=str(raw.get("name") or key), notes=str(raw.get("notes") or ""),
        bf16_tflops=figure("peak_tflops.bf16"), fp8_tflops=figure("peak_tflops.fp8", optional=True),
        hbm_bytes=figure("hbm_bytes", integer=True), hbm_gbps=figure("hbm_gbps", optional=True),
        gpus_per_node=figure("gpus_per_node", integer=True),
        intra_node_gbps=figure("intra_node_gbps", optional=True), inter_node_gbps=figure("inter_node_gbps", optional=True),
        grouped_gemm=curve, memory_bound_gemm=fraction(bound, "memory_bound_gemm", "value"),
        attention_bandwidth=fraction(attention, "attention_decode", "bandwidth"),
        attention_compute=fraction(attention, "attention_decode", "compute"),
        a2a_intra_node=fraction(a2a, "all_to_all", "intra_node"), a2a_inter_node=fraction(a2a, "all_to_all", "inter_node"),
        a2a_latency_us=float(latency), sources=sources,
        fp32_tflops=figure("peak_tflops.fp32", optional=True),
        layer_overhead_us=figure("layer_overhead_us", optional=True) or 0.0,
        sequence_overhead_us=figure("sequence_overhead_us", optional=True) or 0.0,
        prompt_token_overhead_us=figure("prompt_token_overhead_us", optional=True) or 0.0, kernels=tables,
        micro_batch_overhead_us=figure("micro_batch_overhead_us", optional=True) or 0.0,
        assumed=tuple(sorted(k for k, v in sources.items() if v.lstrip().lower().startswith("assumed"))))
    return profile
