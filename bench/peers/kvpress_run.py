"""NVIDIA kvpress as a peer for KV-cache compression accuracy (run with .peers/kvpress/bin/python).

For each text (token ids, all the same length L) the first C tokens are the context and the rest
the continuation. Scored positions are C-1 .. L-2, predicting tokens C .. L-1:

- full KV: one forward over the context into a DynamicCache (its logits at C-1 predict token C),
  then one teacher-forced forward over the continuation with that cache (position ids C .. L-1);
- each press and budget: the same, with the press applied to the context forward only
  (`with press(model):`, compression_ratio = 1 - budget), then the continuation forward on the
  compressed cache outside the context manager, so nothing further is compressed.

Reported per press and budget: mean NLL (nats) over all scored positions of all texts and top-1
agreement with the full-KV argmax; full KV the same (agreement 1.0); kept_fraction, the cache entries
left per layer and KV head after the context over C (entries AdaKVPress masks rather than evicts
not counted). fp32. Presses run under sdpa
attention (kvpress's head-wise masking patches the registered attention functions, eager is not
one), ObservedAttentionPress under eager (it needs the attention weights); each press's agreement
is against the full-KV argmax of the same attention implementation. Sanity check: the full-KV
path against one forward over the whole text, at the same positions, per implementation.

    .peers/kvpress/bin/python bench/peers/kvpress_run.py --model engine/sample_model \\
        --texts texts.json --context 1024 --budgets 0.25,0.5 --out kvpress.json
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import logging
import os
import platform
import time
import traceback
from importlib.metadata import version

# Local checkpoints only: presses that fetch trained weights from the Hugging Face Hub fail at
# once (and are recorded as failed) instead of waiting on a network that is not there.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from kvpress import (  # noqa: E402
    AdaKVPress,
    CapPress,
    CompactorPress,
    CriticalKVPress,
    CURPress,
    ExpectedAttentionPress,
    KeyDiffPress,
    KnormPress,
    KVzapPress,
    LagKVPress,
    LeverageScorePress,
    NonCausalAttnPress,
    ObservedAttentionPress,
    PyramidKVPress,
    QFilterPress,
    RandomPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)
from kvpress.presses.base_press import SUPPORTED_MODELS  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache  # noqa: E402

# (name, factory(compression_ratio), attention implementation). The six most cited first, then
# kvpress's other token-scoring presses (ScorerPress subclasses, and two wrappers of one), all
# with their default settings. QFilterPress and KVzapPress need per-model trained weights
# from the Hub; they are tried and recorded as failed where there are none.
PRESSES = [
    ("StreamingLLMPress", lambda r: StreamingLLMPress(compression_ratio=r), "sdpa"),
    ("SnapKVPress", lambda r: SnapKVPress(compression_ratio=r), "sdpa"),
    ("KnormPress", lambda r: KnormPress(compression_ratio=r), "sdpa"),
    ("TOVAPress", lambda r: TOVAPress(compression_ratio=r), "sdpa"),
    ("ExpectedAttentionPress", lambda r: ExpectedAttentionPress(compression_ratio=r), "sdpa"),
    ("ObservedAttentionPress", lambda r: ObservedAttentionPress(compression_ratio=r), "eager"),
    ("RandomPress", lambda r: RandomPress(compression_ratio=r, seed=0), "sdpa"),
    ("KeyDiffPress", lambda r: KeyDiffPress(compression_ratio=r), "sdpa"),
    ("LagKVPress", lambda r: LagKVPress(compression_ratio=r), "sdpa"),
    ("PyramidKVPress", lambda r: PyramidKVPress(compression_ratio=r), "sdpa"),
    ("CURPress", lambda r: CURPress(compression_ratio=r), "sdpa"),
    ("LeverageScorePress", lambda r: LeverageScorePress(compression_ratio=r), "sdpa"),
    ("NonCausalAttnPress", lambda r: NonCausalAttnPress(compression_ratio=r), "sdpa"),
    ("CompactorPress", lambda r: CompactorPress(compression_ratio=r), "sdpa"),
    ("CapPress", lambda r: CapPress(compression_ratio=r), "sdpa"),
    (
        "CriticalKVPress(ExpectedAttentionPress)",
        # use_vnorm off, as CriticalKVPress warns otherwise
        lambda r: CriticalKVPress(ExpectedAttentionPress(compression_ratio=r, use_vnorm=False)),
        "sdpa",
    ),
    ("AdaKVPress(ExpectedAttentionPress)", lambda r: AdaKVPress(ExpectedAttentionPress(compression_ratio=r)), "sdpa"),
    ("QFilterPress", lambda r: QFilterPress(compression_ratio=r), "sdpa"),
    ("KVzapPress", lambda r: KVzapPress(compression_ratio=r), "sdpa"),
]


def attention_modules(model):
    inner = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return [layer.self_attn for layer in inner.layers]


def run_text(model, ids: torch.Tensor, context: int, press=None):
    """Log-probabilities of the actual next tokens and argmax tokens at positions C-1 .. L-2, the
    cache length each layer kept after the context, and layer 0's cache shapes then."""
    for attn in attention_modules(model):  # head-wise presses leave their masks on the modules
        attn.masked_key_indices = None
    length = ids.shape[1]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        with press(model) if press is not None else contextlib.nullcontext():
            first = model(
                input_ids=ids[:, :context],
                past_key_values=cache,
                position_ids=torch.arange(context).unsqueeze(0),
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1:]
        # Entries per layer after the context, less those a head-wise press (AdaKV) masks instead of
        # evicting (it leaves them in the cache), averaged over KV heads.
        kept = []
        for i, attn in enumerate(attention_modules(model)):
            heads = cache.layers[i].keys.shape[1]
            masked = getattr(attn, "masked_key_indices", None)
            n_masked = 0 if masked is None else len(masked[0])
            kept.append((cache.get_seq_length(i) * heads - n_masked) / heads)
        layout = {"keys": list(cache.layers[0].keys.shape), "values": list(cache.layers[0].values.shape)}
        rest = model(
            input_ids=ids[:, context:],
            past_key_values=cache,
            position_ids=torch.arange(context, length).unsqueeze(0),
            use_cache=True,
        ).logits[:, :-1]
    logits = torch.cat([first, rest], dim=1)[0].float()  # (L - C, vocab): positions C-1 .. L-2
    logp = torch.log_softmax(logits, dim=-1)
    target = ids[0, context:]
    return logp.gather(1, target[:, None])[:, 0], logits.argmax(-1), kept, layout


