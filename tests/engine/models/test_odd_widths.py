"""Hidden and expert widths the grouped GEMM cannot take (rows not on 16-byte strides: not a
multiple of 8 values in bf16/fp16, of 4 in fp32) run through the per-expert loop, for every
architecture, in every dtype. They once crashed with "strides should be multiple of 16 bytes" on
any prompt of 4 tokens or more (a Mixtral of hidden 52 and intermediate 20, a DeepSeek-V3 of
hidden 48 and expert width 12)."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.engine.core.config import EngineConfig
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.models.moe import _rows_aligned
from tests.checkpoints import prompts, tiny_checkpoint

HEADS = dict(num_attention_heads=2, num_key_value_heads=2)  # 26 a head: RoPE wants an even head
ODD = {  # hidden 52, expert width 18: rows of 208 and 72 bytes in fp32, 104 and 36 in bf16
    "mixtral": dict(HEADS, hidden_size=52, intermediate_size=18),
    "qwen2_moe": dict(HEADS, hidden_size=52, moe_intermediate_size=18, shared_expert_intermediate_size=26),
    "qwen3_moe": dict(HEADS, hidden_size=52, moe_intermediate_size=18),
    "olmoe": dict(HEADS, hidden_size=52, intermediate_size=18),
    "deepseek_v3": dict(hidden_size=48, moe_intermediate_size=18, intermediate_size=26),
    "gpt_oss": dict(HEADS, hidden_size=52, intermediate_size=18),
}


@pytest.fixture(scope="module", params=sorted(ODD))
def odd_checkpoint(request, tmp_path_factory):
    name = request.param
    return name, tiny_checkpoint(tmp_path_factory.mktemp(f"odd_{name}"), name, **ODD[name])


def test_the_alignment_rule():
    assert _rows_aligned(torch.empty(2, 2 * 16, 64, dtype=torch.bfloat16))
    assert not _rows_aligned(torch.empty(2, 2 * 12, 48, dtype=torch.bfloat16))  # expert width 12
    assert _rows_aligned(torch.empty(2, 2 * 12, 48, dtype=torch.float32))
    assert not _rows_aligned(torch.empty(2, 2 * 18, 52, dtype=torch.float32))


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_odd_widths_generate_in_every_dtype(odd_checkpoint, dtype):
    name, ckpt = odd_checkpoint
    engine = LLMEngine(EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=64, dtype=dtype, num_threads=1))
    batch = [[t % 250 for t in p] for p in prompts(3, seed=5, lo=8, hi=16)]  # 8+ rows: grouped-path sized
    outs = engine.generate(batch, SamplingParams(max_tokens=4, ignore_eos=True))
    assert all(len(o.token_ids) == 4 and o.finish_reason == "length" for o in outs)
    if dtype == "fp32":  # the same greedy tokens as transformers' own model
        import transformers

        ref = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32,
                                                                experts_implementation="eager").eval()
        for p, o in zip(batch, outs):
            with torch.no_grad():
                want = ref.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False, min_new_tokens=4,
                                    pad_token_id=0)[0, len(p):].tolist()
            assert o.token_ids == want, name


def test_verify_passes_on_an_odd_width_mixtral(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "odd", "mixtral", **HEADS, hidden_size=52, intermediate_size=20)
    result = CliRunner().invoke(app, ["verify", "--model", str(ckpt), "--json"])
    assert result.exit_code == 0, result.output
