"""The live console's demo workload: an endless Poisson stream of corpus prompts, fed to the
engine on its own thread and steered while it runs (rate, lengths, pause). It runs where the
engine runs (server/engine_host.py); a console only sends it the operator's changes."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace

from moectl.engine.tools.workload import WorkloadSpec, make_workload
from moectl.wire.actions import ActionRefused


@dataclass(frozen=True)
class DemoLoad:
    """The live demo's workload, editable while it runs."""

    rate: float = 4.0  # requests per second (Poisson)
    prompt_len: str = "32-256"
    output_len: str = "32-128"
    paused: bool = False

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
            items = make_workload(self.load.spec(self.seed, self.BATCH), engine.tokenizer,
                                  engine.model_config.vocab_size)
            self.queue.extend(items)
        out = []
        while self.queue and self.queue[0].arrival_s <= now:
            out.append(self.queue.popleft())
        if not self.queue:  # the next batch's arrivals start after this one's
            self.t0 += now
        return out
