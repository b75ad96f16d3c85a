"""Log-probabilities through `moectl serve` against transformers' own, on the shipped sample model.

    python bench/logprob_agreement.py [--json] [--prompts 4] [--chars 1500]

Each prompt is a slice of a Python standard-library file (the kind of text the model knows),
sent as token ids to /v1/completions with echo, logprobs 5 and max_tokens 0 (lm-evaluation-
harness's log-likelihood request). transformers' MixtralForCausalLM runs the same ids in float32.
Prints the largest relative and absolute difference over every prompt position, and how often
the top-5 agree as sets.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from moectl.engine import sample_model_dir  # noqa: E402
from moectl.engine.core.config import EngineConfig  # noqa: E402
from moectl.engine.core.driver import EngineDriver  # noqa: E402
from moectl.engine.llm_engine import LLMEngine  # noqa: E402
from moectl.server.app import ServerThread  # noqa: E402


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--chars", type=int, default=1500)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import transformers

    model_dir = sample_model_dir()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    sources = [Path(m.__file__).read_text() for m in (textwrap, json.decoder, argparse, urllib.request)]
    driver = EngineDriver(lambda: LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_threads=1)))
    worst_rel = worst_abs = 0.0
    positions = top_agree = over = 0
    worst_at = None
    try:
        with ServerThread(driver) as srv:
            for text in sources[:args.prompts]:
                ids = post(srv.url + "/tokenize", {"prompt": text[:args.chars]})["tokens"]
                out = post(srv.url + "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 5, "max_tokens": 0})
                lp = out["choices"][0]["logprobs"]
                with torch.no_grad():
                    want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)
                got = torch.tensor(lp["token_logprobs"][1:], dtype=torch.float64)
                ref = want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
                worst_abs = max(worst_abs, (got - ref).abs().max().item())
                rel = (got - ref).abs() / ref.abs().clamp_min(1e-12)
                over += int((rel >= 1e-3).sum())
                i = int(rel.argmax())
                if rel[i].item() > worst_rel:
                    worst_rel, worst_at = rel[i].item(), (ref[i].item(), got[i].item())
                for pos in range(1, len(ids)):
                    mine = set(lp["top_logprobs"][pos].values())
                    theirs = want[pos - 1].topk(5).values.tolist()
                    top_agree += all(any(abs(v - t) <= 1e-3 * abs(t) for v in mine) for t in theirs)
                    positions += 1
    finally:
        driver.close()
    result = {"positions": positions, "max_rel_diff": worst_rel, "max_abs_diff": worst_abs,
              "worst_rel_at": {"transformers": worst_at[0], "moectl": worst_at[1]}, "positions_over_1e-3_rel": over,
              "top5_agree_fraction": top_agree / positions, "target_rel": 1e-3, "met": worst_rel < 1e-3}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{positions} prompt positions: max relative difference {worst_rel:.2e} (target < 1e-3: "
              f"{'met' if result['met'] else 'MISSED'}; at logprob {worst_at[0]:.6g} vs {worst_at[1]:.6g}; "
              f"{over} positions at or over 1e-3), max absolute {worst_abs:.2e}; "
              f"top-5 agree at {100 * result['top5_agree_fraction']:.1f}% of positions")


if __name__ == "__main__":
    main()
