"""The engine options are declared once (cli/engine_options.py): every command that starts an
engine takes them with the same flags, help and defaults, and the engine process of `run` and
`web` gets them as a JSON config in its private directory, not as flags parsed again."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from moectl.cli.common import engine_config
from moectl.cli.engine_options import ALL_OPTIONS, DEFAULT_OPTIONS, DEFAULT_REDUNDANT, EngineOptions, flag
from moectl.cli.engine_process import CONFIG_NAME, EngineHostConfig, EngineProcess, EngineStartFailed, config_from_flags
from moectl.cli.main import app
from tests.paths import REPO

# the commands that start an engine (engine-host is run's and web's engine process: no flags of its own)
ENGINE_COMMANDS = ("run", "web", "serve", "record", "generate", "bench")


def _commands():
    group = typer.main.get_command(app)
    return {name: group.commands[name] for name in (*ENGINE_COMMANDS, "engine-host")}


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_every_engine_command_takes_the_engine_options_as_declared_once(command):
    """Each option of EngineOptions a command takes has the one flag, help and default the field
    declares; and the options each takes are EngineOptions' fields, not copies of them."""
    declared = {f.name: f for f in fields(EngineOptions) if "typer" in f.metadata}
    params = {p.name: p for p in _commands()[command].params if p.name in declared}
    assert {"model", "devices", "redundant", "backend", "nproc", "dtype", "threads"} <= set(params)
    for name, param in params.items():
        info = declared[name].metadata["typer"]
        assert (param.default, param.help, max(param.opts, key=len)) == (declared[name].default, info.help,
                                                                         flag(name)), (command, name)


def test_each_engine_option_has_one_default_across_commands():
    defaults: dict[str, set] = {}
    for command in ENGINE_COMMANDS:
        for param in _commands()[command].params:
            if param.name in ALL_OPTIONS:
                defaults.setdefault(param.name, set()).add(repr(param.default))
    assert {name: len(values) for name, values in defaults.items()} == dict.fromkeys(defaults, 1), defaults


def test_redundant_means_one_spare_slot_per_device_on_every_command(tmp_path):
    """--redundant left out: DEFAULT_REDUNDANT, whatever the command."""
    from moectl.engine import sample_model_dir

    assert {repr(p.default) for c in ENGINE_COMMANDS for p in _commands()[c].params if p.name == "redundant"} \
        == {"None"}
    config = engine_config(EngineOptions(model=sample_model_dir(), threads="1"))
    assert config.redundant_slots == DEFAULT_REDUNDANT == 1


def test_the_engine_process_takes_no_engine_flags():
    params = [p.name for p in _commands()["engine-host"].params]
    assert params == ["engine_dir"]


def test_the_engine_process_gets_its_options_as_a_private_json_file(tmp_path):
    """run's engine: argv is `engine-host --engine-dir DIR`; the options are DIR's config (mode
    0600), read back equal, and the engine checks them (an HBM of 0 is its one-line error)."""
    options = EngineOptions(model=tmp_path, devices=2, hbm="0", threads="1", given=frozenset({"devices", "hbm"}))
    engine = EngineProcess(EngineHostConfig(options, workload="rate=4,prompt=8-16,output=8-16", inject_fault=7))
    try:
        assert engine.proc.args[-3:] == ["engine-host", "--engine-dir", str(engine.dir)]
        assert not any(arg in engine.proc.args for arg in ("--devices", "--hbm", "--model", "--workload"))
        path = engine.dir / CONFIG_NAME
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        read = EngineHostConfig.read(engine.dir)
        assert read == EngineHostConfig(options, "rate=4,prompt=8-16,output=8-16", 7)
        assert read.options.given == {"devices", "hbm"} and read.options.model == tmp_path.resolve()
        with pytest.raises(EngineStartFailed, match="--hbm") as failed:
            engine.wait_ready(timeout_s=120)
        assert failed.value.code == 2
    finally:
        engine.stop()


