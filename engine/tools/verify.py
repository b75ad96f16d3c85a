"""`moectl verify`: run one checkpoint through this engine and through transformers, and compare.

Three checks, each with a fixed threshold (THRESHOLDS):

* numerics (fp32): per-layer hidden states and the final logits of one batched prefill (the
  reference text plus as many seeded random ids), as the max relative error
  max|ours - ref| / max|ref| of each tensor; expert_coverage says how many (layer, expert)
  pairs those tokens reached, since an expert no token reaches is not checked;
* log-likelihood (bf16): mean per-token NLL of a reference text, this engine in bf16 against
  transformers in bf16 (both are also reported against the fp32 reference, for information);
* greedy generation (fp32): this engine runs all prompts batched (continuous batching, paged
  KV cache) and must be token-identical to transformers' `generate` run on each prompt alone;
* with dtype bf16 or fp16, the numerics once more in that dtype, both sides in it. The max error
  is no measure there: rounding flips a near-tied top-k routing now and then, on either side,
  and that token's output changes outright. Each tensor's median per-token relative error is
  checked instead (HALF_THRESHOLDS).

The engine side always goes through the real paged path (block tables, slot mapping, KV writes),
not a dense shortcut, so the checks cover what serving runs.
"""

from __future__ import annotations

import gc
import inspect
import math
import textwrap
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moectl.engine.core.config import EngineConfig, SchedulerKnobs
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.core.sequence import Sequence
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.models.config import MODEL_TYPE_ALIASES, ModelConfig, parse_dtype
from moectl.engine.models.tokenizer import Tokenizer

THRESHOLDS = {"max_rel_error": 1e-3, "loglik_rel_diff": 0.05}
# the median per-token relative error of every layer and the logits, engine against transformers in
# the same half precision; measured on the tiny checkpoints of every architecture, odd widths too
# (tests/engine/models/test_odd_widths.py): up to 0.032 in bf16, 0.003 in fp16. A wrong cast or
# kernel, which every token meets, gives O(1). (The fp32 check is the one that catches a fault
# only some tokens meet, such as a swapped expert.)
HALF_THRESHOLDS = {torch.bfloat16: 0.1, torch.float16: 0.02}
MAX_TEXT_TOKENS = 256  # enough to cross many KV blocks, small enough for a CPU reference run
PROMPT_LENGTHS = (3, 9, 17, 33)  # default greedy prompts: under, at and across block boundaries
BLOCK_SIZE = 16


class ReferenceMissing(RuntimeError):
    """transformers, the reference, is not installed."""


class _Probe:
    """Keeps the hidden state after every layer (index 0 = embeddings) as fp32 copies, and counts
    the tokens routed to each expert of each sparse layer."""

    def __init__(self):
        self.hidden: dict[int, torch.Tensor] = {}
        self.routed: dict[int, torch.Tensor] = {}

    def on_hidden(self, index: int, x: torch.Tensor) -> None:
        self.hidden[index] = x.float().clone()

    def on_routing(self, layer: int, counts: torch.Tensor, ids: torch.Tensor) -> None:
        self.routed[layer] = self.routed.get(layer, 0) + counts.cpu()


