"""The recipe for the embedded sample MoE model: stdlib corpus -> BPE tokenizer -> Mixtral.

`train_sample_model` does everything end to end and writes a Hugging Face-format model
directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json) plus the
model card (README.md) and training_stats.json. Everything is fixed by the seed: weights
init, batch order and the tokenizer (trained on a sorted file list). Only the Python version
(which changes the stdlib text) and the torch build change the result.

    moectl model train --out engine/sample_model --replace-sample-model --steps 4000 --time-budget 2640 --eval-every 500
"""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from moectl.engine.models.attention import DenseContext
from moectl.engine.models.config import ModelConfig
from moectl.engine.models.decoder import MoEForCausalLM
from moectl.engine.models.loader import load_model, save_checkpoint
from moectl.engine.tools import corpus

EOS_TOKEN = "<|endoftext|>"  # also the bos token: it separates files in the training stream

# The shipped sample model. Sized for the <= 16 MB budget in bf16 (~7.6M params) and for a
# ~45 minute run on two CPU cores. Embeddings are untied, as in every real Mixtral checkpoint.
SAMPLE_MODEL = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_local_experts": 16,
    "num_experts_per_tok": 2,
    "intermediate_size": 96,  # per expert
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def mixtral_config(vocab_size: int, eos_id: int, aux_coef: float, dtype: str, **overrides) -> dict:
    """A complete HF MixtralForCausalLM config.json, sample-model sizes unless overridden."""
    sizes = {**SAMPLE_MODEL, **overrides}
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": vocab_size,
        **sizes,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "sliding_window": None,
        "router_aux_loss_coef": aux_coef,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "use_cache": True,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "dtype": dtype,
    }


# The second sample model: the seeds' class (DeepSeek-V3, Kimi-K2) scaled down. MLA with a q
# LoRA, a dense first layer, then MoE layers of 32 routed experts (top-8, sigmoid scores in 4
# groups of which 2 stay eligible, DeepSeek-V3's selection-only correction bias) and a shared
# expert. Sized so that the routed experts are most of a decode step (their share of the matmul
# FLOPs and of the measured step: bench/expert_share_bench.py) within 48 MB in bf16.
DSV3_SAMPLE = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "intermediate_size": 512,  # the dense first layer's MLP
    "moe_intermediate_size": 256,  # per routed expert, and the shared expert's
    "n_routed_experts": 32,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
BIAS_UPDATE_SPEED = 1e-3  # DeepSeek-V3's gamma for most of its training


def deepseek_v3_config(vocab_size: int, eos_id: int, aux_coef: float, dtype: str, **overrides) -> dict:
    """A complete HF DeepseekV3ForCausalLM config.json, DSV3_SAMPLE sizes unless overridden."""
    sizes = {**DSV3_SAMPLE, **overrides}
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        **sizes,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "aux_loss_alpha": aux_coef,
        "seq_aux": True,
        "rope_scaling": None,
        "use_cache": True,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "dtype": dtype,
    }


# the architectures `moectl model train --arch` builds: (config builder, default aux-loss weight)
ARCHS = {"mixtral": (mixtral_config, 0.003), "deepseek_v3": (deepseek_v3_config, 1e-4)}


def update_correction_bias(model: MoEForCausalLM, speed: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, after each optimizer step: every MoE layer's
    selection-only bias rises by `speed` for the experts that took fewer than the mean number of
    tokens in the step just trained on, and falls by it for those that took more."""
    with torch.no_grad():
        for layer in model.layers:
            mlp = layer.mlp
            counts = getattr(mlp, "last_counts", None)
            if counts is None or getattr(mlp, "grouped_sigmoid", None) is None:
                continue
            load = counts.to(torch.float32)
            mlp.e_score_correction_bias += speed * torch.sign(load.mean() - load)


# -- tokenizer

def train_tokenizer(vocab_size: int, max_corpus_chars: int | None = None):
    """Byte-level BPE on the training split; byte-level so any text (and indentation) round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus.iter_source_text("train", max_chars=max_corpus_chars), trainer)
    return tok