def single_forward(model, ids: torch.Tensor, context: int):
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0, context - 1 : -1].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, ids[0, context:, None])[:, 0], logits.argmax(-1)


def mixtral_attention_note(model) -> str | None:
    """Whether transformers' MixtralAttention is MistralAttention under another name (same source
    once the names are swapped), the evidence for running an untested Mixtral."""
    if model.config.model_type != "mixtral":
        return None
    from transformers.models.mistral import modeling_mistral
    from transformers.models.mixtral import modeling_mixtral

    mix = inspect.getsource(modeling_mixtral.MixtralAttention).replace("Mixtral", "Mistral")
    mis = inspect.getsource(modeling_mistral.MistralAttention)
    same = mix == mis
    modular = os.path.join(os.path.dirname(modeling_mixtral.__file__), "modular_mixtral.py")
    derived = os.path.exists(modular) and "class MixtralAttention(MistralAttention)" in open(modular).read()
    return (
        f"transformers {transformers.__version__}: MixtralAttention's source "
        f"{'is' if same else 'is NOT'} MistralAttention's with the class names swapped"
        + (" (modular_mixtral.py declares `class MixtralAttention(MistralAttention)`)" if derived else "")
        + "; kvpress does not refuse it: BasePress.__call__ only logs 'not tested' for a model outside "
        "SUPPORTED_MODELS"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    ap.add_argument("--texts", required=True, help="JSON list of token-id lists, all the same length")
    ap.add_argument("--context", type=int, required=True, help="the first C tokens of each text")
    ap.add_argument("--budgets", default="0.25,0.5", help="fractions of the context's KV kept")
    ap.add_argument("--out", required=True)
    ap.add_argument("--presses", default=None, help="comma-separated subset of the press names")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("kvpress").setLevel(logging.ERROR)  # "not tested" is recorded below instead
    budgets = [float(b) for b in args.budgets.split(",")]
    texts = json.load(open(args.texts))
    lengths = {len(t) for t in texts}
    if len(lengths) != 1:
        raise SystemExit(f"texts must all have the same length, got {sorted(lengths)}")
    (length,) = lengths
    if not 0 < args.context < length:
        raise SystemExit(f"--context must be in 1 .. {length - 1}")
    presses = PRESSES
    if args.presses:
        wanted = args.presses.split(",")
        presses = [p for p in PRESSES if p[0] in wanted]
        missing = set(wanted) - {p[0] for p in presses}
        if missing:
            raise SystemExit(f"unknown presses: {sorted(missing)}")

    config = AutoConfig.from_pretrained(args.model)
    out: dict = {
        "model": os.path.abspath(args.model),
        "architecture": (config.architectures or [None])[0],
        "model_type": config.model_type,
        "versions": {
            "kvpress": version("kvpress"),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "torch_threads": torch.get_num_threads(),
        "dtype": "float32",
        "texts": len(texts),
        "text_length": length,
        "context": args.context,
        "scored_positions_per_text": length - args.context,
        "budgets": budgets,
        "method": (
            "context forward into a DynamicCache (press applied here only, compression_ratio = 1 - budget), "
            "then one teacher-forced forward over the continuation with position ids C..L-1; scored positions "
            "C-1..L-2; NLL in nats; agreement = argmax equal to full-KV argmax of the same attention implementation; "
            "torch.manual_seed(0) before each press and budget"
        ),
        "kvpress_tested_models": [m.__name__ for m in SUPPORTED_MODELS],
    }

    models: dict = {}

    def get_model(attn: str):
        if attn not in models:
            m = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation=attn)
            models[attn] = m.eval()
        return models[attn]

    ids_list = [torch.tensor(t, dtype=torch.long)[None] for t in texts]
    n_scored = len(texts) * (length - args.context)

    # Full KV and the sanity check, per attention implementation that a press uses.
    full: dict = {}
    per_text_s = [0.0] * len(texts)  # every run of the text: full KV and each press and budget
    full_kv_s = [0.0] * len(texts)  # the sdpa full-KV run alone (context + continuation forward)
    for attn in sorted({p[2] for p in presses} | {"sdpa"}):
        model = get_model(attn)
        nll, argmaxes, check = 0.0, [], {"max_abs_logprob_diff": 0.0, "argmax_disagreements": 0}
        single_nll = 0.0
        for i, ids in enumerate(ids_list):
            t0 = time.perf_counter()
            logp, am, _, layout = run_text(model, ids, args.context)
            per_text_s[i] += time.perf_counter() - t0
            if attn == "sdpa":
                full_kv_s[i] = time.perf_counter() - t0
            ref_logp, ref_am = single_forward(model, ids, args.context)
            nll -= logp.double().sum().item()
            single_nll -= ref_logp.double().sum().item()
            argmaxes.append(am)
            check["max_abs_logprob_diff"] = max(check["max_abs_logprob_diff"], (logp - ref_logp).abs().max().item())
            check["argmax_disagreements"] += int((am != ref_am).sum())
        check["nll_diff"] = abs(nll - single_nll) / n_scored
        full[attn] = {"nll": nll / n_scored, "argmax": argmaxes, "check": check}
    out["full_kv"] = {"attn_implementation": "sdpa", "nll": full["sdpa"]["nll"], "agreement": 1.0}
    # What transformers caches for this model (batch, kv heads, context, dim): the tensors kvpress
    # compresses. For DeepseekV3 these are the per-head keys and values decompressed from MLA's
    # latent, not the latent itself.
    out["cache_layout_layer0"] = layout
    out["sanity_check"] = {
        "what": "full-KV path (context forward + cached continuation forward) vs one forward over the whole "
        "text, same scored positions; nll_diff = |mean NLL difference|",
        **{attn: full[attn]["check"] for attn in full},
    }
    if "eager" in full:
        out["full_kv"]["nll_eager"] = full["eager"]["nll"]

    note = mixtral_attention_note(get_model("sdpa"))
    tested = isinstance(get_model("sdpa"), SUPPORTED_MODELS)
    out["kvpress_tested"] = tested
    if note:
        out["architecture_note"] = note

    results: dict = {}
    failures: dict = {}
    for name, factory, attn in presses:
        model = get_model(attn)
        for budget in budgets:
            key = f"{name}@{budget:g}"
            t0 = time.perf_counter()
            torch.manual_seed(0)  # LeverageScorePress and CompactorPress draw random sketches
            try:
                press = factory(1.0 - budget)
                nll, agree, kept_frac = 0.0, 0, []
                for i, ids in enumerate(ids_list):
                    t1 = time.perf_counter()
                    logp, am, kept, _ = run_text(model, ids, args.context, press)
                    per_text_s[i] += time.perf_counter() - t1
                    if not torch.isfinite(logp).all():
                        raise FloatingPointError("non-finite log-probabilities")
                    nll -= logp.double().sum().item()
                    agree += int((am == full[attn]["argmax"][i]).sum())
                    kept_frac.append(sum(kept) / (len(kept) * args.context))
            except Exception as e:  # noqa: BLE001 - every failure is recorded, not hidden
                tb = traceback.extract_tb(e.__traceback__)
                where = next((f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(tb)), "")
                failures[key] = {"press": name, "budget": budget, "error": f"{type(e).__name__}: {e}"[:500], "at": where}
                print(f"{key:50s} FAILED {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            results.setdefault(name, {})[f"{budget:g}"] = {
                "attn_implementation": attn,
                "nll": nll / n_scored,
                "agreement": agree / n_scored,
                "kept_fraction": sum(kept_frac) / len(kept_frac),
                "seconds": time.perf_counter() - t0,
            }
            r = results[name][f"{budget:g}"]
            print(f"{key:50s} nll {r['nll']:.4f}  agree {r['agreement']:.4f}  kept {r['kept_fraction']:.3f}", flush=True)

    out["presses"] = results
    out["failed"] = failures
    out["supported"] = bool(results)
    if not results:
        errors = sorted({f["error"] for f in failures.values()})
        out["reason"] = (
            f"no kvpress press runs on {out['architecture']} "
            f"({'a kvpress tested model' if tested else 'not among kvpress tested models'}); errors: {errors}"
        )
        attn0 = attention_modules(get_model("sdpa"))[0]
        if layout["keys"][-1] != layout["values"][-1] or not hasattr(attn0, "head_dim"):
            out["reason"] += (
                f". {type(attn0).__name__} has no single head_dim (keys cached {layout['keys']}, values "
                f"{layout['values']}: per-head tensors transformers decompresses from the MLA latent, not the "
                "latent itself), while kvpress's presses index keys and values by module.head_dim and build "
                "queries from q_proj"
            )
    elif not tested:
        out["reason"] = (
            f"{out['architecture']} is not among kvpress's tested models (kvpress only logs a warning); "
            + (note or "")
        )
    out["per_text_seconds_full_kv"] = full_kv_s
    out["per_text_seconds_all_runs"] = per_text_s
    out["wall_seconds"] = time.perf_counter() - t_start
    print(
        f"full KV nll {out['full_kv']['nll']:.4f}; sanity {json.dumps(out['sanity_check']['sdpa'])}; "
        f"{len(results)} presses ran, {len(failures)} press/budget runs failed; {out['wall_seconds']:.1f}s",
        flush=True,
    )
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
