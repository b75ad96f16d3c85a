"""The NVML sampler (engine/core/gpu_stats.py): without a GPU nothing runs and no record carries GPU
figures; with one (the GPU-gated tests) the driver's figures are sane and ride in every step record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from moectl.engine.core.config import EngineConfig, SchedulerKnobs
from moectl.engine.core.gpu_stats import FIELDS, THREAD_NAME, GpuSampler, read_fields
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.llm_engine import LLMEngine
from tests.checkpoints import prompts, tiny_checkpoint


def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:  # noqa: BLE001 - not installed, no library, no driver
        return False


HAVE_GPU = torch.cuda.is_available() and _nvml_works()
needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="needs CUDA and NVML")
without_gpu = pytest.mark.skipif(HAVE_GPU, reason="a GPU with NVML is here: the GPU tests cover this machine")
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("gpu"))


def make_engine(ckpt, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=64, num_threads=1,
                                  knobs=SchedulerKnobs(max_num_batched_tokens=24), **kw))


def sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME and t.is_alive()]


def test_a_refused_query_leaves_its_fields_out_not_zero():
    # no valid handle: NVML refuses every query (uninitialised, or an invalid argument), so no field is made up
    assert read_fields(None) == {}


@without_gpu
def test_without_a_gpu_the_sampler_is_unavailable_and_starts_no_thread():
    before = sampler_threads()
    sampler = GpuSampler()
    assert not sampler.available and sampler.thread is None and sampler.latest() is None
    assert "NVML" in sampler.reason or "GPU" in sampler.reason
    assert "\n" not in sampler.reason
    assert sampler_threads() == before
    sampler.close()  # a no-op, not an error


def test_an_engine_without_cuda_asks_nvml_nothing_and_its_records_carry_no_gpu(ckpt):
    before = sampler_threads()
    engine = make_engine(ckpt)
    engine.generate(prompts(2), PARAMS)
    assert engine.telemetry.gpu is None and sampler_threads() == before
    records = [s.as_record() for s in engine.step_log]
    assert records and all("gpu" not in r for r in records)
    assert engine.stats()["gpu"] is None


# -- with a GPU -------------------------------------------------------------------------------

def _check_device(d: dict) -> None:
    assert set(d) - {"index", "nvml_index", "name"} <= set(FIELDS)
    assert "memory_total_bytes" in d and "memory_used_bytes" in d  # every NVML GPU reports memory
    assert 0 < d["memory_used_bytes"] <= d["memory_total_bytes"]
    free, total = torch.cuda.mem_get_info(d["index"])
    assert abs(d["memory_total_bytes"] - total) <= 0.05 * total
    for key in ("util_gpu_pct", "util_memory_pct"):
        if key in d:
            assert 0 <= d[key] <= 100
    if "power_w" in d:
        assert d["power_w"] > 0
        if "power_limit_w" in d:
            assert d["power_w"] <= 1.5 * d["power_limit_w"]
    if "temperature_c" in d:
        assert 0 < d["temperature_c"] < 120
    for key in ("sm_clock_mhz", "memory_clock_mhz"):
        if key in d:
            assert d[key] > 0


def _wait_for_sample_after(sampler: GpuSampler, t: float, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sample = sampler.latest()
        if sample is not None and sample["sampled_at"] > t:
            return sample
        time.sleep(0.05)
    raise AssertionError("no new GPU sample")


@needs_gpu
def test_the_sampler_reads_every_gpu_torch_sees_and_stops_on_close():
    sampler = GpuSampler()
    try:
        assert sampler.available and sampler.reason is None and sampler.thread.is_alive()
        block = torch.empty(1 << 28, dtype=torch.float32, device="cuda:0")  # 1 GiB: shows in the driver's figure
        sample = _wait_for_sample_after(sampler, time.monotonic())
        assert sample["source"] == "nvml" and [d["index"] for d in sample["devices"]] == \
            list(range(torch.cuda.device_count()))
        for d in sample["devices"]:
            _check_device(d)
            assert d["memory_used_bytes"] >= torch.cuda.memory_reserved(d["index"])  # this process's part of it
        assert sample["devices"][0]["memory_used_bytes"] >= block.numel() * 4
        json.dumps(sample)  # plain values: the trace codec and the websocket take it as it is
    finally:
        sampler.close()
    assert not sampler.thread.is_alive() and sampler.latest() is None


@needs_gpu
def test_torch_index_maps_to_the_nvml_device_under_cuda_visible_devices():
    """A child process that sees only this process's last GPU: its torch device 0 is sampled from
    that GPU's NVML handle, whatever NVML's own index for it."""
    import pynvml

    last = torch.cuda.device_count() - 1
    uuid = str(torch.cuda.get_device_properties(last).uuid)
    bare = uuid.split("-", 1)[1] if uuid.startswith(("GPU-", "MIG-")) else uuid
    code = ("import json; from moectl.engine.core.gpu_stats import GpuSampler; s = GpuSampler(); "
            "print(json.dumps(s.latest()['devices'])); s.close()")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": uuid if uuid != bare else f"GPU-{bare}"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    (device,) = json.loads(out.stdout.strip().splitlines()[-1])
    pynvml.nvmlInit()
    try:
        nvml_uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(device["nvml_index"]))
    finally:
        pynvml.nvmlShutdown()
    nvml_uuid = nvml_uuid.decode() if isinstance(nvml_uuid, bytes) else nvml_uuid
    assert device["index"] == 0 and nvml_uuid.endswith(bare)


@needs_gpu
def test_a_cuda_engine_puts_the_driver_sample_in_every_step_record(ckpt):
    engine = make_engine(ckpt, device="cuda")
    try:
        engine.generate(prompts(3), PARAMS)
        records = [s.as_record() for s in engine.step_log]
        assert records and all("gpu" in r for r in records)
        for r in records:
            assert r["gpu"]["sampled_at"] <= r["t_end"]
            for d in r["gpu"]["devices"]:
                _check_device(d)
        assert engine.stats()["gpu"]["devices"]
    finally:
        engine.telemetry.gpu.close()
