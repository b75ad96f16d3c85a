"""Expert load measured by other engines (SGLang, vLLM) as a moectl trace.

What each engine writes, as read in its source (docs/external_load.md pins the commits):

SGLang, ExpertDistributionRecorder (python/sglang/srt/eplb/expert_distribution.py), one torch.save'd
dict per `dump_expert_distribution_record`:
  "stat"/"stat_approx": {"rank", "logical_count": int [buffered passes, layers, logical experts]
      (all-reduced over ranks), "average_utilization_rate_over_window"}; the buffer is a ring
      (_CircularBuffer) dumped whole, so its rows are in ring order and unfilled rows are zero.
  "per_pass"/"per_token": {"records": [{"forward_pass_id", "rank", "gatherer_key", ...}],
      "last_physical_to_logical_map": int [layers, physical experts]}, one file per rank;
      per_pass records hold "global_physical_count" [layers, physical experts], per_token ones
      "topk_ids_of_layer" [layers, tokens, 8] of physical ids (-1: no expert).
  Layers are the model's layers (num_hidden_layers); dense layers count nothing.
vLLM writes no file: its EplbState (vllm/distributed/eplb/eplb_state.py) keeps per model
  "physical_to_logical_map" [MoE layers, physical experts], "expert_load_window" [window, MoE layers,
  physical experts] (a ring indexed by expert_load_window_step) and "expert_load_pass". The importer
  reads those fields saved as a dict (torch.save or JSON) from each rank, as docs/external_load.md shows.

Only the per-expert load is real in the trace written here: every step record is one forward
pass (or buffered pass) of the source, with t_start = t_end = 0.0 because the source has no time;
the header's "imported" block says so and lists what is absent.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moectl.engine.experts.physical_map import placement_from_physical_map
from moectl.placement.placement import MAX_EXPERTS, Placement, PlacementError
from moectl.profiler.trace_format import SQLITE_MAGIC
from moectl.wire.records import FORMAT_VERSION

ENGINES = ("sglang", "vllm")
MAX_COUNT = 2**31 - 1  # a trace's routing counts are int32: beyond it a count would wrap (2^62 read as 0)
# what a source commit these readers follow: named in every imported header
FORMAT_REFERENCES = {
    "sglang": "sgl-project/sglang@dd780ab9de484cf1198ff538a1b8b0da6464ab5a python/sglang/srt/eplb/expert_distribution.py",
    "vllm": "vllm-project/vllm@50feac95f9e53a97d6ed27fee6bfe3b163d18594 vllm/distributed/eplb/eplb_state.py",
}
# what no source here measures: the report and replay show these as absent
ABSENT = ("step_times", "spans", "requests", "batch_tokens", "kv_cache", "process_memory", "device_busy")
INT32_MAX = np.iinfo(np.int32).max
# records handed to the trace writer between flushes: far below its backlog's bounds (1024 records,
# 128 MiB), so nothing is dropped
FLUSH_EVERY, FLUSH_BYTES = 256, 32 << 20


class SourceFormatError(ValueError):
    """A source file that is not what the engine writes: exit code 2, one line naming the field."""


@dataclass
class ImportedLoad:
    engine: str
    mode: str  # sglang: stat | per_pass | per_token; vllm: window | pass
    counts: np.ndarray  # int64 [records, layers, logical experts], measured by the engine
    files: list[Path]
    layer_indexing: str  # "model" (SGLang: every model layer) or "moe" (vLLM: MoE layers only)
    placement: Placement | None = None  # from the source's physical_to_logical_map and an EP size
    pass_ids: list[int] | None = None  # the source's forward_pass_id of each record, where it has one
    engine_version: str | None = None
    notes: list[str] = field(default_factory=list)


# ---- reading the files ----------------------------------------------------------------------

def _load(path: Path):
    """A torch.save'd dict (weights_only: tensors, lists, dicts and scalars, never code) or JSON."""
    if not path.is_file():
        raise SourceFormatError(f"{path}: no such file")
    if path.suffix == ".json":
        try:
            return json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SourceFormatError(f"{path}: not JSON ({exc})") from None
    with open(path, "rb") as f:
        if f.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC:
            raise SourceFormatError(f"{path}: an SQLite file (a moectl trace?), not an engine's dump")
    import warnings

    import torch

    try:
        with warnings.catch_warnings():  # a failed load says why in its one line; torch's warnings (a
            warnings.simplefilter("ignore")  # pickle protocol it did not expect) would print before it
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a file that is not its own
        why = (str(exc).splitlines() or [""])[0][:160]
        raise SourceFormatError(f"{path}: not a torch.save file this importer can read "
                                f"({type(exc).__name__}: {why})") from None


