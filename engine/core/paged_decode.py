"""The paged decode-attention kernel (paged_decode.cpp): built once per machine with torch's
C++ extension loader, then loaded from its cache; the torch path stays as the fallback.

On a CPU the padded-gather path spends most of a batched decode step copying every row's blocks
into a padded buffer and expanding K/V for GQA before SDPA reads them again; the kernel reads
each cached entry once where it lies. `MOECTL_DECODE_KERNEL=0` forces the torch path (for A/B
benchmarks); a build failure (no compiler) logs one line and falls back.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from importlib import resources

import torch

log = logging.getLogger(__name__)
_lock = threading.Lock()
_module = None
_failed: str | None = None
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


BUILD_WAIT_S = 300.0  # how long a process waits for another one's build before taking the torch path


def _cpu_fingerprint() -> str:
    """-march=native code must not be loaded on another CPU (a shared home or a baked cache)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _build():
    from torch.utils.cpp_extension import _get_build_directory, load

    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'c++')}) on PATH")
    # the venv's own ninja (a dependency), even when the venv is not activated
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    source = resources.files("moectl.engine.core").joinpath("paged_decode.cpp")
    text = source.read_bytes()
    # an edited kernel, or another CPU, builds afresh instead of loading a stale library
    name = "moectl_paged_decode_" + hashlib.sha256(text + _cpu_fingerprint().encode()).hexdigest()[:12]
    build_dir = _get_build_directory(name, False)
    with open(os.path.join(build_dir, "moectl.lock"), "w") as lock_file:
        # our own lock, with a deadline: torch's lock file has no timeout and outlives a build that
        # was killed, after which every later start would wait forever. Under this lock nobody else
        # builds, so a torch lock file still there is stale.
        deadline = time.monotonic() + BUILD_WAIT_S
        while True:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"another process has been building the kernel for {BUILD_WAIT_S:.0f} s") from None
                time.sleep(0.2)
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            os.remove(stale)
        with resources.as_file(source) as path:
            # -march=native: the library is built on the machine that runs it (the name says which CPU)
            load(name=name, sources=[str(path)], extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fopenmp"],
                 extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    return torch.ops.moectl


def _reason(exc: Exception) -> str:
    """One line: the compiler's first error, else the exception's last line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first_error = next((line for line in lines if "error:" in line), None)
    return f"{type(exc).__name__}: {first_error or (lines[-1] if lines else '')}"


def kernel():
    """The built module, or None (disabled, or it could not be built: `failure()` says why)."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is None and _failed is None:
            if os.environ.get("MOECTL_DECODE_KERNEL", "1") == "0":
                _failed = "disabled by MOECTL_DECODE_KERNEL=0"
            else:
                try:
                    _module = _build()
                except Exception as exc:  # noqa: BLE001 - any build error means: use the torch path
                    _failed = _reason(exc)
                    log.warning("paged decode kernel unavailable, using the torch path (%s)", _failed)
    return _module


def failure() -> str | None:
    return _failed


def describe() -> str:
    """Which decode attention a CPU engine gets: what benchmark results record."""
    return "in-place kernel" if kernel() is not None else f"torch padded gather ({_failed})"


def serves(cache) -> bool:
    """Whether the kernel reads this KV cache (and its window cache): CPU storage of a float dtype.
    INT8 blocks take the torch path, which dequantises them."""
    return cache.k.device.type == "cpu" and cache.k.dtype in KERNEL_DTYPES and kernel() is not None


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
           lo: torch.Tensor, scale: float, sinks: torch.Tensor | None = None, latent: bool = False,
           checked: bool = False) -> torch.Tensor:
    """q [B, Hq, Dq] -> [B, Hq, Dv]; see paged_decode.cpp for the arguments. checked: these same
    tables, lens and lo were checked by an earlier call this step, against a cache of this shape."""
    empty = q.new_empty(0, dtype=torch.float32)
    return kernel().paged_decode(q.contiguous(), k_cache, v_cache, tables, lens, lo,
                                 empty if sinks is None else sinks.float().contiguous(), float(scale), latent, checked)
