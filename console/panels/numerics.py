"""The activation watch (a step record's "numerics", wire/records.py) as the Memory panel shows it:
per layer and point the largest value over the window and its headroom (limit / max) to the dtype's
largest finite value, and for an engine not in fp16 also to fp16's 65504, what serving in fp16 would
leave. A model may have hundreds of layers: only the tightest TOP_LAYERS are drawn, as one text
grid (no Rich Table to measure), built from the state's one computation per version."""

from __future__ import annotations

import math

import numpy as np
from rich.text import Text

from moectl.profiler.analysis import HEADROOM_WARN, fmt_magnitude

TITLE = "Activation headroom: the largest |value| per layer and point, and limit / max (headroom) to the dtype's limit"
TOP_LAYERS = 8
CAUTION = 8.0  # headroom below this is drawn in the caution colour; at HEADROOM_WARN (the alert's) or below in red
LABELS = {"residual": "residual", "norm_sumsq": "norm sum x²", "attn_logits": "attn logits", "expert_out": "expert out"}
SHORT = {"residual": "resid", "norm_sumsq": "sumsq", "attn_logits": "logits", "expert_out": "expert"}
BOUND_MARK = "≤"  # the point's figure is an upper bound (attn_logits: max|q| * max|k| * scale)
TIGHTEST_MARK = "*"
VALUE_W, ROOM_W = 7, 6


def fmt_value(v: float) -> str:
    """At most 7 characters: 65504, 123.5, 0.0123, 3.4e38, inf."""
    if not math.isfinite(v):
        return "inf"
    if v == 0:
        return "0"
    if 1e-3 <= v < 1e5:
        return f"{v:.0f}" if v >= 1000 else f"{v:.4g}"
    mantissa, exponent = f"{v:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def fmt_room(h: float, nonfinite: bool = False) -> str:
    """A headroom factor in at most 6 characters: 1.07x, 12.3x, 1234x, 1e34x; "-" where the max is
    0 (nothing to overflow), "NONFIN" where an inf or NaN was seen."""
    if nonfinite:
        return "NONFIN"
    if math.isinf(h):
        return "-"
    if h < 100:
        return f"{h:.3g}x"
    if h < 1e4:
        return f"{h:.0f}x"
    return f"1e{int(math.floor(math.log10(h)))}x"


def room_style(h: float, nonfinite: bool) -> str:
    if nonfinite:
        return "bold reverse red"
    if h <= HEADROOM_WARN:
        return "bold red"
    return "yellow" if h < CAUTION else ""


def point_name(found: dict, p: int, short: bool = False) -> str:
    name = found["points"][p]
    return (SHORT if short else LABELS).get(name, name) + (BOUND_MARK if found["bound"][p] else "")


def not_recorded(simulated: bool) -> str:
    if simulated:
        return "[dim]not modeled: the simulated backend computes no activations[/]"
    return ("[dim]not recorded: these steps carry no activation watch (recorded before the engine sent it, or with "
            "the watch off)[/]")


def tightest_layers(found: dict, top: int = TOP_LAYERS) -> list[int]:
    """The `top` layers whose tightest point has the least headroom (an inf or NaN first), tightest
    first; ties by fp16's headroom, then the lower layer."""
    room, room16 = found["headroom"].min(axis=1), found["fp16_headroom"].min(axis=1)
    order = np.lexsort((np.arange(room.size), room16, room))
    return [int(i) for i in order[:top]]


