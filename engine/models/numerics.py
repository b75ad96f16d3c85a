"""The numerics watch: per layer, the largest values at the points where half precision overflows
first, gathered every step for the step record's `numerics` (wire/records.py says what each is).

The decoder notes each tensor as it passes: a norm's input (the residual stream: its largest |x|
and largest row sum of x^2), attention's queries and keys (their largest row norms, whose product
times the scale bounds every logit, by Cauchy-Schwarz), and the MoE block's (or dense MLP's)
output. A note is one native pass (kernels/activation_stats.cpp) max-merged into a small fp32
buffer; the engine reads the buffer once per step. Small tensors (a decode step's) are held and
noted in one call when the step's figures are read. Keys are kept as a running maximum per layer,
since a decode's logits reach keys cached steps ago.

The engine sets a watch on the model (`MoEForCausalLM.set_watch`); otherwise NULL_WATCH, whose
notes return at once.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from moectl.engine.kernels.build import NativeKernel

POINTS = ("residual", "norm_sumsq", "attn_logits", "expert_out")
BOUND = (False, False, True, False)
FP16_LIMIT = float(torch.finfo(torch.float16).max)
OVERFLOWED = float(torch.finfo(torch.float32).max)
DEFER_ELEMENTS = 1 << 16  # tensors up to this size are noted together at the step's end
# the buffer's slots: what each note feeds
NORM_INPUT, QUERY, KEY, OUTPUT = range(4)
_KERNEL = NativeKernel("moectl.engine.kernels", "activation_stats.cpp", "moectl_watch", "MOECTL_WATCH_KERNEL",
                       openmp=True)


class NullWatch:
    enabled = False

    def note(self, layer: int, slot: int, x: torch.Tensor) -> None:
        return None


NULL_WATCH = NullWatch()


def _note_torch(x: torch.Tensor, slot: torch.Tensor) -> None:
    """The kernel's figures with torch ops (off the CPU, or without a compiler)."""
    x32 = x.detach().float()
    slot[0] = torch.maximum(slot[0], x32.abs().nan_to_num(0.0).amax() if x32.numel() else slot[0])
    rows = x32.pow(2).sum(-1, dtype=torch.float64) if x32.numel() else x32.new_zeros(1, dtype=torch.float64)
    slot[1] = torch.maximum(slot[1], rows.nan_to_num(0.0).clamp(max=3.0e38).amax().float())
    slot[2] = torch.maximum(slot[2], (~torch.isfinite(rows)).any().float())


class ActivationWatch:
    enabled = True

    def __init__(self, num_layers: int, scales: list[float], device="cpu"):
        """scales: each layer's attention scale (the logits' bound is |q| |k| scale)."""
        self.buffer = torch.zeros(num_layers, 4, 3, device=device)  # [layer, slot, (max|x|, max row x^2, nonfinite)]
        # each slot's view made once: indexing the buffer on every note costs more than the note
        self.slots = [[self.buffer[layer, slot] for slot in range(4)] for layer in range(num_layers)]
        self.scales = np.asarray(scales, dtype=np.float64)
        self.key_sumsq = np.zeros(num_layers)  # running maximum of each layer's key row norms, squared
        ops = _KERNEL.ops() if torch.device(device).type == "cpu" else None
        self._note = ops.note if ops is not None else _note_torch
        self._note_many = ops.note_many if ops is not None else None
        # small tensors wait for one call at the step's end (a decode step's: a dispatch each would
        # cost more than their passes); holding them is cheap, a prefill's large ones are noted at once
        self._pending: list[torch.Tensor] = []
        self._pending_slots: list[int] = []

    def note(self, layer: int, slot: int, x: torch.Tensor) -> None:
        if self._note_many is not None and x.numel() <= DEFER_ELEMENTS:
            self._pending.append(x)
            self._pending_slots.append(layer * 4 + slot)
            return
        self._note(x if x.is_contiguous() else x.contiguous(), self.slots[layer][slot])

    def flush(self) -> None:
        """Notes what waits (the step's small tensors), in one call."""
        if self._pending:
            self._note_many(self._pending, self._pending_slots, self.buffer.view(-1, 3))
            self._pending, self._pending_slots = [], []

    def reset(self) -> None:
        self._pending, self._pending_slots = [], []
        self.buffer.zero_()

    def collect(self, dtype: torch.dtype, residual_dtype: torch.dtype) -> dict:
        """This step's figures (the record's `numerics`), and a fresh buffer for the next step."""
        self.flush()
        stats = self.buffer.cpu().numpy().astype(np.float64)  # one read per step (a copy: zeroed next)
        self.buffer.zero_()
        np.maximum(self.key_sumsq, stats[:, KEY, 1], out=self.key_sumsq)
        out = np.empty((stats.shape[0], 4))
        out[:, 0], out[:, 1], out[:, 3] = stats[:, NORM_INPUT, 0], stats[:, NORM_INPUT, 1], stats[:, OUTPUT, 0]
        out[:, 2] = np.sqrt(stats[:, QUERY, 1] * self.key_sumsq) * self.scales
        bad = np.empty((stats.shape[0], 4), dtype=bool)
        bad[:, 0] = bad[:, 1] = stats[:, NORM_INPUT, 2] > 0
        bad[:, 2] = (stats[:, QUERY, 2] > 0) | (stats[:, KEY, 2] > 0)
        bad[:, 3] = stats[:, OUTPUT, 2] > 0
        out[bad] = OVERFLOWED  # fp32's largest (no inf in a JSON record): past every limit
        np.minimum(out, OVERFLOWED, out=out)
        return {**self._static(dtype, residual_dtype), "max": out.astype(np.float32), "nonfinite": bad.tolist()}

    @functools.lru_cache(maxsize=4)  # noqa: B019 - a few dtype pairs per watch, for its lifetime
    def _static(self, dtype: torch.dtype, residual_dtype: torch.dtype) -> dict:
        """The record's fields that only the dtypes decide."""
        return {"dtype": str(dtype).removeprefix("torch."), "limit": float(torch.finfo(dtype).max),
                "fp16_limit": FP16_LIMIT, "residual_dtype": str(residual_dtype).removeprefix("torch."),
                "points": list(POINTS), "limits": limits(dtype, residual_dtype), "bound": list(BOUND)}


def limits(dtype: torch.dtype, residual_dtype: torch.dtype) -> list[float]:
    """Each point's limit: the residual stream's dtype for the stream and for an accumulation of
    its squares in that dtype (a norm kernel working in the stream's dtype), the activations'
    dtype for attention logits and expert outputs."""
    stream, act = float(torch.finfo(residual_dtype).max), float(torch.finfo(dtype).max)
    return [stream, stream, act, act]


def kernel_failure() -> str | None:
    return _KERNEL.failure
