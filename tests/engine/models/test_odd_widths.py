"""Hidden, expert and head widths the grouped GEMM cannot take (rows not on 16-byte strides: not a
multiple of 8 values in bf16/fp16, of 4 in fp32) run through the per-expert loop, for every
architecture, in every dtype, and agree with transformers layer by layer. They once crashed with
"strides should be multiple of 16 bytes" on any prompt of 4 tokens or more (a Mixtral of hidden 52
and intermediate 20, a DeepSeek-V3 of hidden 48 and expert width 12): `generate` exited 1 and
`verify` 2, as if the input were bad."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.engine.core.config import EngineConfig
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.models import moe
from moectl.engine.models.moe import ExpertFFN, grouped_mm_fits, grouped_offsets
from moectl.engine.tools.verify import HALF_THRESHOLDS, THRESHOLDS, compare_layers
from tests.checkpoints import tiny_checkpoint

pytestmark = pytest.mark.usefixtures("single_thread")

MLA = dict(num_attention_heads=3, num_key_value_heads=3, hidden_size=45, moe_intermediate_size=13,
           intermediate_size=11, v_head_dim=7, qk_nope_head_dim=5, kv_lora_rank=11)
ODD = {  # hidden 42 or 45 and expert width 13: rows off 16 bytes in fp32, bf16 and fp16 alike
    "mixtral": dict(hidden_size=42, num_attention_heads=3, num_key_value_heads=1, intermediate_size=13),
    "qwen2_moe": dict(hidden_size=42, num_attention_heads=3, num_key_value_heads=3, moe_intermediate_size=13,
                      shared_expert_intermediate_size=11, intermediate_size=7),
    "qwen3_moe": dict(hidden_size=45, head_dim=10, num_attention_heads=3, num_key_value_heads=1,
                      moe_intermediate_size=13),
    "olmoe": dict(hidden_size=42, num_attention_heads=3, num_key_value_heads=3, intermediate_size=13),
    "deepseek_v3": dict(MLA, q_lora_rank=9),  # MLA heads of 7 values, latents of 11
    "kimi_k2": dict(MLA, q_lora_rank=9),
    "gpt_oss": dict(hidden_size=45, head_dim=10, num_attention_heads=3, num_key_value_heads=1, intermediate_size=13),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _reference(ckpt, dtype: torch.dtype):
    import transformers

    transformers.logging.set_verbosity_error()
    if "kimi" in str(ckpt):  # transformers knows no kimi_k2 model_type: verify's own loader handles it
        import json

        raw = json.loads((ckpt / "config.json").read_text())
        config = transformers.AutoConfig.for_model("deepseek_v3", **{k: v for k, v in raw.items() if k != "model_type"})
        extra = dict(config=config)
    else:
        extra = {}
    return transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype, attn_implementation="eager",
                                                             experts_implementation="eager", **extra).eval()


@pytest.fixture(scope="module", params=sorted(ODD))
def odd_checkpoint(request, tmp_path_factory):
    name = request.param
    return name, tiny_checkpoint(tmp_path_factory.mktemp(f"odd_{name}"), name, **ODD[name])


def test_the_fit_rule():
    def fits(hidden, inter, dtype, ffn=moe.SWIGLU):
        extra = ffn.extra_column()
        return grouped_mm_fits(torch.empty(2, 2 * inter, hidden + extra, dtype=dtype),
                               torch.empty(2, hidden, inter + extra, dtype=dtype), ffn)

    assert fits(64, 16, torch.bfloat16) and fits(48, 12, torch.float32) and fits(52, 20, torch.float32)
    assert not fits(48, 12, torch.bfloat16)  # the DeepSeek-V3: expert rows of 24 bytes
    assert not fits(52, 20, torch.float16)  # the Mixtral: hidden rows of 104 bytes
    assert not fits(42, 16, torch.float32) and not fits(48, 13, torch.float32)
    assert not fits(63, 15, torch.float32, ExpertFFN(biased=True))  # rows of 64 and 16 values, bias or not
    w13, w2 = torch.empty(4, 26, 48, dtype=torch.bfloat16), torch.empty(4, 48, 13, dtype=torch.bfloat16)
    assert grouped_offsets(torch.tensor([3, 0, 2, 3]), 8, w13, w2) is None


def test_the_decision_is_made_once_per_shape(monkeypatch):
    """After the first use the decision is a lookup, not a re-check per step: a recorded 'no' for an
    aligned shape is what later calls get."""
    monkeypatch.setattr(moe, "_grouped_mm_fits", {})
    w13, w2 = torch.empty(4, 32, 64), torch.empty(4, 64, 16)
    counts = torch.tensor([2, 2, 2, 2])
    assert grouped_offsets(counts, 8, w13, w2) is not None
    assert list(moe._grouped_mm_fits.values()) == [True]
    moe._grouped_mm_fits[next(iter(moe._grouped_mm_fits))] = False
    assert grouped_offsets(counts, 8, w13, w2) is None


def test_odd_widths_never_reach_the_grouped_kernel_and_aligned_ones_do(tmp_path, monkeypatch):
    calls = []
    real = torch._grouped_mm

    def spy(a, b, **kw):
        calls.append((a.shape[-1], a.dtype))
        return real(a, b, **kw)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    odd = tiny_checkpoint(tmp_path / "odd", "mixtral", **ODD["mixtral"])
    aligned = tiny_checkpoint(tmp_path / "aligned", "mixtral")  # hidden 32, intermediate 48
    prompts = [list(range(3, 15)), list(range(20, 29))]
    for ckpt in (odd, aligned):
        engine = LLMEngine(EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=32, dtype="bf16"))
        engine.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
        if ckpt is odd:
            assert calls == []
    if moe._grouped_mm_works(torch.device("cpu"), torch.bfloat16):  # a build with the kernel
        assert {width for width, _ in calls} == {32, 48}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_odd_widths_match_transformers(odd_checkpoint, dtype):
    """Layer by layer against transformers in the same dtype (fp32: max error, tight; bf16/fp16:
    median per-token error, as verify checks them), then a generation that decodes in batches."""
    name, ckpt = odd_checkpoint
    engine = LLMEngine(EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=48, dtype=dtype))
    gen = torch.Generator().manual_seed(5)
    batch = torch.randint(0, 256, (2, 12), generator=gen).tolist()  # 24 rows: grouped-GEMM sized
    result = compare_layers(engine, _reference(ckpt, DTYPES[dtype]), batch)
    if dtype == "fp32":
        assert result["max_rel_error"] <= THRESHOLDS["max_rel_error"], (name, result["layer_rel_errors"])
    else:
        assert result["median_rel_error"] <= HALF_THRESHOLDS[DTYPES[dtype]], (name, result["layer_median_rel_errors"])
    outs = engine.generate([*batch, batch[0][:5], batch[1][:4]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert all(len(o.token_ids) == 4 and o.finish_reason == "length" for o in outs)


@pytest.mark.parametrize("extra", [[], ["--devices", "2"]], ids=["local", "placed"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_generate_cli_on_the_reported_mixtral(tmp_path_factory, dtype, extra):
    ckpt = tmp_path_factory.getbasetemp() / "odd_mixtral_52"
    if not ckpt.exists():
        tiny_checkpoint(ckpt, "mixtral", hidden_size=52, intermediate_size=20, num_attention_heads=2,
                        num_key_value_heads=2)
    result = CliRunner().invoke(app, ["generate", "--model", str(ckpt), "--dtype", dtype, "--max-tokens", "3",
                                      "--ignore-eos", "--threads", "1", "--prompt-ids", "3,4,5,6,7,8",
                                      "--prompt-ids", "9,10,11,12,13", *extra])
    assert result.exit_code == 0, result.output


def test_verify_cli_in_bf16_on_the_reported_deepseek(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "odd", "deepseek_v3", hidden_size=48, moe_intermediate_size=12)
    result = CliRunner().invoke(app, ["verify", "--model", str(ckpt), "--dtype", "bf16", "--max-new-tokens", "4"])
    assert result.exit_code == 0, result.output
    assert "hidden states + logits (bfloat16): median per-token rel error" in result.output
    assert result.output.rstrip().endswith("PASSED")


def test_verify_cli_names_a_bad_dtype(tmp_path):
    result = CliRunner().invoke(app, ["verify", "--model", str(tmp_path), "--dtype", "fp8"])
    assert result.exit_code == 2
    assert "moectl: error: --dtype: 'fp8' is not supported (use fp32, bf16 or fp16)" in result.output


def test_an_engine_failure_in_verify_is_not_bad_input(tmp_path, monkeypatch):
    """Only a missing transformers is the user's to fix (exit 2); the engine's own RuntimeError, such
    as the stride error, is a failure (exit 1)."""
    import moectl.engine.tools.verify as verify

    def crash(*args, **kwargs):
        raise RuntimeError("strides should be multiple of 16 bytes")

    monkeypatch.setattr(verify, "run_verify", crash)
    result = CliRunner().invoke(app, ["verify", "--model", str(tmp_path)])
    assert result.exit_code == 1
    assert "moectl: error: RuntimeError: strides should be multiple of 16 bytes" in result.output
