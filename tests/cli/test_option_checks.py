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
    # --nproc replaced a --devices that was typed, on every command that takes both
    (["record", "unused.trace", "--backend", "distributed", "--devices", "4", "--nproc", "2", "--steps", "2"],
     "--devices 4, --nproc 2"),
    (["run", "--backend", "distributed", "--devices", "3", "--nproc", "2", "--check-only"], "--devices 3, --nproc 2"),
    (["serve", "--backend", "distributed", "--devices", "3", "--nproc", "2", "--port", "8000"], "--devices 3, --nproc 2"),
    (["bench", "--suite", "rebalance", "--backend", "distributed", "--devices", "4", "--nproc", "2"],
     "--devices 4, --nproc 2"),
])
def test_an_option_the_command_would_ignore_is_refused(tmp_path, monkeypatch, args, words):
    monkeypatch.chdir(tmp_path)
    assert words in refused(*args)


@pytest.mark.parametrize("args, flag", [
    (["generate", "x", "--devices", "2", "--expert-cache", "0", "--max-tokens", "1"], "--expert-cache:"),
    (["generate", "x", "--devices", "2", "--redundant", "5000", "--max-tokens", "1"], "--redundant:"),
    # the device count: it said "devices:" for --nproc, and "nproc:" for --devices
    (["generate", "x", "--backend", "distributed", "--nproc", "300"], "--nproc: must be in 1-256, got 300"),
    (["generate", "x", "--devices", "300"], "--devices: must be in 1-256, got 300"),
    (["generate", "x", "--backend", "distributed", "--nproc", "17"], "--nproc: 17 ranks exceed the model's 16"),
    (["record", "unused.trace", "--backend", "distributed", "--devices", "17", "--steps", "2"], "--devices: 17 ranks exceed"),
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


def test_out_of_range_loads_and_placements_are_bad_input_not_python_errors(tmp_path):
    """A loads file of 1e308 values (IndexError in the planner) and a placement of 1e12 experts
    (MemoryError) once exited 1 with a Python error."""
    import json

    loads = tmp_path / "loads.json"
    loads.write_text(json.dumps([[1e308] * 8] * 2))
    line = refused("plan", "rebalance", loads, "--devices", "2")
    assert "loads file loads.json: a load of 1e+308" in line
    plan = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", "rebalance", "--synthetic", "--layers", "4", "--experts", "16",
                                 "--devices", "4", "--json"])
    assert result.exit_code == 0, result.output
    placement = json.loads(result.stdout)
    placement["placement"]["num_experts"] = 10**12
    plan.write_text(json.dumps(placement))
    line = refused("generate", "x", "--devices", "4", "--placement", plan, "--max-tokens", "1")
    assert "num_experts must be an integer in 1-4096" in line and str(plan) in line


def _options_by_flag(command, path=()) -> dict[str, list[tuple[str, object]]]:
    """Every option of every (sub)command, by long flag: [(command path, click parameter)]."""
    found: dict[str, list] = {}
    if hasattr(command, "commands"):  # a group (typer may vendor its own click)
        for name, sub in command.commands.items():
            for flag, params in _options_by_flag(sub, (*path, name)).items():
                found.setdefault(flag, []).extend(params)
        return found
    for param in command.params:
        for flag in param.opts:
            if flag.startswith("--"):
                found.setdefault(flag, []).append((" ".join(path), param))
    return found


@pytest.mark.parametrize("flag, least", [("--devices", 8), ("--redundant", 7)])
def test_each_device_option_is_declared_once_with_one_default(flag, least):
    """--devices and --redundant mean the same on every command: one declaration (help, default)."""
    import typer

    params = _options_by_flag(typer.main.get_command(app))[flag]
    assert len(params) >= least, [p for p, _ in params]  # run, serve, record, web, generate, bench, plan, sim
    declared = {(p.help, p.default, p.show_default) for _, p in params}
    assert len(declared) == 1, {path: (p.help, p.default) for path, p in params}


def test_the_default_device_count_is_the_same_everywhere(tmp_path):
    """plan memory (no engine) and run (an engine) take the same default: the one cli/common.py gives."""
    import json

    from moectl.cli.common import DEFAULT_DEVICES
    from moectl.engine import sample_model_dir

    res = runner.invoke(app, ["plan", "memory", "--model", str(sample_model_dir()), "--context", "64", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["deployment"]["devices"] == DEFAULT_DEVICES
