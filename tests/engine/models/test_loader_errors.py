"""A bad checkpoint fails with one ValueError, on one line, naming the problem, before any weights
are loaded into a model. Uses engine-written checkpoints, so it runs without transformers."""

from __future__ import annotations

import json
import shutil

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
    assert "layers.0.mlp.experts" in msg and "(4, 48, 16)" in msg and "(4, 40, 16)" in msg


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
