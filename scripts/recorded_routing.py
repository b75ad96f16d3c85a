"""Writes engine/sim/recorded/<name>.json, the routing a trace recorded (summed over its steps,
MoE layers only): the simulated backend's default routing source (`--routing sample`), shipped
as data so that an installed moectl has it without the repository's sample_traces/.

    python scripts/recorded_routing.py sample_traces/dsv3_ranks_rebalance.trace sample-dsv3
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from moectl.profiler.trace_queries import trace_routing
from moectl.profiler.trace_store import TraceReader


def main(trace: str, name: str) -> None:
    reader = TraceReader(trace)
    routing = trace_routing(reader)[0]
    moe = routing[routing.sum(1) > 0].astype(int)
    rows = ",\n  ".join(json.dumps(row) for row in moe.tolist())
    source = (f"{trace}: the routing its steps recorded (summed), measured by moectl's engine on "
              f"{reader.header['model']['name']}; regenerate with scripts/recorded_routing.py")
    out = Path(__file__).resolve().parent.parent / "engine" / "sim" / "recorded" / f"{name}.json"
    out.write_text(f'{{"source": {json.dumps(source)},\n "model": {json.dumps(reader.header["model"]["name"])},\n'
                   f' "moe_layers": {moe.shape[0]}, "experts": {moe.shape[1]},\n "counts": [\n  {rows}\n ]\n}}\n')
    print(f"{out}: {moe.shape[0]} MoE layers x {moe.shape[1]} experts")


if __name__ == "__main__":
    main(*sys.argv[1:3])
