"""What a request gets back: RequestOutput per step, RequestStream to read them from any thread,
and the errors a failed step reports (StepFailed; EngineLost when the engine cannot go on)."""

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
    error: str | None = None  # with finish_reason "error": why, e.g. "step 7 failed: RuntimeError: ..."


def describe_error(exc: BaseException) -> str:
    """One line naming an exception: its type and the first line of its message."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


class EngineLost(RuntimeError):
    """An error after which the engine cannot run another step (a distributed rank is gone, the
    ranks are out of step): a step failing with it fails the engine, not only its requests."""


class StepFailed(RuntimeError):
    """A step's model run, sampler or postprocess raised (the original is its __cause__). The
    step's requests were ended (finish_reason "error", RequestOutput.error saying why) and their
    KV blocks freed. outputs: what the step produced, those requests' last outputs among them;
    in_a_row: failed steps since the last good one; failure: set when the engine should not
    serve on (EngineCore.failure: why), None when the next step may run."""

    def __init__(self, message: str, outputs: list[RequestOutput], in_a_row: int, failure: str | None):
        super().__init__(message)
        self.outputs, self.in_a_row, self.failure = outputs, in_a_row, failure


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
