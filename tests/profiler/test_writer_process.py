"""The trace writer process: records cross a pipe and read back identical, the engine process
never encodes, a dead writer is a one-line error at close, and the profiler's cost accounting."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from moectl.engine.core.config import EngineConfig
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.llm_engine import LLMEngine
from moectl.placement.topology import Topology
from moectl.profiler import codec, overhead_cost, trace_writer
from moectl.profiler.overhead_bench import bootstrap_ci, verdict
from moectl.profiler.recorder import TraceRecorder
from moectl.profiler.trace_store import TraceError, TraceReader, TraceWriter
from moectl.wire.link_spans import with_link_spans
from tests.checkpoints import prompts, tiny_checkpoint
from tests.profiler.test_trace_store import same, step_record

GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("writer"))


def engine(ckpt, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=128,
                                  topology=Topology(num_devices=2), **kw))


def test_engine_records_read_back_identical_and_are_encoded_in_another_process(ckpt, tmp_path, monkeypatch):
    eng = engine(ckpt)

    def not_here(*a, **kw):
        raise AssertionError("a record was encoded in the engine's process")

    path = tmp_path / "run.trace"
    with TraceRecorder(eng, path) as recorder:
        assert recorder.writer.writer_pid != os.getpid()
        monkeypatch.setattr(codec, "encode", not_here)  # after the header, which is encoded here
        eng.generate(prompts(3), GREEDY)
    monkeypatch.undo()
    with TraceReader(path) as reader:
        assert reader.complete and reader.dropped == 0 and reader.meta["failed"] == 0
        records = list(reader.steps())
        assert len(records) == len(eng.step_log) > 0
        for stats, record in zip(eng.step_log, records):
            assert same(with_link_spans(stats.as_record()), record), stats.step  # the reader derives link spans


def test_arrays_of_every_kind_cross_the_pipe_exactly(tmp_path):
    rng = np.random.default_rng(0)
    record = {"step": 1, "t_start": 0.0, "t_end": 1.0, "f": rng.random((3, 4)), "big": np.arange(5, dtype=">i4"),
              "fortran": np.asfortranarray(rng.integers(0, 9, (3, 4))), "zero_d": np.array(7),
              "empty": np.zeros((0, 2), np.int16), "text": np.array(["ab", "c"]), "mask": rng.random(5) > 0.5,
              "scalar": np.float32(2.5), "nested": {"a": [np.arange(3, dtype=np.uint8)]}}
    path = tmp_path / "t.trace"
    with TraceWriter(path, {}, str_keys=True) as w:
        assert w.write_step(record)
    with TraceReader(path) as r:
        back = r.seek_step(1)
    for key in record:
        expected = np.ascontiguousarray(record[key]) if key == "fortran" else record[key]
        assert same(expected, back[key]), key


def test_a_killed_writer_is_a_one_line_error_at_close(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="moectl.profiler.trace_writer")
    w = TraceWriter(tmp_path / "t.trace", {})
    for i in range(5):
        w.write_step(step_record(i))
    assert w.flush(timeout=30)
    os.kill(w.writer_pid, signal.SIGKILL)
    for i in range(5, 400):  # never blocks nor raises: a broken pipe is counted
        w.write_step(step_record(i))
    with pytest.raises(TraceError) as e:
        w.close()
    message = str(e.value)
    assert "\n" not in message and "writer process failed" in message and "exit code -9" in message
    warnings = [r for r in caplog.records if r.name == "moectl.profiler.trace_writer"]
    assert len(warnings) == 1 and "failed" in warnings[0].getMessage()  # once, when first found broken
    with TraceReader(tmp_path / "t.trace") as r:  # what was committed before the kill is there
        assert [rec["step"] for rec in r.steps()] == list(range(5)) and not r.complete


def test_records_the_writer_cannot_encode_are_counted_not_fatal(tmp_path):
    with TraceWriter(tmp_path / "t.trace", {}) as w:
        assert not w.write_step({"step": 0, "t_start": 0.0, "t_end": 1.0, "bad": lambda: 0})  # cannot pickle
        w.write_step({"step": 1, "t_start": 0.0, "t_end": 1.0, "bad": object()})  # pickles, cannot encode
        w.write_step(step_record(2))
        assert w.flush(timeout=30)
        assert w.failed == 2 and "cannot store" in w.last_error
        assert not w.write_step({"step": 3, "t_start": 0.0, "t_end": 1.0, "bad": lambda: 0})  # the last frame is STOP
    with TraceReader(tmp_path / "t.trace") as r:  # the engine side's failures reach the file's meta too
        assert [rec["step"] for rec in r.steps()] == [2] and r.meta["failed"] == 3


def test_recording_cost_is_accounted_when_profiling_and_absent_when_off(ckpt, tmp_path):
    off = engine(ckpt, profile_spans=False)
    off.generate(prompts(2), GREEDY)
    cost = off.telemetry.cost.as_dict()
    assert cost["steps"] == len(off.step_log) and cost["spans"] == 0 and cost["seconds"]["listeners"] == 0
    assert cost["seconds"]["span_collect"] == 0

    on = engine(ckpt)
    with TraceRecorder(on, tmp_path / "on.trace") as recorder:
        assert recorder.writer.flush(timeout=60)
        start_cpu = recorder.writer.writer_stats["cpu_s"]
        on.telemetry.cost.reset()
        # from the reset on: the record_start action's handoff came before it, outside the listeners' time
        record_0, handoff_0 = recorder.record_s, recorder.writer.handoff_s
        link = overhead_cost.LinkSpanTimer(on)
        on.generate(prompts(2), GREEDY)
        cost = on.telemetry.cost.as_dict()
        record_s, handoff_s = recorder.record_s - record_0, recorder.writer.handoff_s - handoff_0
    # the modeled link spans are the readers' now: the engine thread notes their traffic only
    assert cost["steps"] == recorder.steps and cost["spans"] > 0 and cost["modeled_spans"] == 0
    assert all(cost["seconds"][k] > 0 for k in ("span_collect", "step_record", "listeners", "devices_record"))
    assert record_s > 0 and handoff_s > 0 and cost["seconds"]["listeners"] >= record_s + handoff_s
    assert link.calls == recorder.steps and link.seconds > 0 and link.notes == link.calls * len(on.experts.cluster.moe_layers)
    stats = recorder.writer.writer_stats
    assert stats["records"] >= recorder.steps and stats["cpu_s"] >= start_cpu
    spans = overhead_cost.span_call_costs(2, calls=2000, repeats=3)
    direct = overhead_cost.direct_overhead(cost, 1.0, record_s=record_s, handoff_s=handoff_s, link=link,
                                           span_costs=spans, writer_cpu_s=stats["cpu_s"] - start_cpu)
    parts = direct["components"]
    assert direct["direct_overhead"] == pytest.approx(sum(p["seconds"] for p in parts.values()))
    assert spans["link_note_s"] > 0
    assert parts["handoff"]["seconds"] == handoff_s
    assert parts["span_link_model"]["seconds"] == pytest.approx(link.seconds + link.notes * spans["link_note_s"])
    assert "devices_record" not in parts and direct["engine_bookkeeping"]["devices_record"]["seconds"] > 0


def test_bootstrap_interval_brackets_the_mean():
    values = [0.98, 1.01, 0.99, 1.02, 1.0, 0.97, 1.03]
    lo, hi = bootstrap_ci(values)
    assert lo < np.mean(values) < hi and hi - lo < max(values) - min(values)
    assert bootstrap_ci([1.0] * 5) == (1.0, 1.0)


def test_the_profiler_verdict_needs_the_ab_to_agree():
    assert verdict(0.008, 0, (0.98, 1.0)) == (True, True)
    assert verdict(0.008, 0, (0.85, 0.95)) == (False, False)  # the A/B sees 5-15%: the 0.8% is no result
    assert verdict(0.008, 1, (0.98, 1.0)) == (False, True)  # a record dropped
    assert verdict(0.02, 0, (0.97, 0.99)) == (False, True)  # agreed, over the target


# --- the writer's lifecycle: backlog, byte budget, exit, timeouts, threads -----------------------

def fill_until(w: TraceWriter, done, limit: int = 200000) -> int:
    """Writes step records (the writer process stopped) until done(); the number accepted."""
    accepted = 0
    for i in range(limit):
        accepted += w.write_step(step_record(i))
        if done():
            return accepted
    raise AssertionError("the pipe never filled")


def test_pending_drains_while_the_producer_waits(tmp_path):
    """The benches' back-off loop (`while w.pending > n: sleep`) ends with no further write."""
    w = TraceWriter(tmp_path / "t.trace", {}, queue_size=100000)
    os.kill(w.writer_pid, signal.SIGSTOP)
    try:
        accepted = fill_until(w, lambda: w.pending >= 20)
    finally:
        os.kill(w.writer_pid, signal.SIGCONT)
    deadline = time.monotonic() + 120
    while w.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.pending == 0 and w.backlog_bytes == 0
    w.close()
    with TraceReader(tmp_path / "t.trace") as r:
        assert r.num_steps == accepted and r.dropped == 0


