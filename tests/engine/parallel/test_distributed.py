"""The distributed backend: 2 ranks on CPU (gloo), tensor + expert parallel, against the
single-process engine. Each launch spawns two fresh interpreters, so launches are few and each
one checks several things."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moectl.engine.core.config import EngineConfig, SchedulerKnobs
from moectl.engine.core.kv_cache import KVCache
from moectl.engine.core.paged_attention import DecodeGroup, PagedContext, PrefillSlice
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.models.config import ModelConfig
from moectl.engine.models.decoder import MoEForCausalLM
from moectl.engine.models.loader import save_checkpoint
from moectl.engine.parallel.distributed import (
    DistributedError,
    GenerateJob,
    ScoreJob,
    check_layout,
    default_tp,
    generate_distributed,
    launch,
    launch_distributed,
    pack_step,
    run_rank,
    unpack_step,
)
from moectl.engine.parallel.sharding import ParallelError, local_kv_heads, tp_head_layout
from tests.checkpoints import randomize_, tiny_checkpoint

# small prefill chunks and a small block size: chunked prefill, several decode groups, a
# prefix-cache hit (prompts 0 and 3 share their first blocks)
KNOBS = SchedulerKnobs(max_num_batched_tokens=12, long_prefill_token_threshold=7)
ENGINE = dict(knobs=KNOBS, block_size=4, num_kv_blocks=96, num_threads=1)
PROMPTS = [list(range(3, 26)), [30, 31, 32], list(range(40, 51)), list(range(3, 15)) + [99, 98]]
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)
SCORE_IDS = list(range(5, 36))
API_PROMPTS = PROMPTS + ["def parse(x):"]

OLMOE = {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "vocab_size": 128, "hidden_size": 32,
         "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_experts": 8, "num_experts_per_tok": 2, "clip_qkv": 1.5, "norm_topk_prob": False,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "dtype": "float32"}
QWEN2 = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 128, "hidden_size": 32,
         "intermediate_size": 40, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 36,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 6,
         "num_experts_per_tok": 2, "norm_topk_prob": False, "mlp_only_layers": [1], "tie_word_embeddings": True,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "dtype": "float32"}

# latent attention with a q LoRA and YaRN, grouped sigmoid routing, a shared expert, a dense first layer
DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 128,
            "hidden_size": 32, "intermediate_size": 40, "moe_intermediate_size": 16, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
            "n_group": 4, "topk_group": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": 24,
            "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 10,
            "routed_scaling_factor": 2.5, "norm_topk_prob": True, "max_position_embeddings": 256,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "dtype": "float32",
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}

# sliding and full layers, sinks (split by heads under TP), router and expert biases, the clamped SwiGLU
GPT_OSS = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 128, "hidden_size": 32,
           "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 5,
           "layer_types": ["sliding_attention", "full_attention"], "swiglu_limit": 0.7,
           "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "dtype": "float32",
           "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "truncate": False,
                               "original_max_position_embeddings": 64}}


def _engine_checkpoint(raw: dict, out: Path, seed: int = 0) -> Path:
    """Every parameter redrawn (norm weights and biases too), so a mis-sharded one shows."""
    model = MoEForCausalLM(ModelConfig.from_hf(raw))
    randomize_(model, seed)
    save_checkpoint(model, out)
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    return {"mixtral": tiny_checkpoint(root / "mixtral"),
            "mixtral_other": tiny_checkpoint(root / "mixtral_other", seed=1, tokenizer=False),
            "olmoe": _engine_checkpoint(OLMOE, root / "olmoe"),
            "qwen2_moe": _engine_checkpoint(QWEN2, root / "qwen2_moe"),
            "deepseek_v3": _engine_checkpoint(DEEPSEEK, root / "deepseek_v3"),
            "gpt_oss": _engine_checkpoint(GPT_OSS, root / "gpt_oss")}


def _config(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), **ENGINE)


@pytest.fixture(scope="module")
def reference(ckpts, single_thread):
    """The single-process engine's greedy tokens and scored logits, per model."""
    out = {}
    for name in ("mixtral", "olmoe", "qwen2_moe", "deepseek_v3", "gpt_oss"):
        eng = LLMEngine(_config(ckpts[name]))
        out[name] = {"tokens": [o.token_ids for o in eng.generate(PROMPTS, PARAMS)], "logits": eng.score(SCORE_IDS)}
        if name == "mixtral":
            out[name]["tokens_api"] = [o.token_ids for o in eng.generate(API_PROMPTS, PARAMS)]
    return out


