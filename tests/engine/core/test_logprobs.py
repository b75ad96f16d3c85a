"""Log-probabilities (prompt and output) and penalties, against the uncached reference forward."""

from __future__ import annotations

import pytest
import torch

from moectl.engine.core.sampling import SamplingParams
from moectl.engine.models.attention import DenseContext
from tests.checkpoints import prompts
from tests.engine.core.test_engine_core import make_engine  # ckpt, ref_model: conftest.py


def reference_logp(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model.logits(model(torch.tensor(ids), torch.arange(len(ids)), DenseContext(1, len(ids))))
    return torch.log_softmax(logits.float(), dim=-1)


def test_prompt_logprobs_match_the_reference_across_chunks(ckpt, ref_model):
    engine = make_engine(ckpt)
    ids = prompts(1, seed=3, lo=50, hi=50)[0]  # chunks of 10 tokens: five prefill steps
    out = engine.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    assert out.token_ids == [] and out.finish_reason == "length"
    want = reference_logp(ref_model, ids)
    lps = out.prompt_logprobs
    assert lps[0] is None and len(lps) == len(ids)
    for pos in range(1, len(ids)):
        lp, top = lps[pos]
        assert lp == pytest.approx(want[pos - 1, ids[pos]].item(), rel=1e-4, abs=1e-5)
        assert [t for t, _ in top] == want[pos - 1].topk(3).indices.tolist()
    assert engine.blocks.num_used == 0


def test_prompt_logprobs_skip_the_prefix_cache(ckpt, ref_model):
    engine = make_engine(ckpt)
    ids = prompts(1, seed=4, lo=30, hi=30)[0]
    engine.generate([ids], SamplingParams(max_tokens=2, ignore_eos=True))  # fills the prefix cache
    hits = engine.blocks.prefix_hits
    out = engine.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0, ignore_eos=True))[0]
    assert engine.blocks.prefix_hits == hits  # every position was computed
    assert all(lp is not None for lp in out.prompt_logprobs[1:])


def test_output_logprobs_are_the_models_and_stream(ckpt, ref_model):
    engine = make_engine(ckpt)
    ids = prompts(1, seed=5)[0]
    stream = engine.add_request(ids, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2), stream=True)
    outs = []
    while not (outs and outs[-1].finished):
        engine.step()
        while not stream._queue.empty():
            outs.append(stream._queue.get())
    final = outs[-1]
    assert len(final.logprobs) == 6
    assert [lp for o in outs for lp in o.new_logprobs] == final.logprobs
    want = reference_logp(ref_model, ids + final.token_ids)
    for i, (lp, top) in enumerate(final.logprobs):
        row = want[len(ids) - 1 + i]
        assert lp == pytest.approx(row[final.token_ids[i]].item(), rel=1e-4, abs=1e-5)
        assert top[0][0] == final.token_ids[i]  # greedy: the chosen token is the most likely
        assert len(top) == 2


def reference_penalised_greedy(model, prompt, n, rep=1.0, presence=0.0, frequency=0.0):
    ids = list(prompt)
    for _ in range(n):
        with torch.inference_mode():
            logits = model.logits(model(torch.tensor(ids), torch.arange(len(ids)), DenseContext(1, len(ids))))[-1]
        logits = logits.clone()  # a normal tensor, updated in place below
        out = ids[len(prompt):]
        for t in set(ids):
            logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
        for t in set(out):
            logits[t] -= frequency * out.count(t) + presence
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.8), dict(presence_penalty=2.0),
                                dict(frequency_penalty=2.0)])
def test_penalties_follow_their_definitions(ckpt, ref_model, kw):
    engine = make_engine(ckpt)
    ids = prompts(1, seed=6)[0]
    plain = engine.generate([ids], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    got = engine.generate([ids], SamplingParams(max_tokens=24, ignore_eos=True, **kw))[0].token_ids
    rep = kw.get("repetition_penalty", 1.0)
    want = reference_penalised_greedy(ref_model, ids, 24, rep, kw.get("presence_penalty", 0.0),
                                      kw.get("frequency_penalty", 0.0))
    assert got == want
    assert got != plain  # the penalty changed something on this prompt


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(logprobs=21), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(seed=2**64), "seed"), (dict(logprobs=True), "logprobs"),
])
def test_bad_logprob_and_penalty_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)
