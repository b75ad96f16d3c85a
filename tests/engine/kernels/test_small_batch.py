"""The small-batch kernels against the torch path, and the cases they hand back to it."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moectl.engine.kernels import small_batch
from moectl.engine.kernels.build import NativeKernel
from moectl.engine.kernels.small_batch import MAX_ROWS, Linear, linear


@pytest.fixture(scope="module", autouse=True)
def built():
    assert small_batch.kernels() is not None, small_batch.failure()


@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize("k, n", [(256, 192), (97, 33), (64, 5000), (8, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(rows, k, n, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    with torch.inference_mode():
        got = linear(x, w, b)
        # the kernel itself, not a fallback: same values through the op directly
        torch.testing.assert_close(small_batch.kernels().linear(x, w, b), got, rtol=0, atol=0)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_other_inputs_take_f_linear():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(16, 32, generator=gen)
    cases = [torch.randn(MAX_ROWS + 1, 32, generator=gen),  # too many rows
             torch.randn(32, 2, generator=gen).t(),  # strided
             torch.randn(2, 3, 32, generator=gen)]  # 3-D
    with torch.inference_mode():
        for x in cases:
            torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=0, atol=0)
        x = torch.randn(2, 32, generator=gen)
        torch.testing.assert_close(linear(x.bfloat16(), w.bfloat16()), F.linear(x.bfloat16(), w.bfloat16()),
                                   rtol=0, atol=0)
        strided = w.t().contiguous().t()
        torch.testing.assert_close(small_batch.kernels().linear(x, strided, None), F.linear(x, strided), rtol=0, atol=0)


def test_autograd_keeps_f_linear():
    layer = Linear(8, 4)
    out = layer(torch.randn(1, 8))
    assert out.grad_fn is not None
    out.sum().backward()
    assert layer.weight.grad is not None


def test_linear_module_is_nn_linear_for_checkpoints():
    torch.manual_seed(0)
    ours, theirs = Linear(12, 6, bias=True), nn.Linear(12, 6, bias=True)
    ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = torch.randn(3, 12)
    with torch.inference_mode():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-6)


def test_switch_off_says_why(monkeypatch):
    monkeypatch.setenv("MOECTL_TEST_SWITCH", "0")
    kernel = NativeKernel("moectl.engine.kernels", "small_batch.cpp", "moectl_small", "MOECTL_TEST_SWITCH")
    assert kernel.ops() is None
    assert kernel.failure == "disabled by MOECTL_TEST_SWITCH=0"


def test_build_failure_is_one_line(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    kernel = NativeKernel("moectl.engine.kernels", "small_batch.cpp", "moectl_small", "MOECTL_TEST_SWITCH")
    assert kernel.ops() is None
    assert kernel.failure == "RuntimeError: no C++ compiler (no-such-compiler-here) on PATH"


def _torch_experts(x, weights, ids, w13, w2):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gate, up = F.linear(x[t], w13[ids[t, j]]).chunk(2)
            out[t] += weights[t, j] * F.linear(F.silu(gate) * up, w2[ids[t, j]])
    return out


@pytest.mark.parametrize("tokens, top_k, hidden, inter", [(1, 2, 256, 96), (1, 8, 64, 32), (4, 3, 37, 11)])
def test_experts_match_swiglu(tokens, top_k, hidden, inter):
    gen = torch.Generator().manual_seed(tokens * 100 + top_k)
    num = 9
    x = torch.randn(tokens, hidden, generator=gen)
    w13, w2 = torch.randn(num, 2 * inter, hidden, generator=gen) / 8, torch.randn(num, hidden, inter, generator=gen) / 8
    ids = torch.stack([torch.randperm(num, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    with torch.inference_mode():
        assert small_batch.experts_take(x, w13, w2)
        got = small_batch.experts(x, weights, ids, w13, w2)
    torch.testing.assert_close(got, _torch_experts(x, weights, ids, w13, w2), rtol=1e-5, atol=1e-5)


def test_experts_bad_ids_are_an_error_not_a_crash():
    x, w13, w2 = torch.randn(1, 8), torch.randn(4, 6, 8), torch.randn(4, 8, 3)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="expert id out of range"):
        small_batch.experts(x, torch.ones(1, 2), torch.tensor([[0, 4]]), w13, w2)


def test_experts_take_only_small_inference_batches():
    w13, w2 = torch.randn(4, 6, 8), torch.randn(4, 8, 3)
    with torch.inference_mode():
        assert small_batch.experts_take(torch.randn(1, 8), w13, w2)
        assert not small_batch.experts_take(torch.randn(small_batch.MAX_EXPERT_TOKENS + 1, 8), w13, w2)
        assert not small_batch.experts_take(torch.randn(1, 8).bfloat16(), w13.bfloat16(), w2.bfloat16())
        assert not small_batch.experts_take(torch.randn(1, 8), w13.transpose(1, 2).contiguous().transpose(1, 2), w2)
        assert not small_batch.experts_take(torch.randn(1, 8), w13, w2.double())
    assert not small_batch.experts_take(torch.randn(1, 8), w13, w2)  # autograd on


def test_set_enabled_switches_the_torch_path_in():
    try:
        small_batch.set_enabled(False)
        assert small_batch.kernels() is None and small_batch.describe() == "torch path (switched off)"
        with torch.inference_mode():
            assert not small_batch.experts_take(torch.randn(1, 8), torch.randn(4, 6, 8), torch.randn(4, 8, 3))
    finally:
        small_batch.set_enabled(True)
    assert small_batch.describe() == "small-batch kernels"


@pytest.mark.parametrize("rows, dim", [(1, 256), (4, 37), (small_batch.MAX_ROWS + 1, 16)])
def test_rms_norm_matches(rows, dim):
    gen = torch.Generator().manual_seed(rows + dim)
    x, w = torch.randn(rows, dim, generator=gen) * 30, torch.randn(dim, generator=gen)
    with torch.inference_mode():
        got = small_batch.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(got, F.rms_norm(x, (dim,), w, 1e-6), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("groups", [[(0, 1), (2, 3)], [(0, 9), (1, 17), (3, 8)], [(3, 2)], [(2, 40), (0, 3), (2, 1)]])
def test_grouped_swiglu_matches_swiglu_per_group(groups):
    from moectl.engine.models.moe import SWIGLU

    ids, rows = [g for g, _ in groups], [n for _, n in groups]
    gen = torch.Generator().manual_seed(sum(rows))
    hidden, inter = 40, 12
    w13, w2 = torch.randn(4, 2 * inter, hidden, generator=gen) / 6, torch.randn(4, hidden, inter, generator=gen) / 4
    x = torch.randn(sum(rows), hidden, generator=gen)
    with torch.inference_mode():
        assert small_batch.grouped_takes(x, w13, w2)
        got = small_batch.grouped_swiglu(x, ids, rows, w13, w2)
        want, start = torch.empty_like(x), 0
        for expert, n in groups:
            want[start:start + n] = SWIGLU(x[start:start + n], w13[expert], w2[expert])
            start += n
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_groups_bits_do_not_depend_on_the_other_groups():
    """What keeps placed devices and the expert cache bit for bit equal to one device."""
    gen = torch.Generator().manual_seed(3)
    w13, w2 = torch.randn(4, 24, 40, generator=gen), torch.randn(4, 40, 12, generator=gen)
    x = torch.randn(3 + 20 + 5, 40, generator=gen)
    with torch.inference_mode():
        together = small_batch.grouped_swiglu(x, [1, 2, 3], [3, 20, 5], w13, w2)
        alone = [small_batch.grouped_swiglu(x[:3], [1], [3], w13, w2),
                 small_batch.grouped_swiglu(x[3:23], [0], [20], w13[2:3].contiguous(), w2[2:3].contiguous()),
                 small_batch.grouped_swiglu(x[23:], [3], [5], w13, w2)]
    torch.testing.assert_close(together, torch.cat(alone), rtol=0, atol=0)


def test_grouped_swiglu_refuses_groups_that_do_not_fit():
    w13, w2 = torch.randn(2, 6, 8), torch.randn(2, 8, 3)
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="the groups hold 3 rows, not the 4 given"):
            small_batch.grouped_swiglu(torch.randn(4, 8), [0, 1], [1, 2], w13, w2)
        with pytest.raises(RuntimeError, match="group 1 has expert 2 of 2"):
            small_batch.grouped_swiglu(torch.randn(4, 8), [0, 2], [1, 3], w13, w2)


def test_grouped_takes_fp32_inference_on_contiguous_weights():
    w13, w2 = torch.randn(4, 6, 8), torch.randn(4, 8, 3)
    with torch.inference_mode():
        assert small_batch.grouped_takes(torch.randn(600, 8), w13, w2)
        assert not small_batch.grouped_takes(torch.randn(4, 8), w13.transpose(1, 2).contiguous().transpose(1, 2), w2)
        assert not small_batch.grouped_takes(torch.randn(4, 8).bfloat16(), w13.bfloat16(), w2.bfloat16())
    assert not small_batch.grouped_takes(torch.randn(4, 8), w13, w2)  # autograd on


def test_one_token_through_experts_or_grouped_gives_the_same_terms():
    gen = torch.Generator().manual_seed(5)
    w13, w2 = torch.randn(6, 24, 40, generator=gen) / 6, torch.randn(6, 40, 12, generator=gen) / 4
    x = torch.randn(1, 40, generator=gen)
    with torch.inference_mode():
        one = small_batch.experts(x, torch.ones(1, 1), torch.tensor([[4]]), w13, w2)
        grouped = small_batch.grouped_swiglu(x, [4], [1], w13, w2)
    torch.testing.assert_close(one, grouped, rtol=0, atol=0)


def test_large_groups_get_the_grouped_gemms_bits_from_either_path():
    """moe.grouped_swiglu hands a call with no small group to torch._grouped_mm: its bits per
    group must be the op's, or an expert's result would depend on the company it keeps."""
    from moectl.engine.models.moe import grouped_offsets, grouped_swiglu

    gen = torch.Generator().manual_seed(7)
    w13, w2 = torch.randn(4, 24, 32, generator=gen), torch.randn(4, 32, 12, generator=gen)
    counts = [small_batch.GROUP_ROWS + 1, 0, 40, 23]
    x = torch.randn(sum(counts), 32, generator=gen)
    with torch.inference_mode():
        offsets = grouped_offsets(torch.tensor(counts), x.shape[0], w13, w2)
        assert offsets is not None
        gemm = grouped_swiglu(x, counts, w13, w2, offsets)
        op = small_batch.grouped_swiglu(x, [0, 2, 3], [counts[0], 40, 23], w13, w2)
    torch.testing.assert_close(gemm, op, rtol=0, atol=0)


@pytest.mark.parametrize("top_k", [2, 4, 8])
def test_experts_equal_the_grouped_path_and_its_combine_bit_for_bit(top_k):
    """The batch-1 op and the batch path (grouped_swiglu, then moe.combine) give one token the
    same bits: the op's weighted sum rounds each product as torch's does (no FMA contraction)."""
    from moectl.engine.models.moe import combine

    gen = torch.Generator().manual_seed(top_k)
    num, hidden, inter = 9, 64, 24
    w13, w2 = torch.randn(num, 2 * inter, hidden, generator=gen) / 8, torch.randn(num, hidden, inter, generator=gen) / 5
    x = torch.randn(3, hidden, generator=gen)
    ids = torch.stack([torch.randperm(num, generator=gen)[:top_k] for _ in range(3)])
    weights = torch.rand(3, top_k, generator=gen)
    with torch.inference_mode():
        one_call = small_batch.experts(x, weights, ids, w13, w2)
        order = torch.argsort(ids.flatten(), stable=True)
        counts = torch.bincount(ids.flatten(), minlength=num).tolist()
        hit = [e for e, n in enumerate(counts) if n]
        grouped = small_batch.grouped_swiglu(x.index_select(0, order // top_k), hit, [counts[e] for e in hit], w13, w2)
        batch_path = combine(grouped, order, weights, x.dtype)
    torch.testing.assert_close(one_call, batch_path, rtol=0, atol=0)


def test_other_devices_keep_the_torch_path():
    """The ops are CPU kernels: a tensor elsewhere (CUDA; meta here, which no machine lacks) goes
    to F.linear and F.rms_norm."""
    x, w = torch.empty(2, 8, device="meta"), torch.empty(4, 8, device="meta")
    with torch.inference_mode():
        assert linear(x, w).shape == (2, 4) and linear(x, w).device.type == "meta"
        assert small_batch.rms_norm(x, torch.empty(8, device="meta"), 1e-6).device.type == "meta"
        assert not small_batch.experts_take(x, torch.empty(3, 6, 8, device="meta"), torch.empty(3, 8, 3, device="meta"))
        assert not small_batch.grouped_takes(x, torch.empty(3, 6, 8, device="meta"), torch.empty(3, 8, 3, device="meta"))


def test_the_kernels_use_torchs_threads():
    """Built with OpenMP, at::parallel_for splits the LM head's rows across threads; without it
    every kernel runs on one thread whatever torch.get_num_threads() says."""
    import pathlib

    from torch.utils.cpp_extension import _get_build_directory

    builds = list(pathlib.Path(_get_build_directory("x", False)).parent.glob("moectl_small_batch_*/build.ninja"))
    assert builds and any("-fopenmp" in b.read_text() and "-ffp-contract=off" in b.read_text() for b in builds)
