"""What INT8 KV quantisation saves and what it costs, measured on one checkpoint.

Accuracy is measured teacher-forced one token per step, so every position reads its whole
context back from the quantised cache, as decoding does.
"""

from __future__ import annotations

import time

import torch

from moectl.engine.core.config import EngineConfig, SchedulerKnobs
from moectl.engine.core.kv_cache import KVCache
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.models.loader import load_model


def _nll(logits: torch.Tensor, ids: list[int]) -> float:
    targets = torch.tensor(ids[1:])
    return torch.nn.functional.cross_entropy(logits[:-1], targets).item()


def run_kv_int8_eval(model_dir: str, token_ids: list[int], prompts: list[list[int]], *, max_tokens: int = 32,
                     dtype: str | None = None, log=print) -> dict:
    model = load_model(model_dir, dtype=dtype)
    cfg = model.cfg
    engines = {}
    for kind in ("auto", "int8"):
        # one token per step: decode-path attention over the cache at every position
        engines[kind] = LLMEngine(EngineConfig(model=model_dir, dtype=dtype, kv_cache_dtype=kind,
                                               knobs=SchedulerKnobs(max_num_batched_tokens=1)), model=model)
    t0 = time.perf_counter()
    exact, quant = engines["auto"].score(token_ids), engines["int8"].score(token_ids)
    nll_exact, nll_quant = _nll(exact, token_ids), _nll(quant, token_ids)
    greedy = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for eng in engines.values():
        eng.update_knobs(max_num_batched_tokens=1024)
    a = engines["auto"].generate(prompts, greedy)
    b = engines["int8"].generate(prompts, greedy)
    agree = sum(_common_prefix(x.token_ids, y.token_ids) for x, y in zip(a, b))
    per_block = {q: KVCache.block_bytes_for(cfg, 16, q) for q in (False, True)}
    bf16_block = KVCache.block_bytes_for(cfg, 16, False, dtype=torch.bfloat16)
    result = {
        "model_dtype": str(cfg.dtype).removeprefix("torch."),
        "bytes_per_block_model_dtype": per_block[False], "bytes_per_block_int8": per_block[True],
        "memory_ratio": per_block[True] / per_block[False],
        "memory_ratio_vs_bf16": per_block[True] / bf16_block,
        "tokens_scored": len(token_ids),
        "nll_model_dtype": nll_exact, "nll_int8": nll_quant,
        "nll_rel_diff": abs(nll_quant - nll_exact) / abs(nll_exact),
        "logits_max_rel_error": ((quant - exact).abs().max() / exact.abs().max()).item(),
        "top1_agreement": (quant.argmax(-1) == exact.argmax(-1)).float().mean().item(),
        "greedy_prefix_agreement": agree / (max_tokens * len(prompts)),
        "seconds": time.perf_counter() - t0,
    }
    log(f"INT8 KV: {result['memory_ratio']:.2f}x the bytes of {result['model_dtype']} KV "
        f"({per_block[True]:,} vs {per_block[False]:,} bytes per 16-token block)")
    log(f"  NLL {nll_exact:.4f} -> {nll_quant:.4f} (rel diff {result['nll_rel_diff']:.2%}), "
        f"top-1 agreement {result['top1_agreement']:.2%}, greedy tokens identical "
        f"{result['greedy_prefix_agreement']:.2%} (before first divergence)")
    return result


def default_eval_inputs(model_dir, text_tokens: int = 512, num_prompts: int = 8, prompt_tokens: int = 48):
    """Token ids of a fixed stdlib source text, and code-snippet prompts (random ids without a tokenizer)."""
    import random

    from moectl.engine.models.config import ModelConfig
    from moectl.engine.models.tokenizer import Tokenizer
    from moectl.engine.tools.corpus import code_snippets
    from moectl.engine.tools.verify import default_reference_text

    cfg = ModelConfig.from_dir(model_dir)
    tok = Tokenizer.from_dir(model_dir, cfg.bos_token_id)
    if tok is None:
        rng = random.Random(0)
        text = [rng.randrange(cfg.vocab_size) for _ in range(text_tokens)]
        return text, [[rng.randrange(cfg.vocab_size) for _ in range(prompt_tokens)] for _ in range(num_prompts)]
    text = tok.encode(default_reference_text())[:text_tokens]
    prompts = [tok.encode(s)[:prompt_tokens] for s in code_snippets(num_prompts, seed=1234, min_chars=200, max_chars=400)]
    return text, prompts


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