class BothJob:
    """Rank 0: a generate batch, then a scored prefill, in one session."""

    def __call__(self, engine):
        tokens = [o["token_ids"] for o in GenerateJob(PROMPTS, PARAMS)(engine)]
        return {"tokens": tokens, "logits": ScoreJob(SCORE_IDS)(engine),
                "kv_heads": engine.kv_cache.k.shape[3], "steps": engine.step_count}


class Sessions:
    """Several sessions (model, tp) one after another in the same two processes."""

    def __init__(self, sessions):
        self.sessions = sessions

    def __call__(self, state):
        return {key: run_rank(replace(_config(path), **extra[0]) if extra else _config(path),
                              TwoBatchJob() if extra else BothJob(), tp, state)
                for key, path, tp, *extra in self.sessions}


class TwoBatchJob(BothJob):
    """BothJob, and what the step records say of the micro-batches and the collectives."""

    def __call__(self, engine):
        out = super().__call__(engine)
        records = [s.as_record() for s in engine.step_log]
        out["micro_batches"] = [r["devices"]["micro_batches"] for r in records]
        out["hidden_s"] = [r["devices"]["link_hidden_s"] for r in records]
        out["span_names"] = sorted({n for r in records for n in r["spans"]["names"]})
        return out


class PerRankModel:
    """Rank r loads model_dirs[r]: a launch whose ranks disagree."""

    def __init__(self, model_dirs):
        self.model_dirs = model_dirs

    def __call__(self, state):
        return run_rank(_config(self.model_dirs[state.rank]), GenerateJob(PROMPTS[:1], PARAMS), 2, state)


@pytest.fixture(scope="module")
def sessions(ckpts):
    """One 2-rank launch: Mixtral tp=2 and tp=1, OLMoE tp=2 (full q/k norm), Qwen2-MoE tp=2
    (shared expert, qkv bias, a dense layer, tied embeddings), DeepSeek-V3 tp=2 (latent attention
    split by heads, the latent cached whole on each rank), gpt-oss tp=2 (sinks split by heads, a sliding
    layer); EP=2 throughout."""
    plan = [("mixtral_tp2", ckpts["mixtral"], 2), ("mixtral_tp1", ckpts["mixtral"], 1),
            ("olmoe_tp2", ckpts["olmoe"], 2), ("qwen2_moe_tp2", ckpts["qwen2_moe"], 2),
            ("deepseek_v3_tp2", ckpts["deepseek_v3"], 2), ("gpt_oss_tp2", ckpts["gpt_oss"], 2)]
    # two-batch overlap from 4 tokens a step: chunks and decode groups split between micro-batches
    tbo = {"overlap": "two-batch", "overlap_min_tokens": 4}
    plan += [(f"{key}_tbo", path, tp, tbo) for key, path, tp in plan if key != "mixtral_tp2"]
    return launch(Sessions(plan), nproc=2, timeout_s=120, collective_timeout_s=60, num_threads=1)


@pytest.mark.parametrize("key", ["mixtral_tp2", "mixtral_tp1", "olmoe_tp2", "qwen2_moe_tp2", "deepseek_v3_tp2",
                                 "gpt_oss_tp2", "mixtral_tp1_tbo", "olmoe_tp2_tbo", "qwen2_moe_tp2_tbo",
                                 "deepseek_v3_tp2_tbo", "gpt_oss_tp2_tbo"])
