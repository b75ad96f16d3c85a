"""Synthetic and recorded workloads for demos and benchmarks, and a driver that replays them.

A `WorkloadSpec` says how requests arrive (a Poisson process at `rate` requests/s, or all at
once when rate is infinite), how many there are (a count, a duration, or both), how long their
prompts and outputs are, and where the prompt text comes from:

* "corpus": code snippets from the Python stdlib (engine.corpus), tokenized with the model's
  tokenizer and cut to the drawn length (more snippets are appended when one is too short);
* "random": deterministic random token ids (for checkpoints without a tokenizer);
* "auto": corpus when a tokenizer is given, random otherwise;
* "jsonl": one request per line, `{"prompt": "..."}` or `{"prompt_ids": [...]}`, with an
  optional `"max_tokens": N` (otherwise drawn from output_len).

`make_workload` turns a spec into `WorkloadItem(arrival_s, prompt_ids, params)` tuples, the
same ones for the same seed. `run_workload` feeds them into an engine's step loop at their
arrival times and returns per-request metrics and a summary (throughput, TTFT/TPOT/E2E
percentiles, batch sizes).

Length specs (`prompt_len`, `output_len`) accept: an int N (fixed), a pair (lo, hi) (uniform
integers, both ends included), a dict {"kind": "lognormal", "median": M, "sigma": S,
"lo": LO, "hi": HI}, a `LengthDist`, or a string "N", "LO-HI", "lognormal:M,S[,LO,HI]".
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from moectl.engine.core.sampling import SamplingParams

SOURCES = ("auto", "corpus", "random", "jsonl")
DIST_KINDS = ("fixed", "uniform", "lognormal")
_SNIPPET_BATCH = 64  # corpus snippets are fetched in fixed-size batches so the stream is seed-stable


# -- small statistics helpers

def summarize(values: Iterable[float | None], percentiles: Sequence[float] = (50, 90, 99)) -> dict:
    """{"count", "mean", "p50", "p90", "p99", "max"} over the non-None values (None when empty)."""
    data = [float(v) for v in values if v is not None]
    out: dict[str, Any] = {"count": len(data), "mean": (sum(data) / len(data)) if data else None}
    for q in percentiles:
        out[f"p{q:g}"] = float(np.percentile(data, q)) if data else None
    out["max"] = max(data) if data else None
    return out


# -- length distributions

@dataclass(frozen=True)
class LengthDist:
    """A distribution over positive integer lengths.

    fixed: always `lo` (== hi). uniform: integers in [lo, hi]. lognormal: exp(N(log median,
    sigma)) rounded and clipped to [lo, hi]."""
    kind: str = "fixed"
    lo: int = 1
    hi: int = 1
    median: float = 0.0
    sigma: float = 0.0

    def validate(self, name: str) -> None:
        if self.kind not in DIST_KINDS:
            raise ValueError(f"{name}: kind must be one of {', '.join(DIST_KINDS)}, got {self.kind!r}")
        for bound in (self.lo, self.hi):
            if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
                raise ValueError(f"{name}: lengths must be integers >= 1, got {bound!r}")
        if self.lo > self.hi:
            raise ValueError(f"{name}: lo {self.lo} is above hi {self.hi}")
        if self.kind == "fixed" and self.lo != self.hi:
            raise ValueError(f"{name}: a fixed length needs lo == hi")
        if self.kind == "lognormal":
            if not (isinstance(self.median, (int, float)) and self.median > 0 and math.isfinite(self.median)):
                raise ValueError(f"{name}: lognormal median must be a positive number, got {self.median!r}")
            if not (isinstance(self.sigma, (int, float)) and self.sigma >= 0 and math.isfinite(self.sigma)):
                raise ValueError(f"{name}: lognormal sigma must be a number >= 0, got {self.sigma!r}")

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "fixed":
            return [self.lo] * n
        if self.kind == "uniform":
            return [int(x) for x in rng.integers(self.lo, self.hi + 1, size=n)]
        draws = np.exp(rng.normal(math.log(self.median), self.sigma, size=n))
        return [int(x) for x in np.clip(np.rint(draws), self.lo, self.hi)]

    @property
    def max(self) -> int:
        return self.hi

    def describe(self) -> str:
        if self.kind == "fixed":
            return str(self.lo)
        if self.kind == "uniform":
            return f"uniform[{self.lo}, {self.hi}]"
        return f"lognormal(median {self.median:g}, sigma {self.sigma:g}) in [{self.lo}, {self.hi}]"

    @classmethod
    def parse(cls, spec: Any, name: str = "length") -> LengthDist:
        """int -> fixed, (lo, hi) -> uniform, dict/str forms as in the module docstring."""
        if isinstance(spec, LengthDist):
            dist = spec
        elif isinstance(spec, bool):
            raise ValueError(f"{name}: expected a length, got {spec!r}")
        elif isinstance(spec, int):
            dist = cls("fixed", spec, spec)
        elif isinstance(spec, (tuple, list)):
            if len(spec) != 2:
                raise ValueError(f"{name}: a range must be (lo, hi), got {spec!r}")
            dist = cls("uniform", spec[0], spec[1])
        elif isinstance(spec, dict):
            kind = spec.get("kind", "fixed")
            unknown = set(spec) - {"kind", "value", "lo", "hi", "median", "sigma"}
            if unknown:
                raise ValueError(f"{name}: unknown key {sorted(unknown)[0]!r}")
            if kind == "fixed":
                value = spec.get("value", spec.get("lo"))
                dist = cls("fixed", value, value)
            elif kind == "uniform":
                dist = cls("uniform", spec.get("lo"), spec.get("hi"))
            else:
                dist = cls(kind, spec.get("lo", 1), spec.get("hi", 1 << 20), spec.get("median", 0.0),
                           spec.get("sigma", 0.0))
        elif isinstance(spec, str):
            dist = cls._parse_str(spec.strip(), name)
        else:
            raise ValueError(f"{name}: expected an int, (lo, hi), a dict or a string, got {spec!r}")
        dist.validate(name)
        return dist

    @classmethod
    def _parse_str(cls, s: str, name: str) -> LengthDist:
        try:
            if s.startswith("lognormal:"):
                parts = [p.strip() for p in s.split(":", 1)[1].split(",")]
                if len(parts) not in (2, 4):
                    raise ValueError
                lo, hi = (int(parts[2]), int(parts[3])) if len(parts) == 4 else (1, 1 << 20)
                return cls("lognormal", lo, hi, float(parts[0]), float(parts[1]))
            if "-" in s:
                lo, hi = s.split("-", 1)
                return cls("uniform", int(lo), int(hi))
            return cls("fixed", int(s), int(s))
        except ValueError:
            raise ValueError(f"{name}: cannot parse {s!r} (use N, LO-HI or lognormal:MEDIAN,SIGMA[,LO,HI])") from None


# -- the spec

@dataclass
class WorkloadSpec:
    """What to generate. Validated on construction; ValueError messages start with the field.

    rate: mean arrivals per second of a Poisson process (the first request arrives at 0 s, the
    gaps after it are exponential with mean 1/rate). `math.inf` (the default) means every
    request arrives at once, at 0 s. Zero or negative rates are refused.
    num_requests / duration_s: at least one is needed (jsonl: neither means one request per
    line). With both, generation stops at whichever limit comes first; duration_s needs a
    finite rate.
    """
    num_requests: int | None = 64
    rate: float = math.inf
    duration_s: float | None = None
    prompt_len: Any = (32, 512)
    output_len: Any = (16, 256)
    seed: int = 0
    source: str = "auto"  # auto | corpus | random | jsonl
    jsonl_path: str | Path | None = None
    temperature: float = 0.0
    ignore_eos: bool = True  # so every request produces exactly its drawn output length
    snippet_chars: tuple[int, int] = (64, 400)  # corpus snippet size bounds, in characters
    _prompt: LengthDist = field(init=False, repr=False)
    _output: LengthDist = field(init=False, repr=False)

    def __post_init__(self):
        if self.num_requests is not None and (isinstance(self.num_requests, bool)
                                              or not isinstance(self.num_requests, int) or self.num_requests < 1):
            raise ValueError(f"num_requests: must be an integer >= 1, got {self.num_requests!r}")
        if isinstance(self.rate, bool) or not isinstance(self.rate, (int, float)) or math.isnan(self.rate) \
                or self.rate <= 0:
            raise ValueError(f"rate: must be > 0 requests/s (math.inf for all at once), got {self.rate!r}")
        if self.duration_s is not None:
            if isinstance(self.duration_s, bool) or not isinstance(self.duration_s, (int, float)) \
                    or not 0 < self.duration_s < math.inf:
                raise ValueError(f"duration_s: must be a positive number of seconds, got {self.duration_s!r}")
            if math.isinf(self.rate):
                raise ValueError("duration_s: needs a finite rate (with rate=inf every request arrives at 0 s)")
        if self.source not in SOURCES:
            raise ValueError(f"source: must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if self.source == "jsonl":
            if self.jsonl_path is None:
                raise ValueError("jsonl_path: required when source is jsonl")
        elif self.jsonl_path is not None:
            raise ValueError(f"jsonl_path: only used with source='jsonl' (source is {self.source!r})")
        if self.num_requests is None and self.duration_s is None and self.source != "jsonl":
            raise ValueError("num_requests: give num_requests or duration_s")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed: must be an integer >= 0, got {self.seed!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature: must be in [0, 100], got {self.temperature!r}")
        lo_c, hi_c = self.snippet_chars
        if not (isinstance(lo_c, int) and isinstance(hi_c, int) and 1 <= lo_c <= hi_c):
            raise ValueError(f"snippet_chars: must be (min, max) with 1 <= min <= max, got {self.snippet_chars!r}")
        self._prompt = LengthDist.parse(self.prompt_len, "prompt_len")
        self._output = LengthDist.parse(self.output_len, "output_len")

    @classmethod
    def from_option(cls, text: str) -> WorkloadSpec:
        """The CLI's --workload: a JSONL path (all its requests at once), or 'key=value,...' with keys
        requests, rate, duration, prompt, output, seed, source, temperature and file (a JSONL path
        whose prompts arrive at `rate`), e.g. 'rate=4,prompt=32-512,output=16-256,requests=64'."""
        if Path(text).is_file() or ("=" not in text and text.endswith(".jsonl")):  # key=value lists have "="
            return cls(num_requests=None, source="jsonl", jsonl_path=text)
        keys = {"requests": "num_requests", "rate": "rate", "duration": "duration_s", "prompt": "prompt_len",
                "output": "output_len", "seed": "seed", "source": "source", "temperature": "temperature",
                "file": "jsonl_path"}
        kw: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key not in keys:
                raise ValueError(f"--workload: {part!r} is not key=value with a key in {', '.join(keys)}")
            name = keys[key]
            try:
                if name in ("num_requests", "seed"):
                    kw[name] = int(value)
                elif name in ("rate", "duration_s", "temperature"):
                    kw[name] = float(value)
                else:
                    kw[name] = value
            except ValueError:
                raise ValueError(f"--workload: {key}={value!r} is not a number") from None
        if "jsonl_path" in kw:
            kw.setdefault("source", "jsonl")
            if "num_requests" not in kw and "duration_s" not in kw:
                kw["num_requests"] = None  # every line of the file once
        return cls(**kw)

    @property
    def prompt_dist(self) -> LengthDist:
        return self._prompt

    @property
    def output_dist(self) -> LengthDist:
        return self._output

    def describe(self) -> dict:
        """A JSON-serialisable summary for reports."""
        return {"num_requests": self.num_requests, "rate": "inf" if math.isinf(self.rate) else self.rate,
                "duration_s": self.duration_s, "prompt_len": self._prompt.describe(),
                "output_len": self._output.describe(), "seed": self.seed, "source": self.source,
                "jsonl_path": None if self.jsonl_path is None else str(self.jsonl_path),
                "temperature": self.temperature, "ignore_eos": self.ignore_eos}


class WorkloadItem(NamedTuple):
    arrival_s: float  # offset from the start of the run
    prompt_ids: list[int]
    params: SamplingParams


# -- prompt sources

def _plain_encoder(tokenizer) -> tuple[Callable[[str], list[int]], list[int]]:
    """(encode without special tokens, prefix ids such as BOS) for engine.tokenizer.Tokenizer,
    a `tokenizers.Tokenizer`, or anything with encode(text) -> list[int]."""
    inner = getattr(tokenizer, "inner", None)
    if inner is not None:  # engine.tokenizer.Tokenizer
        prefix = [tokenizer.bos_token_id] if getattr(tokenizer, "add_bos", False) else []
        return (lambda text: inner.encode(text, add_special_tokens=False).ids), prefix
    if hasattr(tokenizer, "encode_batch") and hasattr(tokenizer, "token_to_id"):  # tokenizers.Tokenizer
        return (lambda text: tokenizer.encode(text, add_special_tokens=False).ids), []
    return (lambda text: list(tokenizer.encode(text))), []


def _corpus_snippets(seed: int, chars: tuple[int, int]) -> Iterator[str]:
    """An endless, seed-determined stream of code snippets, fetched in fixed-size batches."""
    try:
        from moectl.engine.tools import corpus
        fetch = corpus.code_snippets
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"source: the corpus is not available ({exc}); use source='random'") from None
    batch = 0
    while True:
        # a distinct, reproducible seed per batch: code_snippets(n, seed) is deterministic
        yield from fetch(_SNIPPET_BATCH, seed=seed * 1_000_003 + batch, min_chars=chars[0], max_chars=chars[1])
        batch += 1


def _corpus_prompts(lengths: list[int], tokenizer, seed: int, chars: tuple[int, int]) -> list[list[int]]:
    encode, prefix = _plain_encoder(tokenizer)
    stream = _corpus_snippets(seed, chars)
    prompts = []
    for length in lengths:
        ids = list(prefix)
        while len(ids) < length:
            piece = encode(next(stream) + "\n")
            if not piece:
                continue
            ids += piece
        prompts.append(ids[:length])
    return prompts


def _random_prompts(lengths: list[int], vocab_size: int, rng: np.random.Generator) -> list[list[int]]:
    return [[int(t) for t in rng.integers(0, vocab_size, size=n)] for n in lengths]


def _jsonl_records(path: str | Path) -> list[dict]:
    """Parsed and shape-checked lines; ValueError '<file>:<line>: <problem>' on the first bad one."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"jsonl_path: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"jsonl_path: cannot read {path} ({exc.__class__.__name__}: {exc})") from None
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path.name}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: each line must be a JSON object, got {type(obj).__name__}")
        has_text, has_ids = "prompt" in obj, "prompt_ids" in obj
        if has_text == has_ids:
            raise ValueError(f'{where}: needs exactly one of "prompt" (a string) or "prompt_ids" (a list of token ids)')
        if has_text and (not isinstance(obj["prompt"], str) or not obj["prompt"]):
            raise ValueError(f'{where}: "prompt" must be a non-empty string')
        if has_text:
            try:  # JSON may escape a lone surrogate ("\ud800"), which no tokenizer can encode
                obj["prompt"].encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f'{where}: "prompt" is not valid text (a lone surrogate at character {exc.start})') \
                    from None
        if has_ids:
            ids = obj["prompt_ids"]
            if not isinstance(ids, list) or not ids or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                                                           for t in ids):
                raise ValueError(f'{where}: "prompt_ids" must be a non-empty list of non-negative integers')
        if "max_tokens" in obj:
            m = obj["max_tokens"]
            if isinstance(m, bool) or not isinstance(m, int) or m < 1:
                raise ValueError(f'{where}: "max_tokens" must be an integer >= 1, got {m!r}')
        records.append({"where": where, **obj})
    if not records:
        raise ValueError(f"jsonl_path: {path} has no requests")
    return records


