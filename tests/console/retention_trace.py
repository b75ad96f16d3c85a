"""A small trace of synthetic step records with KV retention figures (wire/records.py's
cache.kv_retention) whose numbers are worked out here: two devices, two sequences each, full
retention for the first SWITCH steps, then snapkv with a 64-token budget (a knobs action)."""

from __future__ import annotations

from moectl.profiler.trace_store import TraceWriter
from tests.records import make_record

DEVICES = 2
STEPS = 60
SWITCH = 20  # the knobs action: snapkv, 64 tokens, recorded before this step
BLOCK = 16
TOKEN_BYTES = 8192  # one token's K/V over the full-attention layers
PROMPT = 300
KNOBS = {"max_num_seqs": 8, "max_num_batched_tokens": 1024, "long_prefill_token_threshold": 256, "policy": "fcfs",
         "kv_retention": "full", "kv_budget": 0, "kv_budget_fraction": 1.0, "kv_sink_tokens": 4,
         "kv_recent_tokens": 64}
SNAPKV = {**KNOBS, "kv_retention": "snapkv", "kv_budget": 64}
HEADER = {"model": {"name": "synthetic-retention", "num_layers": 2, "num_experts": 4},
          "devices": {"topology": {"num_devices": DEVICES, "hbm_bytes": 1 << 30}, "backend": "emulated"},
          "knobs": KNOBS}


def figures(step: int) -> tuple[int, int, int]:
    """(held, context, evicted) tokens of one device's two sequences after `step`: their prompts
    computed by step 2, then one token each a step; from SWITCH on each keeps 80 tokens (sinks,
    budget and recent blocks), the rest evicted in whole blocks."""
    per_seq = min(step, 2) * PROMPT // 2 + max(0, step - 2)
    context = 2 * per_seq
    if step < SWITCH:
        return context, context, 0
    kept = min(per_seq, 80 + (per_seq - 80) % BLOCK)  # whole blocks go: what does not fill one stays
    return 2 * kept, context, 2 * (per_seq - kept)


def record(step: int) -> dict:
    held, context, evicted = figures(step)
    rec = make_record(step, busy_s=[0.01] * DEVICES, tokens=[40, 60],
                      memory=[{"expert_weights": 3 << 20, "kv_blocks": -(-held // 2 // BLOCK) * 2 * BLOCK * TOKEN_BYTES}
                              for _ in range(DEVICES)])
    rec["knobs"] = dict(SNAPKV if step >= SWITCH else KNOBS)
    policy = rec["knobs"]["kv_retention"]
    rec["cache"]["kv_retention"] = {
        "policy": policy, "budget_tokens": rec["knobs"]["kv_budget"], "budget_fraction": 1.0,
        "token_bytes": TOKEN_BYTES, "held_tokens": [held] * DEVICES, "context_tokens": [context] * DEVICES,
        "evicted_tokens": [evicted] * DEVICES}
    return rec


def write_retention_trace(path) -> None:
    with TraceWriter(path, HEADER) as writer:
        for step in range(1, STEPS + 1):
            if step == SWITCH:
                rec = record(step)
                writer.write_action({"time": rec["t_start"] - 0.01, "step": step - 1, "kind": "knobs",
                                     "args": {"kv_retention": "snapkv", "kv_budget": 64, "kv_budget_fraction": 1.0},
                                     "result": SNAPKV})
            assert writer.write_step(record(step))
