"""Kineto (PyTorch-profiler) traces shaped as vLLM and SGLang write them on GPUs, for the tests:
Chrome trace JSON with distributedInfo, kernels on streams, their cudaLaunchKernel events (the
same correlation id) and the layer ranges torch.profiler writes with with_stack
("nn.Module: <Class>DecoderLayer_<i>")."""

from __future__ import annotations

import gzip
import json


def kernel(name, ts, dur, stream=7, correlation=1):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"device": 0, "stream": stream, "correlation": correlation}}


def write_rank(path, rank, events, gz=True, with_rank=True):
    doc = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3"}],
           **({"distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2}} if with_rank else {}),
           "traceEvents": [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}},
                           {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 5},
                           *events],
           "unknownField": {"ignored": True}}
    data = json.dumps(doc).encode()
    path.write_bytes(gzip.compress(data) if gz else data)


def layered_rank(rank: int, layers: int = 3, expert_us: float = 40.0, origin_us: float = 1.733e15) -> list[dict]:
    """One decode step of `layers` layers: per layer a CPU range and three launches, then the
    kernels (attention, experts, an all-to-all on its own stream that the next layer's attention
    hides), on an epoch clock as Kineto writes it."""
    events, corr, gpu = [], 0, origin_us + 50
    for layer in range(layers):
        cpu = origin_us + layer * 10
        events.append({"ph": "X", "cat": "python_function", "name": f"nn.Module: DeepseekV2DecoderLayer_{layer}",
                       "pid": 1, "tid": 1, "ts": cpu, "dur": 9})
        for i, (name, dur, stream) in enumerate((("flash_fwd_splitkv_kernel", 20, 7),
                                                 ("fused_moe_kernel", expert_us, 7),
                                                 ("ncclDevKernel_AllToAll_RING_LL", 30, 20))):
            corr += 1
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                           "ts": cpu + 1 + 2 * i, "dur": 1, "args": {"correlation": corr}})
            start = gpu + (20 + expert_us if stream == 20 else (0 if i == 0 else 20))
            events.append(kernel(name, start, dur, stream=stream, correlation=corr))
        gpu += 20 + expert_us + 10  # the next layer's attention starts under this layer's all-to-all
    return events


def two_rank_folder(folder, rank1_later_us: float = 0.0):
    """rank 0, and rank 1 (the straggler: its experts take longer), one .json.gz each; rank 1's
    clock may start later (rank1_later_us)."""
    folder.mkdir(exist_ok=True)
    write_rank(folder / "1733000000-TP-0.pt.trace.json.gz", 0, layered_rank(0))
    write_rank(folder / "1733000000-TP-1.pt.trace.json.gz", 1,
               layered_rank(1, expert_us=60.0, origin_us=1.733e15 + rank1_later_us))
    return folder