# -- the generator

def _arrivals(spec: WorkloadSpec, rng: np.random.Generator, cap: int | None) -> list[float]:
    if math.isinf(spec.rate):
        return [0.0] * cap  # cap is set: duration_s needs a finite rate
    out, t = [], 0.0
    while cap is None or len(out) < cap:
        if spec.duration_s is not None and t >= spec.duration_s:
            break
        out.append(t)
        t += float(rng.exponential(1.0 / spec.rate))
    return out


def make_workload(spec: WorkloadSpec, tokenizer=None, vocab_size: int | None = None) -> list[WorkloadItem]:
    """The spec's requests in arrival order; the same for the same spec (seed included).

    tokenizer: the model's tokenizer (engine.tokenizer.Tokenizer or tokenizers.Tokenizer), needed
    for source corpus and for jsonl "prompt" text. vocab_size: needed for source random, and used
    to check jsonl prompt_ids."""
    seeds = np.random.SeedSequence(spec.seed).spawn(4)
    arrival_rng, prompt_rng, output_rng, token_rng = (np.random.default_rng(s) for s in seeds)
    source = spec.source
    if source == "auto":
        source = "corpus" if tokenizer is not None else "random"
    if source == "corpus" and tokenizer is None:
        raise ValueError("source: corpus prompts need the model's tokenizer (this checkpoint has none; use random)")
    if source == "random" and not (isinstance(vocab_size, int) and vocab_size > 0):
        raise ValueError("vocab_size: random prompts need the model's vocabulary size")

    records = _jsonl_records(spec.jsonl_path) if source == "jsonl" else None
    cap = spec.num_requests if spec.num_requests is not None or records is None else len(records)
    arrivals = _arrivals(spec, arrival_rng, cap)
    n = len(arrivals)
    prompt_lens = spec.prompt_dist.sample(prompt_rng, n)
    output_lens = spec.output_dist.sample(output_rng, n)

    if records is not None:
        prompts = []
        for i in range(n):
            rec = records[i % len(records)]
            if "prompt_ids" in rec:
                ids = list(rec["prompt_ids"])
                if vocab_size is not None and max(ids) >= vocab_size:
                    raise ValueError(f'{rec["where"]}: "prompt_ids" has id {max(ids)}, outside the vocabulary '
                                     f'of {vocab_size}')
            else:
                if tokenizer is None:
                    raise ValueError(f'{rec["where"]}: "prompt" text needs a tokenizer and this checkpoint has '
                                     f'none (use "prompt_ids")')
                encode, prefix = _plain_encoder(tokenizer)
                ids = prefix + encode(rec["prompt"])
                if not ids:
                    raise ValueError(f'{rec["where"]}: "prompt" encodes to no tokens')
            prompts.append(ids)
            if "max_tokens" in rec:
                output_lens[i] = rec["max_tokens"]
    elif source == "corpus":
        prompts = _corpus_prompts(prompt_lens, tokenizer, spec.seed, spec.snippet_chars)
    else:
        prompts = _random_prompts(prompt_lens, vocab_size, token_rng)

    items = []
    for i in range(n):
        params = SamplingParams(max_tokens=output_lens[i], temperature=spec.temperature, ignore_eos=spec.ignore_eos,
                                seed=(spec.seed * 1_000_003 + i) % (2**63) if spec.temperature > 0 else None)
        items.append(WorkloadItem(arrivals[i], prompts[i], params))
    return items