def test_options_round_trip_through_json():
    options = EngineOptions(model=Path("sample-dsv3"), devices=8, redundant=0, backend="simulated", drift=0.5,
                            tp=2, sim_seed=3, given=frozenset({"backend", "tp"}))
    again = EngineOptions.from_dict(json.loads(json.dumps(options.to_dict())), "here")
    assert again == options
    assert EngineOptions.from_dict({}, "here") == DEFAULT_OPTIONS


@pytest.mark.parametrize("values, words", [
    ({"devices": "4"}, "here: devices: must be int or null, got '4'"),
    ({"devices": True}, "here: devices: must be int or null, got True"),
    ({"drift": "x"}, "here: drift: must be float, got 'x'"),
    ({"gpus": 2}, "here: unknown engine option 'gpus'"),
    ({"given": ["devices", "gpus"]}, "here: given: must be a list of engine option names"),
    ({"given": [[1]]}, "here: given: must be a list of engine option names"),
    ([], "here: the engine options are not a JSON object"),
])
def test_a_malformed_options_object_is_one_line_naming_the_field(values, words):
    with pytest.raises(ValueError) as error:
        EngineOptions.from_dict(values, "here")
    assert str(error.value) == words


def test_a_damaged_engine_config_is_bad_input_naming_the_file(tmp_path):
    """engine-host reads its config before anything loads: a broken one is exit 2, one line."""
    (tmp_path / CONFIG_NAME).write_text('{"options": {"devices": "4"}, "workload": null, "inject_fault": null}')
    result = subprocess.run([sys.executable, "-m", "moectl.cli", "engine-host", "--engine-dir", str(tmp_path)],
                            capture_output=True, text=True, cwd=REPO, timeout=120,
                            env={k: v for k, v in os.environ.items() if k != "MOECTL_PARENT_PID"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (f"moectl: error: {tmp_path / CONFIG_NAME}: devices: must be int or null, "
                                     "got '4'")


def test_flags_become_the_same_config_with_what_was_given():
    """Tests and benchmarks start engines from run's flags: parsed here, by the one declaration."""
    config = config_from_flags(["--model", "sample", "--devices", "2", "--tp", "2", "--inject-fault", "3"])
    assert config.options == EngineOptions(model=Path("sample"), devices=2, tp=2,
                                           given=frozenset({"model", "devices", "tp"}))
    assert (config.workload, config.inject_fault) == (None, 3)
    with pytest.raises(ValueError, match="--devices"):
        config_from_flags(["--devices", "two"])


@pytest.mark.parametrize("args, words", [
    (["run", "--engine", "/nonexistent", "--redundant", "0"], "--redundant: an option of the engine; --engine"),
    (["run", "--engine", "/nonexistent", "--workload", "rate=1"], "--workload: an option of the engine; --engine"),
    (["record", "t.trace", "--steps", "1", "--tp", "2"], "--tp: only with --backend simulated"),
    (["record", "t.trace", "--steps", "1", "--backend", "simulated", "--hbm", "1GiB"],
     "--hbm: not on the simulated backend"),
    (["generate", "x", "--engine", "/nonexistent", "--threads", "2"], "--threads: configures an engine; --engine"),
    (["web", "--replay", "t.trace", "--devices", "2"], "--devices: an option of the live console, not for --replay"),
    (["bench", "--suite", "kv-int8", "--tp", "2"], "--tp: not read by --suite kv-int8"),
    (["record", "t.trace", "--steps", "1", "--overlap", "two-batch"],
     "--overlap: only with --backend simulated or distributed"),
    (["record", "t.trace", "--steps", "1", "--backend", "distributed", "--overlap", "five-stage"],
     "--overlap: the distributed backend runs none or two-batch, got 'five-stage' (five-stage is simulated only)"),
    (["bench", "--suite", "profiler", "--backend", "distributed", "--overlap", "two-batch"],
     "--overlap: not read by --suite profiler (only by rebalance)"),
])
def test_options_given_on_the_command_line_are_still_told_from_defaults(tmp_path, monkeypatch, args, words):
    """EngineOptions.given keeps what `given(ctx, name)` told: an option a backend or mode ignores
    is refused when typed, never when left at its default."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert words in result.stderr.strip(), result.stderr
