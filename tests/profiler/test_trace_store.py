"""Trace store: codec round trips, seeks, streaming, back-pressure, bad files, and kill -9."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from moectl.profiler import codec, trace_store
from moectl.profiler.codec import TraceError, decode, encode
from moectl.profiler.trace_store import FORMAT_VERSION, TraceReader, TraceWriter
from moectl.profiler.writer_process import FRAME


def same(a, b) -> bool:
    """Exact equality that also compares types, dtypes and shapes (and treats NaN == NaN)."""
    if isinstance(a, np.ndarray):
        return (type(b) is np.ndarray and a.dtype == b.dtype and a.shape == b.shape
                and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return type(b) is list and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if type(a) is not type(b):
        return False
    return a == b or (a != a and b != b)


def step_record(i: int, t0: float = 100.0, dt: float = 0.1) -> dict:
    return {"step": i, "t_start": t0 + i * dt, "t_end": t0 + i * dt + dt / 2,
            "routing": np.full((3, 8), i, np.int32), "tokens": i * 2}


def write_trace(path, n_steps=50, actions=(), **kw) -> None:
    with TraceWriter(path, {"model": "tiny"}, **kw) as w:
        for i in range(n_steps):
            assert w.write_step(step_record(i))
        for a in actions:
            assert w.write_action(a)
    assert w.dropped == 0 and w.failed == 0


# --- codec ----------------------------------------------------------------------------------------

def test_codec_round_trips_arrays_scalars_and_nesting():
    rng = np.random.default_rng(0)
    record = {
        "step": 7, "t_start": 1.25, "t_end": 1.5, "kind": "decode", "ok": True, "none": None,
        "nan": float("nan"), "huge_int": 2**70, "text": "é\x00x",
        "routing": rng.integers(0, 300, (61, 384)).astype(np.int32),
        "traffic": (rng.integers(0, 50, (8, 8)) * 14336).astype(np.int64),  # multiples: gcd path
        "extremes": np.array([-2**63, 0, 2**63 - 1], np.int64),
        "u64": np.array([0, 2**64 - 1, 5], np.uint64),
        "negative": np.array([[-5, -1], [3, 2**40]], np.int64),
        "constant": np.zeros((4, 5), np.int16),
        "big_endian": np.arange(10, dtype=">i4"),
        "mask": rng.random(9) > 0.5,
        "f16": rng.random((2, 3)).astype(np.float16), "f64": rng.random(5), "c128": np.array([1 + 2j]),
        "strings": np.array(["ab", "c"]), "empty": np.zeros((0, 3), np.int32), "zero_d": np.array(7),
        "np_int": np.int64(5), "np_float": np.float32(2.5), "np_bool": np.bool_(True),
        "fortran": np.asfortranarray(rng.integers(0, 9, (3, 4))),
        "spans": {"name": ["attn", "moe"] * 30, "t_start": rng.random(60), "device": np.arange(60, dtype=np.int16)},
        "int_list": list(range(40)), "float_list": [0.1 * i for i in range(12)],
        "list_of_lists": [[i * 14336 for i in range(8)] for _ in range(8)],  # engine's traffic_bytes form
        "mixed_list": [1, 2.0, "x", None, True] * 3, "bool_list": [True, False] * 8, "short": [1, 2],
        "odd_keys": {1: "a", (0, 1): [1, 2], None: 3, 2.5: "f", "\x00nd": "not an array"},
        "nested": {"a": {"b": [{"c": np.arange(3, dtype=np.uint8)}]}},
        "tuple": (1, 2),
    }
    out = decode(encode(record))
    expected = dict(record, tuple=[1, 2])  # tuples come back as lists
    for key in record:
        assert same(expected[key], out[key]), key
    assert list(out) == list(record)
    assert out["routing"].flags.writeable


def test_codec_torch_tensors_come_back_as_numpy():
    torch = pytest.importorskip("torch")
    out = decode(encode({"r": torch.arange(6, dtype=torch.int32).reshape(2, 3), "h": torch.ones(2, dtype=torch.bfloat16)}))
    assert same(out["r"], np.arange(6, dtype=np.int32).reshape(2, 3))
    assert same(out["h"], np.ones(2, np.float32))


def test_codec_shrinks_integer_arrays_and_restores_dtype():
    rng = np.random.default_rng(1)
    routing = rng.multinomial(512 * 8, rng.dirichlet(np.ones(384), size=61)).astype(np.int32)
    payload = encode({"routing": routing})
    assert len(payload) < routing.nbytes / 5  # 94 KB of int32 counts in under 19 KB
    # narrower than the raw bytes zlib alone would get, at the same level
    import zlib

    from moectl.profiler.codec import ZLIB_LEVEL
    assert len(payload) < len(zlib.compress(routing.tobytes(), ZLIB_LEVEL)) * 0.8
    back = decode(payload)["routing"]
    assert back.dtype == np.int32 and np.array_equal(back, routing)
    # a constant array and a byte matrix of whole tokens cost (almost) nothing
    assert len(encode({"z": np.zeros((61, 384), np.int64)})) < 100
    tokens = rng.integers(0, 200, (64, 64)).astype(np.int64)
    assert len(encode({"t": tokens * 14336})) <= len(encode({"t": tokens})) + 16  # bytes = tokens x 14336


def test_codec_rejects_what_it_cannot_store_and_corrupt_payloads():
    with pytest.raises(TraceError, match="cannot store a value of type object"):
        encode({"x": object()})
    with pytest.raises(TraceError, match="dtype"):
        encode({"x": np.array([object()])})
    good = encode({"a": np.arange(100)})
    with pytest.raises(TraceError, match="codec version 9"):
        decode(bytes([9]) + good[1:])
    with pytest.raises(TraceError, match="corrupt"):
        decode(good[:-7])
    with pytest.raises(TraceError, match="corrupt"):
        decode(b"")
    with pytest.raises(TraceError, match="corrupt"):
        decode(bytes([codec.CODEC_VERSION]) + os.urandom(64))


def test_packed_layout_round_trips_what_the_first_layout_does():
    """Version 2 (pack on the engine thread, seal in the writer) gives back what was packed:
    dtypes, shapes, numpy scalars, key order and odd keys, big records shrunk losslessly."""
    rng = np.random.default_rng(0)
    record = {
        "step": 7, "t_start": 1.25, "t_end": 1.5, "ok": True, "none": None, "nan": float("nan"), "text": "é\x00x",
        "routing": rng.integers(0, 300, (61, 384)).astype(np.int32),
        "traffic": (rng.integers(0, 50, (8, 8)) * 14336).astype(np.int64),
        "extremes": np.array([-2**63, 0, 2**63 - 1], np.int64), "u64": np.array([0, 2**64 - 1, 5] * 30, np.uint64),
        "constant": np.zeros((40, 5), np.int16), "big_endian": np.arange(100, dtype=">i4"),
        "mask": rng.random(9) > 0.5, "f16": rng.random((2, 3)).astype(np.float16), "f64": rng.random(500),
        "c128": np.array([1 + 2j]), "strings": np.array(["ab", "c"]), "empty": np.zeros((0, 3), np.int32),
        "zero_d": np.array(7), "np_int": np.int64(5), "np_float": np.float32(2.5), "np_bool": np.bool_(True),
        "fortran": np.asfortranarray(rng.integers(0, 9, (3, 4))),
        "int_list": list(range(40)), "mixed_list": [1, 2.0, "x", None, True] * 3,
        "odd_keys": {1: "a", (0, 1): [1, 2], "\x00nd": "not an array"},
        "nested": {"a": {"b": [{"c": np.arange(3, dtype=np.uint8)}]}}, "tuple": (1, 2),
    }
    packed = codec.pack(record)
    small = {k: v for k, v in record.items() if k not in ("routing", "f64")}
    assert len(packed) >= codec.SEAL_SHAPE_BYTES > len(codec.pack(small))  # big: arrays shrunk and shuffled
    for given in (record, small):
        # what seal writes (zstd), and the zlib payloads of traces written before it
        for payload, version in ((codec.seal(codec.pack(given)), codec.PACKED_ZSTD_VERSION),
                                 (codec.seal(codec.pack(given), zlib_level=1), codec.PACKED_VERSION)):
            assert payload[0] == version
            out = decode(payload)
            expected = dict(given, tuple=[1, 2])  # tuples come back as lists
            assert list(out) == list(expected)
            for key in expected:
                assert same(expected[key], out[key]), key
                if isinstance(out[key], np.ndarray):
                    assert out[key].flags.writeable, key
    assert same(decode(codec.seal(packed))["routing"], record["routing"])


def test_packed_layout_shrinks_big_records_and_refuses_what_it_cannot_store():
    rng = np.random.default_rng(1)
    routing = rng.multinomial(512 * 8, rng.dirichlet(np.ones(384), size=61)).astype(np.int32)
    payload = codec.seal(codec.pack({"routing": routing}))
    assert len(payload) < routing.nbytes / 5
    assert len(payload) < len(encode({"routing": routing})) + 200  # as small as the first layout (zstd: smaller)
    with pytest.raises(TraceError, match="cannot pack"):
        codec.pack({"x": object()})
    with pytest.raises(TraceError, match="cannot pack"):
        codec.pack({"x": 2**70})
    with pytest.raises(TraceError, match="must be a dict"):
        codec.pack([1])
    import zstandard

    good = codec.seal(codec.pack({"a": np.arange(100)}))
    good_zlib = codec.seal(codec.pack({"a": np.arange(100)}), zlib_level=1)
    for bad in (good[:-7], good_zlib[:-7], bytes([codec.PACKED_VERSION]) + os.urandom(64),
                bytes([codec.PACKED_ZSTD_VERSION]) + os.urandom(64),
                bytes([codec.PACKED_VERSION]) + __import__("zlib").compress(b"\x91\x01"),  # a list, not a dict
                bytes([codec.PACKED_ZSTD_VERSION]) + zstandard.ZstdCompressor().compress(b"\x91\x01")):
        with pytest.raises(TraceError, match="corrupt"):
            decode(bad)
    with pytest.raises(TraceError, match="unknown record codec version 9"):
        decode(bytes([9]) + good[1:])


def test_steps_are_written_packed_and_an_unpackable_one_the_first_way(tmp_path):
    path = tmp_path / "t.trace"
    with TraceWriter(path, {"model": "tiny"}) as w:
        assert w.write_step(step_record(0))
        assert w.write_step(dict(step_record(1), huge=2**70))  # past msgpack's ints: pickled, encoded there
        assert w.write_action({"time": 1.0, "step": 1, "kind": "knobs", "args": {}, "result": {}})
    with sqlite3.connect(path) as conn:
        versions = [row[0][0] for row in conn.execute("SELECT payload FROM steps ORDER BY step")]
    assert versions == [codec.PACKED_ZSTD_VERSION, codec.CODEC_VERSION]
    with TraceReader(path) as reader:
        steps = list(reader.steps())
    assert same(steps[0], step_record(0)) and steps[1]["huge"] == 2**70


# --- writer and reader -----------------------------------------------------------------------------

def test_header_counts_and_summary(tmp_path):
    path = tmp_path / "t.trace"
    placement = np.arange(12, dtype=np.int16).reshape(3, 4)
    with TraceWriter(path, {"model": "m", "placement": placement, "software": {"engine": "x"}}) as w:
        for i in range(10, 30):
            w.write_step(step_record(i))
    with TraceReader(path) as r:
        h = r.header
        assert h["model"] == "m" and same(h["placement"], placement)
        assert h["format_version"] == FORMAT_VERSION and h["created_unix"] > 1.6e9
        assert {"python", "sqlite", "numpy"} <= set(h["software"]) and h["software"]["engine"] == "x"
        assert (r.num_steps, r.first_step, r.last_step) == (20, 10, 29)
        assert r.duration_s == pytest.approx((100 + 2.9 + 0.05) - (100 + 1.0))
        assert r.dropped == 0 and r.complete and r.meta["written"] == 20
        step, t_start, t_end = r.step_times()
        assert step.tolist() == list(range(10, 30)) and t_start[0] == 101.0 and t_end[-1] == pytest.approx(102.95)
    assert not Path(f"{path}-wal").exists()  # a closed trace is one file


def test_seek_step_and_seek_time(tmp_path):
    path = tmp_path / "t.trace"
    with TraceWriter(path, {}) as w:
        for i in [0, 1, 2, 5, 6, 9]:  # steps 3, 4, 7, 8 missing
            w.write_step(step_record(i))
    with TraceReader(path) as r:
        assert r.seek_step(2)["step"] == 2
        assert same(r.seek_step(2)["routing"], np.full((3, 8), 2, np.int32))
        assert r.seek_step(3)["step"] == 5  # nearest step >= n
        assert r.seek_step(-10)["step"] == 0
        assert r.seek_step(9)["step"] == 9
        with pytest.raises(TraceError, match="past the end"):
            r.seek_step(10)
        assert r.seek_time(100.0)["step"] == 0  # exactly a t_start
        assert r.seek_time(100.45)["step"] == 2  # inside the gap after step 2
        assert r.seek_time(100.55)["step"] == 5
        assert r.seek_time(1e9)["step"] == 9  # after the end: the last step
        assert r.seek_time(0.61, relative=True)["step"] == 6
        with pytest.raises(TraceError, match="before the first step"):
            r.seek_time(99.9)
        with pytest.raises(TraceError, match="before the first step"):
            r.seek_time(-0.1, relative=True)


def test_seeks_and_scans_use_indexes(tmp_path):
    """Seek latency on an hour-long trace rests on these plans: no full scan, no sort."""
    path = tmp_path / "t.trace"
    write_trace(path, 5)
    conn = sqlite3.connect(path)
    for sql, args in [(trace_store._SEEK_STEP_SQL, (1,)), (trace_store._SEEK_TIME_SQL, (1.0,)),
                      (trace_store._STEP_PAGE_SQL, (0, 0, 9, 64)), (trace_store._ACTION_PAGE_SQL, (0.0, 0, 9.0, 64))]:
        plan = " ".join(row[-1] for row in conn.execute("EXPLAIN QUERY PLAN " + sql, args))
        assert "USING INDEX" in plan and "SCAN" not in plan, (sql, plan)
    conn.close()


def test_range_iteration_pages_and_bounds(tmp_path, monkeypatch):
    path = tmp_path / "t.trace"
    write_trace(path, 50)
    monkeypatch.setattr(TraceReader, "PAGE", 7)  # several pages, one partial
    with TraceReader(path) as r:
        assert [rec["step"] for rec in r.steps()] == list(range(50))
        assert [rec["step"] for rec in r.steps(10, 24)] == list(range(10, 24))
        assert [rec["step"] for rec in r.steps(start=45)] == list(range(45, 50))
        assert [rec["step"] for rec in r.steps(stop=3)] == [0, 1, 2]
        assert list(r.steps(60, 70)) == [] and list(r.steps(5, 5)) == []


def test_duplicate_step_numbers_are_all_kept(tmp_path, monkeypatch):
    path = tmp_path / "t.trace"
    with TraceWriter(path, {}) as w:
        for i in [0, 1, 1, 1, 2]:
            w.write_step(step_record(i))
    monkeypatch.setattr(TraceReader, "PAGE", 2)  # a page boundary inside the run of 1s
    with TraceReader(path) as r:
        assert [rec["step"] for rec in r.steps()] == [0, 1, 1, 1, 2]
        assert r.seek_step(1)["step"] == 1


def test_actions(tmp_path, monkeypatch):
    actions = [{"time": 100.0 + 0.5 * k, "step": k, "kind": "rebalance" if k % 2 else "pause",
                "args": {"k": k}, "result": {"ok": True, "moved": np.arange(k)}} for k in range(9)]
    path = tmp_path / "t.trace"
    write_trace(path, 3, actions)
    monkeypatch.setattr(TraceReader, "PAGE", 4)
    with TraceReader(path) as r:
        assert r.num_actions == 9
        got = list(r.actions())
        assert [a["step"] for a in got] == list(range(9)) and all(same(a, b) for a, b in zip(actions, got))
        assert [a["step"] for a in r.actions(101.0, 102.5)] == [2, 3, 4]  # start inclusive, end exclusive
        assert [a["step"] for a in r.actions(start_time=103.5)] == [7, 8]
        assert [a["step"] for a in r.actions(end_time=100.5)] == [0]


def test_record_contract_is_checked_on_the_callers_thread(tmp_path):
    with TraceWriter(tmp_path / "t.trace", {}) as w:
        with pytest.raises(TraceError, match="step"):
            w.write_step({"t_start": 1.0, "t_end": 2.0})
        with pytest.raises(TraceError, match="kind"):
            w.write_action({"time": 1.0, "step": 0})
        with pytest.raises(TraceError, match="finite"):  # would fail the NOT NULL insert of a whole batch
            w.write_step({"step": 0, "t_start": float("nan"), "t_end": 1.0})
        # what the codec cannot store is counted as failed, and the trace goes on
        w.write_step({"step": 0, "t_start": 0.0, "t_end": 1.0, "bad": object()})
        w.write_step(step_record(1))
        assert w.flush(timeout=10)
        assert w.failed == 1 and "cannot store" in w.last_error
    with pytest.raises(TraceError, match="closed"):
        w.write_step(step_record(2))
    with TraceReader(tmp_path / "t.trace") as r:
        assert r.num_steps == 1 and r.meta["failed"] == 1
    with pytest.raises(TraceError, match="cannot store"):
        TraceWriter(tmp_path / "bad_header.trace", {"x": object()})
    assert not (tmp_path / "bad_header.trace").exists()


def test_full_pipe_drops_and_counts_without_blocking(tmp_path):
    """With the writer process stopped, the pipe and then the backlog fill; every later write
    returns False at once and is counted, and what was accepted is all in the trace after close."""
    path = tmp_path / "t.trace"
    w = TraceWriter(path, {}, queue_size=4, flush_interval_s=0.01)
    os.kill(w.writer_pid, signal.SIGSTOP)
    try:
        accepted = []
        for i in range(20000):  # ~280 bytes a frame: far more than a 1 MiB pipe plus 4 holds
            accepted.append(w.write_step(step_record(i)))
            if w.dropped >= 50:
                break
        assert w.dropped == 50 and accepted.count(False) == 50
        first_drop = accepted.index(False)
        assert accepted[first_drop:] == [False] * 50  # nothing drains while the writer is stopped
        assert w.pending == 4
    finally:
        os.kill(w.writer_pid, signal.SIGCONT)
    w.close()
    assert w.written == first_drop
    with TraceReader(path) as r:
        assert [rec["step"] for rec in r.steps()] == list(range(first_drop))
        assert r.dropped == 50


def test_refuses_to_overwrite_unless_asked(tmp_path):
    path = tmp_path / "t.trace"
    write_trace(path, 3)
    with pytest.raises(TraceError, match="already exists"):
        TraceWriter(path, {})
    write_trace(path, 2, overwrite=True)
    with TraceReader(path) as r:
        assert r.num_steps == 2


def test_bad_files_give_one_line_trace_errors(tmp_path):
    def error_of(path) -> str:
        with pytest.raises(TraceError) as e:
            TraceReader(path)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "no such" in error_of(tmp_path / "missing.trace")

    noise = tmp_path / "noise.trace"
    noise.write_bytes(np.random.default_rng(0).bytes(8192))
    assert "not an SQLite database" in error_of(noise)

    damaged = tmp_path / "damaged.trace"  # right magic, garbage after it
    damaged.write_bytes(b"SQLite format 3\x00" + np.random.default_rng(1).bytes(8192))
    assert "trace" in error_of(damaged)

    other = tmp_path / "other.db"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    assert "another kind" in error_of(other)

    future = tmp_path / "future.trace"
    write_trace(future, 2)
    conn = sqlite3.connect(future)
    conn.execute("UPDATE header SET format_version = ?", (FORMAT_VERSION + 1,))
    conn.commit()
    conn.close()
    assert f"version {FORMAT_VERSION + 1}" in error_of(future)


def test_corrupt_step_payload_is_a_trace_error(tmp_path):
    path = tmp_path / "t.trace"
    write_trace(path, 3)
    conn = sqlite3.connect(path)
    conn.execute("UPDATE steps SET payload = ? WHERE step = 1", (b"\x01not zlib",))
    conn.commit()
    conn.close()
    with TraceReader(path) as r:
        assert r.seek_step(0)["step"] == 0
        with pytest.raises(TraceError, match="step 1: corrupt record payload"):
            r.seek_step(1)


def test_reads_a_trace_while_it_is_being_written(tmp_path):
    path = tmp_path / "t.trace"
    w = TraceWriter(path, {"model": "live"}, flush_interval_s=0.01)
    try:
        for i in range(20):
            w.write_step(step_record(i))
        assert w.flush(timeout=10)
        with TraceReader(path) as r:
            assert r.num_steps == 20 and not r.complete
            for i in range(20, 30):
                w.write_step(step_record(i))
            assert w.flush(timeout=10)
            assert r.num_steps == 30 and r.seek_step(29)["step"] == 29  # sees new commits
            assert len(list(r.steps())) == 30
    finally:
        w.close()


_CHILD = r"""
import sys, time
import numpy as np
from moectl.profiler.trace_store import TraceWriter
w = TraceWriter(sys.argv[1], {"model": "crash-test"})
log = open(sys.argv[2], "w", buffering=1)
routing = np.arange(61 * 8, dtype=np.int32).reshape(61, 8)
i = 0
while True:
    t = time.monotonic()
    w.write_step({"step": i, "t_start": t, "t_end": t + 0.001, "routing": routing})
    log.write(f"{i} {time.monotonic()}\n")  # step i has returned from write_step by this time
    i += 1
    time.sleep(0.005)