def test_two_ranks_match_single_process(sessions, reference, key):
    got, ref = sessions[key], reference[key.removesuffix("_tbo").rsplit("_", 1)[0]]
    assert got["tokens"] == ref["tokens"]
    diff = (got["logits"] - ref["logits"]).abs().max().item()
    assert diff <= 1e-4, diff
    assert got["steps"] > PARAMS.max_tokens  # prefill took several chunked steps
    tp = int(key.removesuffix("_tbo")[-1])
    # each rank caches only its kv heads; MLA's one latent "head" is whole on every rank
    assert got["kv_heads"] == (1 if key.startswith("deepseek") else 2 // tp)


@pytest.mark.parametrize("key", ["mixtral_tp1_tbo", "deepseek_v3_tp2_tbo", "gpt_oss_tp2_tbo"])
def test_two_batch_overlap_splits_steps_and_measures_hidden_collectives(sessions, key):
    got = sessions[key]
    split = [m for m in got["micro_batches"] if len(m) == 2]
    assert split and all(a > 0 and b > 0 for a, b in split)  # steps ran as two micro-batches
    assert any(len(m) == 1 and m[0] < 4 for m in got["micro_batches"])  # small steps ran as one batch
    hidden = [h for m, h in zip(got["micro_batches"], got["hidden_s"]) if len(m) == 2]
    assert all(len(h) == 2 for h in hidden) and sum(map(sum, hidden)) > 0
    one_batch = [h for m, h in zip(got["micro_batches"], got["hidden_s"]) if len(m) == 1]
    assert all(h == [0.0, 0.0] for h in one_batch)  # nothing is in flight under compute in one batch
    names = got["span_names"]
    for name in ("experts (mb 0)", "experts (mb 1)", "all_reduce combine (mb 1)", "attention (mb 0)"):
        assert name in names, names


def test_generate_distributed_api(ckpts, reference):
    """The public entry: strings and token ids, tp defaulting to the world size (2)."""
    outs = generate_distributed(ckpts["mixtral"], API_PROMPTS, PARAMS, nproc=2, timeout_s=120, **ENGINE)
    assert [o["token_ids"] for o in outs] == reference["mixtral"]["tokens_api"]
    assert outs[-1]["prompt_ids"] and isinstance(outs[-1]["text"], str) and outs[-1]["text"]
    assert outs[0]["prompt_ids"] == PROMPTS[0]


def test_ranks_loading_different_models_are_refused(ckpts):
    with pytest.raises(ValueError) as info:
        launch(PerRankModel([ckpts["mixtral"], ckpts["mixtral_other"]]), nproc=2, timeout_s=90,
               collective_timeout_s=30, num_threads=1)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("distributed: rank 1 loaded a different model than rank 0 (weights differ")


class FailsAfterOneRequest:
    """Rank 0 serves one request, then its job raises: the error comes back as one line and the
    worker, released by the stop message, exits cleanly."""

    def __call__(self, engine):
        GenerateJob(PROMPTS[:1], SamplingParams(max_tokens=2))(engine)
        raise RuntimeError("job failed on purpose")


def test_a_failing_rank_stops_the_launch_without_hanging(ckpts):
    import multiprocessing

    with pytest.raises(DistributedError, match=r"^distributed: rank 0 failed: RuntimeError: job failed on purpose$"):
        launch_distributed(_config(ckpts["mixtral"]), FailsAfterOneRequest(), nproc=2, timeout_s=90)
    assert not multiprocessing.active_children()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_entry_refuses_disagreeing_ranks_with_exit_code_2(ckpts, tmp_path):
    """The torchrun path (RANK/WORLD_SIZE/MASTER_* from the environment): exit code 2, a clear
    line on stderr from every rank, and nobody hangs."""
    port = _free_port()
    procs = []
    for rank, name in enumerate(("mixtral", "mixtral_other")):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "moectl.engine.parallel.distributed", "--model", str(ckpts[name]), "--prompt-ids", "5,6,7",
             "--device", "cpu", "--json"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True))
    try:
        results = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 2, err
        assert "rank 1 loaded a different model than rank 0" in err
        assert out == ""


# -- no processes needed

