"""`moectl serve`'s memory: oneDNN's and ideep's per-shape kernel caches are bounded before the
engine is built (engine/core/native_memory.bound_kernel_caches; docs/serve_memory.md)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.engine.core import native_memory
from moectl.engine.parallel import backends

VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


class _Stop(Exception):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_bounds_the_kernel_caches_before_the_engine_is_built(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)  # restored after the test, with what serve sets
    seen = {}

    def engines(*args, **kwargs):
        seen.update({name: os.environ.get(name) for name in native_memory.KERNEL_CACHES})
        raise _Stop("stop before the model loads")

    monkeypatch.setattr(backends, "Engines", engines)
    result = CliRunner().invoke(app, ["serve", "--port", str(_free_port())])
    assert "stop before the model loads" in result.output, result.output
    assert seen == native_memory.KERNEL_CACHES


def test_an_operators_own_setting_wins(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DNNL_PRIMITIVE_CACHE_CAPACITY", "1024")  # oneDNN's older name counts as set
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "8")
    assert native_memory.bound_kernel_caches() == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "8"}
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ


# bf16 matmuls of 600 row counts: oneDNN builds (and by default keeps) a kernel for each
SHAPES = """
import json, sys, torch
from moectl.engine.core import native_memory
if sys.argv[1] == "bounded":
    native_memory.bound_kernel_caches()
torch.set_num_threads(1)
weight = torch.randn(512, 256, dtype=torch.bfloat16)
before = native_memory.mallinfo()["in_use"]
for rows in range(1, 601):
    torch.nn.functional.linear(torch.randn(rows, 256, dtype=torch.bfloat16), weight)
print(json.dumps(native_memory.mallinfo()["in_use"] - before))
"""


@pytest.mark.skipif(not native_memory.available(), reason="malloc's figures need glibc")
def test_bounded_caches_keep_a_fraction_of_the_kernels_memory():
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}

    def growth(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", SHAPES, mode], env=env, capture_output=True, text=True,
                             timeout=300, check=True)
        return json.loads(out.stdout)

    unbounded = growth("torch's defaults")
    if unbounded < 64 << 20:
        pytest.skip(f"this torch kept {unbounded >> 20} MiB of kernels for 600 shapes: nothing to bound here")
    assert growth("bounded") < unbounded / 2
