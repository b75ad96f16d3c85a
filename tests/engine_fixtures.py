"""Tiny checkpoints built with the engine's own model class (no transformers needed)."""

from __future__ import annotations

from pathlib import Path

import torch

from moectl.engine.models.config import ModelConfig
from moectl.engine.models.loader import save_checkpoint
from moectl.engine.models.decoder import MoEForCausalLM
from tests.tiny_models import build_tokenizer

TINY_MIXTRAL = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 300, "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    "sliding_window": None, "dtype": "float32",
}

def make_tiny_checkpoint(out_dir: Path, seed: int = 0, std: float = 0.2, with_tokenizer: bool = True,
                         **overrides) -> Path:
    raw = {**TINY_MIXTRAL, **overrides}
    model = MoEForCausalLM(ModelConfig.from_hf(raw))
    model.init_weights(std=std, seed=seed)
    save_checkpoint(model, out_dir)
    if with_tokenizer:
        build_tokenizer(raw["vocab_size"]).save(str(Path(out_dir) / "tokenizer.json"))
    return Path(out_dir)


def reference_greedy(model: MoEForCausalLM, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding by recomputing the whole sequence each step: no cache, no batching."""
    from moectl.engine.models.attention import DenseContext

    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            t = torch.tensor(ids)
            hidden = model(t, torch.arange(len(ids)), DenseContext(1, len(ids)))
            ids.append(int(model.logits(hidden[-1:]).argmax()))
    return ids[len(prompt):]