def _array(value, name: str, path: Path, ndim: int) -> np.ndarray:
    import torch

    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError):
        raise SourceFormatError(f"{path}: {name} is not an array") from None
    if arr.ndim != ndim or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise SourceFormatError(f"{path}: {name} must be a {ndim}-d integer array, got shape {list(arr.shape)} {arr.dtype}")
    arr = arr.astype(np.int64)
    if (arr < (-1 if name == "topk_ids_of_layer" else 0)).any():  # -1: a token's unused top-k slot
        raise SourceFormatError(f"{path}: {name} holds negative values")
    if arr.size and arr.max() > MAX_COUNT:
        raise SourceFormatError(f"{path}: {name} holds {int(arr.max()):,}, beyond the trace's counts (at most "
                                f"{MAX_COUNT:,})")
    return arr


def _pass_id(value, where: str) -> int:
    """SGLang's forward_pass_id: an integer (0-d tensors and numpy integers too); a fractional or
    missing id would merge passes silently."""
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise SourceFormatError(f"{where}: forward_pass_id must be an integer, got {value!r}")
    return int(value)


def _num_experts(p2l: np.ndarray, where: str) -> int:
    """Logical experts: one more than the largest id the map names, at most MAX_EXPERTS."""
    num_experts = int(p2l.max(initial=-1)) + 1
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise SourceFormatError(f"{where}: names logical expert {num_experts - 1:,}; at most {MAX_EXPERTS} experts "
                                f"a layer are supported")
    return num_experts


def _to_logical(physical: np.ndarray, p2l: np.ndarray, num_experts: int) -> np.ndarray:
    """[..., L, P] physical counts -> [..., L, E]: SGLang's _convert_global_physical_count_to_logical_count
    and vLLM's scatter_add_ over physical_to_logical_map."""
    out = np.zeros(physical.shape[:-1] + (num_experts,), dtype=np.int64)
    L = p2l.shape[0]
    for layer in range(L):
        np.add.at(out[..., layer, :], (..., p2l[layer]), physical[..., layer, :])
    return out


def _placement(p2l: np.ndarray, num_experts: int, ep_size: int | None, where: str) -> Placement | None:
    if ep_size is None:
        return None
    try:
        return placement_from_physical_map(p2l, num_experts, ep_size)
    except PlacementError as exc:
        # the map's own errors start with its generic name; `where` names the field this file has
        message = str(exc).removeprefix("physical_to_logical_map: ")
        raise SourceFormatError(f"{where}: {message} (--ep-size {ep_size})") from None


def read_sglang(paths: list[Path], ep_size: int | None = None) -> ImportedLoad:
    dumps = [(p, _load(p)) for p in paths]
    for p, d in dumps:
        if not isinstance(d, dict) or not ({"logical_count"} <= d.keys() or {"records"} <= d.keys()):
            raise SourceFormatError(f"{p}: not an SGLang expert distribution dump (no 'logical_count' or 'records')")
    modes = {"stat" if "logical_count" in d else "detail" for _, d in dumps}
    if len(modes) > 1:
        raise SourceFormatError("the files mix SGLang's stat dumps with per_pass/per_token ones: import them apart")
    if modes == {"stat"}:
        return _sglang_stat(dumps, ep_size)
    return _sglang_detail(dumps, ep_size)


def _sglang_stat(dumps, ep_size) -> ImportedLoad:
    blocks = [_array(d["logical_count"], "logical_count", p, 3) for p, d in dumps]
    if len({b.shape[1:] for b in blocks}) > 1:
        raise SourceFormatError("logical_count: the files are for different [layers, experts] shapes")
    counts = np.concatenate(blocks)
    if not len(counts):  # SGLang dumped before its first forward pass
        raise SourceFormatError(f"{dumps[0][0]}: logical_count holds no passes (shape {list(blocks[0].shape)})")
    kept = counts.any(axis=(1, 2))
    notes = ["stat mode: rows are SGLang's buffered forward passes in ring-buffer order (its dump does not say "
             "where the ring starts, so the order is not chronological once the buffer wrapped)",
             f"{int((~kept).sum())} all-zero rows dropped (unfilled buffer slots, or passes that routed nothing)",
             "counts are all-reduced over the ranks, as SGLang dumps them",
             "no physical_to_logical_map in a stat dump: the device placement is absent"]
    if ep_size is not None:
        notes.append(f"--ep-size {ep_size} ignored: a stat dump has no placement to split over devices")
    return ImportedLoad("sglang", "stat", counts[kept], [p for p, _ in dumps], "model", notes=notes)


