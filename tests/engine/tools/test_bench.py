"""engine.bench and engine.machine_limits on tiny checkpoints. Nothing here asserts on timings."""

from __future__ import annotations

import json

import pytest

from moectl.engine.tools import bench, machine_limits

pytestmark = pytest.mark.usefixtures("single_thread")

FAKE_LIMITS = {"read_bw": 10e9, "copy_bw": 10e9, "bw_buffer_bytes": 1, "matmul_flops": 100e9,
               "matmul_flops_by_size": {"64": 100e9}, "matmul_dtype": "float32", "threads": 1, "measure_s": 0.0}


@pytest.fixture(scope="module")
def tiny_result(tiny_hf_checkpoint):
    pytest.importorskip("transformers")
    mp = pytest.MonkeyPatch()
    mp.setattr(machine_limits, "measure", lambda dtype="float32": dict(FAKE_LIMITS))  # the real one takes ~2 s
    lines: list[str] = []
    try:
        # chunky knobs: prefills are split and mixed with decodes, the hard case for equality
        result = bench.run_compare_hf(tiny_hf_checkpoint("mixtral"), num_requests=4, prompt_len=(3, 40),
                                      output_len=(2, 9), seed=1, bs1_output_len=4, bs1_repeats=1,
                                      keep_outputs=True, log=lines.append,
                                      engine_knobs={"long_prefill_token_threshold": 8, "max_num_batched_tokens": 24})
    finally:
        mp.undo()
    return result, lines


def test_compare_hf_returns_every_figure(tiny_result):
    r, lines = tiny_result
    for key in ("throughput_ratio", "tpot_bs1_ratio", "engine", "hf", "bs1", "machine", "shares", "workload",
                "targets", "outputs_match", "params_active", "params_total", "threads", "load_avg_before"):
        assert key in r, key
    for side in ("engine", "hf"):
        for key in ("output_throughput", "total_throughput", "request_throughput", "duration_s",
                    "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p50"):
            assert r[side][key] is not None and r[side][key] >= 0, (side, key)
    assert r["engine"]["output_tokens"] == r["hf"]["output_tokens"] == r["workload"]["output_tokens"]
    assert r["hf"]["generated_tokens"] >= r["hf"]["output_tokens"]
    assert r["bs1"]["engine_tpot"] > 0 and r["bs1"]["hf_tpot"] > 0
    assert r["throughput_ratio"] == pytest.approx(r["engine"]["output_throughput"] / r["hf"]["output_throughput"])
    assert r["tpot_bs1_ratio"] == pytest.approx(r["bs1"]["engine_tpot"] / r["bs1"]["hf_tpot"])
    assert r["machine"] == FAKE_LIMITS
    for key in ("active_bytes_per_token", "engine_bs1_bandwidth_share", "hf_bs1_bandwidth_share",
                "engine_flops_share", "hf_flops_share"):
        assert r["shares"][key] > 0, key
    flops = r["shares"]["run_flops"]  # the same workload's FLOPs, over each side's own duration
    assert r["shares"]["engine_flops_per_s"] == pytest.approx(flops["total"] / r["engine"]["duration_s"])
    assert flops["sampled_rows"] == r["workload"]["output_tokens"] and flops["attention"] > 0
    assert r["shares"]["active_bytes_per_token"] == r["params_active"] * 4  # fp32
    assert set(r["targets"]) >= {"throughput_ratio_min", "tpot_bs1_ratio_max", "throughput_met", "tpot_bs1_met"}
    json.dumps({k: v for k, v in r.items()})  # JSON-serialisable
    assert any("throughput ratio" in line for line in lines)


def test_compare_hf_greedy_tokens_match_transformers(tiny_result):
    r, _ = tiny_result
    engine_out, hf_out = r["outputs"]["engine"], r["outputs"]["hf"]
    assert len(engine_out) == len(hf_out) == 4
    assert [len(o) for o in engine_out] == [len(o) for o in hf_out]
    assert engine_out == hf_out
    assert r["outputs_match"] == {"requests": 4, "identical": 4, "mismatches": []}


def test_compare_hf_argument_errors(tiny_hf_checkpoint):
    for kwargs, field in ((dict(bs1_output_len=1), "bs1_output_len"), (dict(hf_batch_size=0), "hf_batch_size"),
                          (dict(bs1_repeats=0), "bs1_repeats")):
        with pytest.raises(ValueError, match=f"^{field}:"):
            bench.run_compare_hf(tiny_hf_checkpoint("mixtral"), **kwargs)


def test_hf_batches_truncate_to_each_request(tiny_hf_checkpoint):
    """hf_batch_size splits the workload; each row keeps only its own request's tokens."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM

    from moectl.engine.tools.workload import WorkloadSpec, make_workload

    model_dir = tiny_hf_checkpoint("mixtral")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    items = make_workload(WorkloadSpec(num_requests=3, prompt_len=(2, 12), output_len=(1, 6), seed=3, source="random"),
                          vocab_size=320)
    res = bench.run_hf(model, items, batch_size=2, pad_id=1, log=lambda line: None)
    assert res["summary"]["num_batches"] == 2 and res["summary"]["batch_size"] == 2
    assert [len(o) for o in res["outputs"]] == [it.params.max_tokens for it in items]
    alone = [bench._hf_generate(model, [it.prompt_ids], it.params.max_tokens, 1)[0][0].tolist() for it in items]
    assert res["outputs"] == alone


def test_machine_limits_measure_small():
    bw = machine_limits.memory_bandwidth(nbytes=4 << 20, repeats=2, budget_s=0.2)
    mm = machine_limits.matmul_throughput("float32", sizes=(32, 64), repeats=2, budget_s=0.2)
    assert bw["read_bw"] > 0 and bw["copy_bw"] > 0
    assert mm["matmul_flops"] == max(mm["matmul_flops_by_size"].values()) > 0
    assert set(mm["matmul_flops_by_size"]) == {"32", "64"}
    assert "GB/s" in machine_limits.format_limits({**bw, **mm, "threads": 1})
