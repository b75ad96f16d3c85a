"""The verification table: every architecture and option combination of tests/checkpoints.SPECS
(tiny random checkpoints written by transformers' own classes) through `moectl verify`.

    python scripts/verify_matrix.py [NAME ...] [--json]

Prints per checkpoint the largest per-layer relative error (fp32), the logits' error, the bf16
log-likelihood difference and the greedy match, against verify's thresholds. Needs transformers
(pip install 'moectl[reference]').
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moectl.engine.core.config import SchedulerKnobs  # noqa: E402
from moectl.engine.tools.verify import run_verify  # noqa: E402
from tests.checkpoints import SPECS, tiny_checkpoint  # noqa: E402

CHUNKY = SchedulerKnobs(long_prefill_token_threshold=8, max_num_batched_tokens=24)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help=f"default: all of {', '.join(SPECS)}")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.names or list(SPECS):
            r = run_verify(tiny_checkpoint(Path(tmp) / name, name), knobs=CHUNKY)
            rows.append({"name": name, "architecture": r["architecture"], "max_layer_rel_error": max(r["layer_rel_errors"]),
                         "logits_rel_error": r["logits_rel_error"], "loglik_rel_diff": r["loglik_rel_diff"],
                         "greedy": r["greedy_matched"], "expert_coverage": r["expert_coverage"], "passed": r["passed"]})
            if not args.json:
                x = rows[-1]
                print(f"{name:20} {x['architecture']:12} layers {x['max_layer_rel_error']:.1e}  logits "
                      f"{x['logits_rel_error']:.1e}  bf16 loglik {x['loglik_rel_diff']:.3%}  greedy {x['greedy']}  "
                      f"experts hit {x['expert_coverage']}  {'PASS' if x['passed'] else 'FAIL'}")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
