"""The numerics watch: per layer, the largest values at the points where half precision overflows
first, gathered every step for the step record's `numerics` (wire/records.py says what each is).

The decoder notes each tensor as it passes: a norm's input (the residual stream: its largest |x|
and largest row sum of x^2), attention's queries and keys (their largest row norms, whose product
times the scale bounds every logit, by Cauchy-Schwarz), and the MoE block's (or dense MLP's)
output. A note is one native pass (kernels/activation_stats.cpp) max-merged into a small fp32
buffer; the engine reads the buffer once per step. Keys are kept as a running maximum per layer,
since a decode's logits reach keys cached steps ago.

The engine sets a watch on the model (`MoEForCausalLM.set_watch`); otherwise NULL_WATCH, whose
notes return at once.
"""

from __future__ import annotations

import math

import torch

from moectl.engine.kernels.build import NativeKernel

POINTS = ("residual", "norm_sumsq", "attn_logits", "expert_out")
BOUND = (False, False, True, False)
FP16_LIMIT = float(torch.finfo(torch.float16).max)
OVERFLOWED = float(torch.finfo(torch.float32).max)
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
        self.scales = list(scales)
        self.key_sumsq = [0.0] * num_layers  # running maximum of each layer's key row norms, squared
        ops = _KERNEL.ops() if torch.device(device).type == "cpu" else None
        self._note = ops.note if ops is not None else _note_torch

    def note(self, layer: int, slot: int, x: torch.Tensor) -> None:
        if not x.is_contiguous():
            x = x.contiguous()
        self._note(x, self.buffer[layer, slot])

    def collect(self, dtype: torch.dtype, residual_dtype: torch.dtype) -> dict:
        """This step's figures (the record's `numerics`), and a fresh buffer for the next step."""
        stats = self.buffer.cpu().numpy().copy()  # one read per step
        self.buffer.zero_()
        layers = stats.shape[0]
        out = [[0.0] * 4 for _ in range(layers)]
        nonfinite = [[False] * 4 for _ in range(layers)]
        for layer in range(layers):
            norm, query, key, output = stats[layer]
            self.key_sumsq[layer] = max(self.key_sumsq[layer], float(key[1]))
            out[layer][0], out[layer][1] = float(norm[0]), float(norm[1])
            out[layer][2] = math.sqrt(float(query[1]) * self.key_sumsq[layer]) * self.scales[layer]
            out[layer][3] = float(output[0])
            nonfinite[layer] = [bool(norm[2]), bool(norm[2]), bool(query[2] or key[2]), bool(output[2])]
            for point in range(4):
                if nonfinite[layer][point]:  # fp32's largest (no inf in a JSON record): past every limit
                    out[layer][point] = OVERFLOWED
        return {"dtype": str(dtype).removeprefix("torch."), "limit": float(torch.finfo(dtype).max),
                "fp16_limit": FP16_LIMIT, "residual_dtype": str(residual_dtype).removeprefix("torch."),
                "points": list(POINTS), "limits": limits(dtype, residual_dtype),
                "max": torch.tensor(out, dtype=torch.float32).numpy(), "bound": list(BOUND), "nonfinite": nonfinite}


def limits(dtype: torch.dtype, residual_dtype: torch.dtype) -> list[float]:
    """Each point's limit: the residual stream's dtype for the stream and for an accumulation of
    its squares in that dtype (a norm kernel working in the stream's dtype), the activations'
    dtype for attention logits and expert outputs."""
    stream, act = float(torch.finfo(residual_dtype).max), float(torch.finfo(dtype).max)
    return [stream, stream, act, act]


def kernel_failure() -> str | None:
    return _KERNEL.failure
