"""Modeled link spans: the emulated all-to-alls' spans, derived by readers from a step record.

On the local backend nothing crosses a link, so a link span's length is modeled from bytes and
bandwidth. Building those spans on the engine thread every step cost about a percent of its time
(issue 37), so the engine records only what they are made of, in the record's spans["links"]:

  {"layer": int16[n] (the MoE layers that ran), "dispatch_s", "combine_s": float64[n] (each
   all-to-all's start, from t_start), "traffic": int64[n, D, D] (each layer's dispatch bytes,
   src x dst; the combine moves them back), "s_per_byte": float64[D, D] (each device pair's
   link seconds per byte, 0 on the diagonal)}

and every reader (the trace reader, the console, the server) calls `with_link_spans` here, so
all of them see the same spans, flagged modeled, as the engine once built them itself.
"""

from __future__ import annotations

import numpy as np

from moectl.wire.records import link_lane

DISPATCH = "all_to_all dispatch"
COMBINE = "all_to_all combine"
LINKS = "links"  # the key of spans that holds the link traffic


def link_seconds(traffic, s_per_byte) -> np.ndarray:
    """Modeled seconds each device's links are busy for one all-to-all of `traffic` bytes (src x
    dst, or a stack [..., D, D] -> [..., D]): every transfer over its link's seconds per byte,
    counted on both ends (links are full-duplex). One array expression for a whole stack."""
    seconds = np.asarray(traffic) * np.asarray(s_per_byte, dtype=np.float64)
    return seconds.sum(axis=-1) + seconds.sum(axis=-2)


def link_span_columns(links: dict, lanes: list[str]) -> dict:
    """The dispatch and combine spans of `links` as span columns over `lanes`, without names:
    one span per layer and device whose link carried bytes, the n dispatches first, then the n
    combines (the same bytes back, so the same lengths)."""
    seconds = link_seconds(links["traffic"], links["s_per_byte"])  # [layers, D]
    i, d = np.nonzero(seconds)
    lane_of = np.array([lanes.index(link_lane(k)) for k in range(seconds.shape[-1])], dtype=np.int16)
    dur = seconds[i, d]
    starts = (np.asarray(links["dispatch_s"], dtype=np.float64)[i], np.asarray(links["combine_s"], dtype=np.float64)[i])
    n = len(i)
    return {"count": n, "lane": np.tile(lane_of[d], 2),
            "layer": np.tile(np.asarray(links["layer"], dtype=np.int16)[i], 2),
            "start_s": np.concatenate(starts), "dur_s": np.concatenate((dur, dur))}


def with_link_spans(record: dict) -> dict:
    """The record with its modeled link spans appended to its spans and spans["links"] gone (the
    spans as the engine once wrote them); a record without link traffic is returned as it is.
    Neither the record nor its spans dict is changed: both may be shared (the engine's step_log)."""
    spans = record.get("spans")
    if not spans or spans.get(LINKS) is None:
        return record
    merged = {k: v for k, v in spans.items() if k != LINKS}
    extra = link_span_columns(spans[LINKS], list(spans["lanes"]))
    names = list(spans["names"])
    ids = {name: i for i, name in enumerate(names)}
    for name in (DISPATCH, COMBINE):
        if name not in ids:
            ids[name] = len(names)
            names.append(name)
    n = extra["count"]
    merged["names"] = names
    extra["name"] = np.repeat(np.array([ids[DISPATCH], ids[COMBINE]], dtype=np.int16), n)
    for key in ("lane", "name", "layer", "start_s", "dur_s"):  # the record's dtypes (a JSON list's too)
        merged[key] = np.concatenate((np.asarray(spans[key], dtype=extra[key].dtype), extra[key]))
    merged["modeled"] = np.concatenate((np.asarray(spans["modeled"], dtype=bool), np.ones(2 * n, dtype=bool)))
    return {**record, "spans": merged}