def _sglang_detail(dumps, ep_size) -> ImportedLoad:
    maps, by_pass, ranks, mode = [], {}, {}, None
    for n, (p, d) in enumerate(dumps):
        if "last_physical_to_logical_map" not in d:
            raise SourceFormatError(f"{p}: an SGLang per_pass/per_token dump needs 'last_physical_to_logical_map'")
        p2l = _array(d["last_physical_to_logical_map"], "last_physical_to_logical_map", p, 2)
        maps.append(p2l)
        if not isinstance(d["records"], list):
            raise SourceFormatError(f"{p}: 'records' must be a list")
        for i, rec in enumerate(d["records"]):
            where = f"{p}: records[{i}]"
            if not isinstance(rec, dict) or "forward_pass_id" not in rec:
                raise SourceFormatError(f"{where}: needs 'forward_pass_id'")
            if "global_physical_count" in rec:
                kind, physical = "per_pass", _array(rec["global_physical_count"], "global_physical_count", p, 2)
            elif "topk_ids_of_layer" in rec:
                kind = "per_token"
                ids = _array(rec["topk_ids_of_layer"], "topk_ids_of_layer", p, 3)
                physical = np.zeros(p2l.shape, dtype=np.int64)
                if ids.shape[0] != p2l.shape[0] or ids.max(initial=-1) >= p2l.shape[1]:
                    raise SourceFormatError(f"{where}: topk_ids_of_layer is {list(ids.shape)} with ids up to "
                                            f"{ids.max(initial=-1)}, last_physical_to_logical_map {list(p2l.shape)}")
                for layer in range(ids.shape[0]):
                    physical[layer] = np.bincount(ids[layer][ids[layer] >= 0], minlength=p2l.shape[1])
            else:
                raise SourceFormatError(f"{where}: neither 'global_physical_count' (per_pass) nor 'topk_ids_of_layer' "
                                   f"(per_token)")
            if mode not in (None, kind):
                raise SourceFormatError(f"{where}: the files mix per_pass and per_token records")
            mode = kind
            if physical.shape != p2l.shape:
                raise SourceFormatError(f"{where}: counts are {list(physical.shape)}, last_physical_to_logical_map "
                                   f"{list(p2l.shape)}")
            rank = rec.get("rank")
            if rank is not None and (isinstance(rank, bool) or not isinstance(rank, (int, np.integer))):
                raise SourceFormatError(f"{where}: rank must be an integer, got {rank!r}")
            if ranks.get(rank, n) != n:  # one file per rank: a second one would count its passes twice
                raise SourceFormatError(f"{p}: rank {rank}'s records are in {dumps[ranks[rank]][0]} too")
            ranks[rank] = n
            fid = _pass_id(rec["forward_pass_id"], where)
            # per rank, as stat mode all-reduces them: the ranks' counts of one pass add up
            by_pass[fid] = by_pass.get(fid, 0) + physical
    if any(not np.array_equal(m, maps[0]) for m in maps[1:]):
        raise SourceFormatError("last_physical_to_logical_map differs between the files: dumps of different servers?")
    if not by_pass:
        raise SourceFormatError(f"{dumps[0][0]}: the dump holds no records")
    p2l = maps[0]
    # SGLang maps every logical expert to at least one physical one
    num_experts = _num_experts(p2l, f"{dumps[0][0]}: last_physical_to_logical_map")
    ids = sorted(by_pass)
    counts = _to_logical(np.stack([by_pass[i] for i in ids]), p2l, num_experts)
    notes = [f"{mode} mode: one record per forward pass (forward_pass_id order), counts of the {len(ranks)} "
             f"rank(s) given added up",
             "physical ids mapped to logical experts through last_physical_to_logical_map, which SGLang notes "
             "'may change during recording'"]
    placement = _placement(p2l, num_experts, ep_size, "last_physical_to_logical_map")
    if placement is None:
        notes.append("device placement absent: give --ep-size to split the physical experts over ranks")
    return ImportedLoad("sglang", mode, counts, [p for p, _ in dumps], "model", placement, ids, notes=notes)


