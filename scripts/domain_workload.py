"""The rebalance suite's one-domain prompts (Python import blocks, `rebalance_bench.domain_prompts`)
as a JSONL workload, for `moectl record --workload file=PATH,rate=R`:

    python scripts/domain_workload.py sample_traces/workloads/import_blocks.jsonl [--count 400] [--seed 4]

Each line is {"prompt": TEXT, "max_tokens": N}, with outputs of 16-96 tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moectl.engine.tools.rebalance_bench import domain_prompts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--count", type=int, default=400)
    parser.add_argument("--seed", type=int, default=4)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    with args.out.open("w") as f:
        for prompt in domain_prompts(args.count, args.seed):
            f.write(json.dumps({"prompt": prompt, "max_tokens": int(rng.integers(16, 97))}) + "\n")


if __name__ == "__main__":
    main()
