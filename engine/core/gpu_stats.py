"""GPU truth from the driver: NVML's figures for the GPUs this process sees, sampled off the step loop.

Everything else the engine says about memory is its own accounting (the expert layer's categories,
the torch allocator's counters). These figures come from the driver instead: what the GPU really
holds (every process and context on it included), how busy it is, its power, temperature and
clocks. A background thread samples every SAMPLE_PERIOD_S and swaps the newest sample into one
attribute, so a step record reads it for the price of an attribute read; the sample carries its
own time (engine clock), since it is up to a period older than the step it rides in.

No GPU, no NVML library, or no driver: `available` is False, `reason` says why in one line, no
thread runs and `latest()` is None, so records carry no GPU field at all (never zeros). A field
the driver does not support (power on some boards, utilisation on a MIG slice) is left out of its
device's entry, not set to 0.

Sample: {"source": "nvml", "sampled_at": float (time.monotonic), "period_s": float,
         "devices": [{"index": torch's cuda index, "nvml_index": int, "name": str, and those of
                      memory_used_bytes, memory_total_bytes, util_gpu_pct, util_memory_pct,
                      power_w, power_limit_w, temperature_c, sm_clock_mhz, memory_clock_mhz
                      the driver gave}]}
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref

log = logging.getLogger(__name__)

SAMPLE_PERIOD_S = 0.5  # NVML's utilisation is itself averaged over 1/6 s to 1 s: sampling faster shows nothing new
THREAD_NAME = "moectl-gpu-stats"
FIELDS = ("memory_used_bytes", "memory_total_bytes", "util_gpu_pct", "util_memory_pct", "power_w", "power_limit_w",
          "temperature_c", "sm_clock_mhz", "memory_clock_mhz")


def _memory(nv, h) -> dict:
    info = nv.nvmlDeviceGetMemoryInfo(h)
    return {"memory_used_bytes": int(info.used), "memory_total_bytes": int(info.total)}


def _utilisation(nv, h) -> dict:
    rates = nv.nvmlDeviceGetUtilizationRates(h)
    return {"util_gpu_pct": int(rates.gpu), "util_memory_pct": int(rates.memory)}


def _power(nv, h) -> dict:
    return {"power_w": nv.nvmlDeviceGetPowerUsage(h) / 1000.0}  # NVML reports milliwatts


def _power_limit(nv, h) -> dict:
    return {"power_limit_w": nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0}


def _temperature(nv, h) -> dict:
    return {"temperature_c": int(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))}


def _sm_clock(nv, h) -> dict:
    return {"sm_clock_mhz": int(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))}


def _memory_clock(nv, h) -> dict:
    return {"memory_clock_mhz": int(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM))}


# one query per entry: one the driver refuses leaves out only its own fields
_READERS = (_memory, _utilisation, _power, _power_limit, _temperature, _sm_clock, _memory_clock)


def read_fields(handle) -> dict:
    """The FIELDS NVML gives for one device handle; each query it refuses (not supported, no
    permission, GPU lost, NVML not loaded) is left out."""
    import pynvml

    out: dict = {}
    for read in _READERS:
        try:
            out.update(read(pynvml, handle))
        except pynvml.NVMLError:
            pass
    return out


def _visible_nvml_indices() -> list[int] | None:
    """NVML indices named by an integer CUDA_VISIBLE_DEVICES, in torch's order (None: not set
    or not integers). The fallback when a device's UUID cannot be matched."""
    var = os.environ.get("CUDA_VISIBLE_DEVICES")
    if var is None:
        return None
    try:
        return [int(x) for x in var.split(",") if x.strip()]
    except ValueError:
        return None


def _handles(nv) -> list[tuple[int, int, object]]:
    """(torch cuda index, NVML index, handle) per GPU torch sees. Matched by UUID, which holds
    whatever CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER say; else by the visible-devices list."""
    import torch

    visible = _visible_nvml_indices()
    count = nv.nvmlDeviceGetCount()
    out = []
    for index in range(torch.cuda.device_count()):
        match = _by_uuid(nv, str(getattr(torch.cuda.get_device_properties(index), "uuid", "")))
        if match is None:
            nvml_index = visible[index] if visible is not None and index < len(visible) else index
            if nvml_index >= count:
                continue
            match = (nvml_index, nv.nvmlDeviceGetHandleByIndex(nvml_index))
        out.append((index, *match))
    return out


