"""The console's rebalance preview against the outcome it then shows, as an operator sees them.

    python bench/console_outcome_bench.py [--model sample-dsv3] [--rounds 3] [--steps-before 300]
                                          [--steps-after 120] [--workload SPEC] [--json]

Each round starts the console's engine process (`moectl run`'s, 4 emulated devices, 1 spare slot
each, the default demo workload unless --workload), drives the real console headless
(`App.run_test`): waits for --steps-before steps, presses `r` (preview) and `A` (apply) on the
Experts tab, waits for --steps-after steps and for the tab to show an outcome (it waits for steps
of the batch shapes run before the apply), then reads the prediction and that outcome
(`ConsoleState.apply_outcome`: the modeled parallel step's throughput over the batch shapes both
sides of the apply ran, whole and with only the experts' critical path taken from after) beside
the preview's own prediction on those populations (its per-step predictions of its window's
steps of the same shapes; the whole window's is reported too). The error is
|predicted - shown| / |shown| of the gains; beside it, whether the prediction is within
the rebalance suite's bar (max(1 point, 20% of the shown gain)) and inside the interval the tab
shows, and whether the gate would have applied the plan (the bench presses A either way).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIZE = (160, 50)


async def _until(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the console did not get there in time")
        await asyncio.sleep(0.05)


async def one_round(model: str, workload: str | None, steps_before: int, steps_after: int) -> dict:
    from moectl.cli.engine_process import EngineProcess
    from moectl.console.app import MoectlApp
    from moectl.console.engine_client import EngineSource

    process = EngineProcess(["--model", model, "--devices", "4", "--redundant", "1",
                             *(["--workload", workload] if workload else [])])
    process.wait_ready()
    source = EngineSource(process.dir, owner=True)
    app = MoectlApp(source)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await _until(lambda: app.state.steps_seen >= steps_before, 600)
            await pilot.press("2")
            await pilot.press("r")
            await _until(lambda: app.plan is not None, 120)
            await pilot.press("A")
            await _until(lambda: app.state.last_apply is not None, 120)
            applied_at = app.state.steps_seen
            # the tab shows an outcome once enough steps match the shapes run before the apply
            await _until(lambda: app.state.steps_seen >= applied_at + steps_after and (
                app.state.apply_outcome()["outcome"] is not None
                or app.state.steps_seen >= applied_at + 10 * steps_after), 1800)
            result = app.state.apply_outcome()
            outcome, predicted = result["outcome"], result["predicted"]
    finally:
        source.close()
        process.stop()
    if outcome is None:
        return {"predicted_gain": predicted["gain"], "predicted_gain_window": predicted["gain"], "shown_gain": None,
                "error": None}
    # the preview's own prediction on the populations the tab compares (what it shows beside the outcome)
    gain = outcome["predicted_gain"]

    def error(shown):
        return abs(gain - shown) / abs(shown) if shown else None  # None: no figure, or 0

    def within_bar(shown):  # the A/B bar of the rebalance suite: max(1 point, 20% of what was shown)
        return None if shown is None else bool(abs(gain - shown) <= max(0.01, 0.2 * abs(shown)))

    return {"predicted_gain": gain, "predicted_gain_window": predicted["gain"],
            "predicted_steps": outcome["predicted_steps"], "predicted_acts": predicted.get("acts"),
            "shown_gain": outcome["gain"], "shown_gain_low": outcome["gain_low"], "shown_gain_high": outcome["gain_high"],
            "shown_resolved": outcome["resolved"], "shown_gain_experts_only": outcome["gain_experts_only"],
            "shown_is": "modeled" if outcome["modeled"] else "measured", "matched_steps": outcome["steps"],
            "shapes": outcome["shapes"], "throughput_before": outcome["before"], "throughput_after": outcome["after"],
            "error": error(outcome["gain"]), "error_experts_only": error(outcome["gain_experts_only"]),
            "within_bar": within_bar(outcome["gain"]), "within_bar_experts_only": within_bar(outcome["gain_experts_only"]),
            "predicted_inside_shown_interval": bool(outcome["gain_low"] <= gain <= outcome["gain_high"])}


def _pct(value: float | None, spec: str = ".0%") -> str:
    return "n/a" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="sample-dsv3")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps-before", type=int, default=300)
    parser.add_argument("--steps-after", type=int, default=120)
    parser.add_argument("--workload", default=None, help="the engine's --workload (default: the console's own)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rounds = []
    for r in range(args.rounds):
        result = asyncio.run(one_round(args.model, args.workload, args.steps_before, args.steps_after))
        rounds.append(result)
        if not args.json:
            shown = "no shared batch shapes" if result["shown_gain"] is None else (
                f"shown {result['shown_gain']:+.1%} {result['shown_is']} ({result['matched_steps']} steps of "
                f"{result['shapes']} shapes each side; error {_pct(result['error'])}), the experts' critical path "
                f"alone {_pct(result['shown_gain_experts_only'], '+.1%')} (error {_pct(result['error_experts_only'])})")
            print(f"round {r + 1}: predicted {result['predicted_gain']:+.1%}, {shown}", flush=True)
    summary = {"model": args.model, "workload": args.workload, "rounds": rounds}
    for key in ("error", "error_experts_only"):
        errors = [r[key] for r in rounds if r.get(key) is not None]
        summary[f"median_{key}"] = statistics.median(errors) if errors else None
        summary[f"{key}_within_20pct"] = sum(e <= 0.2 for e in errors)
    for key in ("within_bar", "within_bar_experts_only", "predicted_inside_shown_interval"):
        summary[key] = sum(bool(r.get(key)) for r in rounds)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"median error {_pct(summary['median_error'])} against the whole step (within 20% in "
              f"{summary['error_within_20pct']} of {len(rounds)} rounds), {_pct(summary['median_error_experts_only'])} "
              f"against the experts' critical path ({summary['error_experts_only_within_20pct']})")


if __name__ == "__main__":
    main()
