"""gpt-oss in the engine: the pieces verify compares really act (window, sinks, clamp, biases),
the saver round-trips its layout, and bad sliding-window configs name their field.
(Numerics against transformers: tests/engine/tools/test_verify.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from moectl.engine.models.attention import DenseContext
from moectl.engine.models.config import ConfigError, ModelConfig
from moectl.engine.models.loader import load_model, save_checkpoint

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def model(tiny_hf_checkpoint):
    return load_model(tiny_hf_checkpoint("gpt_oss"))


def _logits(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        return model.logits(model(torch.tensor(ids), torch.arange(len(ids)), DenseContext(1, len(ids))))


def test_window_sinks_clamp_and_biases_each_change_the_output(model):
    ids = [(7 * i + 3) % 256 for i in range(24)]  # longer than the window of 3
    base = _logits(model, ids)
    attn0, mlp0 = model.layers[0].attn, model.layers[0].mlp
    assert attn0.window == 3 and model.layers[1].attn.window == 0

    def differs(edit, undo) -> bool:
        edit()
        try:
            return (_logits(model, ids) - base).abs().max().item() > 1e-3
        finally:
            undo()

    assert differs(lambda: setattr(attn0, "window", 0), lambda: setattr(attn0, "window", 3))
    sinks = attn0.sinks.clone()
    assert differs(lambda: attn0.sinks.data.fill_(-1e4), lambda: attn0.sinks.data.copy_(sinks))
    ffn = mlp0.experts.ffn
    assert differs(lambda: setattr(mlp0.experts, "ffn", type(ffn)(biased=True, limit=None)),
                   lambda: setattr(mlp0.experts, "ffn", ffn))
    bias = mlp0.experts.w13.data[..., -1].clone()
    assert differs(lambda: mlp0.experts.w13.data[..., -1].zero_(), lambda: mlp0.experts.w13.data[..., -1].copy_(bias))
    assert model.cfg.param_counts()["params_total"] == sum(p.numel() for p in model.parameters())


def test_saver_round_trips_the_gpt_oss_layout(model, tiny_hf_checkpoint, tmp_path):
    from safetensors import safe_open

    save_checkpoint(model, tmp_path / "copy")
    src = tiny_hf_checkpoint("gpt_oss") / "model.safetensors"
    with safe_open(str(src), "pt") as theirs, safe_open(str(tmp_path / "copy" / "model.safetensors"), "pt") as ours:
        assert set(theirs.keys()) == set(ours.keys())
        for name in theirs.keys():
            assert torch.equal(theirs.get_tensor(name), ours.get_tensor(name)), name


def _raw(tiny_hf_checkpoint, name="gpt_oss") -> dict:
    return json.loads((tiny_hf_checkpoint(name) / "config.json").read_text())


@pytest.mark.parametrize("name, edit, field", [
    ("gpt_oss", {"sliding_window": 4096}, "sliding_window"),  # larger than the 512-token context
    ("gpt_oss", {"layer_types": ["full_attention"]}, "layer_types"),
    ("gpt_oss", {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "layer_types"),
    ("gpt_oss", {"sliding_window": None}, "sliding_window"),
    ("gpt_oss", {"swiglu_limit": -1.0}, "swiglu_limit"),
    ("qwen3_moe_sliding", {"sliding_window": None}, "sliding_window"),
    ("deepseek_v3", {"sliding_window": 64}, "sliding_window"),
])
def test_bad_window_configs_name_the_field(tiny_hf_checkpoint, name, edit, field):
    raw = {**_raw(tiny_hf_checkpoint, name), **edit}
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_hf(raw)
    assert str(err.value).startswith(field + ":"), str(err.value)


def test_window_rules_per_architecture(tiny_hf_checkpoint):
    windows = {name: ModelConfig.from_hf(_raw(tiny_hf_checkpoint, name)).layer_windows
               for name in ("gpt_oss", "gpt_oss_full", "mixtral_sliding", "qwen3_moe_sliding", "mixtral")}
    assert windows == {"gpt_oss": (3, 0, 3), "gpt_oss_full": (0, 0, 5), "mixtral_sliding": (6, 6, 6),
                       "qwen3_moe_sliding": (5, 5, 5), "mixtral": (0, 0, 0)}
    qwen2 = {**_raw(tiny_hf_checkpoint, "qwen2_moe"), "use_sliding_window": True, "sliding_window": 4,
             "max_window_layers": 2}
    qwen2.pop("layer_types", None)
    assert ModelConfig.from_hf(qwen2).layer_windows == (4, 0, 0)  # transformers' default: even layers below 2


def _engine(path, **kw):
    from moectl.engine.core.config import EngineConfig
    from moectl.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=4, num_kv_blocks=128, **kw))


def test_sliding_layers_free_their_blocks_and_stay_bounded(tiny_hf_checkpoint):
    """One long request: the full layers' table grows with the sequence; the sliding layers hold at
    most (window - 1 + chunk) / block_size + 1 blocks at any step, release the rest, and the tokens
    are those of recomputing the whole sequence densely (window masks only, no cache)."""
    from moectl.engine.core.config import SchedulerKnobs
    from moectl.engine.core.sampling import SamplingParams
    from tests.checkpoints import reference_greedy

    knobs = SchedulerKnobs(long_prefill_token_threshold=8, max_num_batched_tokens=8)
    engine = _engine(tiny_hf_checkpoint("gpt_oss"), knobs=knobs, enable_prefix_caching=False)
    prompt = [(5 * i + 1) % 256 for i in range(30)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt, params, request_id="long")
    held, main = [], []
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            held.append(len(engine.blocks.window.held(seq)))
            main.append(len(seq.block_table))
        engine.blocks.check_invariants()
    window, bs = 3, 4
    bound = -(-(window - 1 + knobs.max_num_batched_tokens) // bs) + 1
    assert max(held) <= bound and held[-1] <= -(-window // bs) + 1
    assert max(main) >= -(-(30 + 40 - 2) // bs)  # the full layers keep every position
    assert engine.generate([prompt], params)[0].token_ids == reference_greedy(engine.model, prompt, 40)
    assert engine.blocks.window.store.num_used == 0 and engine.blocks.num_used == 0  # all returned


def test_prefix_reuse_with_sliding_layers_keeps_the_tokens(tiny_hf_checkpoint):
    """A prefix hit needs the sliding layers' blocks just before its end too: the hit is cut back to
    where they are still cached, and the tokens do not change."""
    from moectl.engine.core.config import SchedulerKnobs
    from moectl.engine.core.sampling import SamplingParams
    from tests.checkpoints import reference_greedy

    engine = _engine(tiny_hf_checkpoint("gpt_oss"), knobs=SchedulerKnobs(long_prefill_token_threshold=8,
                                                                          max_num_batched_tokens=24))
    shared = [(3 * i + 2) % 256 for i in range(26)]
    batch = [shared + [i + 7, i + 9] for i in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    first = [o.token_ids for o in engine.generate(batch, params)]
    hits = engine.blocks.prefix_hits
    again = [o.token_ids for o in engine.generate(batch, params)]
    assert engine.blocks.prefix_hits > hits
    assert first == again == [reference_greedy(engine.model, p, 12) for p in batch]
    engine.blocks.check_invariants()


def test_plan_memory_bounds_the_sliding_layers_kv_like_the_engine(tiny_hf_checkpoint):
    """plan memory counts the sliding layers at (window - 1 + chunk) / block + 1 blocks, and the
    engine's KV in use on one long sequence never exceeds the plan."""
    from moectl.engine.core.config import SchedulerKnobs
    from moectl.engine.core.sampling import SamplingParams
    from moectl.engine.planning.memory_plan import plan_memory
    from moectl.placement.topology import Topology

    raw = _raw(tiny_hf_checkpoint)
    context, bs, mbt = 80, 4, 8
    plan = plan_memory(raw, Topology(num_devices=1, hbm_bytes=1 << 30), context=context, dtype="fp32",
                       block_size=bs, max_batched_tokens=mbt)
    full = plan_memory({**raw, "layer_types": ["full_attention"] * 3}, Topology(num_devices=1, hbm_bytes=1 << 30),
                       context=context, dtype="fp32", block_size=bs, max_batched_tokens=mbt)
    per_layer_block = 2 * bs * 2 * 16 * 4  # K and V, 2 kv heads of 16, fp32
    blocks, held = context // bs, -(-(3 - 1 + mbt) // bs) + 1
    assert plan.devices[0].kv_cache == per_layer_block * (1 * blocks + 2 * held)  # 1 full layer, 2 sliding
    assert full.devices[0].kv_cache == per_layer_block * 3 * blocks
    assert any("sliding-window layers: 2 of 3" in n for n in plan.notes)
    engine = _engine(tiny_hf_checkpoint("gpt_oss"), topology=Topology(num_devices=1),
                     knobs=SchedulerKnobs(long_prefill_token_threshold=mbt, max_num_batched_tokens=mbt),
                     enable_prefix_caching=False)
    engine.add_request([i % 256 for i in range(30)], SamplingParams(max_tokens=context - 30, ignore_eos=True))
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.kv_bytes_per_pool(used=True)[0])
    assert 0 < peak <= plan.devices[0].kv_cache


def test_knobs_that_would_outgrow_the_window_pool_are_refused(tiny_hf_checkpoint):
    """The window pool is sized for the knobs at start (max_num_seqs sequences of window - 1 +
    one chunk); a larger chunk that one sequence could not fit is refused, not left to stall."""
    from moectl.engine.core.config import KnobError, SchedulerKnobs

    engine = _engine(tiny_hf_checkpoint("gpt_oss"), knobs=SchedulerKnobs(max_num_seqs=2, max_num_batched_tokens=8,
                                                                        long_prefill_token_threshold=8))
    assert engine.blocks.window.store.num_blocks == 2 * (-(-(3 - 1 + 8) // 4) + 1)
    with pytest.raises(KnobError, match="^max_num_batched_tokens: 64 lets one sequence hold 18 sliding-window"):
        engine.update_knobs(max_num_batched_tokens=64)
    assert engine.update_knobs(max_num_batched_tokens=16).max_num_batched_tokens == 16  # 6 blocks: fits
    from moectl.engine.core.sampling import SamplingParams

    engine.generate([list(range(20))], SamplingParams(max_tokens=4))  # runs the knob change
    scored = engine.score(list(range(40)))
    assert scored.shape[0] == 40 and engine.blocks.window.store.num_used == 0
