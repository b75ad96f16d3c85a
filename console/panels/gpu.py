"""The driver's GPU figures (a step record's "gpu", from NVML) as the Overview and Memory panels show
them: measured by the driver, kept apart from the engine's accounted and modeled figures. A record
without them (no GPU, no NVML, an older trace) shows nothing: no row of zeros stands in for them."""

from __future__ import annotations

from rich.table import Table

from moectl.console.panels.common import fmt_bytes

TITLE = "GPU (NVML, measured by the driver)"


def gpu_sample(state) -> dict | None:
    """The newest record's NVML sample, or None."""
    sample = (state.latest or {}).get("gpu")
    return sample if isinstance(sample, dict) and sample.get("devices") else None


def label(device: dict) -> str:
    return f"gpu{device.get('index', '?')}"


def memory_fraction(device: dict) -> float | None:
    used, total = device.get("memory_used_bytes"), device.get("memory_total_bytes")
    return used / total if used is not None and total else None


def summary(device: dict) -> str:
    """One line of what the driver gave for a device; a figure it did not give is left out."""
    parts = []
    if "memory_used_bytes" in device:
        parts.append(f"{fmt_bytes(device['memory_used_bytes'])} / {fmt_bytes(device.get('memory_total_bytes'))}")
    if "util_gpu_pct" in device:
        parts.append(f"util {device['util_gpu_pct']}%")
    if "power_w" in device:
        limit = f" / {device['power_limit_w']:.0f}" if "power_limit_w" in device else ""
        parts.append(f"{device['power_w']:.0f}{limit} W")
    if "temperature_c" in device:
        parts.append(f"{device['temperature_c']} C")
    return "  ".join(parts) or "no figures from the driver"


def age(sample: dict, record: dict) -> str:
    """How long before its step ended the sample was taken (it rides in the next record built)."""
    seconds = record.get("t_end", sample["sampled_at"]) - sample["sampled_at"]
    period = sample.get("period_s")
    return f"sampled {max(seconds, 0.0):.2f} s before the step ended" + (f", every {period:g} s" if period else "")


def table(sample: dict) -> Table:
    """Every figure per device; a column the driver gave for no device is left out."""
    columns = [("used", "memory_used_bytes", fmt_bytes), ("total", "memory_total_bytes", fmt_bytes),
               ("util", "util_gpu_pct", "{}%".format), ("mem util", "util_memory_pct", "{}%".format),
               ("power", "power_w", "{:.0f} W".format), ("limit", "power_limit_w", "{:.0f} W".format),
               ("temp", "temperature_c", "{} C".format), ("SM clock", "sm_clock_mhz", "{} MHz".format),
               ("mem clock", "memory_clock_mhz", "{} MHz".format)]
    devices = sample["devices"]
    columns = [c for c in columns if any(c[1] in d for d in devices)]
    out = Table(box=None, pad_edge=False, expand=False)
    out.add_column("gpu", no_wrap=True)
    out.add_column("name", no_wrap=True)
    for title, _, _ in columns:
        out.add_column(title, justify="right", no_wrap=True)
    for d in devices:
        out.add_row(label(d), str(d.get("name", "?")), *(fmt(d[key]) if key in d else "-" for _, key, fmt in columns))
    return out