def read_vllm(paths: list[Path], ep_size: int | None = None) -> ImportedLoad:
    maps, windows, notes, versions = [], [], [], set()
    mode = None
    for p in paths:
        d = _load(p)
        if not isinstance(d, dict) or "physical_to_logical_map" not in d:
            raise SourceFormatError(f"{p}: not a saved vLLM EplbState (no 'physical_to_logical_map')")
        p2l = _array(d["physical_to_logical_map"], "physical_to_logical_map", p, 2)
        if "expert_load_window" in d:
            window = _array(d["expert_load_window"], "expert_load_window", p, 3)
            step = d.get("expert_load_window_step")
            if step is not None:  # the ring's next write index: oldest row first
                if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < max(len(window), 1):
                    raise SourceFormatError(f"{p}: expert_load_window_step {step!r} is not a row of the window")
                window = np.roll(window, -step, axis=0)
            kind = "window"
        elif "expert_load_pass" in d:
            window, kind, step = _array(d["expert_load_pass"], "expert_load_pass", p, 2)[None], "pass", None
        else:
            raise SourceFormatError(f"{p}: needs 'expert_load_window' (or 'expert_load_pass')")
        if window.shape[1:] != p2l.shape:
            raise SourceFormatError(f"{p}: expert load is per {list(window.shape[1:])} [MoE layers, experts], "
                               f"physical_to_logical_map {list(p2l.shape)} (older vLLM counted local experts only)")
        if mode not in (None, kind) or (windows and windows[0].shape != window.shape):
            raise SourceFormatError(f"{p}: its expert load is not of the same kind or shape as the other files'")
        mode = kind
        if step is None and kind == "window":
            notes.append(f"{p.name}: no expert_load_window_step, rows kept in ring order")
        saved = d.get("ep_size")
        if ep_size is None and saved is not None:
            if isinstance(saved, bool) or not isinstance(saved, int) or not 1 <= saved <= 256:
                raise SourceFormatError(f"{p}: ep_size {saved!r} is not a number of EP ranks in [1, 256]")
            ep_size = saved
        if d.get("vllm_version"):
            versions.add(str(d["vllm_version"]))
        maps.append(p2l)
        windows.append(window)
    if any(not np.array_equal(m, maps[0]) for m in maps[1:]):
        raise SourceFormatError("physical_to_logical_map differs between the files: saved at different times?")
    p2l = maps[0]
    num_experts = _num_experts(p2l, f"{paths[0]}: physical_to_logical_map")  # vLLM gives each one a slot
    physical = np.sum(windows, axis=0)  # as EplbState.rearrange all-reduces the ranks' windows
    counts = _to_logical(physical, p2l, num_experts)
    if not len(counts):
        raise SourceFormatError(f"{paths[0]}: the expert load window holds no rows (shape {list(windows[0].shape)})")
    kept = counts.any(axis=(1, 2))
    notes += [f"{mode}: one record per vLLM step of the load window (oldest first), the {len(paths)} rank(s) "
              f"given added row by row", f"{int((~kept).sum())} all-zero rows dropped (window rows not yet written)",
              "vLLM notes the load is multiplied by dp_size with naive all-to-all (each DP rank counts the same tokens)",
              "layers are vLLM's MoE layers (dense layers not counted)"]
    placement = _placement(p2l, num_experts, ep_size, "physical_to_logical_map")
    if placement is None:
        notes.append("device placement absent: give --ep-size (or save 'ep_size' with the state)")
    return ImportedLoad("vllm", mode, counts[kept], list(paths), "moe", placement,
                        engine_version=", ".join(sorted(versions)) or None, notes=notes)


def read_source(engine: str, paths: list[Path], ep_size: int | None = None) -> ImportedLoad:
    if engine not in ENGINES:
        raise SourceFormatError(f"--format: must be one of {', '.join(ENGINES)}, got {engine!r}")
    if ep_size is not None and not 1 <= ep_size <= 256:
        raise SourceFormatError(f"--ep-size: must be in [1, 256], got {ep_size}")
    loaded = (read_sglang if engine == "sglang" else read_vllm)([Path(p) for p in paths], ep_size)
    if not len(loaded.counts):
        raise SourceFormatError(f"{paths[0]}: the source holds no expert load (every row is zero)")
    if loaded.counts.max() > INT32_MAX:
        raise SourceFormatError(f"{paths[0]}: a count exceeds the trace's int32 routing ({int(loaded.counts.max())})")
    return loaded


