"""Traces that are not what they should be: a directory, corrupt meta rows, a trace whose writer was
killed (its recent steps still in the -wal), one copied without that -wal, and one whose
recording process was killed (sealed whole by its writer). Each is one line
that says what it is; `moectl trace info` counts the -wal and -shm in the size it reports."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3

import pytest
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.profiler import codec, trace_format
from moectl.profiler.trace_store import TraceError, TraceReader, TraceWriter
from tests.profiler.test_trace_store import step_record, write_trace

HEADER = {"model": {"name": "tiny", "architecture": "MixtralForCausalLM"}}


def trace_info(path, *options):
    return CliRunner().invoke(app, ["trace", "info", str(path), *options])


def error_of(path) -> str:
    with pytest.raises(TraceError) as e:
        TraceReader(path)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.fixture
def killed_writer_trace(tmp_path):
    """A trace whose writer process was killed (kill -9) after committing 20 steps: nothing
    closed it, so its steps are in the -wal beside it."""
    path = tmp_path / "crashed.trace"
    writer = TraceWriter(path, HEADER)
    for i in range(20):
        assert writer.write_step(step_record(i))
    assert writer.flush(timeout=30)
    with TraceReader(path) as reader:  # still recording: another process has it open
        assert reader.file_status()["state"] == "open"
    os.kill(writer.writer_pid, signal.SIGKILL)
    with pytest.raises(TraceError, match="writer process failed"):
        writer.close()  # reaps the killed process; the file stays as the kill left it
    assert trace_format.file_sizes(path).get("-wal"), "the kill left no -wal to test with"
    return path


def test_a_directory_is_not_a_trace(tmp_path):
    assert error_of(tmp_path) == f"{tmp_path}: is a directory, not a trace"


@pytest.mark.parametrize("key, value, problem", [
    ("dropped", "abc", "must be a non-negative integer"),
    ("written", -1, "must be a non-negative integer"),
    ("failed", 1.5, "must be a non-negative integer"),
    ("dropped", None, "must be a non-negative integer"),
    ("closed_unix", "yesterday", "must be a time in seconds"),
    ("abandoned_unix", float("nan"), "must be a time in seconds"),
    ("last_error", b"\x00\x01", "must be text"),
])
def test_a_corrupt_meta_row_names_its_key_and_problem(tmp_path, key, value, problem):
    path = tmp_path / "t.trace"
    write_trace(path, 3)
    conn = sqlite3.connect(path)
    conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))
    conn.commit()
    conn.close()
    with TraceReader(path) as reader, pytest.raises(TraceError) as e:
        reader.meta  # noqa: B018 - the read is the test
    message = str(e.value)
    assert f"meta row {key!r} is corrupt: {problem}" in message and "\n" not in message
    res = trace_info(path)
    assert res.exit_code == 2 and f"meta row {key!r}" in res.output and "Traceback" not in res.output


def test_info_on_a_killed_writers_trace_counts_the_wal_and_says_it_was_not_closed(killed_writer_trace):
    path = killed_writer_trace
    with TraceReader(path) as reader:
        status = reader.file_status()
        assert reader.num_steps == 20 and not reader.complete
    on_disk = sum(p.stat().st_size for p in (path, *(trace_format.sidecar(path, s) for s in trace_format.SIDECARS))
                  if p.exists())
    assert status["state"] == "unclosed" and status["bytes"] == on_disk > path.stat().st_size
    res = trace_info(path)
    assert res.exit_code == 0, res.output
    assert f"{on_disk:,} bytes" in res.output and "not closed cleanly" in res.output
    info = json.loads(trace_info(path, "--json").output)
    assert info["bytes"] == on_disk and info["state"] == "unclosed" and info["steps"] == 20


def test_a_killed_writers_trace_copied_without_its_wal_says_so(killed_writer_trace, tmp_path):
    copy = tmp_path / "copied" / "crashed.trace"
    copy.parent.mkdir()
    shutil.copy(killed_writer_trace, copy)  # the -wal (and -shm) left behind
    with TraceReader(copy) as reader:
        status = reader.file_status()
        readable = reader.num_steps
    assert status["state"] == "wal_missing" and readable < 20
    res = trace_info(copy)
    assert res.exit_code == 0, res.output
    assert "no -wal file beside it" in res.output and f"the {readable} steps in this file" in res.output
    assert trace_info(killed_writer_trace).output.count("no -wal file") == 0  # the original is whole


_RECORDING_PROCESS = r"""
import sys
from moectl.profiler.trace_store import TraceWriter
from tests.profiler.test_trace_store import step_record
w = TraceWriter(sys.argv[1], {"model": {"name": "tiny"}})
for i in range(50):
    w.write_step(step_record(i))