def render(found: dict | None, simulated: bool = False, top: int = TOP_LAYERS) -> Text | str:
    """The summary lines and the tightest layers' grid; "not recorded" without the watch."""
    if found is None:
        return not_recorded(simulated)
    fp16 = found["dtype"] == "float16"
    text = Text(no_wrap=True, overflow="crop")
    residual = ""
    if found["residual_dtype"] != found["dtype"] and "residual" in found["points"]:
        limit = float(found["limits"][found["points"].index("residual")])
        residual = f", residual stream {found['residual_dtype']} (largest {fmt_magnitude(limit)})"
    text.append(f"{found['dtype']} activations (largest finite {fmt_magnitude(found['limit'])}){residual}; "
                f"over the last {found['steps']} steps with the watch (window {found['window']})\n")
    where = found["nonfinite_at"]
    if where:
        named = ", ".join(f"L{layer} {point_name(found, p)}" for layer, p in where[:4])
        more = f" and {len(where) - 4} more" if len(where) > 4 else ""
        text.append(f"inf/NaN seen: {named}{more} (first: L{where[0][0]})\n", style="bold reverse red")
    text.append_text(_tightest_line("tightest", found, found["tightest"], found["headroom"], found["limits"]))
    if not fp16:
        text.append_text(_tightest_line(f"if served in fp16 ({fmt_magnitude(found['fp16_limit'])})", found,
                                        found["tightest_fp16"], found["fp16_headroom"],
                                        np.full(len(found["points"]), found["fp16_limit"])))
    layers = tightest_layers(found, top)
    total = found["max"].shape[0]
    shown = f"the tightest {len(layers)} of {total} layers" if len(layers) < total else f"all {total} layers"
    text.append(f"{shown}, tightest first; {TIGHTEST_MARK} the layer's tightest point; {BOUND_MARK} an upper bound "
                f"(max|q| * max|k| * scale), not a value reached\n", style="dim")
    _grid(text, found, layers, fp16)
    text.rstrip()
    return text


def _tightest_line(what: str, found: dict, at: tuple[int, int], room: np.ndarray, limits: np.ndarray) -> Text:
    layer, p = at
    h, bad = float(room[layer, p]), bool(found["nonfinite"][layer, p])
    value = float(found["max"][layer, p])
    if bad:
        tail = "an inf or NaN"
    else:
        past = " (past it)" if h < 1 else ""
        tail = f"{fmt_magnitude(value)}, headroom {fmt_room(h)} to {fmt_magnitude(float(limits[p]))}{past}"
    line = Text(f"{what}: ")
    line.append(f"L{layer} {point_name(found, p)} {tail}", style=room_style(h, bad) or "bold")
    line.append("\n")
    return line


def _grid(text: Text, found: dict, layers: list[int], fp16: bool) -> None:
    points = range(len(found["points"]))
    group = VALUE_W + 1 + ROOM_W + 1  # a point's max and headroom, the headroom's tightest mark
    head1 = "layer".ljust(6) + "".join(point_name(found, p)[:group].ljust(group + 1) for p in points)
    head2 = " " * 6 + "".join(("max".rjust(VALUE_W) + " " + "room".rjust(ROOM_W)).ljust(group + 1) for p in points)
    if not fp16:
        head1 += "| if served in fp16: headroom"
        head2 += "| " + "".join(point_name(found, p, short=True).rjust(ROOM_W) + "  " for p in points)
    text.append(head1.rstrip() + "\n" + head2.rstrip() + "\n", style="bold")
    room, room16, peak, bad = found["headroom"], found["fp16_headroom"], found["max"], found["nonfinite"]
    for layer in layers:
        text.append(f"L{layer}".ljust(6))
        tight = int(np.argmin(room[layer]))
        for p in points:
            h, nf = float(room[layer, p]), bool(bad[layer, p])
            text.append(("inf/NaN" if nf else fmt_value(float(peak[layer, p]))).rjust(VALUE_W) + " ")
            mark = TIGHTEST_MARK if p == tight else " "
            style = room_style(h, nf) or ("bold" if p == tight else "")
            text.append(fmt_room(h, nf).rjust(ROOM_W) + mark, style=style)
            text.append(" ")
        if not fp16:
            text.append("| ")
            tight16 = int(np.argmin(room16[layer]))
            for p in points:
                h, nf = float(room16[layer, p]), bool(bad[layer, p])
                mark = TIGHTEST_MARK if p == tight16 else " "
                text.append(fmt_room(h, nf).rjust(ROOM_W) + mark, style=room_style(h, nf) or ("bold" if p == tight16 else ""))
                text.append(" ")
        text.append("\n")
