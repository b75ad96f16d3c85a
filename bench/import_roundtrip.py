"""A moectl trace round-tripped through SGLang's and vLLM's expert-load files, by the real CLI.

    python bench/import_roundtrip.py [TRACE] [--json] [--keep DIR]

TRACE (default sample_traces/steady_rebalance.trace) is a trace the engine recorded with devices.
Its routing (tokens per logical expert per layer, one step record per step) is written twice:

1. as SGLang's per_pass dump (_DetailAccumulator.dump, docs/external_load.md): one torch.save'd
   file per EP rank, {"records": [{forward_pass_id, rank, gatherer_key, global_physical_count
   int32 [layers, physical experts]}], "last_physical_to_logical_map": int64 [layers, physical]};
   each step's tokens split over its expert's physical slots and over the ranks;
2. as the vLLM EplbState fields, saved per rank: physical_to_logical_map [MoE layers, physical],
   expert_load_window [steps, MoE layers, physical] stored as a ring (expert_load_window_step
   its next write), ep_size and rank.

The physical_to_logical_map is the placement the trace's report uses (the header's, in force at
its first step), read device-major (physical_map.py). Neither engine leaves a slot empty, so each
empty slot gets a second copy of an expert its device already holds alone: the replica rule splits
that expert's tokens between two slots of one device, so no device's load changes (the bench
checks it). Both files go through `moectl trace import`; then `trace report --json` and `plan
rebalance --json` run on the original and on each import, and the figures are printed side by
side. Last, `plan rebalance --export sglang -o F.pt` on the SGLang import is reloaded the way
SGLang's compute_initial_expert_location_metadata does (torch.load(weights_only=True), the dict
passed as keyword arguments, so exactly one key) and compared with the plan's placement.

Exit status: 0 when every figure that must match does (balancedness within 1e-9, the hottest
experts, tokens routed, the plan's figures, the exported map); 1 when one does not (each is
named); 2 for a TRACE that is not a recorded trace with devices.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from moectl.cli.main import app  # noqa: E402
from moectl.engine.experts.physical_map import physical_map  # noqa: E402
from moectl.placement.placement import Placement  # noqa: E402
from moectl.profiler.trace_queries import placement_in_force  # noqa: E402
from moectl.profiler.trace_store import TraceError, TraceReader  # noqa: E402

DEFAULT_TRACE = Path(__file__).resolve().parent.parent / "sample_traces" / "steady_rebalance.trace"
TOLERANCE = 1e-9
PLAN_REDUNDANT = 1  # redundant slots per device of the plans compared
PLAN_FIGURES = ("plan_before", "plan_after", "plan_before_per_layer", "plan_after_per_layer", "slots_moved", "placement")


class BadTrace(ValueError):
    """TRACE is not a trace this bench can round-trip: exit 2."""


# ---- the trace and its placement ------------------------------------------------------------

def read_trace(path: Path) -> tuple[np.ndarray, list[int], Placement, list[int], list[bool]]:
    """(routing int64 [steps, layers, experts], step numbers, the placement its report uses (in force at
    its first step), the steps at which a later one took force, which layers are MoE)."""
    try:
        with TraceReader(path) as reader:
            records = list(reader.steps())
            if not records:
                raise BadTrace(f"{path}: the trace has no steps")
            if reader.header.get("imported"):
                raise BadTrace(f"{path}: already an import of {reader.header['imported']['engine']}: give a recorded trace")
            placement, changes = placement_in_force(reader, records[0]["step"])
            model = reader.header.get("model") or {}
    except TraceError as exc:
        raise BadTrace(str(exc)) from None
    if placement is None:
        raise BadTrace(f"{path}: the trace has no device placement (record it with --devices N)")
    routing = np.stack([np.asarray(r["routing"], dtype=np.int64) for r in records])
    sparse = model.get("sparse_layers") or [True] * routing.shape[1]
    return routing, [int(r["step"]) for r in records], placement, changes, [bool(s) for s in sparse]


def engine_placement(placement: Placement) -> Placement:
    """The placement with no empty slot and the same device loads: each empty slot of device d gets a
    second copy of an expert whose only replica is on d (its tokens split between two slots of d).
    A device with no such expert keeps its empty slot, and physical_map() then names it."""
    slots = placement.slots.copy()
    for layer, device, slot in np.argwhere(slots < 0):
        held = slots[layer, device]
        alone = [e for e in held[held >= 0] if np.count_nonzero(slots[layer] == e) == 1]
        if alone:
            slots[layer, device, slot] = alone[0]
    return Placement(slots, placement.num_experts, placement.pinned)


# ---- the engines' files ---------------------------------------------------------------------

def _split(counts: np.ndarray, parts: int, index: np.ndarray) -> np.ndarray:
    """counts split into `parts` whole shares: share `index` of each count (the first ones take the remainder)."""
    return counts // parts + (index < counts % parts)


def physical_counts(routing: np.ndarray, p2l: np.ndarray) -> np.ndarray:
    """[steps, L, E] logical counts -> [steps, L, P]: each expert's tokens split over its physical slots."""
    L, P = p2l.shape
    replicas = np.zeros((L, routing.shape[2]), np.int64)
    np.add.at(replicas, (np.arange(L)[:, None], p2l), 1)
    nth = np.zeros((L, P), np.int64)  # which replica of its expert each slot is
    for layer in range(L):
        for p in range(P):
            nth[layer, p] = np.count_nonzero(p2l[layer, :p] == p2l[layer, p])
    layer = np.arange(L)[:, None]
    return _split(routing[:, layer, p2l], replicas[layer, p2l], nth)


