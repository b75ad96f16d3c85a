"""DeepSeek-V3's MoE block (grouped sigmoid router with a selection-only correction bias,
routed scaling, an ungated shared expert) against transformers' own DeepseekV3MoE module.

The architecture as a whole is not runnable yet (MLA attention is the next step of issue 12);
this pins the MoE half to the reference."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE  # noqa: E402

from moectl.engine.models.moe import GroupedSigmoidRouter, MoEBlock  # noqa: E402


def _pair(n_group: int, topk_group: int, norm: bool, seed: int = 0):
    cfg = DeepseekV3Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                           n_group=n_group, topk_group=topk_group, n_shared_experts=2, routed_scaling_factor=2.5,
                           norm_topk_prob=norm)
    torch.manual_seed(seed)
    ref = DeepseekV3MoE(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
        # a buffer that transformers zero-initialises: draw it, so a bias used for more than selection shows
        ref.gate.e_score_correction_bias.normal_(0, 0.5)
    ours = MoEBlock(0, 32, 8, 2, 16, norm, shared_intermediate=32, shared_gated=False,
                    grouped_sigmoid=GroupedSigmoidRouter(n_group, topk_group, 2.5))
    with torch.no_grad():
        ours.gate.copy_(ref.gate.weight)
        ours.e_score_correction_bias.copy_(ref.gate.e_score_correction_bias)
        ours.experts.w13.copy_(ref.experts.gate_up_proj)
        ours.experts.w2.copy_(ref.experts.down_proj)
        ours.shared_w13.copy_(torch.cat([ref.shared_experts.gate_proj.weight, ref.shared_experts.up_proj.weight]))
        ours.shared_w2.copy_(ref.shared_experts.down_proj.weight)
    return ref, ours


@pytest.mark.parametrize("n_group, topk_group, norm", [(4, 2, True), (4, 1, False), (1, 1, True), (2, 2, True)])
def test_grouped_sigmoid_moe_matches_transformers(n_group, topk_group, norm):
    ref, ours = _pair(n_group, topk_group, norm)
    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(x)
        got = ours(x.reshape(-1, 32)).reshape(expected.shape)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (got - expected).abs().max()


def test_the_correction_bias_steers_selection_not_weights():
    _, ours = _pair(4, 2, False)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, w0, ids0 = ours.route(x)
        ours.e_score_correction_bias[3] = 100.0  # expert 3 is now always chosen...
        _, w1, ids1 = ours.route(x)
    assert (ids1 == 3).any(1).all() and not (ids0 == 3).any(1).all()
    chosen = torch.sigmoid(torch.nn.functional.linear(x, ours.gate))[:, 3] * 2.5
    assert torch.allclose(w1[ids1 == 3], chosen)  # ...with its unbiased sigmoid score as the weight


def test_groups_that_do_not_divide_the_experts_are_refused():
    with pytest.raises(ValueError, match="groups"):
        MoEBlock(0, 32, 8, 2, 16, True, grouped_sigmoid=GroupedSigmoidRouter(3, 1, 1.0))
