"""The console's side of the engine process: a ConsoleSource (wire/interfaces.py) over wire/protocol.py.

EngineSource connects to an engine's directory (its Unix socket and token), takes the catch-up,
then a reader thread files every record as it arrives, so the console's tick only drains
deques; actions go out as Act messages and come back as Results, each on its own Future;
requests go out as Generate messages and their Outputs come back on a RequestHandle. When
the engine goes (killed, crashed, stopped) the connection's end says so at once: `error` names
the engine and the console stays up for inspection.

Torch-free: this is what a console process imports instead of an engine.
"""

from __future__ import annotations

import itertools
import queue
import socket
import threading
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

from moectl.console.sources import RECORD_BUFFER, RemotePlan
from moectl.wire.actions import Action, ActionRefused
from moectl.wire.interfaces import ConsoleSource
from moectl.wire.protocol import (
    Act,
    Alerts,
    Bye,
    Cancel,
    Generate,
    Hello,
    Output,
    ProtocolError,
    Records,
    Result,
    Shutdown,
    Status,
    Welcome,
    connect,
    encode,
    read_message,
    read_token,
)

WELCOME_TIMEOUT_S = 30.0  # a busy engine answers between steps


class RequestHandle:
    """A request sent to the engine (EngineSource.generate): its Output messages as they come."""

    def __init__(self, source: EngineSource, request: int):
        self._source, self._id = source, request
        self._outputs: queue.Queue[Output] = queue.Queue()
        self.request_id: str | None = None  # the engine's id for it, from its first Output

    def _put(self, output: Output) -> None:
        self.request_id = output.request_id or self.request_id
        self._outputs.put(output)

    def outputs(self, timeout_s: float | None = None):
        """Each Output until the finished one (TimeoutError if none comes within timeout_s)."""
        while True:
            try:
                output = self._outputs.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"request {self._id}: no output within {timeout_s} s") from None
            yield output
            if output.finished:
                return

    def result(self, timeout_s: float | None = None) -> dict:
        """The whole request once finished: its token ids, text, finish reason and error."""
        tokens: list[int] = []
        last = None
        for last in self.outputs(timeout_s):
            tokens += last.new_token_ids
        return {"request_id": last.request_id, "token_ids": tokens, "text": last.text, "finish_reason": last.finish_reason,
                "error": last.error, "prompt_tokens": last.prompt_tokens}

    def cancel(self) -> None:
        try:
            self._source._send(Cancel(id=self._id))
        except (OSError, ProtocolError) as exc:
            raise ActionRefused(f"cancel: not sent ({exc})") from None