def write_sglang_per_pass(out: Path, physical: np.ndarray, steps: list[int], p2l: np.ndarray, ranks: int) -> list[Path]:
    """One expert_distribution_recorder_{time}_{rank}.pt per rank, as _DetailAccumulator.dump writes it."""
    files = []
    for rank in range(ranks):
        part = _split(physical, ranks, np.full(physical.shape, rank))
        records = [{"forward_pass_id": step, "rank": rank, "gatherer_key": "primary",
                    "global_physical_count": torch.from_numpy(counts.astype(np.int32))}
                   for step, counts in zip(steps, part)]
        path = out / f"expert_distribution_recorder_1764633600.0_{rank}.pt"
        torch.save({"records": records, "last_physical_to_logical_map": torch.from_numpy(p2l)}, path)
        files.append(path)
    return files


def write_vllm_states(out: Path, physical: np.ndarray, p2l: np.ndarray, ranks: int, moe: list[bool]) -> list[Path]:
    """EplbModelState's fields from each rank: the window as a ring whose next write (the oldest row)
    is a third of the way in, so the importer's reordering is exercised."""
    window, rows = physical[:, moe], p2l[moe]
    step = len(window) // 3
    files = []
    for rank in range(ranks):
        part = np.roll(_split(window, ranks, np.full(window.shape, rank)), step, axis=0)  # part[step] is the oldest
        path = out / f"eplb_rank{rank}.pt"
        torch.save({"physical_to_logical_map": torch.from_numpy(rows),
                    "expert_load_window": torch.from_numpy(part.astype(np.int32)),  # vLLM's window is int32
                    "expert_load_window_step": step, "ep_size": ranks, "rank": rank}, path)
        files.append(path)
    return files


# ---- the CLI --------------------------------------------------------------------------------

def moectl(*args) -> dict:
    """A `moectl ... --json` command through the real typer app; its JSON output."""
    res = CliRunner().invoke(app, [str(a) for a in args] + ["--json"])
    if res.exit_code != 0:
        raise RuntimeError(f"moectl {' '.join(map(str, args))}: exit {res.exit_code}: {res.output.strip()}")
    return json.loads(res.stdout)


def figures(trace: Path, moe: list[bool]) -> dict:
    """What the comparison reads from `trace report` and `plan rebalance` of one trace."""
    report = moectl("trace", "report", trace)
    plan = moectl("plan", "rebalance", trace, "--redundant", PLAN_REDUNDANT)
    with TraceReader(trace) as reader:
        tokens = sum(int(np.asarray(r["routing"], dtype=np.int64).sum()) for r in reader.steps())
    per_layer = report["balancedness"]["per_layer"]
    if len(per_layer) == len(moe):  # a vLLM import has MoE layers only: compare those rows
        per_layer = [b for b, m in zip(per_layer, moe) if m]
    plan_layers = plan["balancedness_before_per_layer"], plan["balancedness_after_per_layer"]
    if len(plan_layers[0]) == len(moe):
        plan_layers = tuple([b for b, m in zip(rows, moe) if m] for rows in plan_layers)
    return {"layers": len(report["balancedness"]["per_layer"]),
            "balancedness": report["balancedness"]["overall"], "balancedness_per_layer": per_layer,
            "hottest_experts": [(e["layer"], e["expert"], e["tokens"]) for e in report["hottest_experts"]],
            "tokens_routed": tokens, "plan_before": plan["balancedness_before"], "plan_after": plan["balancedness_after"],
            "plan_before_per_layer": plan_layers[0], "plan_after_per_layer": plan_layers[1],
            "slots_moved": plan["moves"], "placement": plan["placement"]}