def iter_workload(spec: WorkloadSpec, tokenizer=None, vocab_size: int | None = None) -> Iterator[WorkloadItem]:
    """make_workload as an iterator of (arrival_offset_s, prompt_ids, SamplingParams)."""
    yield from make_workload(spec, tokenizer, vocab_size)


def workload_for_engine(spec: WorkloadSpec, engine) -> list[WorkloadItem]:
    """make_workload with the engine's tokenizer and vocabulary."""
    return make_workload(spec, engine.tokenizer, engine.model_config.vocab_size)


class WorkloadFeed:
    """Adds workload items to an engine when their arrival time comes: an EngineDriver's feed
    (called on the engine thread before every step). The clock starts at the first call."""

    def __init__(self, items: Iterable[WorkloadItem]):
        self._items = deque(sorted(items, key=lambda it: it.arrival_s))
        self._t0: float | None = None
        self.added = 0
        self.rejected = 0  # requests the engine refused (e.g. longer than its KV cache can ever hold)

    @property
    def exhausted(self) -> bool:
        return not self._items

    def __call__(self, engine) -> None:
        if self._t0 is None:
            self._t0 = time.monotonic()
        now = time.monotonic() - self._t0
        while self._items and self._items[0].arrival_s <= now:
            item = self._items.popleft()
            try:
                engine.add_request(item.prompt_ids, item.params, arrival=self._t0 + item.arrival_s)
            except ValueError:
                self.rejected += 1
            else:
                self.added += 1


