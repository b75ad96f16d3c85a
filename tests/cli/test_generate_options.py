"""`moectl generate`'s --prompt-ids: a value with an empty item is refused, not run as another prompt."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from moectl.cli.main import app
from tests.checkpoints import tiny_checkpoint

runner = CliRunner()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("generate_options"))


@pytest.mark.parametrize("spec, item", [("1,,2", 2), ("1,2,", 3), (",1", 1), ("1, ,2", 2), (",", 1)])
def test_prompt_ids_with_an_empty_item_exit_2_naming_the_option(ckpt, spec, item):
    res = runner.invoke(app, ["generate", "--model", str(ckpt), "--prompt-ids", spec, "--max-tokens", "1"])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moectl: error: --prompt-ids:")
    assert f"empty item {item}" in lines[0]


def test_prompt_ids_with_spaces_still_run(ckpt):
    res = runner.invoke(app, ["generate", "--model", str(ckpt), "--prompt-ids", "1, 2,3", "--max-tokens", "1",
                              "--json"])
    assert res.exit_code == 0, res.output
    assert '"prompt_ids": [1, 2, 3]' in res.stdout
