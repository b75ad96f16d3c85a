"""PyTorch-profiler (Kineto) traces in `moectl trace report` (profiler/kineto.py): a trace this
test records with torch.profiler on the CPU, and multi-rank folders shaped as vLLM and SGLang
write them on GPUs (one gzipped Chrome trace per rank, the rank in distributedInfo or the file
name), with every figure worked by hand; user rules; bad files as one line and exit 2."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from moectl.cli.main import app
from tests.kineto_traces import kernel, write_rank

runner = CliRunner()


def report(*args):
    out = runner.invoke(app, ["trace", "report", *map(str, args), "--json"])
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


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


def test_a_cpu_trace_of_a_transformers_moe_is_broken_down_per_layer(tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    model = MixtralForCausalLM(config).eval()
    # with_stack names each module's range "nn.Module: MixtralDecoderLayer_<i>"
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                 with_stack=True) as prof:
        model(torch.randint(0, 64, (1, 8)))
    prof.export_chrome_trace(str(tmp_path / "mixtral.json"))
    layers = report(tmp_path / "mixtral.json")["layers"]
    assert list(layers["by_layer"]) == ["0", "1", "2"]
    assert all(per["dense_gemm"] > 0 for per in layers["by_layer"].values())
    placed = sum(sum(per.values()) for per in layers["by_layer"].values())
    # the embedding and the LM head run outside every layer
    assert placed == pytest.approx(layers["placed_s"]) and 0 < layers["placed_s"] < layers["total_s"]


def test_a_kernel_takes_the_layer_its_launch_ran_in(tmp_path):
    def launch(corr, ts, tid=3):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": tid, "ts": ts,
                "dur": 2, "args": {"correlation": corr}}

    def layer_range(name, ts, dur, tid=3, cat="python_function"):
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}

    def gpu_kernel(name, ts, dur, corr):
        return {**kernel(name, ts, dur), "args": {"stream": 7, "correlation": corr}}

    events = [
        layer_range("nn.Module: DeepseekV2DecoderLayer_0", 0, 50),
        layer_range("nn.Module: DeepseekV2MoE_0", 20, 20),  # nested: still layer 0
        layer_range("model.layers.1", 60, 30, cat="user_annotation"),
        launch(11, 10), launch(12, 25), launch(13, 70),
        launch(14, 95),  # after every layer (an LM head)
        launch(15, 70, tid=4),  # another thread, no ranges there
        gpu_kernel("flash_fwd_kernel", 100, 10, 11), gpu_kernel("fused_moe_kernel", 110, 30, 12),
        gpu_kernel("fused_moe_kernel", 140, 40, 13), gpu_kernel("sm90_xmma_gemm", 180, 5, 14),
        gpu_kernel("sm90_xmma_gemm", 185, 5, 15), gpu_kernel("triton_poi_fused", 190, 5, 99),  # no launch
    ]
    write_rank(tmp_path / "rank0.json", 0, events, gz=False)
    layers = report(tmp_path / "rank0.json")["layers"]
    assert layers["by_layer"] == {"0": {"attention": pytest.approx(10e-6), "expert_gemm": pytest.approx(30e-6)},
                                  "1": {"expert_gemm": pytest.approx(40e-6)}}
    assert layers["placed_s"] == pytest.approx(80e-6) and layers["total_s"] == pytest.approx(95e-6)
    human = runner.invoke(app, ["trace", "report", str(tmp_path / "rank0.json")])
    assert "per layer (84% of the time placed" in human.output and "layer    1" in human.output


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
