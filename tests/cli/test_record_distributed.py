"""`moectl record` on the distributed backend, and a rank killed mid-recording: the command
names the rank in one line, exits 1 within the bound, and the trace written so far is readable."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from moectl.profiler.trace_store import TraceReader
from tests.checkpoints import tiny_checkpoint

WORKLOAD = "rate=40,requests=100000,prompt=8-24,output=8-16"


def _steps(path) -> int:
    try:
        with TraceReader(path) as reader:
            return reader.num_steps
    except Exception:  # noqa: BLE001 - not created yet
        return 0


def test_a_rank_killed_while_recording_is_named_and_the_trace_stays_readable(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "m")
    trace = tmp_path / "run.trace"
    proc = subprocess.Popen([sys.executable, "-m", "moectl.cli", "record", str(trace), "--steps", "100000",
                             "--model", str(ckpt), "--backend", "distributed", "--nproc", "2", "--redundant", "1",
                             "--workload", WORKLOAD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while _steps(trace) < 20 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()
        ranks = [c for c in psutil.Process(proc.pid).children(recursive=True)
                 if "spawn_main" in " ".join(c.cmdline())]
        assert len(ranks) == 1
        ranks[0].kill()
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - t0 < 10.0
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = err.strip().splitlines()
    assert proc.returncode == 1 and lines and "Traceback" not in err, err
    assert lines[-1].startswith("moectl: error: ") and "rank 1" in lines[-1], err
    with TraceReader(trace) as reader:  # what was written before the failure is all there
        assert reader.num_steps >= 20
        steps = [r["step"] for r in reader.steps()]
        assert steps == list(range(steps[0], steps[0] + len(steps)))