def save_tokenizer(tok, out_dir: Path, max_length: int) -> None:
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN,
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # would rewrite code such as "a ." on decode
        "model_max_length": max_length,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(model_dir: str | Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


def token_stream(tok, split: str, max_chars: int | None = None) -> torch.Tensor:
    """All files of a split, each followed by the end-of-text token, as one flat id tensor."""
    eos = tok.token_to_id(EOS_TOKEN)
    ids: list[int] = []
    for enc in tok.encode_batch(list(corpus.iter_source_text(split, max_chars=max_chars))):
        ids += enc.ids
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


# -- optimisation

class Schedule:
    """Linear warmup, then cosine decay to min_lr_ratio * lr, over steps or a deadline.

    Without a deadline the decay spans steps warmup..steps, and a run is a pure function of
    the seed. With one, two things keep a run inside it while still ending at the lr floor:
    at the end of warmup the measured step time cuts `steps` to what fits (a run that then
    keeps its pace equals a plain run with the cut count, since warmup does not depend on
    it), and if the machine slows down later, the decay follows the clock instead.
    """

    def __init__(self, lr: float, warmup: int, steps: int, min_lr_ratio: float, deadline: float | None):
        self.peak, self.warmup, self.steps, self.floor = lr, warmup, steps, min_lr_ratio
        self.deadline = deadline
        self.time_bound = False  # set once the clock, not the step count, drove the decay
        self._clock_start = self._decay_start = None

    def lr(self, step: int) -> float:
        if step == 1:
            self._clock_start = time.time()  # step 0 pays one-off allocation costs
        if step == self.warmup and self.deadline is not None:
            self._fit_steps(step)
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        if self._decay_start is not None:
            by_clock = (time.time() - self._decay_start) / max(1e-9, self.deadline - self._decay_start)
            if by_clock > progress:
                progress, self.time_bound = by_clock, True
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return self.peak * (self.floor + (1 - self.floor) * cosine)

    def finished(self, step: int) -> bool:
        return step >= self.steps or (self.deadline is not None and time.time() >= self.deadline)

    def _fit_steps(self, step: int) -> None:
        now = time.time()
        self._decay_start = now
        if self._clock_start is None:  # no timed steps yet (warmup < 2): only the clock can fit
            return
        per_step = (now - self._clock_start) / max(1, step - 1)
        fitted = step + int(0.95 * (self.deadline - now) / per_step)  # 5% slack for a busier machine
        self.steps = max(step + 1, min(self.steps, fitted))


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    # no decay on norms (1-d); the router and expert weights decay like any matrix
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def random_windows(stream: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq_len, (batch_size,), generator=gen)
    return torch.stack([stream[s:s + seq_len] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model: MoEForCausalLM, stream: torch.Tensor, seq_len: int, max_windows: int = 64,
             batch_size: int = 16) -> float:
    """Mean next-token loss over the first max_windows non-overlapping windows of the stream."""
    was_training = model.training
    model.eval()
    n = min(max_windows, len(stream) // seq_len)
    windows = stream[:n * seq_len].view(n, seq_len)
    total = 0.0
    for i in range(0, n, batch_size):
        batch = windows[i:i + batch_size]
        hidden = model(batch.flatten(), torch.arange(seq_len).repeat(len(batch)), DenseContext(len(batch), seq_len))
        logits = model.logits(hidden).view(len(batch), seq_len, -1)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
        total += loss.item() * len(batch)
    model.train(was_training)
    return total / n


# -- inspection of a saved model

class _RoutingCounter:
    """Probe for MoEForCausalLM.forward: sums the top-k expert token counts per layer."""

    def __init__(self):
        self.counts: dict[int, torch.Tensor] = {}

    def on_routing(self, layer_idx: int, counts: torch.Tensor, ids: torch.Tensor) -> None:
        c = counts.detach().to("cpu", torch.int64)
        self.counts[layer_idx] = self.counts.get(layer_idx, torch.zeros_like(c)) + c

    def on_hidden(self, i: int, x: torch.Tensor) -> None:
        pass


@torch.no_grad()
def routing_stats(model_dir: str | Path, prompts: list[str], dtype: str | None = "float32",
                  model: MoEForCausalLM | None = None) -> dict:
    """Per-layer expert loads (tokens routed to each expert, counting every top-k slot) on prompts.

    max/mean > 1 means hot experts; min/mean near 0 means cold ones.
    """
    model = model or load_model(model_dir, dtype=dtype)
    tok = load_tokenizer(model_dir)
    bos = tok.token_to_id(EOS_TOKEN)
    probe, tokens = _RoutingCounter(), 0
    for prompt in prompts:
        ids = torch.tensor([bos] + tok.encode(prompt).ids[:model.cfg.max_position_embeddings - 1])
        model(ids, torch.arange(len(ids)), DenseContext(1, len(ids)), probe=probe)
        tokens += len(ids)
    layers = []
    for layer, counts in sorted(probe.counts.items()):
        load = counts.double()
        mean = load.mean().item()
        layers.append({
            "layer": layer,
            "max_over_mean": round(load.max().item() / mean, 3),
            "min_over_mean": round(load.min().item() / mean, 3),
            "unused_experts": int((counts == 0).sum()),
            "hottest_experts": torch.argsort(counts, descending=True, stable=True)[:3].tolist(),
            "counts": counts.tolist(),
        })
    return {"prompts": len(prompts), "tokens": tokens, "top_k": model.cfg.top_k, "layers": layers}


@torch.no_grad()
def greedy_generate(model: MoEForCausalLM, tok, prompt: str, max_new_tokens: int = 64) -> str:
    """Greedy continuation by recomputing the whole sequence each step (no KV cache needed)."""
    eos = tok.token_to_id(EOS_TOKEN)
    ids = [eos] + tok.encode(prompt).ids
    prompt_len = len(ids)
    for _ in range(max_new_tokens):
        window = ids[-model.cfg.max_position_embeddings:]
        hidden = model(torch.tensor(window), torch.arange(len(window)), DenseContext(1, len(window)))
        next_id = int(model.logits(hidden[-1:]).argmax(-1))
        if next_id == eos:
            break
        ids.append(next_id)
    return prompt + tok.decode(ids[prompt_len:])


# -- the recipe

def check_train_options(*, steps: int, seq_len: int, batch_size: int, lr: float, time_budget_s: float | None,
                        eval_every: int) -> None:
    """ValueError naming the option (as the CLI spells it) when a run could not train anything."""
    for option, value in (("--steps", steps), ("--seq-len", seq_len), ("--batch-size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{option}: must be an integer >= 1, got {value!r}")
    if not (isinstance(lr, (int, float)) and 0 < lr < math.inf):
        raise ValueError(f"--lr: must be a positive number, got {lr!r}")
    if time_budget_s is not None and not (isinstance(time_budget_s, (int, float)) and 0 < time_budget_s < math.inf):
        raise ValueError(f"--time-budget: must be a positive number of seconds, got {time_budget_s!r}")
    if isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 0:
        raise ValueError(f"--eval-every: must be an integer >= 0 (0: only at the end), got {eval_every!r}")


def train_sample_model(
    out_dir: str | Path,
    *,
    steps: int = 3000,
    seq_len: int = 256,
    batch_size: int = 16,
    lr: float = 3e-3,
    min_lr_ratio: float = 0.1,
    warmup_steps: int = 200,
    weight_decay: float = 0.1,
    grad_clip: float = 1.0,
    aux_coef: float = 0.003,
    init_std: float = 0.02,
    vocab_size: int = 4096,
    seed: int = 0,
    time_budget_s: float | None = None,
    threads: int | None = 2,
    save_dtype: str = "bfloat16",
    model_overrides: dict | None = None,
    arch: str = "mixtral",
    bias_update_speed: float = BIAS_UPDATE_SPEED,
    max_corpus_chars: int | None = None,
    eval_every: int = 0,
    log_every: int = 25,
    routing_prompts: int = 256,
    routing_seed: int = 1234,
    sample_prompt: str = "def parse_args(",
    log: Callable[[str], None] = print,
) -> dict:
    """Corpus -> tokenizer -> Mixtral MoE -> AdamW (warmup + cosine) -> saved model dir + stats.

    time_budget_s is seconds for the whole call; see Schedule for how it is kept. The stats
    record `planned_steps` (the step count after fitting) and whether the clock took over.
    model_overrides and max_corpus_chars exist for tiny smoke runs.
    """
    started = time.time()
    check_train_options(steps=steps, seq_len=seq_len, batch_size=batch_size, lr=lr, time_budget_s=time_budget_s,
                        eval_every=eval_every)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"out_dir: {out_dir} exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    recipe = {k: v for k, v in locals().items() if k not in ("out_dir", "log", "started")}  # every setting

    tok = train_tokenizer(vocab_size, max_corpus_chars)
    train_ids = token_stream(tok, "train", max_corpus_chars)
    val_ids = token_stream(tok, "val")
    log(f"tokenizer: {tok.get_vocab_size()} tokens; train stream {len(train_ids):,} tokens, "
        f"val {len(val_ids):,} ({time.time() - started:.0f}s)")

    eos = tok.token_to_id(EOS_TOKEN)
    build_config = ARCHS[arch][0]
    raw = build_config(tok.get_vocab_size(), eos, aux_coef, save_dtype, **(model_overrides or {}))
    cfg = ModelConfig.from_hf(raw, dtype="float32")  # train in fp32, save in save_dtype
    model = MoEForCausalLM(cfg)
    model.init_weights(std=init_std, seed=seed)
    model.train()
    opt = make_optimizer(model, lr, weight_decay)
    batch_gen = torch.Generator().manual_seed(seed)
    log(f"model: {cfg.param_counts()}")

    train_start = time.time()
    history, recent_ce, val_history = [], [], []
    finish_reserve_s = 45  # saving, final eval, routing stats and sample take ~15 s on 2 cores
    deadline = started + time_budget_s - finish_reserve_s if time_budget_s is not None else None
    schedule = Schedule(lr, warmup_steps, steps, min_lr_ratio, deadline)
    step = 0
    while not schedule.finished(step):
        for group in opt.param_groups:
            group["lr"] = schedule.lr(step)
        if step == warmup_steps and deadline is not None:
            log(f"{schedule.steps} steps fit the time budget")
        ce, aux = model.training_loss(random_windows(train_ids, batch_size, seq_len, batch_gen), aux_coef)
        (ce + aux_coef * aux).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cfg.router == "grouped_sigmoid":
            update_correction_bias(model, bias_update_speed)
        step += 1
        recent_ce = (recent_ce + [ce.item()])[-50:]
        if step % log_every == 0 or schedule.finished(step):
            elapsed = time.time() - train_start
            history.append({"step": step, "ce": round(ce.item(), 4), "aux": round(aux.item(), 4),
                            "grad_norm": round(grad_norm.item(), 3), "lr": opt.param_groups[0]["lr"],
                            "elapsed_s": round(elapsed, 1)})
            log(f"step {step}/{schedule.steps} ce {ce.item():.4f} aux {aux.item():.4f} gnorm {grad_norm.item():.2f} "
                f"lr {opt.param_groups[0]['lr']:.2e} {step * batch_size * seq_len / elapsed:.0f} tok/s")
        if eval_every and step % eval_every == 0 and step < schedule.steps:
            val_history.append({"step": step, "val_loss": round(evaluate(model, val_ids, seq_len), 4)})
            log(f"step {step} val loss {val_history[-1]['val_loss']:.4f}")
    train_time = time.time() - train_start

    save_checkpoint(model, out_dir, dtype=torch.bfloat16 if save_dtype == "bfloat16" else torch.float16)
    save_tokenizer(tok, out_dir, cfg.max_position_embeddings)

    # everything below measures the shipped (rounded) weights, as a user would load them
    shipped = load_model(out_dir, dtype="float32")
    val_loss = evaluate(shipped, val_ids, seq_len)
    prompts = corpus.code_snippets(routing_prompts, seed=routing_seed) if routing_prompts else []
    routing = routing_stats(out_dir, prompts, model=shipped)
    sample = greedy_generate(shipped, tok, sample_prompt) if sample_prompt else ""

    stats = {
        "recipe": recipe,
        "config": raw,
        "params": cfg.param_counts(),
        "corpus": {"source": "Python standard library", "python": platform.python_version(),
                   "train": corpus.corpus_summary("train"), "val": corpus.corpus_summary("val"),
                   "train_tokens": len(train_ids), "val_tokens": len(val_ids)},
        "planned_steps": schedule.steps,
        "steps_done": step,
        "schedule_followed_clock": schedule.time_bound,
        "tokens_trained": step * batch_size * seq_len,
        "epochs": round(step * batch_size * seq_len / len(train_ids), 2),
        "train_time_s": round(train_time, 1),
        "wall_time_s": round(time.time() - started, 1),
        "final_train_loss": round(sum(recent_ce) / max(1, len(recent_ce)), 4),
        "val_loss": round(val_loss, 4),
        "val_history": val_history,
        "routing": routing,
        "sample": {"prompt": sample_prompt, "greedy": sample},
        "environment": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                        "python": sys.version.split()[0], "machine": platform.machine()},
        "history": history,
    }
    (out_dir / "training_stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    (out_dir / "README.md").write_text(model_card(stats))
    log(f"saved to {out_dir}: train loss {stats['final_train_loss']}, val loss {stats['val_loss']}, "
        f"{stats['wall_time_s']:.0f}s")
    return stats


def _steps_note(stats: dict) -> str:
    requested, planned, done = stats["recipe"]["steps"], stats["planned_steps"], stats["steps_done"]
    if stats["schedule_followed_clock"]:
        return (f"{done} (planned to fit the time budget; the machine then slowed down for a while, "
                f"so the lr decay followed the clock)")
    if planned < requested:
        return (f"{done} (cut from {requested} to fit the time budget; `--steps {planned}` without "
                f"a budget reproduces the run)")
    return str(done)


def _rebuild_note(stats: dict) -> str:
    if not stats["schedule_followed_clock"]:
        return ""
    return (" This model's own run had a time budget that its learning-rate decay had to follow,\n"
            "so a rebuild gives a close sibling of it, not the same bytes.")


def _val_history_note(stats: dict) -> str:
    points = ", ".join(f"{v['val_loss']} at step {v['step']}" for v in stats["val_history"])
    return f" (during training: {points})" if points else ""


def _architecture_line(c: dict) -> str:
    if c["model_type"] == "deepseek_v3":
        return (f"{c['num_hidden_layers']} layers ({c['first_k_dense_replace']} dense, then MoE), hidden "
                f"{c['hidden_size']}; MLA attention: {c['num_attention_heads']} heads, q LoRA rank {c['q_lora_rank']}, "
                f"KV LoRA rank {c['kv_lora_rank']}, qk head {c['qk_nope_head_dim']} + {c['qk_rope_head_dim']} rope, "
                f"v head {c['v_head_dim']}; {c['n_routed_experts']} routed experts per MoE layer, top-"
                f"{c['num_experts_per_tok']} by sigmoid score in {c['n_group']} groups (top-{c['topk_group']} groups "
                f"eligible), weights normalised and scaled by {c['routed_scaling_factor']:g}, "
                f"{c['n_shared_experts']} shared expert; expert FFN {c['moe_intermediate_size']}, dense FFN "
                f"{c['intermediate_size']}; vocab {c['vocab_size']}, "
                f"{'tied' if c['tie_word_embeddings'] else 'untied'} embeddings, RoPE theta {c['rope_theta']:g}")
    return (f"{c['num_hidden_layers']} layers, hidden {c['hidden_size']}, {c['num_attention_heads']} heads "
            f"({c['num_key_value_heads']} KV, head dim {c['head_dim']}), {c['num_local_experts']} experts per layer, "
            f"top-{c['num_experts_per_tok']}, expert FFN {c['intermediate_size']}, vocab {c['vocab_size']}, "
            f"{'tied' if c['tie_word_embeddings'] else 'untied'} embeddings, RoPE theta {c['rope_theta']:g}")


def _balancing_note(c: dict, r: dict) -> str:
    if c["model_type"] == "deepseek_v3":
        return (f"Next-token cross-entropy plus `aux_coef` x DeepSeek-V3's complementary balance loss (over\n"
                f"the batch, mean over layers); after every optimizer step each MoE layer's selection-only\n"
                f"correction bias (`e_score_correction_bias`) moves by `bias_update_speed` ({r['bias_update_speed']:g})\n"
                f"up for the experts that took fewer tokens than the mean in that step and down for those that\n"
                f"took more: DeepSeek-V3's auxiliary-loss-free balancing")
    return ("Next-token cross-entropy plus `aux_coef` x the Switch/Mixtral load-balancing loss (mean over\n"
            "layers)")


def model_card(stats: dict) -> str:
    r, c, p = stats["recipe"], stats["config"], stats["params"]
    env, routing = stats["environment"], stats["routing"]
    routing_rows = "\n".join(
        f"| {l['layer']} | {l['max_over_mean']:.2f} | {l['min_over_mean']:.2f} | {l['unused_experts']} "
        f"| {', '.join(map(str, l['hottest_experts']))} |" for l in routing["layers"])
    recipe_rows = "\n".join(f"| `{k}` | `{v}` |" for k, v in r.items())
    arch = _architecture_line(c)
    data = stats["corpus"]
    deepseek = c["model_type"] == "deepseek_v3"
    name, folder = ("sample-dsv3", "engine/sample_model_dsv3") if deepseek else ("sample", "engine/sample_model")
    kind = ("DeepSeek-V3-architecture (`DeepseekV3ForCausalLM`), the seeds' class scaled down,"
            if deepseek else "Mixtral-architecture (`MixtralForCausalLM`)")
    arch_flag = " --arch deepseek_v3" if deepseek else ""
    return f"""# moectl sample model `{name}`

A tiny {kind} mixture-of-experts model trained from
scratch on the Python standard library's source, so moectl can demo and test its engine,
profiler and console on any machine without a download (`--model {name}`). It writes
Python-looking code; it is not useful for anything else.

Rebuild it with
`moectl model train{arch_flag} --out {folder} --replace-sample-model --steps {stats['planned_steps']} --seed {r['seed']}`
(the recipe is `engine/tools/train.py`; every other setting below that shapes the model is its default). Without a time
budget a run is fixed by the seed for a given Python version (the corpus is this Python's
stdlib) and torch build.{_rebuild_note(stats)}

## Architecture

{arch}.
Parameters: {p['params_total']:,} total, {p['params_active']:,} active per token.
Weights are stored in {c['dtype']}. Trained on {r['seq_len']}-token windows; positions beyond
that are untrained even though `max_position_embeddings` is {c['max_position_embeddings']}.

## Data

Python {data['python']} standard library `.py` files, minus tests, GUI demos, lib2to3,
ensurepip, codec tables and pydoc topics (`engine/tools/corpus.py`). Files are concatenated with
`<|endoftext|>` between them. About 2% of files, chosen by a hash of their path, are held out
for validation.

- train: {data['train']['files']} files, {data['train']['chars']:,} chars, {data['train_tokens']:,} tokens
- val: {data['val']['files']} files, {data['val']['chars']:,} chars, {data['val_tokens']:,} tokens

Tokenizer: byte-level BPE trained on the train split (`tokenizers`), {c['vocab_size']} tokens;
`<|endoftext|>` (id {c['eos_token_id']}) is bos, eos and pad.

## Training

{_balancing_note(c, r)}, AdamW (betas 0.9/0.95, no decay on norms), linear warmup then cosine decay to
`min_lr_ratio` x lr, gradient clipping, fp32 on CPU, random windows drawn from a generator
seeded with `seed`.

| setting | value |
|---|---|
{recipe_rows}

## Results

- seed: {r['seed']}
- steps: {_steps_note(stats)}
- tokens trained: {stats['tokens_trained']:,} ({stats['epochs']} epochs)
- wall time: {stats['wall_time_s'] / 60:.1f} min in all ({stats['train_time_s'] / 60:.1f} min in the training loop),
  {env['threads']} CPU threads, torch {env['torch']}, Python {env['python']}
- final train loss (mean of the last 50 steps): {stats['final_train_loss']}
- validation loss (shipped {c['dtype']} weights): {stats['val_loss']}{_val_history_note(stats)}

## Routing

Expert loads on {routing['prompts']} code snippets (`corpus.code_snippets` with seed {r['routing_seed']}),
{routing['tokens']:,} tokens, each counted once per top-{routing['top_k']} slot. max/mean above 1 marks
hot experts; min/mean near 0 marks cold ones.

| layer | max/mean | min/mean | unused experts | hottest experts |
|---|---|---|---|---|
{routing_rows}

## Sample

Greedy continuation of `{stats['sample']['prompt']}`:

```python
{stats['sample']['greedy'].rstrip()}
```
"""