def prefill_batch(engine: LLMEngine, batch: list[list[int]], probe=None) -> list[torch.Tensor]:
    """fp32 logits [len(ids), vocab] for every sequence of `batch`, from one engine step that
    prefills them all through the paged path (block tables, slot mapping, KV writes).

    Blocks come straight from the free pool (no prefix-cache lookup), so every token really runs
    through the model; they are freed uncommitted, so they leave nothing in the prefix cache.
    Call it only on an idle engine: it steps outside the scheduler. The probe sees the sequences'
    tokens concatenated in batch order.
    """
    if len(batch) > 1 and any(len(ids) < 2 for ids in batch):
        # the runner puts 1-token items first (as decodes), which would reorder the batch
        raise ValueError("prompt: batched prefills need at least 2 tokens each")
    seqs = [Sequence(f"verify-prefill-{i}", list(ids), SamplingParams(max_tokens=1)) for i, ids in enumerate(batch)]
    try:
        for seq in seqs:
            if not engine.blocks.can_grow(seq, seq.num_tokens):
                raise ValueError(f"prompt: {seq.num_tokens} tokens do not fit the {engine.blocks.num_free} "
                                 "free KV blocks")
            engine.blocks.grow(seq, seq.num_tokens)
        logits = engine.runner.run([(seq, seq.num_tokens) for seq in seqs], all_logits=True, probe=probe)
    finally:
        for seq in seqs:
            engine.blocks.free(seq)
    return list(logits.split([len(ids) for ids in batch]))


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref| over the whole tensor (NaN anywhere gives NaN)."""
    ours, ref = ours.float(), ref.float()
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def median_token_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """The median over tokens (rows of the last dimension) of each token's rel_error."""
    ours, ref = ours.float(), ref.float()
    per_token = (ours - ref).abs().amax(-1) / ref.abs().amax(-1).clamp_min(1e-30)
    return float(per_token.flatten().median())


def compare_layers(ours: LLMEngine, ref, batch: list[list[int]]) -> dict:
    """One batched prefill of `batch` (rows of equal length) through this engine's paged path and
    through transformers, in whatever dtype each was loaded: the hidden state after every layer
    (index 0 = embeddings, the last one after the final norm) and the logits, each as rel_error
    and median_token_error. Also this engine's fp32 logits [rows, len, vocab], transformers'
    ("ref_logits") and the tokens routed to each expert of each sparse layer ("routed")."""
    probe = _Probe()
    logits = torch.stack(prefill_batch(ours, batch, probe))
    with torch.inference_mode():  # equal lengths, so one unpadded batch is exact
        out = ref(input_ids=torch.tensor(batch), output_hidden_states=True)
    ref_hidden, ref_logits = out.hidden_states, out.logits.float()
    # transformers' hidden_states are (embeddings, after layer 1, ..., after layer L) except that the
    # last entry is replaced by the final-normed output (tie_last_hidden_states). Our probe sees the
    # pre-norm output of layer L, so the last comparison applies our final norm to it first (in the
    # model's dtype, as the model does).
    n = ours.model_config.num_layers
    if len(ref_hidden) != n + 1:
        raise RuntimeError(f"transformers returned {len(ref_hidden)} hidden states for {n} layers")
    ours_hidden = _our_hidden(ours, probe, batch)
    pairs = [*zip(ours_hidden, ref_hidden), (logits, ref_logits)]
    errors = [rel_error(o, r) for o, r in pairs]
    medians = [median_token_error(o, r) for o, r in pairs]
    return {"layer_rel_errors": errors[:-1], "logits_rel_error": errors[-1], "max_rel_error": max(errors),
            "layer_median_rel_errors": medians[:-1], "logits_median_rel_error": medians[-1],
            "median_rel_error": max(medians), "logits": logits, "ref_logits": ref_logits,
            "routed": list(probe.routed.values()), "ref_hidden": [h.float() for h in ref_hidden]}


def _our_hidden(ours: LLMEngine, probe: _Probe, batch: list[list[int]]) -> list[torch.Tensor]:
    """The probe's hidden states as transformers returns them: [rows, len, hidden] after every
    layer but the last, then the last layer's output after the final norm."""
    n = ours.model_config.num_layers
    hidden = [probe.hidden[i].view(len(batch), len(batch[0]), -1) for i in range(n)]
    last = probe.hidden[n]
    if ours.model.residual_dtype is None:  # the final norm takes the stream in the dtype the model keeps it
        last = last.to(ours.model.norm.weight.dtype)
    hidden.append(ours.model.norm(last).float().view_as(hidden[0]))
    return hidden


