"""A bad checkpoint fails with one ValueError, on one line, naming the problem, before any weights
are loaded into a model. Uses engine-written checkpoints, so it runs without transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moectl.engine.core.config import EngineConfig
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.models.decoder import MoEForCausalLM
from moectl.engine.models.loader import load_model
from tests.checkpoints import shard_checkpoint


@pytest.fixture
def ckpt(tiny_engine_checkpoint, tmp_path):
    """A private copy of the tiny checkpoint, free to break."""
    return shutil.copytree(tiny_engine_checkpoint, tmp_path / "ckpt")


@pytest.fixture
def load_error(monkeypatch):
    """load_model(path) must raise; returns the message. Fails if weights reached a model first."""
    loaded = []
    monkeypatch.setattr(MoEForCausalLM, "load_state_dict", lambda self, *a, **k: loaded.append(1))

    def run(path, load=load_model) -> str:
        with pytest.raises(ValueError) as info:
            load(path)
        assert not loaded, "weights were loaded into a model before the error"
        msg = str(info.value)
        assert msg and "\n" not in msg, msg
        return msg

    return run


def edit_config(path, **changes):
    cfg_path = path / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **changes}))


def edit_tensors(path, change):
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file))


def test_good_checkpoint_loads_single_and_sharded(ckpt, tmp_path):
    single = load_model(ckpt)
    sharded_dir = shutil.copytree(ckpt, tmp_path / "sharded")
    shard_checkpoint(sharded_dir)
    sharded = load_model(sharded_dir)
    for (name, a), (_, b) in zip(single.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), name


def test_not_a_directory(load_error, tmp_path):
    assert "is not a directory" in load_error(tmp_path / "nowhere")


def test_missing_config(ckpt, load_error):
    (ckpt / "config.json").unlink()
    assert load_error(ckpt).startswith("config.json: not found")


def test_config_not_json(ckpt, load_error):
    (ckpt / "config.json").write_text("{ not json")
    assert load_error(ckpt).startswith("config.json: unreadable")


def test_missing_safetensors(ckpt, load_error):
    (ckpt / "model.safetensors").unlink()
    assert load_error(ckpt).startswith("model.safetensors: not found")


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_safetensors(ckpt, load_error, damage):
    file = ckpt / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x00\xff not safetensors" * 50,
                      "empty": b""}[damage])
    assert load_error(ckpt).startswith("model.safetensors: corrupt safetensors file")


def test_tensor_shape_does_not_match_config(ckpt, load_error):
    edit_config(ckpt, intermediate_size=20)  # the experts on disk are 24 wide
    msg = load_error(ckpt)
    assert msg.startswith("model.layers.0.block_sparse_moe.experts.0.w1.weight:") and "(24, 16)" in msg and "(20, 16)" in msg


def test_one_expert_with_a_wrong_shape(ckpt, load_error):
    """One expert unlike its siblings used to stop torch.stack with a message naming no tensor."""
    bad = "model.layers.1.block_sparse_moe.experts.2.w2.weight"  # [hidden 16, intermediate 24]
    edit_tensors(ckpt, lambda t: t.update({bad: torch.zeros(16, 23)}))
    msg = load_error(ckpt)
    assert msg.startswith(bad + ":") and "(16, 23)" in msg and "(16, 24)" in msg


def test_a_projection_that_cannot_join_its_siblings(ckpt, load_error):
    bad = "model.layers.0.self_attn.k_proj.weight"
    edit_tensors(ckpt, lambda t: t.update({bad: torch.zeros(8, 15)}))
    msg = load_error(ckpt)
    assert msg.startswith(bad + ":") and "(8, 15)" in msg and "q_proj" in msg


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool, torch.uint8])
def test_integer_weight_is_refused_not_cast(ckpt, load_error, dtype):
    edit_tensors(ckpt, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(dtype)}))
    msg = load_error(ckpt)
    assert msg.startswith("model.norm.weight:") and str(dtype).removeprefix("torch.") in msg


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_half_precision_weights_still_load(ckpt, dtype):
    edit_tensors(ckpt, lambda t: t.update({k: v.to(dtype) for k, v in t.items()}))
    model = load_model(ckpt, dtype="fp32")
    assert model.norm.weight.dtype == torch.float32


def _point_one_shard_at(ckpt, target: str) -> str:
    """Shard the checkpoint and aim one weight_map entry at `target`; returns the tensor's name."""
    shard_checkpoint(ckpt)
    index = ckpt / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    name = sorted(data["weight_map"])[0]
    data["weight_map"][name] = target
    index.write_text(json.dumps(data))
    return name


