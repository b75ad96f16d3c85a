"""Bad input the red team found: every case exits 2 with one line naming the option, writes
nothing it should not, and never overwrites or deletes what the user had."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest

from moectl.cli.common import MAX_THREADS
from moectl.engine import sample_model_dir
from moectl.engine.llm_engine import EngineConfig, LLMEngine
from moectl.engine.tools.bench import MAX_BENCH_REQUESTS
from moectl.engine.tools.workload import WorkloadSpec, make_workload, run_workload
from moectl.profiler.trace_store import TraceReader
from moectl.wire.records import StepStats
from tests.checkpoints import tiny_checkpoint
from tests.cli.test_cli import run

SMALL = "rate=inf,requests=2,prompt=4-8,output=4-8"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("bad-input"))


@pytest.fixture(scope="module")
def trace(ckpt, tmp_path_factory):
    """A small trace, recorded right after a refused run at the same path (which must leave
    nothing behind, or this run would be refused with 'exists')."""
    path = tmp_path_factory.mktemp("trace") / "t.trace"
    refused = run("record", path, "--steps", 4, "--model", ckpt, "--devices", 2, "--workload", SMALL, "--capture", -1)
    assert refused.exit_code == 2 and "--capture" in refused.stderr
    assert not path.exists()
    res = run("record", path, "--steps", 4, "--model", ckpt, "--devices", 2, "--workload", SMALL)
    assert res.exit_code == 0, res.output
    return path


def one_line_error(res, needle: str) -> None:
    assert res.exit_code == 2, res.output
    assert needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert res.stderr.startswith("moectl: error:")


# -- 1. run_workload keeps running sums, not every step's record

def test_run_workload_holds_no_step_records_beyond_the_engines_window(ckpt):
    engine = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32"))
    engine.step_log = deque(maxlen=4)  # the engine's own window, so only run_workload could hold more
    spec = WorkloadSpec(num_requests=2, prompt_len=8, output_len=40, source="random")
    items = make_workload(spec, vocab_size=engine.model_config.vocab_size)
    alive: list[int] = []
    gc.collect()  # records other tests' engines left behind count as the baseline, not as this run's
    baseline = sum(type(o) is StepStats for o in gc.get_objects())

    def count_step_records(_outs) -> None:
        if engine.step_count % 8 == 0:
            alive.append(sum(type(o) is StepStats for o in gc.get_objects()) - baseline)

    start = engine.step_count
    res = run_workload(engine, items, realtime=False, on_step=count_step_records)
    ran = engine.step_count - start
    assert ran >= 32 and res.summary["steps"] == ran  # the summary still counts every step
    assert res.summary["mean_decode_batch_size"] > 0 and res.summary["completed"] == 2
    assert max(alive) <= engine.step_log.maxlen + 2  # independent of the run's length


# -- 2. bench options without bounds

@pytest.mark.parametrize("args, needle", [
    (("bench", "--requests", 100_000_000), "--requests"),
    (("bench", "--suite", "serve", "--requests", MAX_BENCH_REQUESTS + 1), "--requests"),
    (("bench", "--suite", "serve", "--workload", "requests=100000000"), "--workload"),
    (("bench", "--suite", "serve", "--workload", "requests=100000000,rate=1000,duration=100000"), "--workload"),
    (("bench", "--suite", "limits", "--threads", 100_000), "--threads"),
    (("bench", "--suite", "limits", "--threads", MAX_THREADS + 1), "--threads"),
    (("bench", "--suite", "limits", "--nproc", 0), "--nproc"),
    (("bench", "--suite", "limits", "--seed", 10**30), "--seed"),
])
def test_bench_refuses_unbounded_options(args, needle):
    one_line_error(run(*args), needle)


# -- 3 and 8. trace export and report

def test_export_never_writes_over_its_input(trace, tmp_path):
    before = trace.read_bytes()
    one_line_error(run("trace", "export", trace, "-o", trace), "--output")
    link = tmp_path / "same.trace"
    link.symlink_to(trace)
    one_line_error(run("trace", "export", trace, "-o", link), "--output")
    assert trace.read_bytes() == before
    with TraceReader(trace) as reader:
        assert reader.num_steps == 4


def test_export_output_must_be_a_file_in_an_existing_folder(trace, tmp_path):
    one_line_error(run("trace", "export", trace, "-o", tmp_path / "missing" / "x.json"), "--output")
    one_line_error(run("trace", "export", trace, "-o", tmp_path), "--output")
    ok = run("trace", "export", trace, "-o", tmp_path / "x.json", "--json")
    assert ok.exit_code == 0 and json.loads(ok.stdout)["steps"] == 4


@pytest.mark.parametrize("command", ["export", "report"])
@pytest.mark.parametrize("option", ["--from-step", "--to-step"])
def test_step_range_beyond_int64_is_bad_input(trace, tmp_path, command, option):
    extra = ("-o", tmp_path / "x.json") if command == "export" else ()
    one_line_error(run("trace", command, trace, option, 10**23, *extra), option)


# -- 4. model train

def test_train_refuses_runs_that_would_train_nothing(tmp_path):
    out = tmp_path / "m"
    one_line_error(run("model", "train", "--out", out, "--steps", -1), "--steps")
    one_line_error(run("model", "train", "--out", out, "--time-budget", -1), "--time-budget")
    one_line_error(run("model", "train", "--out", out, "--time-budget", "inf"), "--time-budget")
    one_line_error(run("model", "train", "--out", out, "--seed", 10**30), "--seed")
    assert not out.exists()


def test_train_never_overwrites_the_shipped_model_or_a_file_by_default(tmp_path):
    shipped = sample_model_dir()
    stamps = {p.name: p.stat().st_mtime_ns for p in shipped.iterdir()}
    res = run("model", "train", "--out", shipped, "--steps", 1)
    one_line_error(res, "--replace-sample-model")
    assert {p.name: p.stat().st_mtime_ns for p in shipped.iterdir()} == stamps
    assert "--replace-sample-model" in run("model", "train", "--help").stdout
    afile = tmp_path / "file"
    afile.write_text("mine")
    one_line_error(run("model", "train", "--out", afile, "--steps", 1), "--out")
    assert afile.read_text() == "mine"


# -- 5. record and the KV pool / context

@pytest.mark.parametrize("workload, needle", [
    ("rate=inf,requests=32,prompt=150-300,output=60-120", "KV blocks"),  # 16 blocks of 16 tokens per device
    ("rate=inf,requests=32,prompt=100000-200000,output=4", "context"),
])
def test_record_refuses_requests_that_can_never_run(ckpt, tmp_path, workload, needle):
    path = tmp_path / "t.trace"
    res = run("record", path, "--steps", 10, "--model", ckpt, "--devices", 4, "--kv-blocks", 64,
              "--workload", workload)
    one_line_error(res, needle)
    assert "--workload" in res.stderr and not path.exists()


# -- 6. record's own options

def test_record_validates_before_writing_and_keeps_the_users_file(ckpt, tmp_path):
    mine = tmp_path / "mine.trace"
    mine.write_bytes(b"the user's file")
    for args, needle in ((("--capture", -1), "--capture"), (("--rebalance-at", -1), "--rebalance-at"),
                         (("--rebalance-at", 11), "--rebalance-at"), (("--kv-blocks", 0), "--kv-blocks")):
        one_line_error(run("record", mine, "--steps", 10, "--model", ckpt, "--overwrite", *args), needle)
        assert mine.read_bytes() == b"the user's file"


def test_record_onto_a_directory_is_bad_input(ckpt, tmp_path):
    one_line_error(run("record", tmp_path, "--steps", 1, "--model", ckpt, "--overwrite"), "directory")
    one_line_error(run("record", tmp_path / "no" / "t.trace", "--steps", 1, "--model", ckpt), "directory")
    assert list(tmp_path.iterdir()) == []


# -- 7. generate

def test_generate_prompt_that_is_not_text_is_bad_input(ckpt):
    one_line_error(run("generate", "\ud800", "--model", ckpt), "PROMPT")
    # as a shell passes undecodable bytes: Python's argv holds them as surrogate escapes
    proc = subprocess.run([sys.executable, "-m", "moectl.cli", "generate", b"ok \xed\xa0\x80", "--model", str(ckpt)],
                          capture_output=True, timeout=120)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "PROMPT" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("device", ["tpu:0", "cuda:4096", "nonsense"])
def test_generate_unknown_device_is_bad_input(ckpt, device):
    one_line_error(run("generate", "x", "--model", ckpt, "--device", device), "--device")


# -- 9. sizes, --nproc and --seed

@pytest.mark.parametrize("hbm", ["1e99TiB", "1e999GiB", "2PiB"])
def test_absurd_sizes_are_bad_input(ckpt, hbm):
    one_line_error(run("generate", "x", "--model", ckpt, "--devices", 2, "--hbm", hbm), "--hbm")
    one_line_error(run("generate", "x", "--model", ckpt, "--devices", 2, "--host-mem", hbm), "--host-mem")


@pytest.mark.parametrize("args", [("generate", "x"), ("record", "t.trace", "--steps", 1), ("run",), ("serve",)])
def test_nproc_zero_is_bad_input(ckpt, args):
    one_line_error(run(*args, "--model", ckpt, "--backend", "distributed", "--nproc", 0), "--nproc")


def test_huge_seed_names_the_option(ckpt):
    one_line_error(run("generate", "x", "--model", ckpt, "--seed", 10**30), "--seed")
    one_line_error(run("generate", "x", "--model", ckpt, "--seed", -1), "--seed")


def test_workload_file_prompt_that_is_not_text_is_bad_input(ckpt, tmp_path):
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"prompt": "def f("}\n{"prompt": "\\ud800"}\n')
    res = run("record", tmp_path / "t.trace", "--steps", 2, "--model", ckpt, "--devices", 2, "--workload", workload)
    one_line_error(res, "w.jsonl:2")
    assert not (tmp_path / "t.trace").exists()


@pytest.mark.parametrize("command", [["trace", "info"], ["trace", "report"], ["replay"]])
def test_a_directory_given_as_a_trace_is_named(tmp_path, command):
    result = run(*command, tmp_path)
    assert result.exit_code == 2
    assert result.stderr.strip().endswith(f"{tmp_path}: is a directory, not a trace")


def test_plan_memory_refuses_absurd_sizes():
    config = Path(__file__).resolve().parents[2] / "docs" / "configs" / "k3-3t-1m.json"
    res = run("plan", "memory", "--model", config, "--devices", 8, "--context", 4096,
              "--hbm", "1e99TiB")
    assert res.exit_code == 2 and "--hbm" in res.stderr and "1 PiB" in res.stderr