def guess_engine(paths: list[Path]) -> str:
    """sglang or vllm from the first file's keys (--format says it outright)."""
    d = _load(Path(paths[0]))
    if isinstance(d, dict) and ("logical_count" in d or "last_physical_to_logical_map" in d):
        return "sglang"
    if isinstance(d, dict) and ("expert_load_window" in d or "expert_load_pass" in d):
        return "vllm"
    raise SourceFormatError(f"{paths[0]}: neither an SGLang expert distribution dump nor a saved vLLM EplbState "
                       f"nor a PyTorch-profiler trace (give --format)")


# ---- the trace ------------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def imported_header(load: ImportedLoad) -> dict:
    """A trace header that says where the load came from and what is not in the trace."""
    _, L, E = load.counts.shape
    files = [{"name": p.name, "path": str(p.resolve()), "sha256": _sha256(p)} for p in load.files]
    devices = None
    if load.placement is not None:
        devices = {"backend": f"imported from {load.engine}", "topology": {"num_devices": load.placement.num_devices},
                   "placement": load.placement.to_dict(), "expert_bytes": None, "step_time": "absent"}
    model = {"name": f"{load.engine} import of {load.files[0].name}", "path": None, "architecture": None,
             "num_layers": L, "num_experts": E, "top_k": None}
    if load.layer_indexing == "moe":
        model["sparse_layers"] = [True] * L  # vLLM's rows are its MoE layers
    return {
        "record_format": FORMAT_VERSION, "clock_origin": None, "model": model, "engine_config": None,
        "knobs": None, "devices": devices,
        "imported": {"engine": load.engine, "engine_version": load.engine_version, "mode": load.mode,
                     "files": files, "format_reference": FORMAT_REFERENCES[load.engine],
                     "measured": "expert load: tokens routed to each logical expert per layer, as the engine counted them",
                     "record_unit": "one source pass per step record (step numbers are positions, not engine steps)",
                     "forward_pass_ids": load.pass_ids, "layer_indexing": load.layer_indexing,
                     "placement": "from the source's physical_to_logical_map" if load.placement is not None else None,
                     "absent": list(ABSENT), "notes": load.notes},
    }


def imported_record(step: int, routing: np.ndarray) -> dict:
    """A step record with the source's load and nothing else measured: t_start = t_end = 0.0 (no
    time), empty request and batch lists, zero token counts and no spans, devices or caches."""
    return {"step": step, "t_start": 0.0, "t_end": 0.0,
            "batch": {"prefill_tokens": 0, "decode_tokens": 0, "num_seqs": 0, "request_ids": [], "preempted": []},
            "routing": routing.astype(np.int32), "knobs": {}, "cache": {}, "process": {}, "requests": [],
            "spans": None, "devices": None, "imported": True}


def write_imported_trace(load: ImportedLoad, out: Path, overwrite: bool = False) -> dict:
    from moectl.profiler.trace_format import written_whole
    from moectl.profiler.trace_store import TraceError, TraceWriter

    if load.counts.size and load.counts.max() > MAX_COUNT:  # passes added up past the trace's 32-bit counts
        raise SourceFormatError(f"a count of {int(load.counts.max()):,} tokens (the ranks' passes added up) is "
                                f"beyond the trace's counts (at most {MAX_COUNT:,})")
    with written_whole(out, overwrite) as partial:  # a failed import leaves nothing behind
        writer = TraceWriter(partial, imported_header(load), overwrite=True, str_keys=True)
        try:
            every = max(1, min(FLUSH_EVERY, FLUSH_BYTES // max(load.counts[0].size * 4, 1)))
            for i, routing in enumerate(load.counts):
                if i % every == every - 1:  # keep the backlog far below its bound: nothing is dropped
                    writer.flush()
                if not writer.write_step(imported_record(i + 1, routing)):
                    raise TraceError(f"{out}: the trace writer dropped pass {i + 1}")
        finally:
            writer.close()
    _, L, E = load.counts.shape
    return {"output": str(out), "engine": load.engine, "mode": load.mode, "steps": len(load.counts), "layers": L,
            "experts": E, "devices": load.placement.num_devices if load.placement is not None else None,
            "tokens_routed": int(load.counts.sum()), "notes": load.notes}
