"""The live console's demo workload: chat requests with the seeds' agent turns (one shared prefix)
and long documents mixed in, in their shares, every request fitting the model's context."""

from __future__ import annotations

import pytest

from moectl.engine.tools.demo_workload import AGENT_PREFIX, DemoLoad, DemoWorkload


class CHECKPOINT_SHAPE:  # noqa: N801 - a namespace of constants
    """What the workload reads of an engine: no tokenizer (random prompt ids), a vocabulary and
    a context length. It is not an engine stand-in: nothing here runs a model."""

    tokenizer = None
    max_model_len = 2048

    class model_config:  # noqa: N801 - mirrors the engine's attribute
        vocab_size = 512


def batches(load: DemoLoad, count: int = 8) -> list:
    demo = DemoWorkload(load)
    out = []
    for seed in range(1, count + 1):
        demo.seed = seed
        out.extend(demo._mixed(CHECKPOINT_SHAPE))
    return out


def test_agents_share_one_prefix_and_documents_are_long():
    items = batches(DemoLoad())
    prefix = DemoWorkload(DemoLoad())._agent_prefix(CHECKPOINT_SHAPE)
    agents = [i for i in items if i.prompt_ids[:AGENT_PREFIX] == prefix]
    documents = [i for i in items if len(i.prompt_ids) >= 1024 and i.prompt_ids[:AGENT_PREFIX] != prefix]
    assert 0.15 < len(agents) / len(items) < 0.35 and 0.04 < len(documents) / len(items) < 0.18
    assert all(i.params.max_tokens <= 8 for i in documents)
    assert all(len(i.prompt_ids) + i.params.max_tokens <= 2048 for i in items)


def test_the_mix_can_be_turned_off_and_bad_shares_are_refused():
    items = batches(DemoLoad(agents=0.0, documents=0.0), 2)
    assert max(len(i.prompt_ids) for i in items) <= 256
    with pytest.raises(ValueError, match="agents"):
        DemoLoad(agents=1.5).spec(0, 1)
    with pytest.raises(ValueError, match="add up to more than 1"):
        DemoLoad(agents=0.6, documents=0.6).spec(0, 1)