def precision_report(ours: LLMEngine, ref_hidden: list[torch.Tensor], ref_logits: torch.Tensor,
                     batch: list[list[int]], threshold: float) -> dict:
    """This engine in half precision against the fp32 reference, layer by layer: where an
    operator overflows (the numerics watch: a point past the dtype's limit, or an inf/NaN), and
    which layers lose accuracy (their hidden state's median per-token error against fp32 above
    `threshold`, a NaN included)."""
    if ours.watch is None:
        raise RuntimeError("verify: the engine's numerics watch is off")
    ours.watch.reset()
    ours.watch.key_sumsq[:] = 0  # the keys of this pass only
    probe = _Probe()
    logits = torch.stack(prefill_batch(ours, batch, probe))
    watch = ours.numerics_record()
    ours_hidden = _our_hidden(ours, probe, batch)
    errors = [median_token_error(o, r) for o, r in zip(ours_hidden, ref_hidden)]
    errors = [e if math.isfinite(e) else math.inf for e in errors]
    logits_error = median_token_error(logits, ref_logits)
    logits_error = logits_error if math.isfinite(logits_error) else math.inf
    limits = watch["limits"]
    # an upper bound past the limit (attn_logits) is no overflow by itself: only an inf/NaN there is
    overflows = [{"layer": layer, "operator": point, "max": float(row[j]), "limit": limits[j],
                  "nonfinite": watch["nonfinite"][layer][j]}
                 for layer, row in enumerate(watch["max"].tolist()) for j, point in enumerate(watch["points"])
                 if watch["nonfinite"][layer][j] or (row[j] > limits[j] and not watch["bound"][j])]
    # hidden index 0 is the embeddings, i the output of layer i - 1 (the last one final-normed)
    lossy = [i - 1 for i, e in enumerate(errors) if i > 0 and not e <= threshold]
    headroom = {point: min((limits[j] / row[j] if row[j] > 0 else math.inf) for row in watch["max"].tolist())
                for j, point in enumerate(watch["points"])}
    return {"dtype": watch["dtype"], "residual_dtype": watch["residual_dtype"],
            "path": "mixed" if ours.model.residual_dtype is not None else "pure",
            "overflows": overflows, "first_overflow": overflows[0] if overflows else None,
            "lossy_layers": lossy, "layer_median_errors_vs_fp32": errors[1:],
            "logits_median_error_vs_fp32": logits_error, "threshold": threshold,
            "min_headroom": headroom, "repaired": not overflows and logits_error <= threshold}


def mean_nll(logits: torch.Tensor, ids: list[int]) -> float:
    """Mean next-token negative log-likelihood in nats (logits row t predicts ids[t + 1])."""
    return float(F.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:])))


def default_reference_text() -> str:
    # a fixed piece of Python source every machine has; textwrap changes rarely between versions
    return inspect.getsource(textwrap)[:8000]


