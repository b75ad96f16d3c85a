"""Options a command would silently ignore are refused (exit 2, one line naming them), and errors
name the flag that was typed rather than the engine's field."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from moectl.cli.main import app

runner = CliRunner()


def refused(*args) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moectl: error:"), result.stderr
    return lines[0]


@pytest.mark.parametrize("args, words", [
    (["bench", "--compare", "hf", "--suite", "kv-int8"], "--compare hf: is the compare-hf suite"),
    (["bench", "--suite", "kv-int8", "--devices", "4"], "--devices: not read by --suite kv-int8"),
    (["bench", "--suite", "profiler", "--rounds", "3"], "--rounds: not read by --suite profiler"),
    (["bench", "--suite", "limits", "--requests", "9"], "--requests: not read by --suite limits"),
    (["bench", "--suite", "serve", "--redundant", "1"], "--redundant: not read by --suite serve"),
    (["generate", "x", "--devices", "4", "--backend", "distributed", "--nproc", "2"], "--devices 4, --nproc 2"),
    (["record", "unused.trace", "--capture", "1000", "--steps", "5"], "--capture: 1000 steps is more than the 5"),
])
def test_an_option_the_command_would_ignore_is_refused(tmp_path, monkeypatch, args, words):
    monkeypatch.chdir(tmp_path)
    assert words in refused(*args)


@pytest.mark.parametrize("args, flag", [
    (["generate", "x", "--devices", "2", "--expert-cache", "0", "--max-tokens", "1"], "--expert-cache:"),
    (["generate", "x", "--devices", "2", "--redundant", "5000", "--max-tokens", "1"], "--redundant:"),
])
def test_errors_name_the_flag_not_the_engine_field(args, flag):
    line = refused(*args)
    assert line.startswith(f"moectl: error: {flag}"), line
    assert "expert_cache_slots" not in line and "redundant_slots" not in line


def test_flag_words_translates_only_a_leading_engine_field():
    from moectl.cli.common import flag_words

    assert flag_words("host_mem: too small") == "--host-mem: too small"
    assert flag_words("hbm: needs 3 MiB") == "--hbm: needs 3 MiB"
    assert flag_words("--hbm: already a flag") == "--hbm: already a flag"
    assert flag_words("the hbm: is fine here") == "the hbm: is fine here"
