"""What a request gets back: RequestOutput per step, and RequestStream to read them from any thread."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    new_token_ids: list[int]  # tokens added by this step
    text: str
    finished: bool
    finish_reason: str | None
    metrics: dict = field(default_factory=dict)
    # with SamplingParams.logprobs: (logprob, [(id, logprob), ...]) for new_token_ids, and for
    # every output token once finished; with prompt_logprobs: per prompt token (the first is None),
    # on the output that ends the prompt's prefill and on the finished one
    new_logprobs: list | None = None
    logprobs: list | None = None
    prompt_logprobs: list | None = None


class RequestStream:
    """Thread-safe iterator over one request's outputs, ending with the finished one."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self._sink = None
        self._sink_lock = threading.Lock()

    def put(self, out: RequestOutput) -> None:
        with self._sink_lock:
            sink = self._sink
            if sink is None:
                self._queue.put(out)
                return
        sink(out)

    def set_sink(self, sink) -> None:
        """Send outputs to sink(out) instead of the iterator: first those already queued, in
        order, then each new one as the engine thread produces it (so sink must return at once;
        an event loop's bridge, for example)."""
        with self._sink_lock:
            while True:
                try:
                    sink(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._sink = sink

    def __iter__(self):
        while True:
            out = self._queue.get()
            yield out
            if out.finished:
                return
