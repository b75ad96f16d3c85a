"""A placement file's expert ids are JSON integers in range (placement/placement_file.py):
numpy once read them for us, truncating 1.5 to 1, taking "3" for 3, overflowing on 1e20 (exit 1)
and a deeply nested file hit Python's recursion limit (exit 1). Each is a one-line error, exit 2,
naming the file and the field."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.placement.placement import Placement
from tests.paths import TRACES

runner = CliRunner()
TRACE = TRACES / "steady_rebalance.trace"  # the sample model: 4 layers x 16 experts


def _placement(spare=None, pinned=None) -> dict:
    """A placement the trace's model takes, its first spare slot (empty: -1) set to `spare`."""
    out = Placement.contiguous(4, 16, 4, 1).to_dict()
    if spare is not None:
        out["layers"][0][0][4] = spare
    if pinned is not None:
        out["pinned"] = [pinned]
    return out


def _report(tmp_path, content: str):
    path = tmp_path / "placement.json"
    path.write_text(content)
    return path, runner.invoke(app, ["trace", "report", str(TRACE), "--placement", str(path), "--json"])


def test_a_well_formed_placement_is_taken(tmp_path):
    _, res = _report(tmp_path, json.dumps(_placement(spare=1)))  # a replica of expert 1 in the spare slot
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("content, field, shown", [
    pytest.param(json.dumps(_placement(spare=1.5)), "layers[0][0][4]", "got 1.5", id="float-truncated-to-a-valid-id"),
    pytest.param(json.dumps(_placement(spare="3")), "layers[0][0][4]", "got '3'", id="string"),
    pytest.param(json.dumps(_placement(spare=True)), "layers[0][0][4]", "got True", id="bool"),
    pytest.param(json.dumps(_placement(spare=1e20)), "layers[0][0][4]", "got 1e+20", id="float-overflow"),
    pytest.param(json.dumps(_placement(spare=10**20)), "layers[0][0][4]", "expert 100000000000000000000 out of range",
                 id="int-overflow"),
    pytest.param(json.dumps(_placement(pinned=[0, 1.5])), "pinned[0]", "got 1.5", id="pinned-float"),
    pytest.param(json.dumps(_placement(pinned=[10**20, 1])), "pinned[0]", "layer 100000000000000000000 out of range",
                 id="pinned-overflow"),
    pytest.param("[" * 100_000 + "]" * 100_000, "not JSON", "nested too deeply", id="deep-nesting"),
])
def test_a_bad_expert_id_is_a_one_line_error_naming_the_file_and_the_field(tmp_path, content, field, shown):
    path, res = _report(tmp_path, content)
    assert res.exit_code == 2, res.output
    assert isinstance(res.exception, SystemExit) and "Traceback" not in res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"moectl: error: --placement: {path}: "), res.stderr
    assert field in lines[0] and shown in lines[0]
