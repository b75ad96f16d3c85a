"""The TraceWriter's batches (batch_s > 0, the engine's recorder): many records in one pipe write,
each batch in the pipe by the write that finds it batch_s old, or by the sender thread once it is
twice that (the engine went idle), and nothing lost at flush, close or a dead writer that
unbatched writing would not lose."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from moectl.profiler import trace_writer
from moectl.profiler.recorder import BATCH_S
from moectl.profiler.trace_store import TraceError, TraceReader, TraceWriter
from tests.profiler.test_trace_store import step_record


class Writes(list):
    """The frames' kinds each os.writev call carried, and (`threads`) which thread made it."""

    def __init__(self):
        super().__init__()
        self.threads: list[str] = []


@pytest.fixture
def writes(monkeypatch):
    calls = Writes()
    real = os.writev

    def counting(fd, parts):
        calls.append([bytes(p)[-1] for p in parts if len(p) == trace_writer.FRAME.size])
        calls.threads.append(threading.current_thread().name)
        return real(fd, parts)

    monkeypatch.setattr(trace_writer.os, "writev", counting)
    return calls


def steps_in(path) -> list[int]:
    with TraceReader(path) as r:
        return [rec["step"] for rec in r.steps()]


def test_a_full_batch_goes_into_the_pipe_in_one_write(tmp_path, writes):
    with TraceWriter(tmp_path / "t.trace", {}, batch_s=60.0) as w:
        for i in range(trace_writer.BATCH_RECORDS - 1):
            assert w.write_step(step_record(i))
        assert writes == [] and w.backlog_bytes > 0  # still here: neither full nor due
        assert w.write_step(step_record(trace_writer.BATCH_RECORDS - 1))
        assert writes == [[trace_writer.STEP] * trace_writer.BATCH_RECORDS]
    assert steps_in(tmp_path / "t.trace") == list(range(trace_writer.BATCH_RECORDS))


def test_a_write_that_finds_the_batch_batch_s_old_sends_it(tmp_path, writes):
    with TraceWriter(tmp_path / "t.trace", {}, batch_s=60.0) as w:
        w.write_step(step_record(0))
        w._batch_t0 -= 61.0  # as if written a minute ago: due, though not yet the sender's (at 120 s)
        w.write_step(step_record(1))
        assert writes == [[trace_writer.STEP] * 2] and writes.threads == [threading.current_thread().name]


def test_an_idle_writers_batch_reaches_the_file_without_a_flush(tmp_path, writes):
    path = tmp_path / "t.trace"
    w = TraceWriter(path, {}, batch_s=0.05, flush_interval_s=0.05)
    try:
        for i in range(3):
            assert w.write_step(step_record(i))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and w.backlog_bytes:
            time.sleep(0.01)
        # no write came to send it: the sender thread did, and timed it
        assert w.backlog_bytes == 0 and writes.threads[-1] == "moectl-trace-batch" and w.sender_s > 0
        while time.monotonic() < deadline and len(steps_in(path)) < 3:
            time.sleep(0.05)
        assert steps_in(path) == [0, 1, 2]
    finally:
        w.close()


def test_flush_and_close_send_the_waiting_batch_first(tmp_path, writes):
    path = tmp_path / "t.trace"
    w = TraceWriter(path, {}, batch_s=60.0)
    w.write_step(step_record(0))
    w.write_action({"time": 1.0, "step": 0, "kind": "knobs", "args": {}, "result": {}})
    assert w.flush(timeout=30) and w.written == 2
    assert writes[0][:2] == [trace_writer.STEP, trace_writer.RECORD]  # in order, before the FLUSH
    assert w.sender_s > 0  # flush's write of the batch is hand-off time too
    w.write_step(step_record(1))
    w.close()
    assert steps_in(path) == [0, 1]


def test_pending_counts_and_sends_the_batch(tmp_path):
    with TraceWriter(tmp_path / "t.trace", {}, batch_s=60.0) as w:
        w.write_step(step_record(0))
        assert w.pending == 0 and w.backlog_bytes == 0  # asked: into the pipe now


def test_the_batch_counts_against_the_backlogs_limits(tmp_path):
    with TraceWriter(tmp_path / "t.trace", {}, batch_s=60.0, queue_size=3) as w:
        assert all(w.write_step(step_record(i)) for i in range(3))
        assert not w.write_step(step_record(3)) and w.dropped == 1


def test_a_dead_writers_batch_is_counted_lost(tmp_path):
    w = TraceWriter(tmp_path / "t.trace", {}, batch_s=60.0)
    w.write_step(step_record(0))
    assert w.flush(timeout=30)
    os.kill(w.writer_pid, signal.SIGKILL)
    w._proc.wait(30)  # gone, its end of the pipe closed: the batch's write at close fails
    for i in range(1, 4):
        w.write_step(step_record(i))  # batched: the dead pipe is not even tried yet
    with pytest.raises(TraceError, match="3 records not written"):
        w.close()
    assert w.dropped == 3
    assert steps_in(tmp_path / "t.trace") == [0]


def test_the_recorder_batches_within_the_crash_rule():
    # kill -9 loses at most the last second (tests/profiler/test_trace_store.py): an idle engine's
    # batch waits up to 2 * BATCH_S, then the writer process's poll (0.25 s) commits it
    assert 0 < 2 * BATCH_S <= 0.5


def test_an_unclosed_writer_is_still_collected_and_its_sender_ends(tmp_path):
    import gc
    import weakref

    w = TraceWriter(tmp_path / "t.trace", {}, batch_s=60.0)
    ref = weakref.ref(w)
    del w
    gc.collect()
    assert ref() is None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(t.name == "moectl-trace-batch" for t in threading.enumerate()):
        time.sleep(0.01)
    assert not any(t.name == "moectl-trace-batch" for t in threading.enumerate())


def test_a_negative_batch_time_is_refused_before_any_file(tmp_path):
    with pytest.raises(TraceError, match="batch_s >= 0"):
        TraceWriter(tmp_path / "t.trace", {}, batch_s=-0.1)
    assert not (tmp_path / "t.trace").exists()
