"""What the Overview shows of another engine's live server (a vLLM server read through its
/metrics: console/vllm_source.py), every figure labelled as that engine's own."""

from __future__ import annotations

from moectl.console.panels.common import fmt_s


def _pct(value) -> str:
    return "-" if value is None else f"{value:.0%}"


def _rate(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _latency(figures: dict, name: str, label: str) -> str:
    hist = figures.get(name)
    if not hist:
        return f"{label} not exported"
    if not hist["count"]:
        return f"{label} - (none in the interval)"
    return f"{label} p50/p90/p99 {fmt_s(hist['p50'])} / {fmt_s(hist['p90'])} / {fmt_s(hist['p99'])}"


def title(external: dict) -> str:
    engine = f"{external.get('engine', '?')} {external.get('engine_version') or ''}".strip()
    models = ", ".join(external.get("models") or []) or "?"
    return (f"[b]{models}[/b] on {engine} at {external.get('url', '?')}  |  every figure is {engine}'s own "
            f"(its {external.get('mode', 'live /metrics')}); moectl measures none of it")


def metrics(external: dict, figures: dict | None) -> str:
    engine = external.get("engine", "?")
    if figures is None:
        return f"[dim]waiting for {engine}'s first scrape[/]"
    span = f"over the last {figures['interval_s']:.1f} s" if figures.get("interval_s") else "since it started"
    lines = [
        f"[b]{engine}[/b]: running {_rate(figures.get('running'))}   waiting {_rate(figures.get('waiting'))}   "
        f"KV cache used {_pct(figures.get('kv_usage'))}   engines {figures.get('engines', 1)}",
        f"{span}: output [b]{_rate(figures.get('output_tok_s'))}[/b] tok/s   prompt {_rate(figures.get('prompt_tok_s'))}"
        f" tok/s   finished {_rate(figures.get('finished'))}   preemptions {_rate(figures.get('preemptions'))}   "
        f"prefix-cache hits {_pct(figures.get('prefix_hit_rate'))}",
        f"{_latency(figures, 'ttft', 'TTFT')}   {_latency(figures, 'itl', 'ITL')}",
        f"{_latency(figures, 'tpot', 'TPOT')}   {_latency(figures, 'e2e', 'end to end')}   "
        f"{_latency(figures, 'queue', 'queued')}",
        f"[dim]per-expert load, placement, step spans and memory accounting: not exported by {engine}; "
        f"rebalancing and knobs: unavailable ({engine} offers no control moectl could drive)[/]",
    ]
    return "\n".join(lines)