def _layer_diff(a: list, b: list) -> float:
    if len(a) != len(b):
        return float("inf")
    return max((0.0 if x is None and y is None else abs(x - y) if None not in (x, y) else float("inf")
                for x, y in zip(a, b)), default=0.0)


def _same_plan(a: dict, b: dict, moe: list[bool]) -> bool:
    """The same slots, layer for layer (a vLLM import's plan has the MoE layers only)."""
    a, b = np.array(a["layers"]), np.array(b["layers"])
    if len(a) != len(b) and len(a) == len(moe):
        a = a[np.array(moe)]
    return a.shape == b.shape and bool(np.array_equal(a, b))


def compare(original: dict, imported: dict, moe: list[bool]) -> tuple[dict, list[str]]:
    """The differences to the original, and the figures that must match but do not."""
    hottest = list(imported["hottest_experts"])
    if imported["layers"] != original["layers"]:  # a vLLM import numbers MoE layers only: renumber the original's
        moe_index = {model: i for i, model in enumerate(np.flatnonzero(moe))}
        hottest_original = [(moe_index[layer], e, t) for layer, e, t in original["hottest_experts"]]
    else:
        hottest_original = original["hottest_experts"]
    diff = {"balancedness": abs(imported["balancedness"] - original["balancedness"]),
            "balancedness_per_layer_max": _layer_diff(original["balancedness_per_layer"], imported["balancedness_per_layer"]),
            "hottest_experts_same": hottest == [tuple(h) for h in hottest_original],
            "tokens_routed": imported["tokens_routed"] - original["tokens_routed"],
            "plan_before": abs(imported["plan_before"] - original["plan_before"]),
            "plan_after": abs(imported["plan_after"] - original["plan_after"]),
            "plan_per_layer_max": max(_layer_diff(original["plan_before_per_layer"], imported["plan_before_per_layer"]),
                                      _layer_diff(original["plan_after_per_layer"], imported["plan_after_per_layer"])),
            "slots_moved": imported["slots_moved"] - original["slots_moved"],
            "plan_placement_same": _same_plan(original["placement"], imported["placement"], moe)}
    failed = [name for name, bad in (
        ("balancedness", diff["balancedness"] > TOLERANCE),
        ("balancedness per layer", diff["balancedness_per_layer_max"] > TOLERANCE),
        ("hottest experts", not diff["hottest_experts_same"]),
        ("tokens routed", diff["tokens_routed"] != 0),
        ("plan balancedness before", diff["plan_before"] > TOLERANCE),
        ("plan balancedness after", diff["plan_after"] > TOLERANCE),
        ("plan balancedness per layer", diff["plan_per_layer_max"] > TOLERANCE),
        ("plan slots moved", diff["slots_moved"] != 0),
        ("plan placement", not diff["plan_placement_same"])) if bad]
    return diff, failed


