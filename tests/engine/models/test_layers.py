"""RMSNorm on torch's fused kernel gives the reference formula's values exactly."""

from __future__ import annotations

import pytest
import torch

from moectl.engine.models.layers import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_reference_formula_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(256, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(256, generator=gen))
    for rows in (1, 7, 513):
        x = (torch.randn(rows, 256, generator=gen) * 3).to(dtype)
        x32 = x.float()  # transformers' MixtralRMSNorm: fp32 statistics, cast back, then the weight
        want = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        assert torch.equal(norm(x), want)
