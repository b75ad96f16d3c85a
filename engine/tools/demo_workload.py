"""The live console's demo workload: an endless Poisson stream of corpus prompts, fed to the
engine on its own thread and steered while it runs (rate, lengths, pause). It runs where the
engine runs (server/engine_host.py); a console only sends it the operator's changes.

Besides chat-sized requests it mixes in the seeds' kinds of traffic: agent turns (a long prefix
every agent shares, its tools and instructions, which the prefix cache serves, then a short new
part) and long documents (1-1.5K-token prompts, a few output tokens). The documents' prefill
steps put hundreds of rows on each active expert, where a rebalance pays; the chat and agent
decode steps put a few, where fixed per-expert costs dominate and it mostly does not."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace

import numpy as np

from moectl.engine.tools.workload import WorkloadSpec, make_workload
from moectl.wire.actions import ActionRefused


@dataclass(frozen=True)
class DemoLoad:
    """The live demo's workload, editable while it runs."""

    rate: float = 4.0  # requests per second (Poisson)
    prompt_len: str = "32-256"
    output_len: str = "32-128"
    paused: bool = False
    agents: float = 0.25  # share of requests that are agent turns on the shared prefix
    documents: float = 0.1  # share of requests that are long documents

    @classmethod
    def from_spec(cls, spec: WorkloadSpec) -> DemoLoad:
        """The live demo's part of a --workload spec: its rate and lengths (it runs until quit)."""
        if spec.source == "jsonl":
            raise ValueError("--workload: the live demo draws corpus prompts; give rate=,prompt=,output=")
        load = cls(rate=spec.rate, prompt_len=spec.prompt_len, output_len=spec.output_len)
        load.spec(0, 1)
        return load

    def spec(self, seed: int, count: int) -> WorkloadSpec:
        if isinstance(self.rate, bool) or not isinstance(self.rate, (int, float)) or not 0 < self.rate <= 1000:
            raise ValueError(f"rate: must be a number of requests/s in (0, 1000], got {self.rate!r}")
        for name in ("agents", "documents"):
            share = getattr(self, name)
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
                raise ValueError(f"{name}: must be a share of the requests in [0, 1], got {share!r}")
        if self.agents + self.documents > 1:
            raise ValueError(f"agents, documents: their shares add up to more than 1 "
                             f"({self.agents} + {self.documents})")
        return WorkloadSpec(num_requests=count, rate=self.rate, prompt_len=self.prompt_len,
                            output_len=self.output_len, seed=seed)


class DemoWorkload:
    """An endless Poisson stream of corpus prompts: batches of make_workload, one seed each. Fed to
    the engine on its own thread (the driver's feed)."""

    BATCH = 32

    def __init__(self, load: DemoLoad):
        self.load = load
        self.seed = 0
        self.queue: deque = deque()
        self.t0 = time.monotonic()

    def steer(self, driver, **changes):
        """The operator's "workload" action: the changed load, checked now (ActionRefused names
        the field), in force from the engine thread's next turn. Returns the driver's Future."""
        try:
            load = replace(self.load, **changes)
            load.spec(0, 1)  # validates rate and lengths now
        except (TypeError, ValueError) as exc:
            raise ActionRefused(f"workload: {exc}") from None
        return driver.call(lambda: self.update(load) or {"workload": changes}, "workload")

    def update(self, load: DemoLoad) -> None:
        load.spec(0, 1)  # validates (ValueError names the field)
        self.load = load
        self.queue.clear()  # the new rate and lengths apply from now on
        self.t0 = time.monotonic()

    def feed(self, engine) -> None:
        for item in self.due(engine):
            try:
                engine.add_request(item.prompt_ids, item.params)
            except ValueError:
                pass  # a prompt too long for this KV cache: skipped, like a rejected request

    def due(self, engine) -> list:
        if self.load.paused:
            self.t0 = time.monotonic()
            return []
        now = time.monotonic() - self.t0
        if not self.queue:
            self.seed += 1
            self.queue.extend(self._mixed(engine))
        out = []
        while self.queue and self.queue[0].arrival_s <= now:
            out.append(self.queue.popleft())
        if not self.queue:  # the next batch's arrivals start after this one's
            self.t0 += now
        return out

    def _mixed(self, engine) -> list:
        """One batch of arrivals: chat requests, with agent turns and documents in their shares."""
        load = self.load
        vocab = engine.model_config.vocab_size
        items = make_workload(load.spec(self.seed, self.BATCH), engine.tokenizer, vocab)
        rng = np.random.default_rng(self.seed)
        kinds = rng.choice(3, size=len(items), p=[1 - load.agents - load.documents, load.agents, load.documents])
        limit = engine.max_model_len if hasattr(engine, "max_model_len") else 2048
        docs = make_workload(WorkloadSpec(num_requests=len(items), prompt_len=DOCUMENT_PROMPT,
                                          output_len=DOCUMENT_OUTPUT, seed=self.seed + 10_000), engine.tokenizer, vocab)
        turns = make_workload(WorkloadSpec(num_requests=len(items), prompt_len=AGENT_TURN, output_len=AGENT_OUTPUT,
                                           seed=self.seed + 20_000), engine.tokenizer, vocab)
        prefix = self._agent_prefix(engine)
        out = []
        for item, kind, doc, turn in zip(items, kinds, docs, turns):
            if kind == 1:
                item = item._replace(prompt_ids=prefix + turn.prompt_ids, params=turn.params)
            elif kind == 2:
                item = item._replace(prompt_ids=doc.prompt_ids, params=doc.params)
            if len(item.prompt_ids) + item.params.max_tokens <= limit:
                out.append(item)
        return out

    def _agent_prefix(self, engine) -> list[int]:
        """The instructions and tools every agent turn starts with: the same tokens each time."""
        if getattr(self, "_prefix", None) is None:
            (first,) = make_workload(WorkloadSpec(num_requests=1, prompt_len=AGENT_PREFIX, output_len=1, seed=7),
                                     engine.tokenizer, engine.model_config.vocab_size)
            self._prefix = list(first.prompt_ids)
        return self._prefix


AGENT_PREFIX = 768  # tokens every agent turn shares (the prefix cache serves them after the first)
AGENT_TURN = "32-128"
AGENT_OUTPUT = "16-64"
DOCUMENT_PROMPT = "1024-1536"
DOCUMENT_OUTPUT = "4-8"