@pytest.mark.parametrize("target", ["../../etc/passwd", "/etc/passwd", "sub/../../outside.safetensors",
                                    "C:\\Windows\\x.safetensors", "..\\x.safetensors"])
def test_shard_index_entry_outside_the_folder_is_refused(ckpt, load_error, monkeypatch, target):
    name = _point_one_shard_at(ckpt, target)
    opened = []
    monkeypatch.setattr("moectl.engine.models.loader.safe_open", lambda *a, **k: opened.append(a))
    msg = load_error(ckpt)
    assert msg.startswith("model.safetensors.index.json:") and name in msg and "outside the checkpoint folder" in msg
    assert not opened, "a shard was opened before the index was checked"


def test_shard_index_symlink_escaping_the_folder_is_refused(ckpt, load_error, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    save_file({"x": torch.zeros(1)}, str(outside))
    (ckpt / "link.safetensors").symlink_to(outside)
    name = _point_one_shard_at(ckpt, "link.safetensors")
    msg = load_error(ckpt)
    assert name in msg and "outside the checkpoint folder" in msg


def test_shard_index_symlink_inside_the_folder_loads(ckpt):
    """Links that stay in the folder (a shard under another name) are fine."""
    shards = shard_checkpoint(ckpt)
    moved = shards[0].rename(ckpt / "real.safetensors")
    shards[0].symlink_to(moved.name)
    load_model(ckpt)


def test_hub_cache_snapshot_links_load(ckpt, tmp_path):
    """The Hugging Face hub cache: snapshots/<rev>/ holds links into the repository's blobs/."""
    repo = tmp_path / "models--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, shard in enumerate(shard_checkpoint(ckpt)):
        blob = shutil.move(shard, blobs / f"blob{i}")
        (snapshot / shard.name).symlink_to(Path("..", "..", "blobs", blob.name))
    for other in ckpt.iterdir():
        shutil.copy(other, snapshot / other.name)
    load_model(snapshot)


def test_one_tensor_with_a_wrong_shape(ckpt, load_error):
    edit_tensors(ckpt, lambda t: t.update({"model.norm.weight": torch.ones(15)}))
    msg = load_error(ckpt)
    assert msg.startswith("norm.weight:") and "(15,)" in msg and "(16,)" in msg


def test_missing_tensor(ckpt, load_error):
    edit_tensors(ckpt, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    assert "model.layers.1.self_attn.k_proj.weight is missing" in load_error(ckpt)


@pytest.mark.parametrize("changes, field", [
    ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_parameters"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"sliding_window": 100000}, "sliding_window"),  # a window larger than the context
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"dtype": "float64"}, "dtype"),
    ({"num_key_value_heads": 0}, "num_key_value_heads"),  # 0 used to fall back to one KV head per query head
    ({"num_key_value_heads": -2}, "num_key_value_heads"),
    ({"rope_theta": float("nan")}, "rope_theta"),
    ({"rope_theta": float("inf")}, "rope_theta"),
    ({"rope_theta": 0}, "rope_theta"),
    ({"rope_theta": -1.0}, "rope_theta"),
    ({"rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}},
     "rope_parameters.rope_theta"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
])
def test_unsupported_config_value_names_the_field(ckpt, load_error, changes, field):
    edit_config(ckpt, **changes)
    assert load_error(ckpt).startswith(field)


def test_missing_shard(ckpt, load_error):
    shards = shard_checkpoint(ckpt)
    shards[1].unlink()
    msg = load_error(ckpt)
    assert msg.startswith(shards[1].name) and "shard listed in the index is missing" in msg


def test_corrupt_shard(ckpt, load_error):
    shards = shard_checkpoint(ckpt)
    shards[2].write_bytes(shards[2].read_bytes()[:100])
    msg = load_error(ckpt)
    assert msg.startswith(shards[2].name) and "corrupt safetensors file" in msg


def test_unreadable_index(ckpt, load_error):
    shard_checkpoint(ckpt)
    (ckpt / "model.safetensors.index.json").write_text('{"metadata": {}}')  # no weight_map
    assert load_error(ckpt).startswith("model.safetensors.index.json: unreadable")


def test_engine_reports_the_same_error(ckpt, load_error):
    """LLMEngine fails on the checkpoint before it allocates anything else."""
    edit_config(ckpt, architectures=["GPT2LMHeadModel"])
    msg = load_error(ckpt, lambda path: LLMEngine(EngineConfig(model=str(path))))
    assert msg.startswith("architectures: 'GPT2LMHeadModel' is not supported")


def test_unused_checkpoint_tensor_is_refused(tmp_path):
    """A weight the layout does not read would be silently dropped; it must be an error."""
    from safetensors.torch import load_file, save_file

    from moectl.engine.models.loader import CheckpointError, load_model
    from tests.checkpoints import tiny_checkpoint

    ckpt = tiny_checkpoint(tmp_path / "m", tokenizer=False)
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(32)
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match="o_proj.bias is not part of the MixtralForCausalLM layout"):
        load_model(ckpt)


@pytest.mark.parametrize("change, field", [
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"rms_norm_eps": "small"}, "rms_norm_eps"),
    ({"vocab_size": "300"}, "vocab_size"),
    ({"rope_scaling": "yarn"}, "rope_scaling"),
    ({"num_local_experts": "8"}, "num_experts"),
    ({"rope_theta": "abc"}, "rope_theta"),
    # bools are ints to Python; none may stand for a size or a count
    ({"hidden_size": True}, "hidden_size"),
    ({"num_hidden_layers": True}, "num_hidden_layers"),
    ({"num_attention_heads": True}, "num_attention_heads"),
    ({"num_key_value_heads": True}, "num_key_value_heads"),
    ({"intermediate_size": True}, "expert_intermediate_size"),
    ({"num_local_experts": True}, "num_experts"),
    ({"num_experts_per_tok": True}, "num_experts_per_tok"),
    ({"max_position_embeddings": True}, "max_position_embeddings"),
    ({"vocab_size": False}, "vocab_size"),
    ({"head_dim": True}, "head_dim"),
    ({"sliding_window": True}, "sliding_window"),
    ({"bos_token_id": True}, "bos_token_id"),
    ({"rms_norm_eps": True}, "rms_norm_eps"),
])
def test_wrongly_typed_config_values_name_the_field(change, field):
    from moectl.engine.models.config import ConfigError, ModelConfig
    from tests.checkpoints import TINY_MIXTRAL

    with pytest.raises(ConfigError) as err:
        ModelConfig.from_hf({**TINY_MIXTRAL, **change})
    assert field in str(err.value) and "\n" not in str(err.value)


