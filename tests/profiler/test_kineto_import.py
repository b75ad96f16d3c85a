"""`moectl trace import` of PyTorch-profiler (Kineto) traces (profiler/kineto_import.py): a GPU
timeline that `trace report` reads to the same figures as the source, `trace info` describes,
and the commands that need engine steps refuse in one line; a rank split over many records;
Chrome's array form; a CPU trace recorded here; bad input as one line and exit 2."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.profiler import kineto_import
from tests.kineto_traces import kernel, two_rank_folder, write_rank

runner = CliRunner()
FIGURES = ("breakdown", "idle_s", "overlap", "straggler", "layers", "unclassed")


def invoke(*args, code=0):
    out = runner.invoke(app, [*map(str, args)])
    assert out.exit_code == code, out.output
    return out


def report(path, *args):
    return json.loads(invoke("trace", "report", path, *args, "--json").stdout)


def test_an_imported_folder_reports_as_its_source_does(tmp_path):
    folder = two_rank_folder(tmp_path / "profile")
    out = invoke("trace", "import", folder, "-o", tmp_path / "gpu.trace")
    assert "a GPU timeline of 2 rank(s), 18 device events, 4 lanes" in out.output
    source, imported = report(folder), report(tmp_path / "gpu.trace")
    assert {k: imported[k] for k in FIGURES} == {k: source[k] for k in FIGURES}
    # worked by hand (tests/kineto_traces.py): rank 1's experts take 60 us, rank 0's 40
    assert imported["breakdown"] == pytest.approx({"attention": 120e-6, "expert_gemm": 300e-6,
                                                   "dispatch_combine": 180e-6})
    assert imported["overlap"]["fraction"] == pytest.approx(80 / 180)  # each rank: 40 of its 90 us hidden
    assert imported["straggler"]["rank"] == 1 and imported["straggler"]["behind_median_s"] == pytest.approx(30e-6)
    assert imported["layers"]["by_layer"]["2"] == pytest.approx({"attention": 40e-6, "expert_gemm": 100e-6,
                                                                 "dispatch_combine": 60e-6})
    info = json.loads(invoke("trace", "info", tmp_path / "gpu.trace", "--json").stdout)
    ranks = info["gpu_timeline"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["lanes"] == ["0/stream 7", "0/stream 20"]
    assert len(info["gpu_timeline"]["files"][0]["sha256"]) == 64 and "routing and expert load" in \
        info["gpu_timeline"]["absent"]
    human = invoke("trace", "info", tmp_path / "gpu.trace").output
    assert "a GPU timeline imported from 2 PyTorch-profiler trace file(s): 2 rank(s), 4 lanes" in human


def test_commands_that_need_engine_steps_refuse_a_gpu_timeline(tmp_path):
    invoke("trace", "import", two_rank_folder(tmp_path / "p"), "-o", tmp_path / "gpu.trace")
    for args in (("trace", "export", tmp_path / "gpu.trace", "-o", tmp_path / "x.json"),
                 ("trace", "diff", tmp_path / "gpu.trace", tmp_path / "gpu.trace"),
                 ("trace", "report", tmp_path / "gpu.trace", "--from-step", "1"),
                 ("plan", "rebalance", tmp_path / "gpu.trace"),
                 ("sim", "--model", "sample-dsv3", "--hardware", "h100", "--routing", tmp_path / "gpu.trace")):
        out = invoke(*args, code=2)
        assert len(out.output.strip().splitlines()) == 1, out.output
        assert "GPU timeline" in out.output or "Kineto" in out.output, out.output
    assert not (tmp_path / "x.json").exists()


def test_a_rank_over_many_records_and_reclassed_on_report(tmp_path, monkeypatch):
    monkeypatch.setattr(kineto_import, "CHUNK_EVENTS", 4)  # 9 kernels per rank: 3 records each
    folder = two_rank_folder(tmp_path / "p")
    result = json.loads(invoke("trace", "import", folder, "-o", tmp_path / "gpu.trace", "--json").stdout)
    assert result["records"] == 6 and result["events"] == 18
    assert report(tmp_path / "gpu.trace")["breakdown"] == pytest.approx(report(folder)["breakdown"])
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"rules": [{"class": "attention_prefill", "pattern": "splitkv"}]}))
    reclassed = report(tmp_path / "gpu.trace", "--rules", rules)
    assert reclassed["breakdown"]["attention_prefill"] == pytest.approx(120e-6) and \
        "attention" not in reclassed["breakdown"]


def test_chrome_array_form_and_a_cpu_trace_recorded_here(tmp_path):
    events = [kernel("fused_moe_kernel", 0, 10), kernel("ncclDevKernel_AllReduce", 5, 10, stream=20)]
    (tmp_path / "array.json").write_text(json.dumps(events))
    invoke("trace", "import", tmp_path / "array.json", "-o", tmp_path / "a.trace")
    assert report(tmp_path / "a.trace")["overlap"]["fraction"] == pytest.approx(0.5)

    x = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            (x @ x).softmax(-1).topk(2)
    prof.export_chrome_trace(str(tmp_path / "cpu.json"))
    out = invoke("trace", "import", tmp_path / "cpu.json", "-o", tmp_path / "cpu.trace")
    assert "CPU ops (no device events: a CPU run)" in out.output
    assert report(tmp_path / "cpu.trace")["breakdown"]["dense_gemm"] > 0


def test_files_without_a_rank_take_the_numbers_no_file_says(tmp_path):
    for name, rank in (("a.json", None), ("b.json", None), ("worker-TP-0.json", None), ("c.json", 1)):
        write_rank(tmp_path / name, rank, [kernel("k", 0, 1)], gz=False, with_rank=rank is not None)
    paths = [tmp_path / n for n in ("a.json", "b.json", "worker-TP-0.json", "c.json")]
    result = json.loads(invoke("trace", "import", *paths, "-o", tmp_path / "out.trace", "--json").stdout)
    assert result["ranks"] == [2, 3, 0, 1]


def test_bad_kineto_imports_are_one_line(tmp_path):
    folder = tmp_path / "p"
    folder.mkdir()
    write_rank(folder / "a.json", 0, [kernel("k", 0, 1)], gz=False)
    write_rank(folder / "b.json", 0, [kernel("k", 0, 1)], gz=False)  # the same rank again
    (tmp_path / "bad.json").write_bytes(b'{"traceEvents": [{"ph": "X", "cat": "kernel", ')
    cases = [((folder,), "same rank"),
             ((tmp_path / "bad.json",), "not valid trace JSON"),
             ((folder / "a.json", "--ep-size", "2"), "--ep-size"),
             ((tmp_path / "bad.json", "--format", "kineto", "--rules", tmp_path / "none.json"), "--rules")]
    for args, message in cases:
        out = invoke("trace", "import", *args, "-o", tmp_path / "out.trace", code=2)
        assert message in out.output and len(out.output.strip().splitlines()) == 1, out.output
        assert not (tmp_path / "out.trace").exists()


def test_replay_of_a_bad_kineto_source_is_one_line(tmp_path):
    (tmp_path / "bad.json").write_bytes(b'{"traceEvents": [{"ph": "M", "name": "x"}]}')
    out = invoke("replay", tmp_path / "bad.json", code=2)
    assert "no complete events" in out.output and len(out.output.strip().splitlines()) == 1
    rules = tmp_path / "rules.json"
    rules.write_text('{"rules": [], "layer_patterns": ["layer\\\\d+"]}')  # no group for the layer's index
    write_rank(tmp_path / "ok.json", 0, [kernel("k", 0, 1)], gz=False)
    out = invoke("replay", tmp_path / "ok.json", "--rules", rules, code=2)
    assert "a layer pattern needs a group" in out.output and len(out.output.strip().splitlines()) == 1


def test_web_replays_profiler_traces_in_its_tabs_as_replay_does(tmp_path):
    from moectl.cli.common import BadInput
    from moectl.cli.web import replay_args

    folder = two_rank_folder(tmp_path / "p")
    assert replay_args(folder) == ["replay", str(folder.resolve())]
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInput, match="--replay"):
        replay_args(tmp_path / "empty")
