"""Kineto traces past moectl's limits (profiler/kineto.py): JSON nested deeper than MAX_DEPTH
anywhere, a string longer than MAX_STRING_BYTES, and kept events whose ts, dur or
args.correlation are not what a profiler writes. Each is one line naming the file and exit 2;
a legitimately nested trace, with brackets, quotes and backslashes in its names, still reads,
whatever the chunks the file is read in."""

from __future__ import annotations

import gzip
import io
import json
import random

import pytest
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.profiler import kineto
from tests.kineto_traces import kernel, write_rank

runner = CliRunner()


def one_line_error(path, *options) -> str:
    out = runner.invoke(app, ["trace", "report", str(path), *options])
    assert out.exit_code == 2, out.output
    lines = out.output.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "Traceback" not in out.output
    return lines[0]


@pytest.mark.parametrize("doc", [
    '{"traceEvents": [' + "[" * 5000 + "]" * 5000 + "]}",  # the file, N = 5000
    '{"distributedInfo": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + ', "traceEvents": []}',
    '{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 1, "args": '
    + "[" * 5000 + "]" * 5000 + "}]}",
    "[" * 5000 + "]" * 5000,  # Chrome's array form
], ids=["events", "distributedInfo", "args", "array-form"])
def test_json_nested_past_the_limit_is_one_line_and_exit_2(tmp_path, doc):
    path = tmp_path / "deep.json"
    path.write_text(doc)
    assert f"nested more than {kineto.MAX_DEPTH} levels" in one_line_error(path)


def test_a_string_past_the_limit_is_refused_before_it_is_read_whole(tmp_path):
    path = tmp_path / "long.json.gz"
    name = "x" * (kineto.MAX_STRING_BYTES + 1)
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": [kernel(name, 0, 1)]}).encode(), 1))
    assert "a JSON string longer than 1 MiB" in one_line_error(path)
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": [kernel(name[:-1], 0, 1)]}).encode(), 1))
    assert runner.invoke(app, ["trace", "report", str(path)]).exit_code == 0  # at the limit: read


