"""The disk tier (--host-mem): experts left in the checkpoint's files behind a host cache and the
devices' HBM caches give the all-in-memory tokens, on every expert layout; per-tier counters;
bad input."""

from __future__ import annotations

import pytest

from moectl.engine.core.config import EngineConfig
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.experts.disk_tier import DiskExperts, SafetensorsFiles, one_expert_bytes
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.models.config import ConfigError, ModelConfig
from moectl.engine.models.loader import CheckpointError
from moectl.placement.topology import Topology
from tests.checkpoints import prompts, tiny_checkpoint

pytestmark = pytest.mark.usefixtures("single_thread")
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _batch(vocab: int) -> list[list[int]]:
    return [[t % vocab for t in p] for p in prompts(4, seed=5)]


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), block_size=4, num_kv_blocks=96, num_threads=1, **kw))


def _checkpoint(name, tiny_hf_checkpoint, tmp_path):
    return tiny_checkpoint(tmp_path / "engine") if name == "engine" else tiny_hf_checkpoint(name)


# the engine's Mixtral (per-expert w1/w3/w2), Qwen3 sharded over an index, DeepSeek-V3 (per-expert
# names, a dense first layer), gpt-oss (fused, transposed, interleaved, with biases)
@pytest.mark.parametrize("name", ["engine", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_experts_on_disk_give_the_all_in_memory_tokens(name, tiny_hf_checkpoint, tmp_path):
    path = _checkpoint(name, tiny_hf_checkpoint, tmp_path)
    cfg = ModelConfig.from_dir(path)
    batch = _batch(cfg.vocab_size)
    topology = Topology(num_devices=2)
    want = [o.token_ids for o in _engine(path, topology=topology).generate(batch, GREEDY)]
    one = one_expert_bytes(cfg)
    # a host cache of 3 experts and HBM caches of a layer's working set: most lookups go to disk
    engine = _engine(path, topology=topology, host_mem=3 * one, expert_cache_slots=cfg.num_experts // 2)
    disk = engine.model.disk_experts
    assert engine.model.layers[-1].mlp.experts.logical.w13.is_meta  # never loaded
    assert [o.token_ids for o in engine.generate(batch, GREEDY)] == want
    tiers = [r.devices["tiers"] for r in engine.step_log]
    reads = sum(t["disk"]["reads"] for t in tiers)
    # fp32 files and an fp32 model: a read is exactly one expert's bytes (gpt-oss: its biases included)
    assert reads > 0 and sum(t["disk"]["bytes_read"] for t in tiers) == reads * one
    assert sum(t["host"]["hits"] + t["host"]["misses"] for t in tiers) >= reads
    assert all(t["host"]["expert_weights"] <= 3 * one for t in tiers) and len(disk.cached) <= 3
    assert engine.step_log[-1].devices["tiered_experts"] == "disk"


def test_the_router_prefetch_reaches_down_to_disk(tmp_path):
    path = tiny_checkpoint(tmp_path / "m", num_hidden_layers=3)
    cfg = ModelConfig.from_dir(path)
    engine = _engine(path, topology=Topology(num_devices=2), host_mem=2 * one_expert_bytes(cfg),
                     expert_cache_slots=cfg.num_experts, expert_prefetch="router")
    engine.generate(_batch(cfg.vocab_size), GREEDY)
    disk = [r.devices["tiers"]["disk"] for r in engine.step_log]
    assert sum(d["prefetch_reads"] for d in disk) > 0 and sum(d["prefetch_s"] for d in disk) > 0


def test_experts_that_fit_the_host_memory_are_loaded_whole(tmp_path):
    path = tiny_checkpoint(tmp_path / "m")
    engine = _engine(path, host_mem=1 << 30)
    assert not hasattr(engine.model, "disk_experts") and engine.config.topology.num_devices == 1


def test_host_mem_below_one_expert_is_refused_naming_the_flag(tmp_path):
    path = tiny_checkpoint(tmp_path / "m")
    with pytest.raises(ConfigError, match="^--host-mem: .* smaller than one expert"):
        DiskExperts(path, ModelConfig.from_dir(path), 10)
    from typer.testing import CliRunner

    from moectl.cli.main import app

    res = CliRunner().invoke(app, ["generate", "--model", str(path), "--prompt-ids", "1,2", "--host-mem", "1KiB"])
    assert res.exit_code == 2 and "--host-mem" in res.output and len(res.output.strip().splitlines()) == 1


def test_a_corrupt_header_is_one_line(tmp_path):
    path = tiny_checkpoint(tmp_path / "m")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(CheckpointError, match="^model.safetensors: corrupt safetensors header"):
        SafetensorsFiles(path)


def test_the_sample_model_in_its_own_bf16_from_disk():
    """A bf16 checkpoint: the caches take the checkpoint's dtype, and the tokens are unchanged."""
    from moectl.engine import sample_model_dir

    path = sample_model_dir()
    batch = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    want = [o.token_ids for o in _engine(path, topology=Topology(num_devices=1)).generate(batch, GREEDY)]
    engine = _engine(path, host_mem=2 << 20)
    assert engine.model_config.dtype == engine.experts.cluster.caches[0].w13_cache.dtype
    assert [o.token_ids for o in engine.generate(batch, GREEDY)] == want


def test_expert_shapes_that_disagree_with_the_config_fail_at_load(tmp_path):
    import json

    path = tiny_checkpoint(tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "intermediate_size": raw["intermediate_size"] // 2}))
    with pytest.raises(CheckpointError, match="^checkpoint: layer 0's experts hold"):
        _engine(path, host_mem=1 << 15)


def test_the_host_tier_keeps_its_most_used_experts_through_a_sweep(tmp_path):
    """Layers are swept in order every step: with room for 2 of 3 experts, least-recently-used
    would miss every lookup of the cycle; keeping the most used ones hits 2 of every 3."""
    path = tiny_checkpoint(tmp_path / "m")
    cfg = ModelConfig.from_dir(path)
    disk = DiskExperts(path, cfg, 2 * one_expert_bytes(cfg))
    for _ in range(10):
        for expert in (0, 1, 2):
            disk.fetch(0, expert)
    assert disk.hits == 18 and disk.misses == 12 and len(disk.cached) == 2