def test_backlog_is_bounded_in_bytes_too(tmp_path):
    budget = 20000  # ~70 frames of ~280 bytes; the record count limit is far away
    w = TraceWriter(tmp_path / "t.trace", {}, queue_size=100000, max_backlog_bytes=budget)
    os.kill(w.writer_pid, signal.SIGSTOP)
    try:
        accepted = fill_until(w, lambda: w.dropped >= 10)
        assert 0 < w.backlog_bytes <= budget and 0 < w.pending < 100
        assert not w.write_step({"step": 0, "t_start": 0.0, "t_end": 1.0, "blob": np.zeros(budget, np.uint8)})
    finally:
        os.kill(w.writer_pid, signal.SIGCONT)
    w.close()
    with TraceReader(tmp_path / "t.trace") as r:
        assert r.num_steps == accepted and r.dropped == 11 == w.dropped


_EXIT_CHILD = """
import json, os, signal, sys
import numpy as np
from moectl.profiler.trace_writer import TraceWriter
w = TraceWriter(sys.argv[1], {}, queue_size=100000)
os.kill(w.writer_pid, signal.SIGSTOP)
accepted = 0
for i in range(200000):
    accepted += w.write_step({"step": i, "t_start": float(i), "t_end": i + 0.5, "routing": np.full((3, 8), i)})
    if w.pending >= 50:  # the pipe is full and records wait in the backlog
        break
pending = len(w._backlog)  # not w.pending: that would move some into the pipe
os.kill(w.writer_pid, signal.SIGCONT)
print(json.dumps({"pid": w.writer_pid, "accepted": accepted, "pending": pending}), flush=True)
# exits without close()
"""