def test_generation_config_adds_end_of_sequence_ids(tmp_path):
    from moectl.engine.models.config import ConfigError, ModelConfig
    from tests.checkpoints import TINY_MIXTRAL

    (tmp_path / "config.json").write_text(json.dumps(TINY_MIXTRAL))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7, 99999]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (1, 7)
    (tmp_path / "generation_config.json").write_text("{nope")
    with pytest.raises(ConfigError, match="generation_config.json"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("damage, named", [
    (lambda d: edit_config(d, hidden_size=True), "hidden_size"),
    (lambda d: edit_config(d, rope_theta="abc"), "rope_theta"),
    (lambda d: edit_tensors(d, lambda t: t.update({"model.layers.0.block_sparse_moe.experts.1.w1.weight": torch.zeros(5, 16)})),
     "model.layers.0.block_sparse_moe.experts.1.w1.weight"),
    (lambda d: edit_tensors(d, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.int8)})),
     "model.norm.weight"),
])
def test_cli_exits_2_naming_the_field(ckpt, damage, named):
    """The CLI turns each of these into bad input (2), not a failure (1), with one line and no traceback."""
    from typer.testing import CliRunner

    from moectl.cli.main import app

    damage(ckpt)
    res = CliRunner().invoke(app, ["generate", "--model", str(ckpt), "--prompt-ids", "1,2", "--max-tokens", "1",
                                   "--threads", "1"])
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("moectl: error:")]
    assert len(errors) == 1 and named in errors[0] and "Traceback" not in res.output, res.output
