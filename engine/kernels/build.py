"""Builds a kernel's C++ source once per machine with torch's extension loader, then loads it
from its cache; a kernel that cannot be built (no compiler) says why in one line and its caller
takes the torch path."""

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

log = logging.getLogger(__name__)

BUILD_WAIT_S = 300.0  # how long a process waits for another one's build before taking the torch path


def _cpu_fingerprint() -> str:
    """-march=native code must not be loaded on another CPU (a shared home or a baked cache)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def build(package: str, filename: str, openmp: bool = False, cflags: tuple[str, ...] = ()) -> None:
    """Compiles and loads package/filename, whose TORCH_LIBRARY registers its ops under torch.ops.
    cflags: the source's own (they join the library's name, so a change builds afresh)."""
    from torch.utils.cpp_extension import _get_build_directory, load

    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'c++')}) on PATH")
    # the venv's own ninja (a dependency), even when the venv is not activated
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    source = resources.files(package).joinpath(filename)
    text = source.read_bytes()
    # an edited kernel, or another CPU, builds afresh instead of loading a stale library
    stem = filename.rsplit(".", 1)[0]
    name = f"moectl_{stem}_" + hashlib.sha256(text + _cpu_fingerprint().encode() + " ".join(cflags).encode()
                                              ).hexdigest()[:12]
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
                    raise RuntimeError(f"another process has been building {filename} for {BUILD_WAIT_S:.0f} s") from None
                time.sleep(0.2)
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            os.remove(stale)
        omp = ["-fopenmp"] if openmp else []
        with resources.as_file(source) as path:
            # -march=native: the library is built on the machine that runs it (the name says which CPU)
            load(name=name, sources=[str(path)], extra_cflags=["-O3", "-march=native", "-fno-math-errno", *omp, *cflags],
                 extra_ldflags=omp, is_python_module=False, verbose=False)


def _reason(exc: Exception) -> str:
    """One line: the compiler's first error, else the exception's last line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first_error = next((line for line in lines if "error:" in line), None)
    return f"{type(exc).__name__}: {first_error or (lines[-1] if lines else '')}"


class NativeKernel:
    """One C++ source's ops, built on first ask: `ops()` is torch.ops.<namespace> or None, and
    `failure` then says why (disabled by its environment switch, or the build's first error)."""

    def __init__(self, package: str, filename: str, namespace: str, switch: str, openmp: bool = False,
                 cflags: tuple[str, ...] = ()):
        self.package, self.filename, self.namespace = package, filename, namespace
        self.switch = switch  # NAME=0 in the environment forces the torch path (A/B benchmarks)
        self.openmp, self.cflags = openmp, cflags
        self.failure: str | None = None
        self._ops = None
        self._lock = threading.Lock()

    def ops(self):
        if self._ops is not None or self.failure is not None:
            return self._ops
        with self._lock:
            if self._ops is None and self.failure is None:
                if os.environ.get(self.switch, "1") == "0":
                    self.failure = f"disabled by {self.switch}=0"
                else:
                    try:
                        build(self.package, self.filename, self.openmp, self.cflags)
                        import torch

                        self._ops = getattr(torch.ops, self.namespace)
                    except Exception as exc:  # noqa: BLE001 - any build error means: use the torch path
                        self.failure = _reason(exc)
                        log.warning("%s unavailable, using the torch path (%s)", self.filename, self.failure)
        return self._ops