def check_sglang_export(trace: Path, out: Path, num_experts: int) -> tuple[dict, list[str]]:
    """`plan rebalance --export sglang -o out`, reloaded as SGLang's loader reads it."""
    plan = moectl("plan", "rebalance", trace, "--redundant", PLAN_REDUNDANT, "--export", "sglang", "-o", out)
    data = torch.load(out, map_location="cpu", weights_only=True)  # compute_initial_expert_location_metadata's load
    failed = []
    if not isinstance(data, dict) or set(data) != {"physical_to_logical_map"}:  # init_by_mapping(**data_dict)
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        return {"file": str(out), "keys": keys}, ["export: not a dict of exactly physical_to_logical_map"]
    p2l = data["physical_to_logical_map"]
    slots = np.array(plan["placement"]["layers"])
    L, D, S = slots.shape
    if p2l.dtype != torch.int64:
        failed.append(f"export: physical_to_logical_map is {p2l.dtype}, not int64")
    p2l = p2l.numpy()
    if p2l.shape != (L, D * S):
        failed.append(f"export: shape {list(p2l.shape)}, the plan's is [{L}, {D * S}]")
    else:
        if not all(set(row.tolist()) == set(range(num_experts)) for row in p2l):
            failed.append("export: a layer leaves a logical expert without a physical slot (or names one past them)")
        if not np.array_equal(p2l.reshape(L, D, S), slots):  # physical slot p on rank p // S
            failed.append("export: the map does not reproduce the plan's placement")
    return {"file": str(out), "shape": list(p2l.shape), "ep_size": plan["export"]["ep_size"],
            "ep_num_redundant_experts": plan["export"]["ep_num_redundant_experts"],
            "slots_filled_for_export": plan["slots_filled_for_export"], "balancedness_after": plan["balancedness_after"],
            "flags": plan["export"]["flags"]}, failed


# ---- the round trip -------------------------------------------------------------------------

def reference(trace: Path, work: Path, routing: np.ndarray, placement: Placement, moe: list[bool]) -> dict:
    """What the imports must reproduce: the original's routing under the placement given to the
    engines (`trace report --placement`, a counterfactual on the same routing), and the plan
    from that placement (the planner starts from the placement in force; `plan rebalance TRACE`
    starts from the recorded one, empty slots and all, so its moves differ where slots were filled)."""
    from moectl.placement.rebalancer import run_plan_rebalance

    path = work / "engine_placement.json"
    path.write_text(json.dumps(placement.to_dict()))
    counterfactual = moectl("trace", "report", trace, "--placement", path)["counterfactual"]
    plan = run_plan_rebalance(routing.sum(0), placement.num_devices, PLAN_REDUNDANT, current=placement)
    ref = {**figures(trace, moe), "balancedness": counterfactual["overall"],
           "balancedness_per_layer": [b for b, m in zip(counterfactual["per_layer"], moe) if m]}
    ref.update(plan_before=plan["balancedness_before"], plan_after=plan["balancedness_after"],
               plan_before_per_layer=[b for b, m in zip(plan["balancedness_before_per_layer"], moe) if m],
               plan_after_per_layer=[b for b, m in zip(plan["balancedness_after_per_layer"], moe) if m],
               slots_moved=plan["moves"], placement=plan["placement"])
    return ref


def round_trip(trace: Path, work: Path) -> dict:
    routing, steps, recorded, changes, moe = read_trace(trace)
    placement = engine_placement(recorded)
    # the fill must leave every device's load as it was: then the figures under it are the recorded ones
    fill_diff = float(np.abs(placement.device_loads(routing.sum(0)) - recorded.device_loads(routing.sum(0))).max())
    p2l = physical_map(placement)
    physical = physical_counts(routing, p2l)
    ranks = placement.num_devices
    sglang_files = write_sglang_per_pass(work, physical, steps, p2l, ranks)
    vllm_files = write_vllm_states(work, physical, p2l, ranks, moe)
    imports = {"sglang": moectl("trace", "import", *sglang_files, "--ep-size", ranks, "-o", work / "sglang.trace",
                                "--overwrite"),
               "vllm": moectl("trace", "import", *vllm_files, "-o", work / "vllm.trace", "--overwrite")}
    original, expected = figures(trace, moe), reference(trace, work, routing, placement, moe)
    result = {"trace": str(trace), "steps": len(steps), "layers": routing.shape[1], "experts": routing.shape[2],
              "devices": ranks, "slots_per_device": placement.slots_per_device,
              "slots_filled": int((recorded.slots < 0).sum()), "fill_load_change": fill_diff, "placement_changes": changes,
              "original": original, "reference": expected, "imports": {}, "failed": []}
    # the recorded placement's figures are the reference's when the fill moved no load
    _, failed = compare(original, {**expected, **{k: original[k] for k in PLAN_FIGURES}}, moe)
    result["failed"] += [f"engine placement: {name} differs from the recorded one's" for name in failed]
    for engine, summary in imports.items():
        got = figures(work / f"{engine}.trace", moe)
        diff, failed = compare(expected, got, moe)
        result["imports"][engine] = {"records": summary["steps"], "mode": summary["mode"], **got, "diff": diff}
        result["failed"] += [f"{engine}: {name}" for name in failed]
    export, failed = check_sglang_export(work / "sglang.trace", work / "location.pt", routing.shape[2])
    result["export"] = export
    result["failed"] += failed
    return result


