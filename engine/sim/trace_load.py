"""A recorded step as the step model's load: what the simulation of a measured step prices, so
that simulated and measured step times can be set side by side (bench/sim_machine_validation.py).

From a step record of moectl's distributed backend (every rank holds every token; attention and
the dense parts tensor parallel over the ranks, the experts' outputs all-reduced):
* tokens: the batch's prompt and decode tokens; sequences sampled: its sequences;
* decode keys: the KV tokens the cache holds (kv_blocks_used x block size), which a decode-only
  step's sequences attend one token each; a mixed step's decode share of them by its decode
  tokens over its sequences;
* prompt keys: each prompt token attends half its prompt on average, the trace's mean prompt
  (its finished requests');
* the routed pairs: the record's own routing, MoE layers only.
Each part above is an approximation where the record does not hold the figure itself (which
sequence had which context), and the bench says so beside its errors.
"""

from __future__ import annotations

import numpy as np

from moectl.engine.sim.step_model import StepLoad, window_classes


def mean_prompt(requests_events) -> float:
    prompts = [e["prompt_tokens"] for e in requests_events if e.get("event") == "finished" and e.get("prompt_tokens")]
    return float(np.mean(prompts)) if prompts else 128.0


def load_from_record(record: dict, shape, moe_layers: list[int], block_size: int, prompt: float) -> StepLoad:
    batch, cache = record["batch"], record.get("cache") or {}
    return ranks_load(shape, batch["prefill_tokens"], batch["decode_tokens"], batch["num_seqs"],
                      cache.get("kv_blocks_used", 0) * block_size, prompt,
                      np.asarray(record["routing"], dtype=np.float64)[moe_layers])


def ranks_load(shape, prefill: int, decode: int, seqs: int, kv_tokens: float, prompt: float,
               pairs: np.ndarray | None = None) -> StepLoad:
    """One step of moectl's ranks (one attention group holding every token): `prefill` prompt
    tokens of prompts of `prompt` tokens, `decode` tokens over `kv_tokens` KV tokens held, `seqs`
    sequences sampled; pairs: the routed (token, choice) pairs per MoE layer and expert (default
    balanced)."""
    seqs = max(1, seqs)
    tokens = prefill + decode
    if pairs is None:
        pairs = np.full((shape.num_sparse, shape.num_experts), tokens * shape.top_k / shape.num_experts)
    windows, _ = window_classes(shape)
    decode_keys = np.array([[min(kv_tokens, w * decode) if w else kv_tokens * decode / seqs] for w in windows],
                           dtype=np.float64)
    prompt_keys = np.array([[prefill * (min(prompt, w) if w else prompt) / 2] for w in windows], dtype=np.float64)
    reads = decode_keys + np.array([[prefill]] * len(windows), dtype=np.float64)
    return StepLoad(np.array([float(tokens)]), np.array([float(seqs)]), decode_keys, prompt_keys, reads, pairs,
                    np.array([float(prefill)]))