def test_head_layout_and_limits():
    # 4 q heads, 2 kv heads: tp=2 splits both; tp=4 replicates each kv head on two ranks
    assert [tp_head_layout(4, 2, r, 2) for r in range(2)] == [(range(0, 2), range(0, 1)), (range(2, 4), range(1, 2))]
    assert [tp_head_layout(4, 2, r, 4)[1] for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert local_kv_heads(32, 8, 8) == 1 and local_kv_heads(32, 8, 2) == 4
    cfg = ModelConfig.from_hf({**OLMOE, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 8})
    with pytest.raises(ParallelError, match="tp: 4 does not divide the model's 6 attention heads"):
        check_layout(cfg, 4, 4)
    with pytest.raises(ParallelError, match=r"tp: tensor-parallel size must be an integer in \[1, 8\], got 16"):
        check_layout(cfg, 16, 16)
    with pytest.raises(ParallelError, match="exceed the model's 8 experts"):
        check_layout(ModelConfig.from_hf(OLMOE), 16, 1)
    assert default_tp(cfg, 4) == 2 and default_tp(ModelConfig.from_hf(OLMOE), 2) == 2


def test_step_message_round_trip():
    cache = KVCache(1, 8, 4, 1, 2, torch.float32)
    ctx = PagedContext(cache=cache, slot_mapping=torch.tensor([5, 9, 10, 11]), num_decodes=2,
                       decode_context_lens=torch.tensor([2, 6]))
    ctx.decode_groups = [DecodeGroup(0, 1, torch.tensor([1]), 1, torch.tensor([[[[True, True, False, False]]]])),
                         DecodeGroup(1, 2, torch.tensor([2, 3]), 2, None)]
    ctx.prefills = [PrefillSlice(2, 4, 0, torch.tensor([4]))]
    ids, pos, got, split, interleaved = unpack_step(pack_step(torch.tensor([7, 8, 9, 10]), torch.tensor([1, 5, 0, 1]),
                                                              ctx, 3, False), cache, torch.device("cpu"))
    assert ids.tolist() == [7, 8, 9, 10] and pos.tolist() == [1, 5, 0, 1] and (split, interleaved) == (3, False)
    with pytest.raises(DistributedError, match="corrupt"):  # a split outside the step's tokens
        unpack_step(pack_step(torch.tensor([7, 8, 9, 10]), torch.tensor([1, 5, 0, 1]), ctx, 4), cache,
                    torch.device("cpu"))
    assert got.slot_mapping.tolist() == [5, 9, 10, 11] and got.num_decodes == 2
    assert got.decode_context_lens.tolist() == [2, 6]
    for a, b in zip(got.decode_groups, ctx.decode_groups):
        assert (a.start, a.end, a.width) == (b.start, b.end, b.width)
        assert a.blocks.reshape(-1).tolist() == b.blocks.tolist()
        if a.lens is not None:  # this rank reads its cache in place: each row's key count, no mask
            assert a.lens.tolist() == ctx.decode_context_lens[a.start:a.end].tolist()
        else:
            assert (a.mask is None and b.mask is None) or torch.equal(a.mask, b.mask)
    p = got.prefills[0]
    assert (p.start, p.end, p.cached_len, p.block_table.tolist()) == (2, 4, 0, [4])


# ---------------------------------------------------------------- placement on ranks, changed live

def _scrambled_placement(num_layers: int, num_experts: int) -> dict:
    """Two ranks, one spare slot each: experts interleaved (not contiguous), expert 0 replicated."""
    import numpy as np

    from moectl.placement.placement import Placement

    half = num_experts // 2
    row = np.full((2, half + 1), -1)
    row[0, :half] = np.arange(0, num_experts, 2)
    row[1, :half] = np.arange(1, num_experts, 2)
    row[1, half] = 0  # a replica of expert 0 on rank 1
    return Placement(np.broadcast_to(row, (num_layers, 2, half + 1)), num_experts).to_dict()


class MigrationJob:
    """Rank 0: requests in flight, a live placement change mid-run, more steps; the tokens, the
    migration's measured figures and the step records' device fields."""

    def __init__(self, placement: dict):
        self.placement = placement

    def __call__(self, engine):
        from moectl.placement.placement import Placement

        streams = [engine.add_request(p, PARAMS, stream=True) for p in PROMPTS]
        for _ in range(4):
            engine.step()
        before = engine.experts.placement
        future = engine.experts.apply(Placement.from_dict(self.placement))
        while engine.has_unfinished():
            engine.step()
        result = future.result(timeout=5)
        records = [s.as_record() for s in engine.step_log]
        return {"tokens": [list(s)[-1].token_ids for s in streams], "apply": result,
                "placement_changed": before != engine.experts.placement, "spans": records[-1]["spans"],
                "devices": [r["devices"] for r in records], "header": engine.experts.header()}


class PlacedSessions:
    """Sessions with an initial placement (replicas, spare slots) per routing policy, and one
    with a live migration."""

    def __init__(self, path):
        self.path = path

    def __call__(self, state):
        cfg = ModelConfig.from_dir(self.path)
        placed = _scrambled_placement(cfg.num_layers, cfg.num_experts)
        out = {}
        for policy in ("locality", "least_loaded", "round_robin"):
            config = EngineConfig(model=str(self.path), placement=placed, routing_policy=policy,
                                  topology=_topology(), **ENGINE)
            out[policy] = run_rank(config, GenerateJob(PROMPTS, PARAMS), 2, state)
        config = EngineConfig(model=str(self.path), redundant_slots=1, topology=_topology(), **ENGINE)
        out["migration"] = run_rank(config, MigrationJob(placed), 2, state)
        return out


def _topology():
    from moectl.placement.topology import Topology

    return Topology(num_devices=2)


@pytest.fixture(scope="module")
def placed(ckpts):
    return launch(PlacedSessions(ckpts["mixtral"]), nproc=2, timeout_s=120, collective_timeout_s=60, num_threads=1)


@pytest.mark.parametrize("policy", ["locality", "least_loaded", "round_robin"])
def test_any_placement_on_ranks_gives_the_same_tokens(placed, reference, policy):
    assert [o["token_ids"] for o in placed[policy]] == reference["mixtral"]["tokens"]


def test_a_live_migration_between_ranks_keeps_tokens_and_is_measured(placed, reference):
    run = placed["migration"]
    assert run["tokens"] == reference["mixtral"]["tokens"]  # requests in flight across the change
    assert run["placement_changed"]
    migration = run["apply"]["migration"]
    assert migration["measured"] and len(migration["per_rank"]) == 2
    assert migration["bytes_transferred"] > 0 and migration["bytes_transferred"] == run["apply"]["bytes_moved"]
    assert all(r["seconds"] > 0 for r in migration["per_rank"])
    assert sum(r["bytes_sent"] for r in migration["per_rank"]) == migration["bytes_transferred"]


def test_distributed_step_records_are_measured_per_rank(placed):
    run = placed["migration"]
    assert run["header"]["backend"] == "distributed" and run["header"]["link_time"] == "measured"
    for dev in run["devices"]:
        assert dev["backend"] == "distributed" and dev["link_s_modeled"] is False
        assert dev["step_time"]["modeled"] is False and dev["step_time"]["step_s"] > 0
        assert len(dev["busy_s"]) == 2 and all(b > 0 for b in dev["busy_s"])
        assert len(dev["link_wait_s"]) == 2 and dev["telemetry_s"] > 0
        assert all(p["rss_bytes"] > 0 for p in dev["process"])
        assert sum(dev["tokens"]) > 0 and len(dev["memory"]) == 2
    # the cost model is calibrated from what the ranks measured
    assert run["devices"][-1]["step_time"]["cost_model"]["samples"] > 0


def test_rank_zeros_timeline_has_its_measured_expert_and_link_spans(placed):
    run = placed["migration"]
    spans = run["spans"]
    names = set(spans["names"])
    assert {"experts", "all_reduce combine", "wait for ranks"} <= names
    lanes = [spans["lanes"][i] for i in set(spans["lane"].tolist())]
    assert "device 0" in lanes and "link 0" in lanes
    assert not spans["modeled"].any()  # nothing on this backend's timeline is modeled
