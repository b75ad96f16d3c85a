"""`model make-tiny`'s defaults fit the --like config (16 experts and 4 layers, or the config's when
it has fewer): Mixtral-8x7B's 8 experts once failed with "--experts: must be in 2..8, got 16"
though no --experts was given. The options given are checked first, each error naming the value
given: that error once hid a --layers 0."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moectl.cli.main import app
from tests.paths import DOCS

MIXTRAL = DOCS / "configs" / "mixtral-8x7b.json"  # 32 layers, 8 experts
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_the_defaults_fit_a_config_with_fewer_experts(tmp_path):
    res = run("model", "make-tiny", "--like", MIXTRAL, "--out", tmp_path / "tiny", "--json")
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert (info["experts"], info["layers"]) == (8, 4)


def test_the_defaults_fit_a_config_with_fewer_layers(tmp_path):
    like = json.loads(MIXTRAL.read_text())
    like["num_hidden_layers"] = 2
    (tmp_path / "like.json").write_text(json.dumps(like))
    res = run("model", "make-tiny", "--like", tmp_path / "like.json", "--out", tmp_path / "tiny", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["layers"] == 2


@pytest.mark.parametrize("args, message", [
    (["--layers", "0"], "--layers: must be at least 1, got 0"),
    (["--layers", "0", "--experts", "16"], "--layers: must be at least 1, got 0"),
    (["--experts", "16", "--layers", "0"], "--layers: must be at least 1, got 0"),
    (["--experts", "16"], "--experts: must be in 2..8 (the config's routed experts), got 16"),
    (["--layers", "40"], "--layers: must be in 1..32 (the config's layers), got 40"),
    (["--experts", "1"], "--experts: must be at least 2, got 1"),
])
def test_an_option_given_is_checked_first_and_named_as_given(tmp_path, args, message):
    res = run("model", "make-tiny", "--like", MIXTRAL, "--out", tmp_path / "tiny", *args)
    assert res.exit_code == 2, res.output
    assert res.stderr == f"moectl: error: {message}\n"
    assert not (tmp_path / "tiny").exists()
