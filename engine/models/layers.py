"""Small building blocks: RMSNorm, rotary embeddings (default and YaRN), the SwiGLU feed-forward."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moectl.engine.kernels.small_batch import linear, rms_norm


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as the reference implementations do."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel: one op instead of six; in fp32 the weight goes in too (bit for bit
        # the same result), in lower precision it multiplies after the cast, as the references do
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return rms_norm(x, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def rope_inv_freq(dim: int, theta: float, scaling=None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim / 2] and the factor on cos/sin, as transformers computes them
    (`_compute_yarn_parameters` for YaRN: interpolated frequencies below the beta_slow correction
    dimension, extrapolated above beta_fast, a linear ramp between)."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if scaling is None or scaling.kind == "default":
        return 1.0 / pos_freqs, 1.0

    def correction_dim(rotations: float) -> float:
        return dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv_freq = ramp / (scaling.factor * pos_freqs) + (1 - ramp) / pos_freqs
    return inv_freq, scaling.cos_sin_factor


class RotaryEmbedding(nn.Module):
    """RoPE over the first `head_dim` values of each head (default or YaRN frequencies); cos/sin
    are built for positions on demand and cached."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, scaling=None):
        super().__init__()
        # plain attributes, not buffers: the model may be built on the meta device before loading
        self.head_dim, self.theta = head_dim, theta
        self.max_positions = max_positions
        self.scaling = scaling
        self._cache_len = 0
        self._cos = self._sin = None
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # the tables in each model dtype
        # the last (positions, dtype, cos, sin): every layer of a step asks for the same positions
        # tensor, and a lookup costs a small step more than its matmuls (positions.max() syncs)
        self._last: tuple | None = None

    def _table(self, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if length > self._cache_len or self._cos.device != device:
            size = max(length, min(2 * self._cache_len, self.max_positions), 256)
            t = torch.arange(size, device=device, dtype=torch.float32)
            inv_freq, factor = rope_inv_freq(self.head_dim, self.theta, self.scaling)
            freqs = torch.outer(t, inv_freq.to(device))
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos, self._sin, self._cache_len = emb.cos() * factor, emb.sin() * factor, size
            self._cast = {}
        return self._cos, self._sin

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, 1, D] for `positions`, computed in fp32 and cast to the model dtype (as HF's
        rotary embedding does: bf16 results match it bit for bit)."""
        last = self._last
        if last is not None and last[0] is positions and last[1] == dtype:
            return last[2], last[3]
        cos_t, sin_t = self._table(int(positions.max()) + 1, positions.device)
        if dtype not in self._cast:
            self._cast[dtype] = (cos_t.to(dtype), sin_t.to(dtype))
        cos_t, sin_t = self._cast[dtype]
        cos, sin = cos_t[positions].unsqueeze(1), sin_t[positions].unsqueeze(1)
        self._last = (positions, dtype, cos, sin)
        return cos, sin

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [N, H, D] (any heads: q and k side by side rotate in one pass)."""
        cos, sin = self._tables(positions, x.dtype)
        return _rotate(x, cos, sin)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [N, Hq, D], k: [N, Hk, D], positions: [N]."""
        cos, sin = self._tables(positions, q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # the rotation runs in the model dtype, as HF's apply_rotary_pos_emb does
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """SwiGLU with gate and up projections fused in w13 = [gate; up] of shape [2I, H]."""
    gate, up = linear(x, w13).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, w2)


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(hidden, intermediate))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.w13, self.w2)