def _fmt_layers(values: list) -> str:
    return "[" + ", ".join("-" if v is None else f"{v:.4f}" for v in values) + "]"


def print_result(r: dict) -> None:
    print(f"{r['trace']}: {r['steps']} steps, {r['layers']} layers x {r['experts']} experts, {r['devices']} devices x "
          f"{r['slots_per_device']} slots; {r['slots_filled']} empty slots given a same-device copy for the engines "
          f"(device loads moved by it: {r['fill_load_change']:g} tokens)")
    if r["placement_changes"]:  # a dump holds one map: the report's figures use one placement for the range too
        print(f"the recorded placement changed at steps {r['placement_changes']}: the report, the plan and the dumps all "
              f"use the one in force at the first step for the whole trace")
    print("columns: the original under its recorded placement (`plan rebalance` from it, empty slots and all); the "
          "original under the engines' placement (report --placement, plan from it); each import (|diff|: to the "
          "second column)")
    sides = {"original": r["original"], "original, engines' pl.": r["reference"], **r["imports"]}
    imports = set(r["imports"])

    def diff(key: str, fmt: str = ".1e"):
        return lambda s, n: format(s["diff"][key], fmt) if n in imports else "-"

    rows = [("records", lambda s, n: s["records"] if n in imports else r["steps"]),
            ("balancedness", lambda s, n: f"{s['balancedness']:.12f}"),
            ("  |diff|", diff("balancedness")),
            ("  per layer, max |diff|", diff("balancedness_per_layer_max")),
            ("tokens routed", lambda s, n: f"{s['tokens_routed']:,}"),
            ("plan balancedness before", lambda s, n: f"{s['plan_before']:.12f}"),
            ("plan balancedness after", lambda s, n: f"{s['plan_after']:.12f}"),
            ("  |diff|", diff("plan_after")),
            ("  per layer, max |diff|", diff("plan_per_layer_max")),
            ("plan slots moved", lambda s, n: s["slots_moved"]),
            ("plan placement same", lambda s, n: s["diff"]["plan_placement_same"] if n in imports else "-")]
    print(f"{'':<28}" + "".join(f"{name:>24}" for name in sides))
    for label, cell in rows:
        print(f"{label:<28}" + "".join(f"{cell(s, n)!s:>24}" for n, s in sides.items()))
    print(f"balancedness per MoE layer (original): {_fmt_layers(r['original']['balancedness_per_layer'])}")
    for name, s in sides.items():
        hot = ", ".join(f"L{layer}/E{e} {t:,.0f}" for layer, e, t in s["hottest_experts"])
        same = (" (same)" if s["diff"]["hottest_experts_same"] else " (DIFFERENT)") if name in imports else ""
        print(f"hottest experts, {name}: {hot}{same}")
    e = r["export"]
    loaded = "OK" if not any(f.startswith("export") for f in r["failed"]) else "FAILED"
    what = (f"physical_to_logical_map {e['shape']}, {e['slots_filled_for_export']} slots filled, plan after "
            f"{e['balancedness_after']:.4f}; {e['flags']}") if "shape" in e else f"keys {e['keys']}"
    print(f"export sglang (plan on the sglang import): {Path(e['file']).name}, reloaded as SGLang does: {loaded}; {what}")
    print("all figures that must match do" if not r["failed"] else "MISMATCH: " + "; ".join(r["failed"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", nargs="?", type=Path, default=DEFAULT_TRACE, help="a trace recorded with devices")
    ap.add_argument("--keep", type=Path, help="write the dumps, imports and export here (default: a temporary folder)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            result = round_trip(args.trace, args.keep)
        else:
            with tempfile.TemporaryDirectory(prefix="import_roundtrip_") as work:
                result = round_trip(args.trace, Path(work))
    except BadTrace as exc:
        print(f"import_roundtrip: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, default=float))
    else:
        print_result(result)
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
