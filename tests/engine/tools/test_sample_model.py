"""The shipped sample model (engine/sample_model) and the recipe that builds it."""

from __future__ import annotations

import json

import pytest
import torch

from moectl.engine import sample_model_dir
from moectl.engine.models.attention import DenseContext
from moectl.engine.models.config import ModelConfig
from moectl.engine.models.loader import load_model
from moectl.engine.tools import corpus
from moectl.engine.tools.train import load_tokenizer, train_sample_model

SAMPLE_DIR = sample_model_dir()
SIZE_LIMIT = 16_000_000
CODE = 'def f(x, *args):\n    """Doc."""\n\tif x  ==  1 :\n        return {"a": [x ,  2]}  # é\n\n\n'


@pytest.fixture(scope="module")
def sample_model():
    if not (SAMPLE_DIR / "model.safetensors").is_file():
        pytest.fail(f"the sample model is missing from {SAMPLE_DIR}")
    return load_model(SAMPLE_DIR, dtype="float32")


def test_sample_model_is_small_and_big_enough():
    files = [p for p in SAMPLE_DIR.iterdir() if p.is_file()]
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "README.md", "training_stats.json"} <= {p.name for p in files}
    assert sum(p.stat().st_size for p in files) <= SIZE_LIMIT
    raw = json.loads((SAMPLE_DIR / "config.json").read_text())
    assert raw["architectures"] == ["MixtralForCausalLM"] and raw["sliding_window"] is None
    cfg = ModelConfig.from_hf(raw)
    assert cfg.num_layers >= 4 and cfg.num_experts >= 16 and cfg.top_k >= 2
    assert cfg.eos_token_ids == (cfg.bos_token_id,)


def test_routing_has_hot_and_cold_experts_but_no_dead_ones():
    stats = json.loads((SAMPLE_DIR / "training_stats.json").read_text())
    for layer in stats["routing"]["layers"]:
        assert layer["unused_experts"] == 0, layer
        assert layer["max_over_mean"] >= 1.5, layer


def test_tokenizer_round_trips_code():
    tok = load_tokenizer(SAMPLE_DIR)
    for text in [CODE, *corpus.code_snippets(5, seed=7)]:
        assert tok.decode(tok.encode(text).ids) == text


def test_transformers_loads_it_and_agrees(sample_model):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(SAMPLE_DIR, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(SAMPLE_DIR)
    ids = tok(CODE)["input_ids"]
    assert tok.decode(ids) == CODE
    ids = torch.tensor([tok.bos_token_id] + ids)
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
        got = sample_model.logits(sample_model(ids, torch.arange(len(ids)), DenseContext(1, len(ids))))
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-3


TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            num_local_experts=4, num_experts_per_tok=2, intermediate_size=16, max_position_embeddings=64)


def test_tiny_training_run_is_deterministic(tmp_path):
    def run(out):
        return train_sample_model(out, steps=3, seq_len=32, batch_size=2, warmup_steps=1, vocab_size=300,
                                  model_overrides=TINY, max_corpus_chars=50_000, eval_every=0,
                                  routing_prompts=2, sample_prompt="def f(", log=lambda line: None)

    first, second = run(tmp_path / "a"), run(tmp_path / "b")
    assert first["steps_done"] == 3
    assert first["history"] == [{**h, "elapsed_s": first["history"][i]["elapsed_s"]}
                                for i, h in enumerate(second["history"])]
    assert first["val_loss"] == second["val_loss"]
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    model = load_model(tmp_path / "a")
    assert model.cfg.num_experts == 4 and model.cfg.dtype == torch.bfloat16
