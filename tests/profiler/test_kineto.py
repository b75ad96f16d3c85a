"""PyTorch-profiler (Kineto) traces in `moectl trace report` (profiler/kineto.py): a trace this
test records with torch.profiler on the CPU, and multi-rank folders shaped as vLLM and SGLang
write them on GPUs (one gzipped Chrome trace per rank, the rank in distributedInfo or the file
name), with every figure worked by hand; user rules; bad files as one line and exit 2."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from typer.testing import CliRunner

from moectl.cli.main import app

runner = CliRunner()


def report(*args):
    out = runner.invoke(app, ["trace", "report", *map(str, args), "--json"])
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


def kernel(name, ts, dur, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"device": 0, "stream": stream, "correlation": 1}}


def write_rank(path, rank, events, gz=True, with_rank=True):
    doc = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3"}],
           **({"distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2}} if with_rank else {}),
           "traceEvents": [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}},
                           {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 5},
                           *events],
           "unknownField": {"ignored": True}}
    data = json.dumps(doc).encode()
    path.write_bytes(gzip.compress(data) if gz else data)


def test_a_cpu_trace_recorded_here_is_classed_by_its_ops(tmp_path):
    x = torch.randn(128, 128)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            torch.nn.functional.silu(x @ x).topk(4)
    prof.export_chrome_trace(str(tmp_path / "cpu.json"))
    result = report(tmp_path / "cpu.json")
    assert result["ranks"][0]["source"] == "cpu_ops"
    assert result["breakdown"]["dense_gemm"] > 0 and result["breakdown"]["sampling"] > 0
    assert set(result) >= {"breakdown", "idle_s", "overlap"} and result["idle_s"] >= 0


def test_a_two_rank_gpu_folder_as_vllm_and_sglang_write_it(tmp_path):
    folder = tmp_path / "profile"
    folder.mkdir()
    # rank 0: attention 0-100 us, experts 100-300, an all-to-all 250-350 (50 us of it behind the
    # experts), a memcpy 400-410, an unknown kernel 410-430; idle 350-400
    write_rank(folder / "1733000000-TP-0.trace.json.gz", 0, [
        kernel("flash_fwd_splitkv_kernel", 0, 100), kernel("fused_moe_kernel", 100, 200),
        kernel("ncclDevKernel_AllToAll_RING_LL", 250, 100, stream=20),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "pid": 0, "tid": 7,
         "ts": 400, "dur": 10}, kernel("my_custom_kernel", 410, 20)])
    # rank 1 (named by the file only): the same but its experts take 300 us: the straggler
    write_rank(folder / "worker-TP-1.pt.trace.json.gz", 1, [
        kernel("flash_fwd_splitkv_kernel", 0, 100), kernel("fused_moe_kernel", 100, 300),
        kernel("ncclDevKernel_AllToAll_RING_LL", 400, 100, stream=20)], with_rank=False)
    result = report(folder)
    r0, r1 = sorted(result["ranks"], key=lambda r: r["rank"])
    assert (r0["rank"], r1["rank"]) == (0, 1) and r0["source"] == "device"
    assert r0["breakdown"] == pytest.approx({"attention": 100e-6, "expert_gemm": 200e-6, "dispatch_combine": 100e-6,
                                              "memcpy_memset": 10e-6, "unclassed": 20e-6})
    assert r0["idle_s"] == pytest.approx(50e-6) and r1["idle_s"] == pytest.approx(0.0)
    assert r0["overlap"]["fraction"] == pytest.approx(0.5)  # 50 of its 100 us of all-to-all behind the experts
    assert r1["overlap"]["fraction"] == pytest.approx(0.0)
    assert result["overlap"]["fraction"] == pytest.approx(50 / 200)
    assert result["breakdown"]["expert_gemm"] == pytest.approx(500e-6)
    assert result["straggler"]["rank"] == 1
    assert result["unclassed"] == [["my_custom_kernel", pytest.approx(20e-6)]]
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"rules": [{"class": "expert_gemm", "pattern": "my_custom"}]}))
    with_rules = report(folder, "--rules", rules)
    assert with_rules["unclassed"] == [] and with_rules["breakdown"]["expert_gemm"] == pytest.approx(520e-6)
    human = runner.invoke(app, ["trace", "report", str(folder)])
    assert human.exit_code == 0 and "straggler: rank 1" in human.output and "my_custom_kernel" in human.output


@pytest.mark.parametrize("content, message", [
    (b"{not json", "not valid trace JSON"),
    (b'{"traceEvents": [{"ph": "M", "name": "x"}]}', "no complete events"),
])
def test_bad_trace_files_are_one_line_and_exit_2(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    out = runner.invoke(app, ["trace", "report", str(path)])
    assert out.exit_code == 2 and message in out.output and len(out.output.strip().splitlines()) == 1
    rules = tmp_path / "rules.json"
    rules.write_text('{"rules": [{"class": "x", "pattern": "("}]}')
    write_rank(tmp_path / "ok.json", 0, [kernel("k", 0, 1)], gz=False)
    out = runner.invoke(app, ["trace", "report", str(tmp_path / "ok.json"), "--rules", str(rules)])
    assert out.exit_code == 2 and "--rules" in out.output