def run_verify(model_dir, *, prompts=None, reference_text=None, max_new_tokens: int = 16,
               log: Callable[[str], None] | None = None, knobs: SchedulerKnobs | None = None,
               dtype: str | torch.dtype = "float32", mixed_precision: bool = False) -> dict:
    """Compare this engine with transformers on `model_dir`; returns the measurements and `passed`.

    prompts: token-id lists or strings (strings need tokenizer.json); default: slices of the
    reference text of PROMPT_LENGTHS tokens. reference_text: a string or token ids; default: a
    chunk of stdlib source, or seeded pseudo-random ids when the checkpoint has no tokenizer.
    knobs: the engine's batching knobs for the greedy run (small prefill chunks exercise chunking).
    dtype: bf16 or fp16 adds the numerics in that dtype (under "half") and the precision report
    (under "precision": where operators overflow and layers lose accuracy against fp32); fp32 adds
    nothing. mixed_precision: the half-precision engine keeps its residual stream in fp32 (fp16
    matmuls, fp32 norms and sums); the report then covers both paths, and the checks the mixed one,
    against the fp32 reference (transformers has no such path to compare with).
    """
    if mixed_precision and dtype in ("float32", torch.float32):
        raise ValueError("mixed_precision: needs a half-precision dtype (bf16 or fp16)")
    half_dtype = parse_dtype(dtype)
    half_dtype = None if half_dtype == torch.float32 else half_dtype
    try:
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ReferenceMissing("verify needs transformers: pip install 'moectl[reference]'") from None
    say = log or (lambda msg: None)
    transformers.logging.set_verbosity_error()  # generation-config chatter is not a result
    transformers.utils.logging.disable_progress_bar()
    model_dir = str(model_dir)

    def reference(dtype):
        say(f"loading transformers reference ({dtype})")
        # eager attention: the plainest reference, independent of the SDPA kernel this engine uses
        # and the eager experts loop: transformers' grouped_mm experts refuse widths off 16-byte
        # strides (hidden 52) that the model itself defines, and the loop is the plainest reference
        kwargs = dict(dtype=dtype, attn_implementation="eager", experts_implementation="eager")
        if cfg.raw.get("model_type") in MODEL_TYPE_ALIASES:
            # transformers knows no kimi_k2 model_type, and keys its weight conversion on model_type:
            # load the architecture it names under the model_type that architecture has
            config = transformers.AutoConfig.for_model(MODEL_TYPE_ALIASES[cfg.raw["model_type"]],
                                                       **{k: v for k, v in cfg.raw.items() if k != "model_type"})
            kwargs["config"] = config
        return AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).eval()

    def engine(dtype, blocks, engine_knobs=None, mixed=False):
        say(f"loading engine ({dtype}{', fp32 residual' if mixed else ''})")
        return LLMEngine(EngineConfig(model=model_dir, dtype=dtype, block_size=BLOCK_SIZE, num_kv_blocks=blocks,
                                      knobs=engine_knobs or SchedulerKnobs(), mixed_precision=mixed))

    # -- inputs, from the config and tokenizer alone (no weights loaded yet)
    cfg = ModelConfig.from_dir(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir, cfg.bos_token_id)
    text_ids = _text_ids(cfg, tokenizer, reference_text)
    prompt_ids = [_encode(tokenizer, p) for p in prompts] if prompts is not None else \
        [text_ids[7 * i: 7 * i + n] for i, n in enumerate(PROMPT_LENGTHS)]
    if any(not p or not all(0 <= t < cfg.vocab_size for t in p) for p in prompt_ids):
        raise ValueError(f"prompts: every prompt needs at least one token id in [0, {cfg.vocab_size})")
    blocks = max(2 * -(-len(text_ids) // BLOCK_SIZE),  # the numerics batch: text + as many random ids
                 sum(-(-(len(p) + max_new_tokens) // BLOCK_SIZE) for p in prompt_ids)) + 1

    # -- fp32: hidden states, logits, greedy generation
    ours = engine("float32", blocks, knobs)
    ref = reference(torch.float32)

    # the text, plus seeded random ids: a text alone may leave some experts unrouted, and an expert
    # no token reaches is an expert this comparison cannot check (see expert_coverage)
    noise = torch.randint(0, cfg.vocab_size, (len(text_ids),), generator=torch.Generator().manual_seed(1)).tolist()
    batch = [text_ids, noise]
    say(f"comparing hidden states over {len(batch)} x {len(text_ids)} tokens")
    numerics = compare_layers(ours, ref, batch)
    logits, ref_logits = numerics["logits"], numerics["ref_logits"]
    layer_errors, logits_error = numerics["layer_rel_errors"], numerics["logits_rel_error"]
    max_error = numerics["max_rel_error"]
    nll_engine_fp32, nll_ref_fp32 = mean_nll(logits[0], text_ids), mean_nll(ref_logits[0], text_ids)
    routed = numerics["routed"]
    coverage = (sum(int((c > 0).sum()) for c in routed), sum(c.numel() for c in routed))

    say(f"greedy generation: {len(prompt_ids)} prompts x {max_new_tokens} tokens")
    greedy = _compare_greedy(ours, ref, prompt_ids, max_new_tokens)
    ref_hidden_fp32 = numerics["ref_hidden"]
    del ours, ref, numerics, logits
    gc.collect()

    # -- bf16 or fp16 on request: the numerics in that dtype, and where it overflows or loses accuracy
    half = loglik = precision = None
    if half_dtype is not None:
        half_name = str(half_dtype).removeprefix("torch.")
        ours, ref = engine(half_name, blocks), reference(half_dtype)
        say(f"comparing hidden states in {half_name}")
        measured = compare_layers(ours, ref, batch)
        half = {"dtype": half_name, **{k: v for k, v in measured.items()
                                       if k not in ("logits", "ref_logits", "routed", "ref_hidden")}}
        say(f"precision report: {half_name} against fp32, layer by layer")
        precision = {"pure": precision_report(ours, ref_hidden_fp32, ref_logits, batch, HALF_THRESHOLDS[half_dtype])}
        if half_dtype == torch.bfloat16:  # the pair the log-likelihood check loads anyway
            loglik = mean_nll(ours.score(text_ids), text_ids), _reference_nll(ref, text_ids)
        del ours, ref, measured
        gc.collect()
        if mixed_precision:
            ours = engine(half_name, blocks, mixed=True)
            say(f"precision report: {half_name} with an fp32 residual stream against fp32")
            precision["mixed"] = precision_report(ours, ref_hidden_fp32, ref_logits, batch, HALF_THRESHOLDS[half_dtype])
            del ours
            gc.collect()
    del ref_logits, ref_hidden_fp32

    # -- bf16: log-likelihood of the reference text, one model at a time
    if loglik is None:
        ours = engine("bfloat16", blocks)
        nll_engine = mean_nll(ours.score(text_ids), text_ids)
        del ours
        gc.collect()
        ref = reference(torch.bfloat16)
        loglik = nll_engine, _reference_nll(ref, text_ids)
        del ref
        gc.collect()
    nll_engine, nll_ref = loglik

    loglik_diff = abs(nll_engine - nll_ref) / abs(nll_ref)
    matched = sum(g["match"] for g in greedy)
    checks = {
        "numerics": max_error <= THRESHOLDS["max_rel_error"],
        "loglik": loglik_diff <= THRESHOLDS["loglik_rel_diff"],
        "greedy": matched == len(greedy),
    }
    thresholds = dict(THRESHOLDS)
    if half is not None:
        thresholds["median_rel_error"] = HALF_THRESHOLDS[half_dtype]
        if mixed_precision:  # the path served: no overflow, every layer within the threshold of fp32
            checks["half_precision"] = precision["mixed"]["repaired"] and not precision["mixed"]["lossy_layers"]
        else:
            checks["half_numerics"] = half["median_rel_error"] <= thresholds["median_rel_error"]
            checks["half_precision"] = not precision["pure"]["overflows"]
    return {
        "architecture": cfg.architecture,
        "num_layers": cfg.num_layers,
        "num_text_tokens": len(text_ids),  # the numerics also run as many seeded random ids
        # index 0: embeddings, i: after layer i (1..L-1), L: after the final norm
        "layer_rel_errors": layer_errors,
        "logits_rel_error": logits_error,
        "max_rel_error": max_error,
        # (layer, expert) pairs that got at least one token in the numerics check, of all of them
        "expert_coverage": f"{coverage[0]}/{coverage[1]}",
        "loglik_engine": nll_engine,  # mean NLL per token (nats), bf16
        "loglik_reference": nll_ref,
        "loglik_rel_diff": loglik_diff,
        "loglik_engine_fp32": nll_engine_fp32,
        "loglik_reference_fp32": nll_ref_fp32,
        "loglik_engine_vs_fp32": abs(nll_engine - nll_ref_fp32) / abs(nll_ref_fp32),
        "loglik_reference_vs_fp32": abs(nll_ref - nll_ref_fp32) / abs(nll_ref_fp32),
        "greedy_match": checks["greedy"],
        "greedy_matched": f"{matched}/{len(greedy)}",
        "greedy": greedy,
        # dtype bf16/fp16: that dtype's numerics, as compare_layers measures them, and its dtype
        "half": half,
        # dtype bf16/fp16: precision_report of the pure half path ("pure") and, with
        # mixed_precision, of the path with an fp32 residual stream ("mixed")
        "precision": precision,
        "thresholds": thresholds,
        "checks": checks,
        "passed": all(checks.values()),
    }


def _reference_nll(ref, ids: list[int]) -> float:
    with torch.inference_mode():
        return mean_nll(ref(input_ids=torch.tensor([ids])).logits[0].float(), ids)


def _encode(tokenizer: Tokenizer | None, prompt) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompts: this checkpoint has no tokenizer.json; pass token ids")
        return tokenizer.encode(prompt)
    return [int(t) for t in prompt]


def _text_ids(cfg: ModelConfig, tokenizer: Tokenizer | None, reference_text) -> list[int]:
    limit = min(MAX_TEXT_TOKENS, cfg.max_position_embeddings)
    if reference_text is not None:
        ids = _encode(tokenizer, reference_text)
    elif tokenizer is not None:
        ids = tokenizer.encode(default_reference_text())
    else:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (limit,), generator=gen).tolist()
    ids = ids[:limit]
    if len(ids) < 2:
        raise ValueError("reference_text: needs at least 2 tokens")
    if any(not 0 <= t < cfg.vocab_size for t in ids):
        raise ValueError(f"reference_text: token ids must be in [0, {cfg.vocab_size})")
    return ids


def _compare_greedy(engine: LLMEngine, ref, prompt_ids: list[list[int]], max_new_tokens: int) -> list[dict]:
    eos = list(engine.model_config.eos_token_ids)
    # eos handled the same way on both sides: both stop at the config's eos ids
    outs = engine.generate(prompt_ids, SamplingParams(max_tokens=max_new_tokens, temperature=0.0))
    results = []
    for prompt, out in zip(prompt_ids, outs):
        x = torch.tensor([prompt])
        with torch.inference_mode():
            # explicit neutral settings: a checkpoint's generation_config.json may carry a repetition
            # penalty or the like, which would change greedy decoding on the reference side only
            gen = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False, num_beams=1,
                               max_new_tokens=max_new_tokens, repetition_penalty=1.0, no_repeat_ngram_size=0,
                               eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0,
                               output_scores=True, return_dict_in_generate=True)
        theirs = gen.sequences[0, len(prompt):].tolist()
        results.append({"prompt_len": len(prompt), "engine": out.token_ids, "reference": theirs,
                        "match": _same_generation(out.token_ids, theirs, eos, ref.generation_config.eos_token_id),
                        # smallest top-1/top-2 logit gap along the reference path: near 0 means a
                        # near-tie that rounding alone could flip
                        "min_margin": min((_margin(s[0]) for s in gen.scores), default=float("inf"))})
    return results


def _same_generation(ours: list[int], theirs: list[int], eos: list[int], ref_eos) -> bool:
    """Identical, or one side stopped on a token it treats as eos (e.g. from generation_config.json)
    where the other kept going with the same tokens."""
    if ours == theirs:
        return True
    stops = set(eos) | set(ref_eos if isinstance(ref_eos, list) else [ref_eos] if ref_eos is not None else [])
    short, long_ = sorted((ours, theirs), key=len)
    return len(short) < len(long_) and bool(short) and short[-1] in stops and long_[:len(short)] == short


def _margin(scores: torch.Tensor) -> float:
    top = torch.topk(scores.float(), 2).values
    return float(top[0] - top[1])
