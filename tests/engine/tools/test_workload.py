"""engine.workload: the spec's validation, deterministic generation, JSONL requests, the driver."""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest

from moectl.engine.core.config import EngineConfig, SchedulerKnobs
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.models.tokenizer import Tokenizer
from moectl.engine.tools.workload import (
    LengthDist,
    WorkloadItem,
    WorkloadSpec,
    iter_workload,
    make_workload,
    run_workload,
    summarize,
    workload_for_engine,
)

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 1000


def _items_key(items):
    return [(it.arrival_s, it.prompt_ids, it.params.max_tokens) for it in items]


# -- statistics helpers

def test_summarize_skips_missing_values_and_interpolates_percentiles():
    data = [5.0, 1.0, None, 3.0, 2.0, 4.0]
    s = summarize(data, percentiles=(0, 50, 90, 100))
    assert s["p0"] == 1.0 and s["p100"] == 5.0 and s["p50"] == 3.0 and s["p90"] == pytest.approx(4.6)
    s = summarize([1.0, None, 3.0])
    assert s["count"] == 2 and s["mean"] == 2.0 and s["p50"] == 2.0 and s["max"] == 3.0
    assert summarize([])["p99"] is None


# -- lengths and validation

@pytest.mark.parametrize("spec, kind, lo, hi", [
    (7, "fixed", 7, 7), ((3, 9), "uniform", 3, 9), ([3, 9], "uniform", 3, 9), ("12", "fixed", 12, 12),
    ("4-40", "uniform", 4, 40), ({"kind": "uniform", "lo": 2, "hi": 5}, "uniform", 2, 5),
    ("lognormal:100,0.5,10,400", "lognormal", 10, 400),
    ({"kind": "lognormal", "median": 50, "sigma": 1.0, "lo": 1, "hi": 200}, "lognormal", 1, 200),
])
def test_length_dist_parse(spec, kind, lo, hi):
    d = LengthDist.parse(spec, "prompt_len")
    assert (d.kind, d.lo, d.hi) == (kind, lo, hi)


@pytest.mark.parametrize("kwargs, field", [
    (dict(rate=0), "rate"), (dict(rate=-1.0), "rate"), (dict(rate=float("nan")), "rate"),
    (dict(num_requests=0), "num_requests"), (dict(num_requests=2.5), "num_requests"),
    (dict(num_requests=None), "num_requests"),
    (dict(duration_s=5.0), "duration_s"),  # needs a finite rate
    (dict(rate=2.0, duration_s=-1.0), "duration_s"),
    (dict(prompt_len=0), "prompt_len"), (dict(prompt_len=(10, 5)), "prompt_len"),
    (dict(prompt_len=(1, 2, 3)), "prompt_len"), (dict(prompt_len="abc"), "prompt_len"),
    (dict(output_len={"kind": "lognormal", "median": -1, "sigma": 1}), "output_len"),
    (dict(output_len={"kind": "zipf"}), "output_len"),
    (dict(source="web"), "source"), (dict(source="jsonl"), "jsonl_path"),
    (dict(jsonl_path="x.jsonl"), "jsonl_path"), (dict(seed=-1), "seed"), (dict(temperature=-0.5), "temperature"),
])
def test_spec_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError) as err:
        WorkloadSpec(**kwargs)
    assert str(err.value).startswith(field + ":"), str(err.value)


# -- generation

def test_deterministic_for_a_seed():
    spec = WorkloadSpec(num_requests=40, rate=10.0, prompt_len=(4, 60), output_len=(1, 30), seed=3)
    a = make_workload(spec, vocab_size=VOCAB)
    b = list(iter_workload(WorkloadSpec(num_requests=40, rate=10.0, prompt_len=(4, 60), output_len=(1, 30), seed=3),
                           vocab_size=VOCAB))
    assert _items_key(a) == _items_key(b)
    c = make_workload(WorkloadSpec(num_requests=40, rate=10.0, prompt_len=(4, 60), output_len=(1, 30), seed=4),
                      vocab_size=VOCAB)
    assert _items_key(a) != _items_key(c)
    assert all(isinstance(it, tuple) and len(it) == 3 for it in a)
    arrival, ids, params = a[0]
    assert arrival == 0.0 and isinstance(params, SamplingParams) and params.ignore_eos and params.greedy


