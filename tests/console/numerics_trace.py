"""A small trace of synthetic step records with the activation watch (wire/records.py's numerics)
whose figures are worked out here: twelve layers in float16 with a float32 residual stream (the
mixed-precision path); every point at 100 x (layer + 1) + 10 x point, except layer 7's expert
output, which grows by 1000 a step (40000 at the last step: 65504 / 40000 = 1.64x of headroom, under
the alert's 2x from step 33), and layer 9's attention-logit bound, 20000 throughout (3.28x)."""

from __future__ import annotations

import numpy as np

from moectl.profiler.trace_store import TraceWriter
from tests.profiler.numerics_records import record

LAYERS = 12
STEPS = 40
HOT_LAYER, HOT_POINT = 7, 3  # expert_out
BOUND_LAYER, BOUND_POINT, BOUND_VALUE = 9, 2, 20000.0  # attn_logits
HEADER = {"model": {"name": "synthetic-numerics", "num_layers": LAYERS, "num_experts": 4},
          "devices": {"topology": {"num_devices": 2, "hbm_bytes": 1 << 30}, "backend": "emulated"},
          "knobs": {"max_num_seqs": 8}}


def maxima(step: int) -> np.ndarray:
    peak = 100.0 * (np.arange(LAYERS)[:, None] + 1) + 10.0 * np.arange(4)[None, :]
    peak[HOT_LAYER, HOT_POINT] = 1000.0 * step
    peak[BOUND_LAYER, BOUND_POINT] = BOUND_VALUE
    return peak


def step_record(step: int) -> dict:
    rec = record(step, maxima(step), dtype="float16", residual_dtype="float32")
    rec["devices"] = None
    return rec


def write_numerics_trace(path) -> None:
    with TraceWriter(path, HEADER) as writer:
        for step in range(1, STEPS + 1):
            assert writer.write_step(step_record(step))