def _by_uuid(nv, uuid: str) -> tuple[int, object] | None:
    """(NVML index, handle) of the device with torch's UUID (torch prints it without NVML's "GPU-"
    or, for a MIG slice, "MIG-" prefix); a MIG slice gets its parent GPU's index."""
    for name in (uuid, f"GPU-{uuid}", f"MIG-{uuid}") if uuid else ():
        try:
            handle = nv.nvmlDeviceGetHandleByUUID(name)
        except nv.NVMLError:
            continue
        try:
            return nv.nvmlDeviceGetIndex(handle), handle
        except nv.NVMLError:  # a MIG slice's handle has no index of its own
            return nv.nvmlDeviceGetIndex(nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)), handle
    return None


class _Sampling:
    """What the thread shares with its GpuSampler; the thread holds only this, so dropping the
    sampler (its engine gone) lets weakref.finalize stop it."""

    def __init__(self, devices: list[tuple[int, int, str, object]], period_s: float):
        self.devices = devices  # (torch index, NVML index, name, handle)
        self.period_s = period_s
        self.stop = threading.Event()
        self.latest: dict | None = None

    def sample(self) -> dict:
        entries = [{"index": index, "nvml_index": nvml_index, "name": name, **read_fields(handle)}
                   for index, nvml_index, name, handle in self.devices]
        return {"source": "nvml", "sampled_at": time.monotonic(), "period_s": self.period_s, "devices": entries}

    def run(self) -> None:
        import pynvml

        try:
            while not self.stop.wait(self.period_s):
                self.latest = self.sample()  # one attribute swap: readers see the old or the new sample
        except Exception as exc:  # noqa: BLE001 - a failing sampler must not leave a stale sample behind
            self.latest = None
            log.warning("GPU sampling stopped: %s", exc)
        finally:
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError:
                pass


class GpuSampler:
    """NVML sampling of the GPUs torch sees, on its own daemon thread; started at construction
    when NVML and a GPU are there, else `available` is False and nothing runs."""

    def __init__(self, period_s: float = SAMPLE_PERIOD_S):
        self.reason: str | None = None
        self.thread: threading.Thread | None = None
        self._state: _Sampling | None = None
        devices = self._open()
        if devices is None:
            return
        state = self._state = _Sampling(devices, period_s)
        state.latest = state.sample()  # the first records already carry one
        self.thread = threading.Thread(target=state.run, name=THREAD_NAME, daemon=True)
        weakref.finalize(self, state.stop.set)
        self.thread.start()

    def _open(self) -> list | None:
        try:
            import pynvml
        except ImportError:
            self.reason = "NVML not available: nvidia-ml-py is not installed"
            return None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            self.reason = f"NVML not available: {exc}"
            return None
        try:
            devices = [(index, nvml_index, _name(pynvml, h), h) for index, nvml_index, h in _handles(pynvml)]
        except (pynvml.NVMLError, RuntimeError, AssertionError) as exc:  # torch without CUDA raises these
            devices, self.reason = [], f"NVML not available: {exc}"
        if not devices:
            self.reason = self.reason or "no GPU: NVML sees none of the GPUs torch uses"
            pynvml.nvmlShutdown()
            return None
        return devices

    @property
    def available(self) -> bool:
        return self._state is not None

    def latest(self) -> dict | None:
        """The newest sample (see the module's docstring), or None without NVML."""
        state = self._state
        return state.latest if state is not None else None

    def close(self) -> None:
        """Stop sampling; from here on `latest()` is None (a stopped sampler's figures would go stale)."""
        if self._state is not None:
            self._state.stop.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=5)
        self._state = None


def _name(nv, handle) -> str:
    try:
        name = nv.nvmlDeviceGetName(handle)
    except nv.NVMLError:
        return "?"
    return name.decode() if isinstance(name, bytes) else str(name)
