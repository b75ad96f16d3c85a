"""What choosing a replica costs in the dispatch: `assign_replicas` per MoE layer call.

    python bench/replica_routing_bench.py [--tokens 256] [--devices 4] [--repeat 2000] [--json]

The engine calls it once per MoE layer per step for every (token, choice), the way it is timed
here (check=False, the routing state carried across calls). For the two sample models' shapes
(16 experts top-2, 32 experts top-8) and a 64-expert layer, it times each routing policy on the
naive placement (one replica per expert: one gather, the floor) and on one with a replica of a
quarter of the experts (one per device's spare slot), median of `repeat` calls with the calls
of every case interleaved, so a busy core slows each case alike. The target (issue 35): at most
30 us per layer call at 256 tokens on the 2-core CI machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from moectl.engine.experts.replica_routing import POLICIES, RoutingState, assign_replicas
from moectl.placement.placement import Placement

TARGET_US = 30.0
SHAPES = (("sample (16 experts, top-2)", 16, 2), ("sample-dsv3 (32 experts, top-8)", 32, 8),
          ("64 experts, top-8", 64, 8))


def replicated(experts: int, devices: int) -> Placement:
    """Device d's spare slot holds a replica of device d + 1's first expert."""
    naive = Placement.contiguous(1, experts, devices, 1)
    slots = naive.slots.copy()
    per = experts // devices
    for d in range(devices):
        slots[0, d, -1] = ((d + 1) % devices) * per
    return Placement(slots, experts)


def cases(tokens: int, devices: int):
    gen = torch.Generator().manual_seed(0)
    home = torch.arange(tokens) % devices
    for label, experts, top_k in SHAPES:
        # Zipf-like popularity: the replicated experts are among the hot ones, as a plan makes them
        weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.2
        ids = torch.multinomial(weights, tokens * top_k, replacement=True, generator=gen).view(tokens, top_k)
        for name, placement in (("naive", Placement.contiguous(1, experts, devices, 1)),
                                ("replicas", replicated(experts, devices))):
            for policy in POLICIES:
                yield f"{label} {name}/{policy}", placement, ids, home, policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    runs = [(key, placement, ids, home, policy, RoutingState(2)) for key, placement, ids, home, policy
            in cases(args.tokens, args.devices)]
    times: dict[str, list[float]] = {key: [] for key, *_ in runs}
    for _ in range(args.repeat):
        for key, placement, ids, home, policy, state in runs:
            t0 = time.perf_counter()
            assign_replicas(placement, 0, ids, home, policy, state, check=False)
            times[key].append(time.perf_counter() - t0)
    us = {key: statistics.median(t[1:]) * 1e6 for key, t in times.items()}  # the first call builds the tables
    result = {"tokens": args.tokens, "devices": args.devices, "target_us": TARGET_US, "us": us,
              "worst_replicated_us": max(v for k, v in us.items() if " replicas/" in k)}
    if args.json:
        print(json.dumps(result))
        return
    for key, v in us.items():
        floor = us[key.replace(" replicas/", " naive/")]
        print(f"{key:48s} {v:6.1f} us per layer call  ({v / TARGET_US:4.2f}x the {TARGET_US:.0f} us target, "
              f"{v / floor:4.1f}x the single-replica gather)")
    worst = result["worst_replicated_us"]
    print(f"worst replicated case: {worst:.1f} us at {args.tokens} tokens: "
          f"{'meets' if worst <= TARGET_US else 'misses'} the {TARGET_US:.0f} us target")


if __name__ == "__main__":
    main()
