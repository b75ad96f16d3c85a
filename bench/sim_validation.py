"""The simulator against published large-scale deployments: per-node throughput predicted from each
deployment's published configuration (its overlap, batch per GPU, all-to-all mode and MTP, as it
reports them) and the shipped hardware profile with its kernel tables, beside the published
figure; SGLang's published two-batch-overlap ablation; and a held-out deployment.

    python bench/sim_validation.py [--json]

Every input and its source is in CASES and ABLATION (and docs/sim.md). Nothing is fitted per
case: the constants are the hardware profiles' (h800.json's kernel tables are fitted on DeepSeek's
published training profile, one forward layer of 4K tokens; h100.json borrows them). Targets
(issue 36): each case within 15% per node; the ablation's gain within 10 points of SGLang's.
Also printed: each case without overlap, and with the roofline alone (the profiles without their
kernel tables: what the simulator priced before them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SGLANG_BLOG = "lm-sys/lm-sys.github.io blog/2025-05-05-large-scale-ep.md @2db4e404"
DEEPSEEK_DAY6 = ("deepseek-ai/open-infra-index 202502OpenSourceWeek/"
                 "day_6_one_more_thing_deepseekV3R1_inference_system_overview.md @3122a252")
DEEPSEEK_PROFILE = "deepseek-ai/profile-data README.md @44960242"
TARGET, ABLATION_TARGET = 0.15, 0.10

# name, hardware, phase, devices (EP group), tokens per device, context, overlap, MTP draft tokens,
# MTP acceptance, published per-node tok/s, source
CASES = [
    ("DeepSeek profile, decode", "h800", "decode", 128, 128, 4096, "five-stage", 0, 0.0, 18_598,
     f"{DEEPSEEK_PROFILE}: decode at EP128, TP1, 4K prompts, 128 requests per GPU, two micro-batches, the all-to-all "
     f"not occupying SMs (DeepEP's low-latency mode); no MTP stated; per-node 18,598 as {SGLANG_BLOG} derives it from "
     f"the profile (its decode table, 'DeepSeek Profile'); the 5-stage decode pipeline of {DEEPSEEK_DAY6}"),
    ("DeepSeek serving, decode", "h800", "decode", 144, 88, 4989, "five-stage", 0, 0.0, 14_800,
     f"{DEEPSEEK_DAY6}: 'Each H800 node delivers ... ~14.8k tokens/s output during decoding', EP144 (18 nodes), "
     f"'average kvcache length per output token was 4,989', 'a 5-stage pipeline'; batch per GPU derived: 1,850 output "
     f"tok/s per GPU over 'The average output speed was 20-22 tokens per second' per request = 84-92 requests (88); "
     f"alibaba/rtp-llm's replay of the same service: 13,200 requests on 144 GPUs = 92; MTP not mentioned there"),
    ("DeepSeek profile, prefill", "h800", "prefill", 32, 16384, 4096, "two-batch", 0, 0.0, 62_713,
     f"{DEEPSEEK_PROFILE}: prefill at EP32, TP1, 4K prompts, 16K tokens per GPU, two micro-batches; per-node 62,713 "
     f"as {SGLANG_BLOG} derives it (its prefill table, 'DeepSeek Profile'); 24 SMs for the all-to-all ({DEEPSEEK_DAY6})"),
    ("SGLang, prefill 4K", "h100", "prefill", 32, 16384, 4096, "two-batch", 0, 0.0, 50_302,
     f"{SGLANG_BLOG}: 4 nodes x 8 H100, EP32, DP attention, two-batch overlap, --deepep-mode normal: 'per-node "
     f"throughputs of 57,674, 54,543, and 50,302 tokens per second for prompt lengths of 1K, 2K, and 4K'; 16,384 "
     f"tokens per device"),
    ("SGLang, prefill 1K", "h100", "prefill", 32, 16384, 1024, "two-batch", 0, 0.0, 57_674,
     f"{SGLANG_BLOG}: the same, 1K prompts"),
    ("SGLang, decode", "h100", "decode", 72, 256, 2000, "two-batch", 0, 0.0, 22_282,
     f"{SGLANG_BLOG}: 9 nodes x 8 H100, EP72, DP attention, two-batch overlap, --deepep-mode low_latency, 'achieved "
     f"22,282 tokens/sec per node for 2K inputs'; batch 256 per device (its decode table, 'SGLang Default'; "
     f"--cuda-graph-bs 256); no MTP"),
]
RTP_LLM = "alibaba/rtp-llm docs/RTP-LLM-DeepSeek-Replay-Tech-Report.md @055130f7"
# held out: never simulated while the kernel tables and the schedule were set
HELD_OUT = [
    ("RTP-LLM, decode", "h800", "decode", 144, 92, 5120, "two-batch", 0, 0.0, 14_700,
     f"{RTP_LLM}: DeepSeek-V3 on H800, 'Decode 单实例规格为 18 节点 144 卡' (EP144), '4K input/2K output ... Decode 14.7K "
     f"TPS per H800 node', '在13200 并发时 ... 单卡吞吐为1850 TPS' (13,200 requests on 144 GPUs = 92 per GPU); context: "
     f"4K prompts plus half the 2K output on average = 5,120; micro-batch overlap (two-batch; its own scheme is not "
     f"described as DeepSeek's five stages); no MTP stated"),
]
# SGLang's two-batch-overlap ablation on its H100 deployments (prefill EP32, decode EP72): TBO's
# throughput over the same batch without it. name, phase, tokens per GPU, context, MTP draft, MTP
# acceptance, published gain (low, high), source
ABLATION = [
    ("prefill, 8,192 tokens per GPU, 4K prompts", "prefill", 8192, 4096, 0, 0.0, (0.27, 0.35),
     f"{SGLANG_BLOG}: 'TBO achieves a 27% to 35% throughput increase compared to the vanilla setup, even when "
     f"processing the same token count per device' ('each device processes up to 8,192 tokens' without TBO); the "
     f"prompt lengths of the range are not stated: 4K and 1K both checked against it"),
    ("prefill, 8,192 tokens per GPU, 1K prompts", "prefill", 8192, 1024, 0, 0.0, (0.27, 0.35),
     f"{SGLANG_BLOG}: as above"),
    ("decode, 32 tokens per GPU", "decode", 32, 2000, 0, 0.0, (-0.27, -0.27),
     f"{SGLANG_BLOG}: 'TBO yields minimal or negative gains (e.g., -27% at 32 tokens/device)'"),
    ("decode, 256 tokens per GPU", "decode", 256, 2000, 0, 0.0, (0.255, 0.255),
     f"{SGLANG_BLOG}: 'The speedup reaches 25.5% at 256 tokens with a performance of 22,310 tokens per second'"),
    ("decode, MTP (1 draft, 60%), 128 sequences per GPU", "decode", 128, 2000, 1, 0.6, (0.358, 0.358),
     f"{SGLANG_BLOG}: simulated MTP, 'a 35% speedup at 128 sequences/device, with throughput 17,552 tokens per "
     f"second compared to 12,929 without TBO' (17,552 / 12,929 = +35.8%), 'We conservatively assume a 60% "
     f"acceptance rate'; theirs doubles the batch and halves the KV, ours verifies one draft token a sequence"),
]
REDUNDANT_EXPERTS = 32  # both deployments: "32 redundant experts" (DeepSeek day 6; SGLang: 256 + 32 = 288)
ROUTING_TRACE = ROOT / "sample_traces" / "dsv3_ranks_rebalance.trace"


def recorded_routing(num_layers: int, num_experts: int):
    """sample-dsv3's routing on its recorded trace (the seeds' class: top-8 of 32, one domain),
    scaled to DeepSeek-V3's 58 x 256 by engine/sim/routing.py's stated method."""
    from moectl.engine.sim.routing import routing_from
    from moectl.profiler.trace_queries import trace_routing
    from moectl.profiler.trace_store import TraceReader

    with TraceReader(ROUTING_TRACE) as reader:
        total = trace_routing(reader)[0]
    return routing_from(str(ROUTING_TRACE.name), num_layers, num_experts, 0, total)[0]


def eplb_placement(loads, devices: int, num_experts: int):
    """An EPLB-style placement for the deployments' 32 redundant experts: the slots per device
    that 256 + 32 experts need, every spare one filled with a replica of a hot expert (moectl's
    planner). Slots per device are whole, so at EP128 that is 3 a device: 384 slots, 128
    replicas, more than the deployment's 32."""
    from moectl.placement.rebalancer import plan_rebalance

    slots = -(-(num_experts + REDUNDANT_EXPERTS) // devices)
    return plan_rebalance(loads, devices, slots - -(-num_experts // devices)).placement


def _roofline_only(profile):
    return replace(profile, kernels=None)


def run_cases(cases: list | None = None, load_profile=None) -> list[dict]:
    """Each case simulated; `load_profile`: how a profile is loaded (default: the shipped ones)."""
    from moectl.engine.sim.hardware import load_profile as shipped
    from moectl.engine.sim.model_shape import load_sim_model
    from moectl.engine.sim.routing import balanced
    from moectl.engine.sim.step_model import SimSpec, simulate

    load_profile = load_profile or shipped
    model = load_sim_model(ROOT / "docs" / "configs" / "deepseek-v3.json")
    shape = model.shape
    even = balanced(shape.num_sparse, shape.num_experts)
    recorded = recorded_routing(shape.num_sparse, shape.num_experts)
    rows = []
    for name, hardware, phase, devices, tokens, context, overlap, draft, accept, published, source in (cases or CASES):
        profile = load_profile(hardware)
        row = {"case": name, "hardware": hardware, "phase": phase, "devices": devices, "tokens_per_device": tokens,
               "context": context, "overlap": overlap, "mtp_draft": draft, "mtp_accept": accept,
               "published_per_node": published, "source": source}
        eplb = eplb_placement(recorded, devices, shape.num_experts)
        for key, (hw, loads, placement, how) in {
                "deployed": (profile, even, None, overlap), "deployed_recorded_eplb": (profile, recorded, eplb, overlap),
                "no_overlap": (profile, even, None, "none"),
                "roofline_only": (_roofline_only(profile), even, None, "two-batch"),
        }.items():
            out = simulate(SimSpec(model, hw, devices, loads, phase=phase, tokens_per_device=tokens, context=context,
                                   placement=placement, overlap=how, mtp_draft=draft, mtp_accept=accept))
            row[key] = {"predicted_per_node": out["tokens_per_s_per_node"],
                        "error": out["tokens_per_s_per_node"] / published - 1, "balancedness": out["balancedness"],
                        "step_ms": out["step_ms"], "comm": out["comm"], "breakdown_ms": out["breakdown_ms"]}
        rows.append(row)
    return rows


def run_ablation(load_profile=None) -> list[dict]:
    from moectl.engine.sim.hardware import load_profile as shipped
    from moectl.engine.sim.model_shape import load_sim_model
    from moectl.engine.sim.routing import balanced
    from moectl.engine.sim.step_model import SimSpec, simulate

    load_profile = load_profile or shipped
    model = load_sim_model(ROOT / "docs" / "configs" / "deepseek-v3.json")
    even = balanced(model.shape.num_sparse, model.shape.num_experts)
    rows = []
    for name, phase, tokens, context, draft, accept, (low, high), source in ABLATION:
        devices = 32 if phase == "prefill" else 72
        steps = {how: simulate(SimSpec(model, load_profile("h100"), devices, even, phase=phase, tokens_per_device=tokens,
                                       context=context, overlap=how, mtp_draft=draft,
                                       mtp_accept=accept))["step_ms"] for how in ("none", "two-batch")}
        gain = steps["none"] / steps["two-batch"] - 1
        off = gain - high if gain > high else gain - low if gain < low else 0.0  # outside the published range
        rows.append({"case": name, "phase": phase, "tokens_per_device": tokens, "published_gain": [low, high],
                     "predicted_gain": gain, "points_off": off * 100, "step_ms": steps, "source": source})
    return rows


SM_SHARES = (0.0, 0.6)  # the low-latency all-to-all's SM share the decode cases are re-run at (h800/h100: 0.35)


def run_sensitivity() -> dict:
    """What the decode cases depend on: each again with the low-latency all-to-all holding SMs for
    another share of its time (SGLang's 256-token ablation beside them), and DeepSeek's profile
    decode with MTP at the V3 report's acceptance (one draft token, 85%)."""
    from moectl.engine.sim.hardware import load_profile

    decode = [c for c in CASES if c[2] == "decode"]
    out = {"sm_share": {}}
    for share in SM_SHARES:
        def at_share(name, share=share):
            profile = load_profile(name)
            tables = profile.kernels
            return replace(profile, kernels=replace(tables, low_latency=replace(tables.low_latency, sm_share=share)))
        out["sm_share"][str(share)] = {
            "cases": {r["case"]: r["deployed"]["error"] for r in run_cases(decode, at_share)},
            "ablation_256": next(a["predicted_gain"] for a in run_ablation(at_share) if a["tokens_per_device"] == 256)}
    name, *rest = CASES[0]
    with_mtp = run_cases([(f"{name}, MTP 1 draft at 85%", *rest[:6], 1, 0.85, *rest[8:])])[0]["deployed"]
    out["mtp"] = {"case": CASES[0][0], "error": with_mtp["error"]}
    return out


def summarise(rows: list[dict], ablation: list[dict], held_out: list[dict], sensitivity: dict | None = None) -> dict:
    summary = {"cases": rows, "ablation": ablation, "held_out": held_out, "target": TARGET,
               "ablation_target_points": ABLATION_TARGET * 100, "sensitivity": sensitivity}
    for key in ("deployed", "deployed_recorded_eplb", "no_overlap", "roofline_only"):
        errors = [abs(r[key]["error"]) for r in rows]
        summary[key] = {"median_abs_error": statistics.median(errors), "within_target": sum(e <= TARGET for e in errors)}
    summary["ablation_within"] = sum(abs(a["points_off"]) <= ABLATION_TARGET * 100 for a in ablation)
    return summary


VARIANTS = {"deployed": "as deployed (overlap, batch, comm mode)",
            "deployed_recorded_eplb": "as deployed, recorded routing + EPLB",
            "no_overlap": "without overlap", "roofline_only": "roofline only (no kernel tables), two-batch"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    summary = summarise(run_cases(), run_ablation(), run_cases(HELD_OUT), run_sensitivity())
    if args.json:
        print(json.dumps(summary, indent=1))
        return
    print("SIMULATED per-node throughput of DeepSeek-V3 against published deployments, each with its own overlap, "
          "batch per GPU and all-to-all mode (balanced routing, as DeepSeek's profiles simulate):")
    for r in summary["cases"]:
        unit = "output" if r["phase"] == "decode" else "input"
        print(f"  {r['case']} ({r['devices']} x {r['hardware']}, {r['tokens_per_device']:,} per GPU, overlap "
              f"{r['overlap']}, {r['deployed']['comm']} all-to-all): published {r['published_per_node']:,.0f} {unit} "
              f"tok/s per node")
        for key, label in VARIANTS.items():
            got = r[key]
            print(f"      {label:44s} {got['predicted_per_node']:8,.0f}  {got['error']:+7.1%}")
    for key, label in VARIANTS.items():
        print(f"{label}: median |error| {summary[key]['median_abs_error']:.1%}, within {TARGET:.0%} in "
              f"{summary[key]['within_target']} of {len(summary['cases'])} cases")
    for r in summary["held_out"]:
        got = r["deployed"]
        print(f"held out: {r['case']} ({r['devices']} x {r['hardware']}, {r['tokens_per_device']} per GPU): published "
              f"{r['published_per_node']:,.0f}, simulated {got['predicted_per_node']:,.0f} ({got['error']:+.1%})")
    print("SGLang's two-batch-overlap ablation (H100; prefill EP32, decode EP72; the same batch with and without):")
    for a in summary["ablation"]:
        low, high = a["published_gain"]
        published = f"{low:+.1%}" if low == high else f"{low:+.0%} to {high:+.0%}"
        print(f"  {a['case']}: published {published}, simulated {a['predicted_gain']:+.1%} "
              f"({a['points_off']:+.1f} points outside; target within {ABLATION_TARGET * 100:.0f})")
    sens = summary["sensitivity"]
    print("what the decode cases depend on (the low-latency all-to-all's SM share; the profiles' is 0.35):")
    for share, got in sens["sm_share"].items():
        print(f"  at {share}: " + ", ".join(f"{case} {err:+.1%}" for case, err in got["cases"].items())
              + f"; SGLang's 256-token ablation {got['ablation_256']:+.1%}")
    print(f"  {sens['mtp']['case']} with MTP (1 draft token, 85% accepted): {sens['mtp']['error']:+.1%}")


if __name__ == "__main__":
    main()