def test_lengths_in_range():
    spec = WorkloadSpec(num_requests=300, prompt_len=(5, 50), output_len={"kind": "lognormal", "median": 20,
                                                                              "sigma": 1.0, "lo": 2, "hi": 64})
    items = make_workload(spec, vocab_size=VOCAB)
    plens = [len(it.prompt_ids) for it in items]
    olens = [it.params.max_tokens for it in items]
    assert min(plens) >= 5 and max(plens) <= 50 and len(set(plens)) > 20
    assert min(olens) >= 2 and max(olens) <= 64
    assert 12 <= statistics.median(olens) <= 30  # lognormal median 20
    assert all(0 <= t < VOCAB for it in items for t in it.prompt_ids)
    fixed = make_workload(WorkloadSpec(num_requests=5, prompt_len=9, output_len=3), vocab_size=VOCAB)
    assert {len(it.prompt_ids) for it in fixed} == {9} and {it.params.max_tokens for it in fixed} == {3}


def test_all_at_once_and_poisson_arrivals():
    now = make_workload(WorkloadSpec(num_requests=10, rate=math.inf, prompt_len=4, output_len=2), vocab_size=VOCAB)
    assert [it.arrival_s for it in now] == [0.0] * 10
    rate = 20.0
    items = make_workload(WorkloadSpec(num_requests=2000, rate=rate, prompt_len=4, output_len=2, seed=1),
                          vocab_size=VOCAB)
    times = [it.arrival_s for it in items]
    assert times[0] == 0.0 and times == sorted(times)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.mean(gaps) == pytest.approx(1 / rate, rel=0.15)
    # exponential gaps: the standard deviation is about the mean
    assert statistics.pstdev(gaps) == pytest.approx(1 / rate, rel=0.25)


def test_duration_limits_arrivals():
    items = make_workload(WorkloadSpec(num_requests=None, rate=50.0, duration_s=2.0, prompt_len=4, output_len=2),
                          vocab_size=VOCAB)
    assert 50 <= len(items) <= 160 and all(it.arrival_s < 2.0 for it in items)
    capped = make_workload(WorkloadSpec(num_requests=10, rate=50.0, duration_s=2.0, prompt_len=4, output_len=2),
                           vocab_size=VOCAB)
    assert len(capped) == 10


def test_random_source_needs_vocab_and_corpus_needs_tokenizer():
    with pytest.raises(ValueError, match="^vocab_size:"):
        make_workload(WorkloadSpec(num_requests=2, source="random"))
    with pytest.raises(ValueError, match="^source: corpus prompts need"):
        make_workload(WorkloadSpec(num_requests=2, source="corpus"), vocab_size=VOCAB)


def test_corpus_prompts_are_code_cut_to_length(tiny_hf_checkpoint):
    model_dir = tiny_hf_checkpoint("mixtral")
    tok = Tokenizer.from_dir(model_dir)
    spec = WorkloadSpec(num_requests=6, prompt_len=(8, 120), output_len=4, seed=2)
    items = make_workload(spec, tokenizer=tok, vocab_size=320)
    again = make_workload(spec, tokenizer=tok, vocab_size=320)
    assert _items_key(items) == _items_key(again)
    # the prompt lengths are the spec's own draws (the second of the seed's four streams)
    want = LengthDist.parse((8, 120)).sample(np.random.default_rng(np.random.SeedSequence(2).spawn(4)[1]), 6)
    assert [len(it.prompt_ids) for it in items] == want
    text = tok.decode(items[0].prompt_ids)
    assert text and any(word in text for word in ("def", "class", "return", "self", "(", "=")), text


# -- JSONL

