"""The driver's GPU figures in the Overview and Memory panels. The samples are built here and written
into a copy of a sample trace's step rows: this tests the trace round trip and the display, not the
driver (tests/engine/core/test_gpu_stats.py does that on a GPU). A trace without them shows nothing."""

from __future__ import annotations

import shutil
import sqlite3

from moectl.console.app import MoectlApp
from moectl.console.panels.common import fmt_bytes
from moectl.console.sources import ReplaySource
from moectl.profiler import codec
from tests.paths import TRACES
from tests.pilot import run_app, text_of

TRACE = TRACES / "kv_pressure.trace"
STEP = 20
GIB = 1 << 30
FULL = {"index": 0, "nvml_index": 3, "name": "NVIDIA H200", "memory_used_bytes": 71 * GIB,
        "memory_total_bytes": 141 * GIB, "util_gpu_pct": 87, "util_memory_pct": 41, "power_w": 412.5,
        "power_limit_w": 700.0, "temperature_c": 61, "sm_clock_mhz": 1980, "memory_clock_mhz": 3201}
# a board whose driver gives neither power nor utilisation (a MIG slice, say): those are left out
PARTIAL = {"index": 1, "nvml_index": 0, "name": "NVIDIA H200 MIG 1g.18gb", "memory_used_bytes": 5 * GIB,
           "memory_total_bytes": 18 * GIB, "temperature_c": 55, "sm_clock_mhz": 1755, "memory_clock_mhz": 3201}


def trace_with_gpu(tmp_path):
    """A copy of TRACE whose steps up to STEP carry a GPU sample taken 0.25 s before each step ended."""
    path = tmp_path / "gpu.trace"
    shutil.copy(TRACE, path)
    with sqlite3.connect(path) as db:
        for rowid, payload in db.execute("SELECT rowid, payload FROM steps WHERE step <= ?", (STEP,)).fetchall():
            record = codec.decode(payload)
            assert "gpu" not in record  # the sample traces predate the field
            record["gpu"] = {"source": "nvml", "sampled_at": record["t_end"] - 0.25, "period_s": 0.5,
                             "devices": [FULL, PARTIAL]}
            db.execute("UPDATE steps SET payload = ? WHERE rowid = ?", (codec.encode(record, str_keys=True), rowid))
    return path


def replay_at(path, body):
    source = ReplaySource(path)

    async def run(app, pilot):
        await pilot.pause()
        source.pause()
        source.seek_step(STEP)
        app.tick()
        assert app.state.latest["step"] == STEP
        await body(app, pilot)
    run_app(MoectlApp(source), run)


def test_the_panels_show_the_drivers_figures_apart_from_the_accounting(tmp_path):
    async def body(app, pilot):
        assert app.state.latest["gpu"]["devices"] == [FULL, PARTIAL]  # through the codec and replay unchanged
        app.refresh_panels()
        await pilot.pause()
        assert app.query_one("#ov-gpu-box").display
        title, overview = text_of(app, "#ov-gpu-title"), text_of(app, "#ov-gpu")
        assert "NVML, measured by the driver" in title and "sampled 0.25 s before the step ended" in title
        full, partial = overview.splitlines()
        assert full.startswith("gpu0") and partial.startswith("gpu1")
        used = f"{fmt_bytes(FULL['memory_used_bytes'])} / {fmt_bytes(FULL['memory_total_bytes'])}"
        assert used in full and f"util {FULL['util_gpu_pct']}%" in full and f"{FULL['temperature_c']} C" in full
        assert f"{FULL['power_w']:.0f} / {FULL['power_limit_w']:.0f} W" in full
        assert "util" not in partial and " W" not in partial  # absent, not 0
        await pilot.press("3")
        await pilot.pause()
        assert app.query_one("#mem-gpu-box").display
        table = text_of(app, "#mem-gpu")
        lines = table.splitlines()
        header = next(line for line in lines if line.startswith("gpu "))
        assert "power" in header and "SM clock" in header and "mem clock" in header
        row0 = next(line for line in lines if line.startswith("gpu0"))
        row1 = next(line for line in lines if line.startswith("gpu1"))
        assert FULL["name"] in row0 and f"{FULL['sm_clock_mhz']} MHz" in row0 and f"{FULL['power_w']:.0f} W" in row0
        assert PARTIAL["name"] in row1 and f"{PARTIAL['sm_clock_mhz']} MHz" in row1 and " W" not in row1
        assert "sampled 0.25 s before the step ended, every 0.5 s" in table

    replay_at(trace_with_gpu(tmp_path), body)


def test_a_trace_without_gpu_figures_shows_no_gpu_rows():
    async def body(app, pilot):
        assert "gpu" not in app.state.latest
        for key, box, shown in (("1", "#ov-gpu-box", "#ov-gpu"), ("3", "#mem-gpu-box", "#mem-gpu")):
            await pilot.press(key)
            app.refresh_panels()
            await pilot.pause()
            assert not app.query_one(box).display and text_of(app, shown).strip() == ""

    replay_at(TRACE, body)
