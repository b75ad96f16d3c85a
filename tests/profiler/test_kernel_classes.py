"""The shipped kernel classes (profiler/kernel_classes.json) on real GPU traces: DeepSeek's published
profile of DeepSeek-V3 (H800, EP64, DeepEP, DeepGEMM; tests/profiler/data/README.md says where
from) and kernel names the DeepSeek prefill and decode profiles, SGLang and vLLM carry. Classes
follow the kernels' structure (DeepEP's dispatch/combine/notify in any namespace, DeepGEMM's
grouped GEMM types, the MoE routing and reduce kernels, FP8 casts), so a DeepSeek-style trace is
at most 10% unclassed and its communication is measured."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.profiler.kineto import UNCLASSED, Rules

DEEPSEEK_TRAIN = Path(__file__).parent / "data" / "deepseek_v3_train_ep64_kernels.json.gz"

# real names, as the traces write them; each with the class it must get
KERNELS = [
    ("void dpsk::ep::internode::dispatch_ll<true, 3, 10, 7168>(void*, float*, int*, long*, int*, "
     "int*, void*, int*, void*, void const*, long const*, int*, int*, int*, int, int, int, int, int, "
     "int, int, int*, int)", "dispatch_combine"),
    ("void dpsk::ep::internode::combine_ll<3, 10, 7168, 9>(void*, void*, int*, void*, void const*, "
     "long const*, float const*, int const*, long const*, int*, int, int*, int, int, int, int, int, "
     "int, int, int*, int)", "dispatch_combine"),
    ("void dpsk::ep::internode::notify_dispatch<false, 4>(int const*, long*, int, int const*, int*, "
     "int const*, int*, int, bool const*, int, int, int, int, int, int, int, int*, int*, int*, int*, "
     "void*, void**, int**, int, int, int*, int)", "dispatch_combine"),
    ("void dpsk::ep::internode::cached_notify<false>(int, int, int, int, int*, int, int, int const*, "
     "int const*, int*, void*, void**, int**, int, int, int, int*, bool, int)", "dispatch_combine"),
    ("void dpsk::ep::cuda::get_dispatch_layout<256, 32, 8>(long const*, int*, int*, int*, bool*, int, "
     "int, int, int)", "dispatch_combine"),
    ("void deep_ep::internode_ll::dispatch<true, 3, 10, 7168>(void*, float*, int*, long*, int*, "
     "void*, int*, void*, void const*, long const*, int*, int*, int*, int, int, int, int, int, int, "
     "int, int)", "dispatch_combine"),
    ("void deep_ep::intranode::combine<__nv_bfloat16, 8, 768>(int4*, float*, int4 const*, float "
     "const*)", "dispatch_combine"),
    ("ncclDevKernel_AllReduce_Sum_f32_TREE_LL(ncclDevKernelArgsStorage<4096ul>)", "dispatch_combine"),
    ("void dpsk::gemm::fp8_gemm_kernel<4096u, 7168u, 128u, 128u, 128u, 5u, 128u, 128u, 2u, "
     "(dpsk::gemm::GemmType)1>(__nv_bfloat16*, float*, int*, unsigned int, unsigned int, "
     "CUtensorMap_st, CUtensorMap_st, CUtensorMap_st, CUtensorMap_st)", "expert_gemm"),
    ("void dpsk::gemm::fp8_gemm_kernel<7168u, 2048u, 128u, 112u, 128u, 6u, 128u, 128u, 1u, "
     "(dpsk::gemm::GemmType)2>(__nv_bfloat16*, float*, int*, unsigned int, unsigned int, unsigned "
     "int, unsigned int, CUtensorMap_st, CUtensorMap_st, CUtensorMap_st, CUtensorMap_st)", "expert_gemm"),
    ("void dpsk::gemm::fp8_gemm_kernel<7168u, 16384u, 128u, 128u, 128u, 5u, 128u, 128u, 2u, "
     "(dpsk::gemm::GemmType)0>(__nv_bfloat16*, float*, int*, unsigned int, unsigned int, "
     "CUtensorMap_st, CUtensorMap_st, CUtensorMap_st, CUtensorMap_st)", "dense_gemm"),
    ("void deep_gemm::fp8_gemm_kernel<4096u, 7168u, 256u, 128u, 128u, 0u, 128u, 4u, 3u, 128u, 128u, "
     "1u, true, (deep_gemm::GemmType)2>(__nv_bfloat16*, float*, int*, unsigned int, CUtensorMap_st, "
     "CUtensorMap_st, CUtensorMap_st, CUtensorMap_st)", "expert_gemm"),
    ("void deep_gemm::fp8_gemm_kernel<7168u, 2048u, 256u, 128u, 128u, 0u, 128u, 1u, 3u, 128u, 128u, "
     "2u, true, (deep_gemm::GemmType)0>(__nv_bfloat16*, float*, int*, unsigned int, CUtensorMap_st, "
     "CUtensorMap_st, CUtensorMap_st, CUtensorMap_st)", "dense_gemm"),
    ("void cuda::top2_sum_gate<32, 8, 256, 8, 4>(float const*, float const*, long*, float*, int, int)", "moe_routing"),
    ("void cuda::clean_and_count_expert<512>(long const*, int*, int*, int*, int*, int*, int, int, "
     "int, int)", "moe_routing"),
    ("void cuda::reduce_fused_impl<__nv_bfloat16, true, false>(int4 const*, float const*, int const*, "
     "int4*, int, int, int, __nv_fp8_interpretation_t, float const*, float const*)", "moe_routing"),
    ("_fwd_kernel_ep_scatter_2", "moe_routing"),
    ("moe_align_block_size_kernel", "moe_routing"),
    ("fused_moe_kernel", "expert_gemm"),
    ("void per_token_group_quant_8bit_kernel<__nv_bfloat16, c10::Float8_e4m3fn, false>(__nv_bfloat16 "
     "const*, void*, float*, int, int, int, float, float, float, int, int)", "quantize"),
    ("void cuda::per_token_cast_to_fp8_with_channels<__nv_bfloat16, 128, true, 128, "
     "false>(__nv_bfloat16 const*, int, unsigned char*, float*, int, int, int, int, bool, float, "
     "__nv_fp8_interpretation_t)", "quantize"),
    ("void cuda::per_channel_cast_and_transpose<256, 128, true, true, true, false, true>(void const*, "
     "float const*, int const*, int const*, unsigned char*, float*, int, int, float, "
     "__nv_fp8_interpretation_t)", "quantize"),
    ("void cuda::batched_swiglu_forward_and_per_token_cast_to_fp8_with_channels_impl<__nv_bfloat16, "
     "128, 512, true, 128>(unsigned char*, __nv_bfloat16 const*, int, int, int, float*, int const*, "
     "float, __nv_fp8_interpretation_t)", "norm_elementwise"),
    ("void flashinfer::activation::act_and_mul_kernel<__nv_bfloat16, &(silu(float "
     "const&))>(__nv_bfloat16*, __nv_bfloat16 const*, int)", "norm_elementwise"),
    ("void flash::flash_fwd_splitkv_mla_kernel<Flash_fwd_kernel_traits_mla<576, 64, 64, 8, "
     "cutlass::bfloat16_t, 512, true, 0, cutlass::bfloat16_t, cutlass::bfloat16_t>, true, "
     "flash::SharedStorageMLA<Flash_fwd_kernel_traits_mla<576, 64, 64, 8, cutlass::bfloat16_t, 512, "
     "true, 0, cutlass::bfloat16_t, cutlass::bfloat16_t> > >(Flash_fwd_mla_params)", "attention"),
    ("void vllm::rotary_embedding_with_kv_cache_kernel<c10::BFloat16, false, false, true, 32>(long "
     "const*, c10::BFloat16*)", "attention"),
    ("void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, "
     "false>(cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*)", "dense_gemm"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, "
     "at::native::func_wrapper_t<float, at::native::sum_functor<float, float, "
     "float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, unsigned int, float, 4> "
     ">(at::native::ReduceOp<float>)", "norm_elementwise"),
]


def test_a_deepseek_v3_profile_is_classed_with_its_communication_measured():
    out = CliRunner().invoke(app, ["trace", "report", str(DEEPSEEK_TRAIN), "--json"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout)
    total = sum(result["breakdown"].values())
    assert result["breakdown"].get(UNCLASSED, 0.0) <= 0.10 * total
    assert result["breakdown"]["dispatch_combine"] > 0 and result["overlap"]["fraction"] > 0
    human = CliRunner().invoke(app, ["trace", "report", str(DEEPSEEK_TRAIN)])
    assert human.exit_code == 0 and "no communication events" not in human.output


@pytest.mark.parametrize("name, cls", KERNELS, ids=[f"{c}-{i}" for i, (_, c) in enumerate(KERNELS)])
def test_real_kernel_names_get_their_class(name, cls):
    assert Rules.load().classify(name) == cls


@pytest.mark.parametrize("name, not_cls", [
    # CUB's scan kernels in DeepSeek's prefill trace sit in a namespace ending in "dpsk::ep": not DeepEP
    ("void cdpsk::ep::CUB_200200_900_NS::DeviceScanByKeyKernel<cdpsk::ep::CUB_200200_900_NS::"
     "DeviceScanByKeyPolicy<int>::Policy900>(int)", "dispatch_combine"),
    ("aten::permute", "moe_routing"), ("PermuteBackward0", "moe_routing"),  # a view, not the experts' permute
    ("aten::quantile", "quantize"),
])
def test_look_alike_names_stay_out_of_a_class(name, not_cls):
    assert Rules.load().classify(name) != not_cls


def test_no_shipped_pattern_scans_unbounded():
    # '.*' before an alternative backtracks over the rest of the name at every match of what
    # precedes it: a long name with many of those would take minutes
    rules = json.loads(resources.files("moectl.profiler").joinpath("kernel_classes.json").read_text())["rules"]
    assert not [r["pattern"] for r in rules if re.search(r"\.[*+]", r["pattern"])]
