"""The engine's C-allocator handling: glibc's figures, the periodic trim, the mode switch."""

from __future__ import annotations

import pytest
import torch

from moectl.engine.core import native_memory

pytestmark = pytest.mark.skipif(not native_memory.available(), reason="needs glibc (mallopt, mallinfo2)")


@pytest.fixture
def fresh(monkeypatch):
    """setup() as in a new process, with the environment the test sets."""
    monkeypatch.setattr(native_memory, "_applied", None)
    monkeypatch.setattr(native_memory, "_steps", 0)
    monkeypatch.delenv("MOECTL_NATIVE_MEMORY", raising=False)
    return monkeypatch


def test_mallinfo_is_well_formed():
    info = native_memory.mallinfo()
    assert set(info) >= {"heap", "mmapped", "mmapped_blocks", "in_use", "free", "releasable"}
    assert all(isinstance(v, int) and v >= 0 for v in info.values())
    assert info["in_use"] >= info["mmapped"]


def test_setup_defaults_to_trim_and_runs_once(fresh):
    first = native_memory.setup()
    assert first == {"mode": "trim", "every_steps": native_memory.TRIM_EVERY_STEPS}
    fresh.setenv("MOECTL_NATIVE_MEMORY", "off")
    assert native_memory.setup() == first  # fixed at the first call


def test_off_leaves_glibc_alone(fresh):
    fresh.setenv("MOECTL_NATIVE_MEMORY", "off")
    assert native_memory.setup()["mode"] == "off"
    calls = []
    fresh.setattr(native_memory, "_LIBC", type("L", (), {"malloc_trim": lambda _self, pad: calls.append(pad)})())
    for _ in range(3 * native_memory.TRIM_EVERY_STEPS):
        native_memory.after_step()
    assert calls == []


def test_after_step_trims_every_n_steps(fresh):
    native_memory.setup()
    calls = []
    fresh.setattr(native_memory, "_LIBC", type("L", (), {"malloc_trim": lambda _self, pad: calls.append(pad)})())
    for _ in range(3 * native_memory.TRIM_EVERY_STEPS - 1):
        native_memory.after_step()
    assert calls == [0, 0]


def test_trim_gives_back_pages_in_holes_between_live_blocks():
    # blocks below any mmap threshold, every other one freed: holes that no trim at the top of a
    # heap reaches, whole pages inside each
    blocks = [torch.empty(16 << 10, dtype=torch.uint8) for _ in range(1024)]
    del blocks[::2]
    assert native_memory.mallinfo()["free"] >= 512 * (16 << 10)
    assert native_memory.trim() is True
    del blocks


def test_mmap_mode_fixes_the_thresholds(fresh):
    fresh.setenv("MOECTL_NATIVE_MEMORY", "mmap")
    applied = native_memory.setup()
    try:
        assert applied["mode"] == "mmap" and applied["mmap_threshold_ok"] and applied["trim_threshold_ok"]
        # glibc's dynamic threshold would now be this block's size, and the next, smaller one
        # would come from the heap; fixed, it gets its own mmap. Larger than all the free bytes
        # in the arenas, so no free chunk can serve it (glibc looks there first)
        size = max(2 * native_memory.MMAP_THRESHOLD, native_memory.mallinfo()["free"] + (1 << 20))
        big = torch.empty(4 * size, dtype=torch.uint8)
        del big
        before = native_memory.mallinfo()
        block = torch.empty(size, dtype=torch.uint8)
        after = native_memory.mallinfo()
        assert after["mmapped_blocks"] == before["mmapped_blocks"] + 1
        assert after["mmapped"] - before["mmapped"] >= block.numel()
    finally:  # glibc's maximum dynamic threshold back, so later tests see near-default behaviour
        native_memory.fix_thresholds(32 << 20, 64 << 20)