# -- running a workload on the caller's thread

@dataclass
class StepTotals:
    """Running sums over a run's engine steps: everything summarize_run reports about steps, in
    memory that does not grow with the run (a step's record is ~25 KB; a long run has millions)."""
    steps: int = 0
    seqs: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    tokens: int = 0
    step_s: float = 0.0
    preemptions: int = 0

    def add(self, stats) -> None:
        """One StepStats (or anything with its fields)."""
        self.steps += 1
        self.seqs += stats.num_seqs
        if stats.decode_tokens:
            self.decode_steps += 1
            self.decode_tokens += stats.decode_tokens
        self.tokens += stats.prefill_tokens + stats.decode_tokens
        self.step_s += stats.t_end - stats.t_start
        self.preemptions += len(stats.preempted)

    @classmethod
    def of(cls, steps: Iterable) -> StepTotals:
        totals = cls()
        for stats in steps:
            totals.add(stats)
        return totals


@dataclass
class WorkloadResult:
    requests: list[dict]  # per request, in workload order
    summary: dict

    def as_dict(self) -> dict:
        return {"summary": self.summary, "requests": self.requests}


def run_workload(engine, items: Sequence[WorkloadItem] | Iterable[tuple], realtime: bool = True, *,
                 keep_outputs: bool = False, on_step: Callable[[list], None] | None = None,
                 max_steps: int | None = None) -> WorkloadResult:
    """Feed items into the engine at their arrival offsets and step until every request ends.

    realtime=True: requests are added when the wall clock reaches their offset; an idle engine
    sleeps until then. realtime=False: the same, except that idle gaps are skipped (the clock
    jumps to the next arrival), so a sparse workload runs as fast as the engine allows while
    busy periods keep their real timing. Latencies are measured from each request's (possibly
    shifted) arrival time. A request the engine refuses (ValueError) is recorded with its
    error and not retried.

    Returns per-request metrics in the order of `items` (ttft, tpot, e2e, queue_time, itl, token
    counts; output token ids when keep_outputs) and a summary. Other requests may share the
    engine; only this workload's are measured.
    """
    given = [WorkloadItem(*it) for it in items]
    records: list[dict] = [{"index": i, "request_id": None, "arrival_s": it.arrival_s,
                            "prompt_tokens": len(it.prompt_ids), "max_tokens": it.params.max_tokens}
                           for i, it in enumerate(given)]
    order = sorted(range(len(given)), key=lambda i: given[i].arrival_s)  # stable: ties keep their order
    items = [given[i] for i in order]
    by_id: dict[str, dict] = {}  # this workload's unfinished requests
    outputs: dict[str, list[int]] = {}
    steps = StepTotals()  # running sums: a list of every step's record would grow without bound
    start_step = engine.step_count
    t0 = time.monotonic()
    skew = 0.0  # seconds of idle time skipped (realtime=False)
    nxt = 0
    pending = 0
    while nxt < len(items) or pending:
        now = time.monotonic() - t0 + skew
        while nxt < len(items) and items[nxt].arrival_s <= now:
            it, rec = items[nxt], records[order[nxt]]
            try:
                rid = engine.add_request(it.prompt_ids, it.params, arrival=t0 - skew + it.arrival_s)
            except ValueError as exc:
                rec.update(error=str(exc), finish_reason="rejected")
            else:
                rec["request_id"] = rid
                by_id[rid] = rec
                pending += 1
            nxt += 1
        if not pending:
            if nxt < len(items):  # idle until the next arrival
                wait = items[nxt].arrival_s - (time.monotonic() - t0 + skew)
                if wait > 0:
                    if realtime:
                        time.sleep(min(wait, 0.05))
                    else:
                        skew += wait
            continue
        before = engine.step_count
        outs = engine.step()
        if engine.step_count > before and engine.step_log:
            steps.add(engine.step_log[-1])
        for out in outs:
            rec = by_id.get(out.request_id)
            if rec is None:
                continue
            if keep_outputs:
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                pending -= 1
                del by_id[out.request_id]
                m = out.metrics
                rec.update(finish_reason=out.finish_reason, output_tokens=m.get("output_tokens"),
                           ttft=m.get("ttft"), tpot=m.get("tpot"), e2e=m.get("e2e"),
                           queue_time=m.get("queue_time"), itl=m.get("itl", []),
                           cached_prompt_tokens=m.get("cached_prompt_tokens"), preemptions=m.get("preemptions"))
                if keep_outputs:
                    rec["output_ids"] = list(out.token_ids)
        if on_step is not None:
            on_step(outs)
        if max_steps is not None and engine.step_count - start_step >= max_steps:
            raise RuntimeError(f"max_steps: {max_steps} steps ran and {pending} requests are unfinished")
    wall = time.monotonic() - t0
    return WorkloadResult(records, summarize_run(records, steps, wall, skew))


