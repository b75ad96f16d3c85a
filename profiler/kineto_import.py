"""`trace import` of PyTorch-profiler (Kineto) traces: their device events (or a CPU run's ops)
as a moectl trace, a GPU timeline that `trace report`, `trace info` and `replay` read.

The trace holds what the source measured and nothing else: per rank its lanes (streams), the
distinct event names with their classes, and per event its lane, name, start, duration and
layer, as records of up to CHUNK_EVENTS events (columns). There are no engine steps, routing,
requests or memory; the header's gpu_timeline says so, and commands that need those refuse it
with one line.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from moectl.profiler.kineto import RankTrace, Rules, read_ranks

KEY = "gpu_timeline"
CHUNK_EVENTS = 1 << 18
ABSENT = ["engine steps", "routing and expert load", "requests and latencies", "memory accounting"]


def is_timeline(header: dict) -> bool:
    return isinstance(header.get(KEY), dict)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_source(sources: list[Path], rules_file: Path | None = None) -> list[RankTrace]:
    """The sources' ranks (files, or folders of one per rank), numbered (kineto.read_ranks)."""
    return read_ranks([Path(p) for p in sources], Rules.load(rules_file))


def write_timeline(traces: list[RankTrace], out: Path, rules_file: Path | None, overwrite: bool = False) -> dict:
    from moectl.profiler.trace_format import FORMAT_VERSION, written_whole
    from moectl.profiler.trace_store import TraceError, TraceWriter

    header = {
        "record_format": FORMAT_VERSION, "clock_origin": None, "model": None, "engine_config": None, "knobs": None,
        "devices": None,
        KEY: {"source": "PyTorch profiler (Kineto) Chrome trace",
              "files": [{"name": t.path.name, "path": str(t.path.resolve()), "sha256": _sha256(t.path)}
                        for t in traces],
              "rules": str(rules_file) if rules_file is not None else "profiler/kernel_classes.json",
              "ranks": [{"rank": t.rank, "file": t.path.name, "source": t.source, "lanes": t.lanes, "names": t.names,
                         "classes": t.classes, "origin_s": t.origin_s} for t in traces],
              "measured": "device kernels, copies and memsets as the PyTorch profiler recorded them (a CPU run: its "
                          "outermost CPU ops); times in seconds from each rank's origin_s on the trace's clock",
              "record_unit": f"one record per rank and run of up to {CHUNK_EVENTS:,} events (step numbers are "
                             f"positions, not engine steps)",
              "absent": ABSENT},
    }
    step = 0
    with written_whole(out, overwrite) as partial:  # a failed import leaves nothing behind
        writer = TraceWriter(partial, header, overwrite=True, str_keys=True)
        try:
            for index, t in enumerate(traces):
                for lo in range(0, len(t.dur), CHUNK_EVENTS):
                    part = slice(lo, lo + CHUNK_EVENTS)
                    start, dur = t.start[part], t.dur[part]
                    step += 1
                    record = {"step": step, "t_start": t.origin_s + float(start.min()),
                              "t_end": t.origin_s + float((start + dur).max()),
                              KEY: {"rank_index": index, "lane": t.lane[part], "name_id": t.name_id[part],
                                    "start_s": start, "dur_s": dur, "layer": t.layer[part]}}
                    if not writer.write_step(record):
                        raise TraceError(f"{out}: the trace writer dropped record {step}")
                    writer.flush()  # a record is megabytes: keep the backlog to one
        finally:
            writer.close()
    return {"output": str(out), "ranks": [t.rank for t in traces], "events": int(sum(len(t.dur) for t in traces)),
            "records": step, "source": traces[0].source}


def read_timeline(reader, rules_file: Path | None = None) -> list[RankTrace]:
    """The ranks a GPU-timeline trace holds; --rules reclasses their names (layers stay as imported)."""
    from moectl.profiler.trace_store import TraceError

    meta = reader.header[KEY]
    parts: dict[int, list[dict]] = {i: [] for i in range(len(meta["ranks"]))}
    for record in reader.steps():
        cols = record[KEY]
        parts[int(cols["rank_index"])].append(cols)
    rules = Rules.load(rules_file) if rules_file is not None else None
    traces = []
    for index, rank in enumerate(meta["ranks"]):
        cols = parts[index]
        if not cols:  # what an import that stopped part-way left, before imports were written whole
            raise TraceError(f"{reader.path}: holds no events of rank {rank['rank']} ({rank['file']}): an import "
                             f"that did not finish; import the source again")

        def joined(key, dtype, cols=cols):
            return np.concatenate([np.asarray(c[key], dtype=dtype) for c in cols])
        names = list(rank["names"])
        classes = [rules.classify(n) for n in names] if rules is not None else list(rank["classes"])
        traces.append(RankTrace(Path(rank["file"]), rank["rank"], list(rank["lanes"]), rank["source"],
                                joined("lane", np.int32), joined("name_id", np.int32), names, classes,
                                joined("start_s", np.float64), joined("dur_s", np.float64),
                                joined("layer", np.int32), float(rank.get("origin_s") or 0.0)))
    return traces