def _write(tmp_path, lines, name="reqs.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_requests(tmp_path, tiny_hf_checkpoint):
    path = _write(tmp_path, [json.dumps({"prompt_ids": [5, 6, 7], "max_tokens": 4}), "",
                             json.dumps({"prompt": "def f(x):\n    return x\n"}),
                             json.dumps({"prompt_ids": [9], "max_tokens": 1, "note": "extra keys are ignored"})])
    tok = Tokenizer.from_dir(tiny_hf_checkpoint("mixtral"))
    items = make_workload(WorkloadSpec(num_requests=None, source="jsonl", jsonl_path=path, output_len=6),
                          tokenizer=tok, vocab_size=320)
    assert len(items) == 3
    assert items[0].prompt_ids == [5, 6, 7] and items[0].params.max_tokens == 4
    assert items[1].prompt_ids == tok.encode("def f(x):\n    return x\n") and items[1].params.max_tokens == 6
    assert items[2].params.max_tokens == 1
    # more requests than lines: the file repeats; arrivals follow the rate
    cycled = make_workload(WorkloadSpec(num_requests=7, rate=5.0, source="jsonl", jsonl_path=path),
                           tokenizer=tok, vocab_size=320)
    assert [it.prompt_ids for it in cycled[3:6]] == [it.prompt_ids for it in items]
    assert cycled[-1].arrival_s > 0


@pytest.mark.parametrize("line, message", [
    ('{"prompt_ids": [1, 2]', "reqs.jsonl:2: not valid JSON"),
    ('[1, 2, 3]', "reqs.jsonl:2: each line must be a JSON object"),
    ('{"max_tokens": 3}', 'reqs.jsonl:2: needs exactly one of "prompt"'),
    ('{"prompt": "x", "prompt_ids": [1]}', 'reqs.jsonl:2: needs exactly one of "prompt"'),
    ('{"prompt": ""}', 'reqs.jsonl:2: "prompt" must be a non-empty string'),
    ('{"prompt_ids": [1, -2]}', 'reqs.jsonl:2: "prompt_ids" must be a non-empty list'),
    ('{"prompt_ids": []}', 'reqs.jsonl:2: "prompt_ids" must be a non-empty list'),
    ('{"prompt_ids": [1], "max_tokens": 0}', 'reqs.jsonl:2: "max_tokens" must be an integer >= 1'),
    ('{"prompt_ids": [1], "max_tokens": "8"}', 'reqs.jsonl:2: "max_tokens" must be an integer >= 1'),
    ('{"prompt_ids": [1, 5000]}', 'reqs.jsonl:2: "prompt_ids" has id 5000, outside the vocabulary'),
    ('{"prompt": "def f(): pass"}', 'reqs.jsonl:2: "prompt" text needs a tokenizer'),
])
def test_jsonl_errors_are_one_line_and_name_the_line(tmp_path, line, message):
    path = _write(tmp_path, ['{"prompt_ids": [1, 2, 3]}', line])
    with pytest.raises(ValueError) as err:
        make_workload(WorkloadSpec(num_requests=None, source="jsonl", jsonl_path=path), vocab_size=VOCAB)
    text = str(err.value)
    assert text.startswith(message), text
    assert "\n" not in text


def test_jsonl_missing_or_empty_file(tmp_path):
    with pytest.raises(ValueError, match="^jsonl_path: .* does not exist"):
        make_workload(WorkloadSpec(source="jsonl", jsonl_path=tmp_path / "nope.jsonl"), vocab_size=VOCAB)
    empty = _write(tmp_path, ["", "   "], "empty.jsonl")
    with pytest.raises(ValueError, match="^jsonl_path: .* has no requests"):
        make_workload(WorkloadSpec(source="jsonl", jsonl_path=empty), vocab_size=VOCAB)


# -- the driver

@pytest.fixture(scope="module")
def engine(tiny_engine_checkpoint):
    # small chunks and token budget, so a run mixes chunked prefills with decodes
    knobs = SchedulerKnobs(max_num_seqs=8, max_num_batched_tokens=48, long_prefill_token_threshold=16)
    return LLMEngine(EngineConfig(model=str(tiny_engine_checkpoint), num_kv_blocks=64, block_size=4, knobs=knobs))


@pytest.mark.parametrize("realtime", [True, False])
def test_run_workload_completes_everything_without_leaks(engine, realtime):
    spec = WorkloadSpec(num_requests=12, rate=400.0, prompt_len=(3, 40), output_len=(1, 12), seed=5)
    items = workload_for_engine(spec, engine)  # no tokenizer: random ids
    res = run_workload(engine, items, realtime=realtime, keep_outputs=True)
    s = res.summary
    assert s["requests"] == s["completed"] == 12 and s["rejected"] == 0
    assert engine.blocks.num_used == 0
    engine.blocks.check_invariants()
    assert not engine.has_unfinished()
    assert [r["output_tokens"] for r in res.requests] == [it.params.max_tokens for it in items]
    assert all(len(r["output_ids"]) == it.params.max_tokens for r, it in zip(res.requests, items))
    assert all(r["finish_reason"] == "length" for r in res.requests)
    assert s["output_tokens"] == sum(it.params.max_tokens for it in items)
    assert s["prompt_tokens"] == sum(len(it.prompt_ids) for it in items)
    assert s["output_throughput"] > 0 and s["request_throughput"] > 0 and s["steps"] > 0
    assert 1 <= s["mean_batch_size"] <= 8
    for key in ("ttft", "tpot", "e2e", "queue_time", "itl"):
        assert set(s[key]) == {"count", "mean", "p50", "p90", "p99", "max"}
    assert s["ttft"]["p50"] <= s["ttft"]["p99"] and s["ttft"]["count"] == 12
    for r in res.requests:
        assert r["ttft"] >= 0 and r["e2e"] >= r["ttft"] and r["queue_time"] >= 0
    json.dumps(res.as_dict())  # serialisable


def test_run_workload_greedy_outputs_match_generate(engine):
    """The driver adds nothing of its own: same tokens as LLMEngine.generate on the same prompts."""
    items = make_workload(WorkloadSpec(num_requests=4, prompt_len=(2, 20), output_len=(2, 6), seed=9),
                          vocab_size=engine.model_config.vocab_size)
    res = run_workload(engine, items, keep_outputs=True)
    ref = engine.generate([it.prompt_ids for it in items], [it.params for it in items])
    assert [r["output_ids"] for r in res.requests] == [o.token_ids for o in ref]


def test_run_workload_skips_idle_gaps_when_not_realtime(engine):
    items = [WorkloadItem(0.0, [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)),
             WorkloadItem(30.0, [4, 5, 6], SamplingParams(max_tokens=2, ignore_eos=True))]
    res = run_workload(engine, items, realtime=False)
    assert res.summary["completed"] == 2
    assert res.summary["duration_s"] < 10 and res.summary["idle_skipped_s"] > 20
    assert res.requests[1]["ttft"] < 10  # measured from its (shifted) arrival, not from the start


def test_run_workload_records_refused_requests(engine):
    too_long = WorkloadItem(0.0, [1] * 100, SamplingParams(max_tokens=100))  # beyond the 128-token context
    ok = WorkloadItem(0.0, [1, 2], SamplingParams(max_tokens=1, ignore_eos=True))
    res = run_workload(engine, [too_long, ok])
    assert res.summary["rejected"] == 1 and res.summary["completed"] == 1
    assert res.requests[0]["finish_reason"] == "rejected" and res.requests[0]["error"].startswith("prompt:")
    assert engine.blocks.num_used == 0


def test_run_workload_reports_in_the_order_given(engine):
    late = WorkloadItem(0.05, [7, 8, 9, 10], SamplingParams(max_tokens=3, ignore_eos=True))
    early = WorkloadItem(0.0, [1, 2], SamplingParams(max_tokens=1, ignore_eos=True))
    res = run_workload(engine, [late, early], realtime=False)
    assert [r["prompt_tokens"] for r in res.requests] == [4, 2]
    assert [r["output_tokens"] for r in res.requests] == [3, 1]
    assert [r["arrival_s"] for r in res.requests] == [0.05, 0.0]


def test_workload_option_takes_a_file_at_a_rate(tmp_path):
    path = _write(tmp_path, [json.dumps({"prompt_ids": [5, 6, 7]}), json.dumps({"prompt_ids": [8]})])
    spec = WorkloadSpec.from_option(f"file={path},rate=4,seed=2")
    assert (spec.source, spec.rate, spec.seed, spec.num_requests) == ("jsonl", 4.0, 2, None)
    items = make_workload(spec, vocab_size=VOCAB)
    assert [it.prompt_ids for it in items] == [[5, 6, 7], [8]] and items[-1].arrival_s > 0  # every line, spread
    assert len(make_workload(WorkloadSpec.from_option(f"requests=5,rate=4,file={path}"), vocab_size=VOCAB)) == 5
    with pytest.raises(ValueError, match="^jsonl_path: .* does not exist"):
        make_workload(WorkloadSpec.from_option(f"file={tmp_path / 'nope.jsonl'},rate=4"), vocab_size=VOCAB)