def test_exit_without_close_keeps_every_record(tmp_path):
    path = tmp_path / "t.trace"
    child = subprocess.run([sys.executable, "-c", _EXIT_CHILD, str(path)], capture_output=True, text=True,
                           timeout=300, cwd=Path(__file__).parents[2])
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["pending"] > 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the writer process has exited (the child's close reaped it)
        try:
            os.kill(report["pid"], 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the writer process outlived its engine")
    with TraceReader(path) as r:
        assert r.num_steps == report["accepted"] and r.complete and r.dropped == 0


def test_close_times_out_on_a_stopped_writer_without_holding_the_lock(tmp_path):
    w = TraceWriter(tmp_path / "t.trace", {}, queue_size=100000)
    os.kill(w.writer_pid, signal.SIGSTOP)
    errors = []

    def close():
        try:
            w.close(timeout=3)
        except TraceError as e:
            errors.append(e)

    try:
        fill_until(w, lambda: w.pending >= 5)  # the STOP frame cannot go in either
        closer = threading.Thread(target=close)
        closer.start()
        free = 0
        while closer.is_alive():  # the engine thread's writes must not wait for close()
            if w._lock.acquire(blocking=False):
                w._lock.release()
                free += 1
            time.sleep(0.01)
            closer.join(0.0)
        closer.join(120)
    finally:
        if w._proc.poll() is None:
            os.kill(w.writer_pid, signal.SIGKILL)
    assert not closer.is_alive() and free > 0
    assert len(errors) == 1
    message = str(errors[0])
    assert "\n" not in message and "did not finish within 3 s" in message and "killed" in message
    assert w._proc.returncode is not None and w._fd == -1 and w._kick == -1
    with pytest.raises(TraceError, match="closed"):
        w.write_step(step_record(0))


def test_concurrent_flushes_all_answer(tmp_path):
    w = TraceWriter(tmp_path / "t.trace", {}, flush_interval_s=5.0)  # only flushes move things
    results, errors = [], []

    def worker(k):
        try:
            for j in range(5):
                for i in range(20):
                    assert w.write_step(step_record(k * 1000 + j * 20 + i))
                results.append(w.flush(timeout=120))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads) and not errors
    assert results == [True] * 20
    assert w.written == 400  # the last answer covers every thread's records
    w.close()
    with TraceReader(tmp_path / "t.trace") as r:
        assert r.num_steps == 400


def test_writes_racing_close(tmp_path):
    for attempt in range(3):
        path = tmp_path / f"t{attempt}.trace"
        w = TraceWriter(path, {})
        accepted, errors, started = [], [], threading.Barrier(4)

        def writer(k):
            n = 0
            started.wait()
            try:
                for i in range(10**6):
                    n += w.write_step(step_record(k * 10**6 + i))
            except TraceError as e:
                if "closed" not in str(e):
                    errors.append(e)
            except Exception as e:  # noqa: BLE001 - e.g. a write on a closed fd
                errors.append(e)
            accepted.append(n)

        threads = [threading.Thread(target=writer, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        started.wait()
        time.sleep(0.05 * attempt)
        w.close(timeout=120)
        for t in threads:
            t.join(120)
        assert not errors and len(accepted) == 3
        assert w._fd == -1 and w._kick == -1 and w._out == -1
        with TraceReader(path) as r:
            assert r.num_steps == sum(accepted) == w.written and r.complete


def test_a_writer_that_dies_at_start_up_is_an_error_quoting_its_stderr(tmp_path, monkeypatch):
    monkeypatch.setattr(trace_writer, "_WRITER_MODULE", "moectl.profiler.no_such_writer")
    with pytest.raises(TraceError) as e:
        TraceWriter(tmp_path / "t.trace", {})
    message = str(e.value)
    assert "\n" not in message and "start-up" in message and "no_such_writer" in message
    assert not (tmp_path / "t.trace").exists()


def test_writer_runs_below_the_engine_but_not_at_the_bottom(tmp_path):
    with TraceWriter(tmp_path / "t.trace", {}) as w:
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, w.writer_pid) == min(19, mine + 10)
    with TraceWriter(tmp_path / "u.trace", {}, nice=3) as w:
        assert os.getpriority(os.PRIO_PROCESS, w.writer_pid) == min(19, mine + 3)


def test_torch_tensors_cross_as_numpy(tmp_path):
    record = {"step": 0, "t_start": 0.0, "t_end": 1.0, "counts": torch.arange(6, dtype=torch.int64).reshape(2, 3),
              "bf16": torch.tensor([1.5, 2.0], dtype=torch.bfloat16), "view": torch.arange(10.0)[::2]}
    with TraceWriter(tmp_path / "t.trace", {}) as w:
        assert w.write_step(record)
    with TraceReader(tmp_path / "t.trace") as r:
        back = r.seek_step(0)
    assert same(back["counts"], np.arange(6).reshape(2, 3))
    assert same(back["bf16"], np.array([1.5, 2.0], np.float32))
    assert same(back["view"], np.arange(10.0, dtype=np.float32)[::2])


# --- the cost accounting ---------------------------------------------------------------------------

def test_the_rule_counts_profiling_only_work_once(ckpt, tmp_path):
    """A listener that sleeps a known time per step: its time is counted once, under the listeners,
    and never in the engine bookkeeping that runs with the profiler off too."""
    nap = 0.02
    eng = engine(ckpt)
    naps = []

    def sleepy(stats):
        time.sleep(nap)
        naps.append(nap)

    with TraceRecorder(eng, tmp_path / "on.trace") as recorder:
        assert recorder.writer.flush(timeout=60)
        eng.add_listener(on_step=sleepy)
        eng.telemetry.cost.reset()
        recorder.record_s = recorder.writer.handoff_s = 0.0
        link = overhead_cost.LinkSpanTimer(eng)
        eng.generate(prompts(2), GREEDY)
        cost = eng.telemetry.cost.as_dict()
        record_s, handoff_s = recorder.record_s, recorder.writer.handoff_s
    slept = sum(naps)
    assert slept > 0 and cost["seconds"]["listeners"] >= slept
    direct = overhead_cost.direct_overhead(cost, 1.0, record_s=record_s, handoff_s=handoff_s, link=link,
                                           span_costs={"pair_s": 0.0, "modeled_s": 0.0}, writer_cpu_s=0.0)
    parts, books = direct["components"], direct["engine_bookkeeping"]
    listener_parts = sum(parts[k]["seconds"] for k in ("record_dict", "handoff", "listeners_other"))
    assert listener_parts == pytest.approx(cost["seconds"]["listeners"])  # split, not double counted
    assert parts["listeners_other"]["seconds"] >= slept
    assert set(books) == set(overhead_cost.BOOKKEEPING) and not set(books) & set(parts)
    assert all(b["seconds"] < slept for b in books.values())  # the sleep is not in any bookkeeping part
    assert direct["counted_s"] == pytest.approx(sum(p["seconds"] for p in parts.values()))
    assert direct["engine_bookkeeping_s"] == pytest.approx(sum(b["seconds"] for b in books.values()))
    counted = set(overhead_cost.COUNTED_TIMED) | {"listeners"}
    assert counted == set(eng.telemetry.cost.PROFILING_ONLY)
    assert counted | set(overhead_cost.BOOKKEEPING) == set(eng.telemetry.cost.COMPONENTS)


def test_profiling_only_components_stay_zero_with_profiling_off(ckpt):
    off = engine(ckpt, profile_spans=False)
    off.generate(prompts(2), GREEDY)
    cost = off.telemetry.cost.as_dict()
    assert all(cost["seconds"][k] == 0 for k in off.telemetry.cost.PROFILING_ONLY)
    assert all(cost["seconds"][k] > 0 for k in ("step_record", "process_memory", "request_events"))


def test_span_calibration_uses_the_engines_tracer_mode(ckpt, monkeypatch):
    eng = engine(ckpt)
    assert eng.telemetry.tracer_mode == {"num_devices": 2, "cuda": False}
    seen = []
    monkeypatch.setattr(overhead_cost, "span_call_costs", lambda **kw: seen.append(kw) or {})
    overhead_cost.span_call_costs_for(eng, calls=10)
    assert seen == [{"num_devices": 2, "cuda": False, "calls": 10}]
