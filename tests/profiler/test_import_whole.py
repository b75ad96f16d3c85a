"""`moectl trace import` writes a trace whole or not at all (trace_format.written_whole): an import
that fails part-way leaves no half-written trace (one its closed writer would call "complete",
0 records), keeps the trace it was to replace, and needs no --overwrite to run again. A GPU
timeline missing a rank's events (what such an import left before) is one line, not a numpy
error."""

from __future__ import annotations

import sqlite3

import pytest
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.profiler.trace_store import TraceReader, TraceWriter
from tests.kineto_traces import two_rank_folder
from tests.profiler.test_external_load import sglang_per_pass

runner = CliRunner()


def kineto_source(tmp_path):
    return [two_rank_folder(tmp_path / "profile")]  # two records: one per rank


def sglang_source(tmp_path):
    return sglang_per_pass(tmp_path)[0]  # five records: one per pass


def trace_import(sources, out, *options):
    return runner.invoke(app, ["trace", "import", *map(str, sources), "-o", str(out), *options])


@pytest.fixture
def failing_writer(monkeypatch):
    """The trace writer drops every record after the first: the import fails part-way."""
    write_step = TraceWriter.write_step
    written = []

    def first_only(self, record):
        written.append(record["step"])
        return write_step(self, record) if len(written) == 1 else False

    monkeypatch.setattr(TraceWriter, "write_step", first_only)


@pytest.mark.parametrize("source", [kineto_source, sglang_source], ids=["kineto", "sglang"])
def test_a_failed_import_leaves_nothing_and_runs_again_without_overwrite(tmp_path, source, failing_writer, monkeypatch):
    sources, out = source(tmp_path), tmp_path / "x.trace"
    res = trace_import(sources, out)
    assert res.exit_code != 0 and "dropped" in res.output and len(res.output.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob("x.trace*"))  # no partial file either
    monkeypatch.undo()  # the writer works again
    assert trace_import(sources, out).exit_code == 0  # no --overwrite needed
    with TraceReader(out) as reader:
        assert reader.complete and reader.num_steps >= 2


@pytest.mark.parametrize("source", [kineto_source, sglang_source], ids=["kineto", "sglang"])
def test_a_failed_import_over_a_trace_keeps_it(tmp_path, source, monkeypatch):
    sources, out = source(tmp_path), tmp_path / "x.trace"
    assert trace_import(sources, out).exit_code == 0
    before = out.read_bytes()
    write_step = TraceWriter.write_step
    monkeypatch.setattr(TraceWriter, "write_step", lambda self, record: record["step"] == 1 and write_step(self, record))
    assert trace_import(sources, out, "--overwrite").exit_code != 0
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.glob("x.trace*")) == ["x.trace"]


def test_a_timeline_missing_a_rank_is_one_line_not_a_numpy_error(tmp_path):
    out = tmp_path / "gpu.trace"
    assert trace_import(kineto_source(tmp_path), out).exit_code == 0
    conn = sqlite3.connect(out)
    conn.execute("DELETE FROM steps WHERE step = 2")  # rank 1's record, as an import that stopped left it
    conn.commit()
    conn.close()
    res = runner.invoke(app, ["trace", "report", str(out)])
    assert res.exit_code == 2 and "holds no events of rank 1" in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1
