"""Shared fixtures: tiny checkpoints, built once per test session."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import SMALLER, STD, tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory):
    """name -> directory of a tiny transformers-written checkpoint (see tests/checkpoints.SPECS),
    built on first use and cached for the session. Skips when transformers is not installed."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("tiny_hf")
    built = {}

    def get(name: str):
        if name not in built:
            built[name] = tiny_checkpoint(root / name, name)
        return built[name]

    return get


@pytest.fixture(scope="session")
def tiny_engine_checkpoint(tmp_path_factory):
    """A tiny Mixtral written by the engine's own saver (no transformers needed)."""
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny_engine"), tokenizer=False, std=STD, **SMALLER)


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for tiny models: nothing to gain from more, and on a shared 2-core box
    oversubscribed threads make these tests several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _engines_leave_the_heap_alone():
    """A command run in-process (CliRunner: serve, record) marks the process as owning its engine
    (engine/core/gc_heap.py), which then freezes the heap at every engine build. The test process
    builds and drops hundreds of engines: each test starts unowned and leaves nothing frozen."""
    import gc

    from moectl.engine.core import gc_heap

    gc_heap._owned = False
    yield
    gc_heap._owned = False
    if gc.get_freeze_count():
        gc.unfreeze()
