"""Step records carrying the activation watch (wire/records.py's "numerics"), built on
tests/records.py's make_record, with figures chosen by hand."""

from __future__ import annotations

import numpy as np

from moectl.profiler.analysis import DTYPE_LIMITS, FP16_LIMIT, NUMERIC_POINTS
from tests.records import make_record

BF16_LIMIT = DTYPE_LIMITS["bfloat16"]


OVERFLOWED = DTYPE_LIMITS["float32"]  # the engine's "max" where it saw an inf or NaN


def numerics(peak, dtype: str = "float16", residual_dtype: str | None = None, nonfinite=None) -> dict:
    """The field as the engine sends it (engine/models/numerics.py): float32 [layers, 4] maxima,
    fp32's largest where an inf or NaN was seen, the per-point limits and per-layer flags."""
    stream = residual_dtype or dtype
    flags = np.zeros(np.shape(peak), bool) if nonfinite is None else np.asarray(nonfinite, bool)
    peak = np.where(flags, OVERFLOWED, np.asarray(peak, dtype=np.float64)).astype(np.float32)
    return {"dtype": dtype, "limit": DTYPE_LIMITS[dtype], "fp16_limit": FP16_LIMIT, "residual_dtype": stream,
            "points": list(NUMERIC_POINTS),
            "limits": [DTYPE_LIMITS[stream], DTYPE_LIMITS[stream], DTYPE_LIMITS[dtype], DTYPE_LIMITS[dtype]],
            "max": peak, "bound": [False, False, True, False], "nonfinite": flags.tolist()}


def flat(layers: int, value: float = 100.0) -> np.ndarray:
    """Every point of every layer at `value`."""
    return np.full((layers, len(NUMERIC_POINTS)), value, np.float32)


def record(step: int, peak, experts: int = 4, **field) -> dict:
    """A step record (routing of as many layers as `peak` has, over `experts`) with the watch's field."""
    peak = np.asarray(peak, dtype=np.float32)
    rec = make_record(step, routing=np.ones((peak.shape[0], experts), np.int32))
    rec["numerics"] = numerics(peak, **field)
    return rec
