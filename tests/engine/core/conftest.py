"""The engine-core tests' tiny Mixtral and its uncached reference model, built once per module."""

from __future__ import annotations

import pytest

from moectl.engine.models.loader import load_model
from tests.checkpoints import tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def ref_model(ckpt):
    return load_model(ckpt)