def test_a_nested_trace_with_brackets_and_quotes_in_its_names_still_reads(tmp_path, monkeypatch):
    # names with more unbalanced brackets than the limit, escaped quotes and backslashes, read
    # in chunks of a few bytes (every boundary: inside a string, on a backslash, after one)
    monkeypatch.setattr(kineto, "READ_BYTES", 3)
    odd = 'void k<"[[[[' + "[" * 40 + '{{\\"x\\\\"}>(int)\\'
    events = [kernel(odd, 0, 10), kernel("fused_moe_kernel", 10, 20)]
    events[0]["args"]["nested"] = json.loads("[" * 20 + "]" * 20)  # 24 levels in all: under the limit
    write_rank(tmp_path / "rank0.json", 0, events, gz=False)
    out = runner.invoke(app, ["trace", "report", str(tmp_path / "rank0.json"), "--json"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout)
    assert result["unclassed"] == [[odd, pytest.approx(10e-6)]]
    assert result["breakdown"]["expert_gemm"] == pytest.approx(20e-6)


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def _longest_string(value) -> int:
    """Bytes between the quotes of the longest string (keys too), as json.dumps writes it."""
    if isinstance(value, dict):
        return max([len(json.dumps(k)) - 2 for k in value] + [_longest_string(v) for v in value.values()], default=0)
    if isinstance(value, list):
        return max(map(_longest_string, value), default=0)
    return len(json.dumps(value)) - 2 if isinstance(value, str) else 0


def _random_value(rng: random.Random, depth: int):
    pieces = ['"', "\\", "[", "]", "{", "}", "a", "\\\\", '\\"', "é", " "]
    kind = rng.random()
    if depth <= 0 or kind < 0.3:
        return "".join(rng.choice(pieces) for _ in range(rng.randrange(8))) if kind < 0.2 else rng.randrange(100)
    if kind < 0.65:
        return [_random_value(rng, depth - 1) for _ in range(rng.randrange(4))]
    return {"".join(rng.choice(pieces) for _ in range(rng.randrange(4))): _random_value(rng, depth - 1)
            for _ in range(rng.randrange(4))}


@pytest.mark.parametrize("read_bytes", [1, 2, 5, 64])
def test_the_limits_are_exact_whatever_the_chunks(read_bytes, monkeypatch):
    monkeypatch.setattr(kineto, "MAX_DEPTH", 4)
    monkeypatch.setattr(kineto, "MAX_STRING_BYTES", 6)
    monkeypatch.setattr(kineto, "READ_BYTES", read_bytes)
    rng = random.Random(read_bytes)
    seen = set()
    for _ in range(400):
        doc = _random_value(rng, 7)
        too_deep, too_long = _depth(doc) > 4, _longest_string(doc) > 6
        guarded = kineto._Bounded(io.BytesIO(json.dumps(doc).encode()), "doc.json")
        try:
            while guarded.read(1 << 16):
                pass
            refused = None
        except kineto.KinetoError as exc:
            refused = "nested" if "nested" in str(exc) else "string"
        assert (refused is not None) == (too_deep or too_long), json.dumps(doc)
        if refused == "nested":  # the first limit met while reading is the one named
            assert too_deep, json.dumps(doc)
        if refused == "string":
            assert too_long, json.dumps(doc)
        seen.add((too_deep, too_long))
    assert len(seen) == 4  # documents within, past each and past both limits were all tried


@pytest.mark.parametrize("field, token, says", [
    ("dur", "-100", "has dur -100: not a time in microseconds (a finite number >= 0)"),
    ("dur", '"inf"', "has dur 'inf'"),
    ("dur", '"nan"', "has dur 'nan'"),
    ("ts", '"nan"', "has ts 'nan': not a time in microseconds (a finite number)"),
    ("ts", '"soon"', "has ts 'soon'"),
    ("correlation", "1e300", "has args.correlation 1e+300: not an id"),
    ("correlation", "1.5", "has args.correlation 1.5: not an id"),
    ("correlation", '"7"', "has args.correlation '7': not an id"),
])
def test_a_kept_event_with_a_bad_value_is_one_line_and_exit_2(tmp_path, field, token, says):
    bad = kernel("ncclDevKernel_AllToAll", 100, 100, stream=20)
    (bad["args"] if field == "correlation" else bad)[field] = "VALUE"
    write_rank(tmp_path / "rank0.json", 0, [kernel("fused_moe_kernel", 0, 50), bad], gz=False)
    path = tmp_path / "rank0.json"
    path.write_text(path.read_text().replace('"VALUE"', token))
    message = one_line_error(path)
    assert "ncclDevKernel_AllToAll" in message and says in message


def test_an_event_moectl_does_not_read_may_hold_anything(tmp_path):
    # a flow event and a category never read: their values are not checked, as before
    events = [kernel("fused_moe_kernel", 0, 50), {"ph": "X", "cat": "Trace", "name": "x", "ts": "nan", "dur": -1},
              {"ph": "f", "cat": "ac2g", "name": "launch", "ts": "nan", "args": {"correlation": 1e300}}]
    write_rank(tmp_path / "rank0.json", 0, events, gz=False)
    assert runner.invoke(app, ["trace", "report", str(tmp_path / "rank0.json")]).exit_code == 0


def test_a_rank_that_is_not_a_number_of_one_is_one_line(tmp_path):
    doc = {"distributedInfo": {"rank": 1.5}, "traceEvents": [kernel("fused_moe_kernel", 0, 50)]}
    (tmp_path / "rank.json").write_text(json.dumps(doc))
    assert "distributedInfo.rank 1.5 is not a rank" in one_line_error(tmp_path / "rank.json")


def test_a_class_is_decided_on_the_start_of_a_long_name():
    # a second per pattern and distinct name of a MiB, were whole names searched
    rules = kineto.Rules.load()
    padding = "x" * kineto.CLASSIFIED_CHARS
    assert rules.classify("fused_moe_kernel" + padding) == "expert_gemm"
    assert rules.classify(padding + "fused_moe_kernel") == kineto.UNCLASSED