assert w.flush(timeout=30)
print(w.writer_pid, flush=True)
import time
time.sleep(600)
"""


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_trace_whose_recording_process_was_killed_is_sealed_whole_and_says_so(tmp_path):
    """kill -9 of `moectl record` (the engine's process, not its writer): the writer process sees its
    input end, commits what it received and seals the file. `trace info` once said the steps in
    the -wal were lost, because that seal had emptied the -wal without saying so; all 50 were there."""
    import subprocess
    import sys
    import time

    path = tmp_path / "killed.trace"
    child = subprocess.Popen([sys.executable, "-c", _RECORDING_PROCESS, str(path)], stdout=subprocess.PIPE,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        writer_pid = int(child.stdout.readline().strip() or 0)
        assert writer_pid, "the recording process never flushed"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not _exited(writer_pid):  # it polls its input every 0.25 s
        time.sleep(0.05)  # (not reading the trace meanwhile: a reader keeps the file in WAL mode)
    with TraceReader(path) as reader:
        status, steps, complete = reader.file_status(), reader.num_steps, reader.complete
    assert status["state"] == "abandoned" and steps == 50 and not complete
    assert not trace_format.in_wal_mode(path) and not trace_format.file_sizes(path).get("-wal")
    res = trace_info(path)
    assert res.exit_code == 0, res.output
    assert "ended without closing it" in res.output and "50 steps, all readable" in res.output
    assert "-wal" not in res.output and "lost" not in res.output
    copy = tmp_path / "copy.trace"
    shutil.copy(path, copy)  # sealed: the file alone holds everything
    with TraceReader(copy) as reader:
        assert reader.num_steps == 50 and reader.file_status()["state"] == "abandoned"


def test_a_trace_copied_without_its_wal_before_any_checkpoint_is_not_another_kind_of_database(tmp_path):
    """While a reader holds a snapshot from before the trace's first commit (a console polling for
    the file), SQLite cannot checkpoint anything into it: a copy of the file alone then has no
    schema at all, not even the application id, and every record is in the -wal."""
    path = tmp_path / "t.trace"
    early_reader = sqlite3.connect(path, isolation_level=None)
    early_reader.execute("PRAGMA journal_mode=WAL").fetchall()
    early_reader.execute("BEGIN")
    early_reader.execute("SELECT count(*) FROM sqlite_master").fetchall()  # pins the empty snapshot
    try:
        trace_format.create(path, 0.0, codec.encode(HEADER))
        writer = trace_format.open_for_append(path)
        steps = [(i, float(i), i + 0.5, codec.encode(step_record(i))) for i in range(5)]
        trace_format.commit(writer, steps, [], {"written": 5})
        copy = tmp_path / "copied.trace"
        shutil.copy(path, copy)  # copied while the writer holds it open with its WAL
        with TraceReader(path) as whole:  # the original, with its -wal, reads in full
            assert whole.num_steps == 5
        writer.close()
    finally:
        early_reader.close()
    message = error_of(copy)
    assert "another kind" not in message
    assert "a moectl trace whose writer did not close it" in message and "-wal" in message
    assert "nothing can be read" in message
    res = trace_info(copy)
    assert res.exit_code == 2 and "whose writer did not close it" in res.output


def test_a_cleanly_closed_trace_is_complete_and_its_size_is_the_file(tmp_path):
    path = tmp_path / "t.trace"
    write_trace(path, 5)
    with TraceReader(path) as reader:
        status = reader.file_status()
    assert status == {"bytes": path.stat().st_size, "files": {"": path.stat().st_size}, "state": "complete",
                      "summary": "complete"}


def test_a_trace_with_damaged_pages_is_not_called_complete(tmp_path):
    # the steps table's root page overwritten: the header, meta rows and indexes `trace info`
    # reads are intact, so only SQLite's integrity check finds it; report and export name the file
    path = tmp_path / "damaged.trace"
    write_trace(path, 300)
    conn = sqlite3.connect(path)
    root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'steps'").fetchone()[0]
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    conn.close()
    with open(path, "r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(b"\xff" * page_size)
    res = trace_info(path)
    assert res.exit_code == 2 and "damaged: SQLite's integrity check finds" in res.output, res.output
    assert "complete" not in res.output and len(res.output.strip().splitlines()) == 1
    for args in (["report", str(path)], ["export", str(path), "-o", str(tmp_path / "out.json")]):
        res = CliRunner().invoke(app, ["trace", *args])
        assert res.exit_code == 2 and f"{path}: damaged" in res.output and "Traceback" not in res.output
        assert len(res.output.strip().splitlines()) == 1