"""


def test_kill_9_loses_at_most_the_last_second(tmp_path):
    path, log = tmp_path / "crash.trace", tmp_path / "written.log"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), str(log)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        seen, first_seen = 0, None
        give_up = time.monotonic() + 30  # only a broken writer gets anywhere near this
        while time.monotonic() < give_up:
            assert child.poll() is None, child.stderr.read().decode()[-2000:]
            try:
                with TraceReader(path) as r:
                    seen = r.num_steps
            except TraceError:  # not created yet
                pass
            if seen and first_seen is None:
                first_seen = time.monotonic()
            if first_seen is not None and time.monotonic() - first_seen > 1.5:
                break
            time.sleep(0.05)
        assert seen > 0, "the child never committed a step"
        kill_time = time.monotonic()
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
        child.stderr.close()

    lines = log.read_text().split("\n")[:-1]  # the last piece may be cut by the kill
    returned_by = {int(i): float(t) for i, t in (line.split() for line in lines)}
    with TraceReader(path) as r:
        steps = [rec["step"] for rec in r.steps()]  # every row decodes
        assert not r.complete
    assert len(steps) >= seen
    assert steps == list(range(len(steps)))  # commits land in order: a prefix, no holes
    # Every step handed over more than a second before the kill (4 flush intervals) survived.
    old = [i for i, t in returned_by.items() if t <= kill_time - 1.0]
    assert old, "the child wrote too little to test anything"
    assert len(steps) >= max(old) + 1


def test_the_str_keys_fast_path_writes_the_same_records():
    """encode(str_keys=True) (json's C encoder walks the record) decodes to exactly what the
    general walk gives, arrays and lists alike."""
    from moectl.profiler import codec

    rng = np.random.default_rng(3)
    record = {"step": 7, "t_start": 1.5, "t_end": 1.75, "routing": rng.integers(0, 900, (6, 32)).astype(np.int32),
              "small": np.arange(5, dtype=np.int64), "flags": np.array([True, False]), "x": np.float32(2.5),
              "nested": {"a": [1, 2, 3] * 4, "b": {"c": None, "d": "text", "e": [0.5] * 9}},
              "spans": {"lanes": ["engine"], "start_s": rng.random(40), "lane": np.zeros(40, np.int16)}}

    def same(a, b):
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if isinstance(a, np.ndarray):
            return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and (a == b).all()
        return type(a) is type(b) and a == b

    general, fast = codec.decode(codec.encode(record)), codec.decode(codec.encode(record, str_keys=True))
    assert same(general, fast) and same(fast["routing"], record["routing"])
    with pytest.raises(codec.TraceError, match="cannot store"):
        codec.encode({"step": 1, "bad": object()}, str_keys=True)


def test_a_flush_wakes_the_writer_after_its_frame_is_in_the_pipe(tmp_path, monkeypatch):
    """The writer process sleeps up to its poll interval unless kicked. A kick sent before the
    flush's frame is in the pipe can wake it to an empty pipe, and the flush then waits out the
    interval (it did: 0.25 s, once in 8 flushes). So the kick must follow the frame's write."""
    from moectl.profiler import trace_writer as tw

    with TraceWriter(tmp_path / "t.trace", {"model": "tiny"}, flush_interval_s=600) as w:
        assert w.write_step(step_record(0))
        events = []
        writev, write = os.writev, os.write

        def logged_writev(fd, parts):
            events.append(("frame", bytes(parts[0])[FRAME.size - 1]))  # the header's last byte: its kind
            return writev(fd, parts)

        def logged_write(fd, data):
            events.append(("kick", None) if fd == w._kick else ("write", None))
            return write(fd, data)

        monkeypatch.setattr(tw.os, "writev", logged_writev)
        monkeypatch.setattr(tw.os, "write", logged_write)
        assert w.flush(timeout=60)
        monkeypatch.undo()
    flush_frame = events.index(("frame", tw.FLUSH))
    assert ("kick", None) in events[flush_frame + 1:], events
