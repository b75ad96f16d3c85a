"""What choosing a replica costs in the dispatch: `Placement.assign_replicas` per MoE layer call.

    python bench/replica_routing_bench.py [--tokens 1024] [--devices 4] [--json]

The engine calls it once per MoE layer per step for every (token, choice) (top-2 here). It
times each routing policy on the naive placement (one replica per expert: the fast path) and
on one with a replica of a quarter of the experts (one per device's spare slot), median of
repeated calls, the way the engine calls it (check=False).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from moectl.engine.experts.replica_routing import POLICIES, RoutingState, assign_replicas
from moectl.placement.placement import Placement


def time_call(placement: Placement, ids: torch.Tensor, home: torch.Tensor, policy: str, repeat: int) -> float:
    state = RoutingState(8)
    assign_replicas(placement, 0, ids, home, policy, state, check=False)  # warm-up (tables cached)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        assign_replicas(placement, 0, ids, home, policy, state, check=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.experts, (args.tokens, 2), generator=gen)
    home = torch.randint(0, args.devices, (args.tokens,), generator=gen)
    naive = Placement.contiguous(1, args.experts, args.devices, 1)
    slots = naive.slots.copy()
    per = args.experts // args.devices
    for d in range(args.devices):  # device d's spare slot holds a replica of an expert of device d + 1
        slots[0, d, -1] = ((d + 1) % args.devices) * per
    replicated = Placement(slots, args.experts)
    result = {"tokens": args.tokens, "devices": args.devices, "experts": args.experts, "us": {}}
    for name, placement in (("naive", naive), ("replicas", replicated)):
        for policy in POLICIES:
            result["us"][f"{name}/{policy}"] = time_call(placement, ids, home, policy, args.repeat) * 1e6
    if args.json:
        print(json.dumps(result))
        return
    for key, us in result["us"].items():
        print(f"{key:24s} {us:8.0f} us per layer call ({args.tokens} tokens x top-2)")


if __name__ == "__main__":
    main()