def summarize_run(records: list[dict], steps: StepTotals | Iterable, wall_s: float, skipped_s: float = 0.0) -> dict:
    """Throughput, latency percentiles and batch statistics of one run. steps: the run's
    StepTotals, or its StepStats records."""
    t = steps if isinstance(steps, StepTotals) else StepTotals.of(steps)
    done = [r for r in records if r.get("ttft") is not None or r.get("e2e") is not None]
    out_tokens = sum(r.get("output_tokens") or 0 for r in done)
    prompt_tokens = sum(r["prompt_tokens"] for r in done)
    busy = max(wall_s, 1e-9)  # the wall time the run took, idle gaps skipped by realtime=False excluded
    itl = [g for r in done for g in (r.get("itl") or [])]
    n_steps = t.steps
    return {
        "requests": len(records),
        "completed": len(done),
        "rejected": sum(1 for r in records if r.get("finish_reason") == "rejected"),
        "duration_s": wall_s,
        "idle_skipped_s": skipped_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "output_throughput": out_tokens / busy,  # output tokens/s
        "total_throughput": (out_tokens + prompt_tokens) / busy,  # prompt + output tokens/s
        "request_throughput": len(done) / busy,  # requests/s
        "ttft": summarize(r.get("ttft") for r in done),
        "tpot": summarize(r.get("tpot") for r in done),
        "itl": summarize(itl),
        "e2e": summarize(r.get("e2e") for r in done),
        "queue_time": summarize(r.get("queue_time") for r in done),
        "steps": n_steps,
        "mean_batch_size": (t.seqs / n_steps) if n_steps else 0.0,
        "mean_decode_batch_size": (t.decode_tokens / t.decode_steps) if t.decode_steps else 0.0,
        "mean_tokens_per_step": (t.tokens / n_steps) if n_steps else 0.0,
        "mean_step_ms": (t.step_s / n_steps * 1e3) if n_steps else 0.0,
        "preemptions": t.preemptions,
    }


__all__ = ["LengthDist", "WorkloadSpec", "WorkloadItem", "WorkloadResult", "StepTotals", "make_workload", "iter_workload",
           "workload_for_engine", "run_workload", "summarize_run", "summarize"]