class EngineSource(ConsoleSource):
    """An engine process's records and actions. owner: this console started the engine, which
    stops when this source closes (or this process dies); the engine grants it only to the process
    that started it, and refuses anyone else's claim (ActionRefused here)."""

    mode = "live"
    engine_alerts = True  # the engine computes the alerts: `alerts` and `alerts_version` follow its Alerts

    def __init__(self, engine_dir: Path, *, owner: bool = False, timeout_s: float = WELCOME_TIMEOUT_S,
                 client: str = "console", records: bool = True):
        """records: False for requests and actions only (the engine sends no record stream)."""
        self.engine_dir = Path(engine_dir)
        self.owner = owner
        self._records: deque = deque(maxlen=RECORD_BUFFER)
        self._actions: deque = deque(maxlen=RECORD_BUFFER)
        self._pending: dict[int, tuple[str, Future]] = {}
        self._requests: dict[int, RequestHandle] = {}
        self._requests_lock = threading.Lock()  # the reader's end of the connection and generate() alike
        self.unclaimed_outputs = 0
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._lost: str | None = None
        self.dropped = 0
        try:
            token = read_token(self.engine_dir)
            self._sock = connect(self.engine_dir)
        except ProtocolError as exc:
            raise ActionRefused(f"engine: {exc}") from None
        try:
            self._sock.settimeout(timeout_s)
            self._sock.sendall(encode(Hello(token=token, owner=owner, client=client, records=records)))
            welcome = read_message(self._sock)
            self._sock.settimeout(None)
        except (OSError, ProtocolError) as exc:
            self._sock.close()
            raise ActionRefused(f"engine: no welcome from {self.engine_dir} ({exc})") from None
        if not isinstance(welcome, Welcome):
            self._sock.close()
            reason = welcome.reason if isinstance(welcome, Bye) else "the engine closed the connection"
            raise ActionRefused(f"engine: {reason}")
        self.engine_name, self.pid = welcome.engine, welcome.pid
        self.header = welcome.header
        self._status = Status(**welcome.status)
        self._records.extend(welcome.steps)
        self._actions.extend(welcome.actions)
        self.alerts: list = welcome.alerts or []
        self.alerts_version = 0 if welcome.alerts is None else 1
        self._reader = threading.Thread(target=self._read_loop, name="moectl-engine-client", daemon=True)
        self._reader.start()

    # -- the reader thread
    def _read_loop(self) -> None:
        reason = "the connection closed"
        try:
            while True:
                message = read_message(self._sock)
                if message is None:
                    break
                if isinstance(message, Records):
                    self._records.extend(message.steps)
                    self._actions.extend(message.actions)
                    self.dropped = max(self.dropped, message.dropped)
                elif isinstance(message, Status):
                    self._status = message
                elif isinstance(message, Alerts):
                    self.alerts = message.alerts
                    self.alerts_version += 1
                elif isinstance(message, Result):
                    self._answer(message)
                elif isinstance(message, Output):
                    handle = self._requests.get(message.id)
                    if handle is None:
                        self.unclaimed_outputs += 1  # another client's, or a cancelled one's: none should come
                    else:
                        if message.finished:
                            self._requests.pop(message.id, None)
                        handle._put(message)
                elif isinstance(message, Bye):
                    reason = message.reason
                    break
        except (OSError, ProtocolError) as exc:
            reason = str(exc) or type(exc).__name__
        except Exception as exc:  # noqa: BLE001 - a message this client cannot use: said, not a dead thread
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        with self._requests_lock:
            self._lost = f"{self.engine_name} is gone: {reason}"
            handles, self._requests = dict(self._requests), {}
        for request, handle in handles.items():
            handle._put(Output(id=request, request_id=handle.request_id or "", finished=True, finish_reason="error",
                               error=self._lost))
        for kind, future in list(self._pending.values()):
            if not future.done():
                future.set_exception(ActionRefused(f"{kind}: {self._lost}"))
        self._pending.clear()

    def _answer(self, result: Result) -> None:
        kind, future = self._pending.pop(result.id, (None, None))
        if future is None:
            return
        if result.error is not None:
            future.set_exception(ActionRefused(result.error))
        elif kind == Action.REBALANCE_PREVIEW:
            future.set_result(RemotePlan(result.value["plan_id"], result.value["summary"]))
        else:
            future.set_result(result.value)

    # -- ConsoleSource
    @property
    def error(self) -> str | None:
        return self._lost or self._status.error

    @property
    def load(self):
        """The demo workload's rate, lengths and pause, as the engine last reported them."""
        return SimpleNamespace(**self._status.load) if self._status.load else None

    def poll(self) -> tuple[list[dict], list[dict]]:
        records = [self._records.popleft() for _ in range(len(self._records))]
        actions = [self._actions.popleft() for _ in range(len(self._actions))]
        return records, actions

    def act(self, kind: str, **args) -> Future:
        if self._lost is not None:
            raise ActionRefused(f"{kind}: {self._lost}")
        if kind == Action.REBALANCE_APPLY:
            args = RemotePlan.apply_args(args)
        future: Future = Future()
        act_id = next(self._ids)
        self._pending[act_id] = (kind, future)
        self._send_or_refuse(kind, Act(id=act_id, kind=kind, args=args), self._pending, act_id)
        return future

    def generate(self, prompt: str | list[int], **params) -> RequestHandle:
        """Sends a request (text or token ids; SamplingParams' fields) to the engine; its outputs
        arrive on the returned handle. A refused one finishes at once with its error."""
        request = next(self._ids)
        handle = RequestHandle(self, request)
        with self._requests_lock:  # a connection that ends now fails this handle too
            if self._lost is not None:
                raise ActionRefused(f"generate: {self._lost}")
            self._requests[request] = handle
        self._send_or_refuse("generate", Generate(id=request, prompt=prompt, params=params), self._requests, request)
        return handle

    def _send_or_refuse(self, kind: str, message, waiting: dict, key: int) -> None:
        """Send `message`; if it cannot go, forget what waits for its answer and refuse, in one line."""
        try:
            self._send(message)
        except (OSError, ProtocolError, TypeError) as exc:
            waiting.pop(key, None)
            raise ActionRefused(f"{kind}: not sent ({exc})") from None

    def _send(self, message) -> None:
        with self._send_lock:
            self._sock.sendall(encode(message))

    def close(self) -> None:
        if self.owner and self._lost is None:
            try:
                self._send(Shutdown())
            except OSError:
                pass
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._reader.join(timeout=5)
        self._sock.close()
