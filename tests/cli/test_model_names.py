"""Models by name: `--model sample` and `--model sample-dsv3` on every command, `moectl model
list`, and a name that is neither a path nor a model refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.engine import SAMPLE_MODELS, sample_model_dir

runner = CliRunner()


def test_model_list_names_every_shipped_model():
    res = runner.invoke(app, ["model", "list", "--json"])
    assert res.exit_code == 0, res.output
    rows = {row["name"]: row for row in json.loads(res.stdout)}
    assert set(rows) == set(SAMPLE_MODELS) and rows["sample"]["default"] and not rows["sample-dsv3"]["default"]
    assert rows["sample"]["architecture"] == "MixtralForCausalLM"
    assert rows["sample-dsv3"]["architecture"] == "DeepseekV3ForCausalLM"
    assert rows["sample-dsv3"]["bytes_on_disk"] <= 48_000_000
    text = runner.invoke(app, ["model", "list"]).stdout
    assert "sample (default)" in text and "sample-dsv3" in text


@pytest.mark.parametrize("name", list(SAMPLE_MODELS))
def test_model_info_and_plan_memory_take_a_name(name):
    res = runner.invoke(app, ["model", "info", "--model", name, "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["path"] == str(sample_model_dir(name).resolve())  # the path stays in the JSON
    res = runner.invoke(app, ["plan", "memory", "--model", name, "--context", "64", "--json"])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("args", [["model", "info"], ["generate", "x"], ["plan", "memory", "--context", "8"],
                                  ["verify"]])
def test_a_name_that_is_neither_path_nor_model_is_one_line(args):
    res = runner.invoke(app, [*args, "--model", "no-such-model"])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "sample, sample-dsv3" in lines[0] and "no-such-model" in lines[0]


def test_a_name_reaches_the_engine_process_as_a_name():
    """run forwards --model to its engine process: a name must not become a path there."""
    done = subprocess.run([sys.executable, "-m", "moectl.cli", "run", "--model", "sample-dsv3", "--check-only",
                           "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
