"""--kv-retention and --kv-budget, engine options like the others (cli/engine_options.py): the
engine's initial knobs (engine_config), one-line bad input (exit 2) for what cannot run, the
engine process's JSON hand-off, and `generate` evicting on the sample model."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from moectl.cli.common import engine_config
from moectl.cli.engine_options import DEFAULT_OPTIONS, EngineOptions
from moectl.cli.engine_process import EngineHostConfig, EngineProcess, EngineStartFailed, config_from_flags
from moectl.cli.main import app
from moectl.console.engine_client import EngineSource
from moectl.engine import sample_model_dir
from moectl.engine.core.config import SchedulerKnobs
from tests.checkpoints import tiny_checkpoint

runner = CliRunner()
# a prompt of a few hundred tokens on the sample model's tokenizer: far past a 32-token budget
LONG_PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 20)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("kv_retention"))


@pytest.mark.parametrize("retention, budget, knobs", [
    ("full", None, SchedulerKnobs()),
    ("streaming", "32", SchedulerKnobs(kv_retention="streaming", kv_budget=32)),
    ("snapkv", "25%", SchedulerKnobs(kv_retention="snapkv", kv_budget_fraction=0.25)),
    ("h2o", "4_096", SchedulerKnobs(kv_retention="h2o", kv_budget=4096)),
])
def test_the_options_are_the_engines_initial_knobs(retention, budget, knobs):
    options = EngineOptions(model=sample_model_dir(), threads="1", kv_retention=retention, kv_budget=budget)
    assert engine_config(options).knobs == knobs


def test_the_options_survive_the_json_hand_off():
    options = EngineOptions(model=sample_model_dir(), kv_retention="h2o", kv_budget="25%",
                            given=frozenset({"kv_retention", "kv_budget"}))
    again = EngineOptions.from_dict(json.loads(json.dumps(options.to_dict())), "here")
    assert again == options and (again.kv_retention, again.kv_budget) == ("h2o", "25%")
    assert DEFAULT_OPTIONS.to_dict()["kv_retention"] == "full" and DEFAULT_OPTIONS.to_dict()["kv_budget"] is None
    config = config_from_flags(["--model", "sample", "--kv-retention", "snapkv", "--kv-budget", "4096"])
    assert (config.options.kv_retention, config.options.kv_budget) == ("snapkv", "4096")
    assert config.options.given == {"model", "kv_retention", "kv_budget"}
    assert config.options.given_flags() == ["--model", "--kv-retention", "--kv-budget"]


@pytest.mark.parametrize("values, words", [
    ({"kv_budget": 32}, "here: kv_budget: must be str or null, got 32"),
    ({"kv_retention": None}, "here: kv_retention: must be str, got None"),
])
def test_a_malformed_hand_off_is_one_line(values, words):
    with pytest.raises(ValueError) as error:
        EngineOptions.from_dict(values, "here")
    assert str(error.value).startswith(words)


BAD = [
    (["generate", "x", "--kv-retention", "bogus"],
     "--kv-retention: must be one of full, streaming, snapkv, h2o, got 'bogus'"),
    (["generate", "x", "--kv-retention", "streaming"],
     "--kv-retention streaming: needs --kv-budget (N tokens or P% of the context)"),
    (["generate", "x", "--kv-budget", "25%"],
     "--kv-budget: only with --kv-retention streaming, snapkv or h2o (full keeps every token)"),
    (["generate", "x", "--kv-retention", "h2o", "--kv-budget", "0"],
     "--kv-budget: '0' is not a token count (e.g. 4096) or a percentage of the context (e.g. 25%)"),
    (["generate", "x", "--kv-retention", "snapkv", "--kv-budget", "150%"],
     "--kv-budget: '150%' is not a token count (e.g. 4096) or a percentage of the context (e.g. 25%)"),
    (["generate", "x", "--kv-retention", "snapkv", "--kv-budget", "lots"],
     "--kv-budget: 'lots' is not a token count"),
    (["generate", "x", "--kv-retention", "streaming", "--kv-budget", str(1 << 41)],
     "--kv-budget: must be an integer in [0, 1099511627776]"),
    (["serve", "--kv-retention", "streaming"], "--kv-retention streaming: needs --kv-budget"),
    (["record", "t.trace", "--steps", "1", "--backend", "simulated", "--kv-retention", "streaming",
      "--kv-budget", "32"], "--kv-retention: not on the simulated backend (it keeps every token's KV; "
                            "`moectl plan memory --kv-budget` prices a budget)"),
    (["run", "--backend", "simulated", "--kv-budget", "32"], "--kv-budget: not on the simulated backend"),
    (["generate", "x", "--engine", "/nonexistent", "--kv-retention", "h2o"],
     "--kv-retention: configures an engine; --engine sends to one already running"),
    (["run", "--engine", "/nonexistent", "--kv-budget", "32"], "--kv-budget: an option of the engine; --engine"),
    (["bench", "--suite", "kv-int8", "--kv-budget", "32"], "--kv-budget: not read by --suite kv-int8"),
]


@pytest.mark.parametrize("args, words", BAD, ids=[" ".join(a)[:60] for a, _ in BAD])
def test_bad_retention_input_is_one_line_and_exit_2(tmp_path, monkeypatch, args, words):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moectl: error: " + words), result.stderr
    assert "Traceback" not in result.output


def test_generate_evicts_on_the_sample_model(monkeypatch):
    """`moectl generate --kv-retention streaming --kv-budget 32` on a prompt of hundreds of tokens:
    the engine it starts runs with those knobs, evicts, and the sequence ends holding at most 32
    tokens' worth of whole blocks beyond the block being written."""
    from moectl.engine.parallel import backends

    engines = []

    class Watched(backends.LLMEngine):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(backends, "LLMEngine", Watched)
    result = runner.invoke(app, ["generate", LONG_PROMPT, "--max-tokens", "8", "--threads", "1", "--ignore-eos",
                                 "--kv-retention", "streaming", "--kv-budget", "32", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(out["prompt_ids"]) > 200 and len(out["token_ids"]) == 8
    (engine,) = engines
    assert engine.scheduler.knobs == SchedulerKnobs(kv_retention="streaming", kv_budget=32)
    context = len(out["prompt_ids"]) + 8
    evicted = sum(engine.blocks.evicted_tokens)
    bs = engine.config.block_size
    assert evicted % bs == 0 and context - 32 - bs < evicted <= context - 32 + bs


def test_the_engine_process_runs_with_them(ckpt):
    """run's engine process (engine-host) gets them in its JSON config, checks them as engine_config
    does (exit 2 through the ready line) and runs with them: its step records carry the knobs and
    the evictions."""
    with pytest.raises(EngineStartFailed, match=r"--kv-retention streaming: needs --kv-budget") as failed:
        engine = EngineProcess(config_from_flags(["--model", str(ckpt), "--threads", "1",
                                                  "--kv-retention", "streaming"]))
        try:
            engine.wait_ready(timeout_s=120)
        finally:
            engine.stop()
    assert failed.value.code == 2

    flags = ["--model", str(ckpt), "--devices", "2", "--threads", "1", "--workload", "rate=40,prompt=64-96,output=8-16",
             "--kv-retention", "streaming", "--kv-budget", "16"]
    config = config_from_flags(flags)
    assert isinstance(config, EngineHostConfig) and config.options.kv_budget == "16"
    engine = EngineProcess(config)
    try:
        engine.wait_ready(timeout_s=120)
        source = EngineSource(engine.dir, owner=True)
        try:
            seen = None
            deadline = time.monotonic() + 60
            while seen is None and time.monotonic() < deadline:
                for record in source.poll()[0]:
                    kv = record["cache"].get("kv_retention")
                    if kv and sum(kv["evicted_tokens"]) > 0:
                        seen = record
                time.sleep(0.05)
            assert seen is not None, "no step record showed an eviction"
            assert seen["knobs"]["kv_retention"] == "streaming" and seen["knobs"]["kv_budget"] == 16
            kv = seen["cache"]["kv_retention"]
            assert (kv["policy"], kv["budget_tokens"], len(kv["held_tokens"])) == ("streaming", 16, 2)
        finally:
            source.close()
    finally:
        engine.stop()
