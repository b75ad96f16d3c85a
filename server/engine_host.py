"""The engine process: one engine, its demo workload, and every client attached to it.

`moectl run` starts it (`moectl engine-host`, cli/console.py) and attaches a console; `moectl
web` starts one and attaches every browser tab's console to it; `moectl serve` hosts the same
protocol beside its HTTP API, for any number of consoles (`moectl run --engine DIR`). Clients speak wire/protocol.py
over a Unix socket in the run's private directory. The engine computes every figure; clients
get the records and draw them.

Threads: the engine steps on its driver's thread (engine/core/driver.py); a pump thread takes
the driver's records every PUMP_S, encodes them once and queues the bytes for every client; each
client has a reader thread (its actions) and a sender thread (its queue, bounded: a slow client
loses its oldest messages, counted, and costs nobody else anything). The engine exits when its
owner client goes (the console that `run` started), on its owner's Shutdown, on SIGTERM, or when
the process that started it dies (PR_SET_PDEATHSIG).

Ownership is the starting process's, not a claim: a Hello's owner flag is granted only to a
connection from the pid in MOECTL_PARENT_PID (cli/engine_process.py sets it), as the kernel names
the peer (SO_PEERCRED). So web's shared engine has no owner but web itself, which never connects,
and serve's (a driver handed in) has none at all: no token holder can stop either by leaving.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path

import msgspec

from moectl.engine.core.driver import EngineDriver
from moectl.engine.tools.demo_workload import DemoLoad, DemoWorkload
from moectl.profiler.alert_feed import AlertCadence, window_alerts
from moectl.profiler.recorder import engine_header
from moectl.wire import protocol
from moectl.wire.actions import Action, ActionRefused
from moectl.wire.interfaces import Engine
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
    encode,
    read_message,
    token_matches,
)

log = logging.getLogger(__name__)

PUMP_S = 0.02  # records reach clients this often: 50 a second, faster than any console redraws
RECENT_STEPS, RECENT_ACTIONS = 64, 256  # a new client's catch-up, and the alerts' window (a console's)
CLIENT_QUEUE = 256  # messages waiting per client before its oldest are dropped
HELLO_TIMEOUT_S = 5.0  # for the whole Hello, however slowly it trickles in
BACKLOG = socket.SOMAXCONN  # clients connecting at once wait in this queue (Linux caps it at net.core.somaxconn)
MAX_PLANS = 16  # previews kept for an apply (newest)
SIGNAL_POLL_S = 0.1  # how soon wait() acts on a SIGTERM


class EngineHost:
    """An engine's clients over the protocol. With a demo workload (`moectl run`, `web`) the host
    builds the engine's driver and owns it; `moectl serve` hands in its own driver (no workload:
    its requests come through the API) and keeps it."""

    def __init__(self, engine_dir: Path, token: str, *, make_engine: Callable[[], Engine] | None = None,
                 load: DemoLoad | None = None,
                 driver: EngineDriver | None = None, on_close=None, name: str = "moectl engine", workload=None):
        """workload: the demo workload itself, in place of a DemoWorkload of `load` (a simulated
        cluster's, on its simulated clock: engine/tools/sim_workload.py)."""
        if (make_engine is None) == (driver is None):
            raise ValueError("EngineHost: give make_engine (and a load) or a driver")
        self.engine_dir = Path(engine_dir)
        self._token = token
        self._on_close = on_close
        self.workload = workload or (DemoWorkload(load) if load is not None else None)
        self._owns_driver = driver is None
        self._owner_pid = starter_pid() if self._owns_driver else None  # serve's engine is nobody's to stop
        self._inbox: deque = deque(maxlen=RECENT_ACTIONS * 16)  # (steps, actions) published by a driver's reader
        self.driver = driver or EngineDriver(make_engine, feed=self.workload.feed if self.workload else None)
        self.name = f"{name} (pid {os.getpid()})"
        self._plans: dict[str, object] = {}
        self._plan_seq = 0
        self._lock = threading.Lock()  # clients, recent, status
        self._clients: set[_Client] = set()
        self._recent_steps: deque = deque(maxlen=RECENT_STEPS)
        self._recent_actions: deque = deque(maxlen=RECENT_ACTIONS)
        self._status = self._current_status()
        self._alerts: Alerts | None = None
        self._alert_cadence = AlertCadence()
        self._steps_seen = 0
        self.stop_reason: str | None = None
        self.signalled: str | None = None  # set by on_signal, from a signal handler
        self._stopped = threading.Event()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path = self.engine_dir / protocol.SOCKET_NAME
        self._listener.bind(str(path))
        os.chmod(path, 0o600)
        self._listener.listen(BACKLOG)
        self._threads = [threading.Thread(target=self._accept_loop, name="moectl-accept", daemon=True),
                         threading.Thread(target=self._pump_loop, name="moectl-pump", daemon=True)]
        for t in self._threads:
            t.start()

    # -- lifetime
    def wait(self) -> str:
        """Blocks until the engine is told to stop; returns why. Polls for a signal's request: a
        signal handler runs on this thread, maybe while it holds a lock, so it takes none."""
        while not self._stopped.wait(SIGNAL_POLL_S):
            if self.signalled is not None:
                self.stop(self.signalled)
        return self.stop_reason or "stopped"

    def on_signal(self, reason: str) -> None:
        """For a signal handler: only records the request (wait() acts on it)."""
        self.signalled = reason

    def stop(self, reason: str) -> None:
        with self._lock:
            if self.stop_reason is not None:
                return
            self.stop_reason = reason
            clients = list(self._clients)
        frame = encode(Bye(reason))
        for client in clients:
            client.answer(frame)
        self._stopped.set()
        try:  # wakes the accept loop; a client connecting now is refused, not queued for nobody
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """After wait(): the clients get their Bye, then the engine and the socket go."""
        self.stop(self.stop_reason or "stopped")
        deadline = time.monotonic() + 1.0
        for client in list(self._clients):
            client.finish(max(0.0, deadline - time.monotonic()))
        try:
            self._listener.close()
        except OSError:
            pass
        try:
            if self._owns_driver:
                self.driver.close()
        finally:
            if self._on_close is not None:
                self._on_close()
            (self.engine_dir / protocol.SOCKET_NAME).unlink(missing_ok=True)

    # -- clients
    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._greet, args=(sock,), name="moectl-client", daemon=True).start()

    def _greet(self, sock: socket.socket) -> None:
        """The first message must be a Hello with the run's token; then the catch-up."""
        try:
            self._welcome(sock)
        except Exception:  # noqa: BLE001 - one client's failure is logged; the engine serves on
            log.exception("engine host: a client's greeting failed")
            sock.close()

    def _welcome(self, sock: socket.socket) -> None:
        try:  # until the token is checked: a small frame, and one deadline for all of it
            hello = read_message(sock, max_bytes=protocol.MAX_HELLO, deadline=time.monotonic() + HELLO_TIMEOUT_S)
            sock.settimeout(None)
        except ProtocolError as exc:
            _refuse(sock, f"refused: {exc}")
            return
        except OSError:  # too slow (the deadline), or gone
            sock.close()
            return
        if not isinstance(hello, Hello) or not token_matches(hello.token, self._token):
            _refuse(sock, "refused: the first message must be a hello with this run's token")
            return
        if hello.owner and not self._owned_by(sock):
            _refuse(sock, "refused: owner: only the process that started this engine owns it"
                          + (f" (pid {self._owner_pid})" if self._owner_pid is not None else "; this one has none"))
            return
        with self._lock:  # the catch-up and the client's place in the fan-out, at one instant
            if self.stop_reason is not None:  # nothing would ever be sent to it
                _refuse(sock, f"refused: the engine is stopping ({self.stop_reason})")
                return
            stream = hello.records
            welcome = Welcome(engine=self.name, pid=os.getpid(), header=self.header(),
                              steps=list(self._recent_steps) if stream else [],
                              actions=list(self._recent_actions) if stream else [],
                              status=msgspec.structs.asdict(self._status),
                              alerts=self._alerts.alerts if self._alerts is not None and stream else None)
            client = _Client(self, sock, hello.owner, encode(welcome), kind=_client_kind(hello.client), records=stream)
            self._clients.add(client)
        client.start()

    def _owned_by(self, sock: socket.socket) -> bool:
        """Whether the peer is the process that started this engine. Where the platform cannot
        name a socket's peer, the claim stands: the socket is the user's alone, behind the token."""
        if self._owner_pid is None:
            return False
        pid = peer_pid(sock)
        return pid is None or pid == self._owner_pid

    def gone(self, client: _Client) -> None:
        with self._lock:
            self._clients.discard(client)
        if client.owner:
            self.stop("its console went away")

    def header(self) -> dict:
        return engine_header(self.driver.engine)

    # -- records and status
    def _pump_loop(self) -> None:
        while not self._stopped.wait(PUMP_S):
            try:
                self.pump()
            except Exception:  # noqa: BLE001 - a record that cannot be sent must not stop the stream
                log.exception("engine host: records not sent")

    def publish(self, steps: list, actions: list) -> None:
        """Records read from a driver this host does not own (serve's app reads them): sent on
        with the next pump."""
        self._inbox.append((steps, actions))

    def _take(self) -> tuple[list, list]:
        if self._owns_driver:
            return self.driver.poll()
        steps, actions = [], []
        while self._inbox:
            s, a = self._inbox.popleft()
            steps += s
            actions += a
        return steps, actions

    def pump(self) -> None:
        steps, actions = self._take()
        status = self._current_status()
        with self._lock:
            self._recent_steps.extend(steps)
            self._recent_actions.extend(actions)
            self._steps_seen += len(steps)
            frames = []
            if steps or actions:
                frames.append(encode(Records(steps=steps, actions=actions)))
            if status != self._status:
                self._status = status
                frames.append(encode(status))
            clients = list(self._clients)
        alerts = self._due_alerts() if clients else None
        if alerts is not None:
            frames.append(encode(alerts))
        for frame in frames:
            for client in clients:
                client.offer(frame)

    def _due_alerts(self) -> Alerts | None:
        """The alerts over the recent window when due (AlertCadence); computed here, once, so no
        console recomputes them (or shares its UI thread with the work)."""
        if not self._alert_cadence.due(self._steps_seen):
            return None
        with self._lock:
            window = list(self._recent_steps)
        if not window:
            return None
        experts = self.driver.engine.experts
        devices = experts.header() if experts is not None else None  # not header(): no memory plan every 2 s
        found = window_alerts(window, experts.placement if experts is not None else None, devices)
        self._alerts = Alerts(step=int(window[-1]["step"]), alerts=found)
        return self._alerts

    def _current_status(self) -> Status:
        # the load in force: steer() changes it on the engine thread, and the next pump reports it
        return Status(error=self.driver.error, load=asdict(self.workload.load) if self.workload else None)

    # -- actions
    def act(self, act: Act) -> Future:
        """An operator action, as EngineDriver.act takes it; "workload" steers the demo workload,
        "rebalance_preview" answers a plan id and summary, "rebalance_apply" takes that id."""
        kind, args = act.kind, dict(act.args)
        if kind == Action.WORKLOAD:
            if self.workload is None:
                raise ActionRefused("workload: this engine has no demo workload (moectl serve: its requests come "
                                    "through the API)")
            return self.workload.steer(self.driver, **args)
        if kind == Action.REBALANCE_APPLY:
            plan = self._plans.get(str(args.pop("plan_id", "")))
            if plan is None:
                raise ActionRefused("rebalance_apply: preview a plan first (or that preview is gone)")
            return self.driver.act(kind, plan=plan)
        future = self.driver.act(kind, **args)
        if kind != Action.REBALANCE_PREVIEW:
            return future
        answer: Future = Future()

        def keep(done: Future) -> None:
            try:
                plan = done.result()
            except Exception as exc:  # noqa: BLE001 - passed on as the action's error
                answer.set_exception(exc)
                return
            with self._lock:
                self._plan_seq += 1
                plan_id = f"p{self._plan_seq}"
                self._plans[plan_id] = plan
                while len(self._plans) > MAX_PLANS:
                    self._plans.pop(next(iter(self._plans)))
            answer.set_result({"plan_id": plan_id, "summary": plan.summary()})
        future.add_done_callback(keep)
        return answer


    # -- requests
    def generate(self, client: _Client, message: Generate) -> None:
        """A client's request into the engine; its outputs go to that client only (Output)."""
        from moectl.engine.core.sampling import SamplingParams

        request_id = f"{client.name}-{message.id}"
        try:
            params = SamplingParams(**message.params)
            stream = self.driver.engine.add_request(message.prompt, params, request_id=request_id, stream=True)
        except Exception as exc:  # noqa: BLE001 - a bad field or value (ValueError, TypeError) or anything else
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            refused = isinstance(exc, (TypeError, ValueError))
            client.answer(encode(Output(id=message.id, request_id=request_id, finished=True, finish_reason="error",
                                        error=f"refused: {text}" if refused else f"{type(exc).__name__}: {text}")))
            return
        client.requests[message.id] = request_id

        def sink(out) -> None:  # engine thread: encode and queue, never block, never raise
            try:
                client.answer(encode(Output(id=message.id, request_id=request_id, new_token_ids=list(out.new_token_ids),
                                            text=out.text if out.finished else "", finished=out.finished,
                                            finish_reason=out.finish_reason, error=out.error,
                                            prompt_tokens=len(out.prompt_ids), output_tokens=len(out.token_ids))))
                if out.finished:
                    client.requests.pop(message.id, None)
            except Exception:  # noqa: BLE001 - a client's output must never raise into the step loop
                log.exception("engine host: an output not sent")
        stream.set_sink(sink)

    def cancel(self, client: _Client, message: Cancel) -> None:
        request_id = client.requests.pop(message.id, None)
        if request_id is not None:
            self.driver.engine.abort(request_id)

    def abort_requests(self, client: _Client) -> None:
        """A client that went away: its unfinished requests stop (nobody reads them)."""
        for request_id in list(client.requests.values()):
            self.driver.engine.abort(request_id)
        client.requests.clear()


def _plain(value):
    """An action's result as the protocol carries it (placements as their dict)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    to_dict = getattr(value, "to_dict", None)
    return to_dict() if callable(to_dict) else value


class _Client:
    _seq = itertools.count(1)

    def __init__(self, host: EngineHost, sock: socket.socket, owner: bool, welcome: bytes, kind: str = "console",
                 records: bool = True):
        self.host, self.sock, self.owner = host, sock, owner
        self.records = records  # False: a client of requests and actions only, sent no record stream
        self.name = f"{kind}{next(self._seq)}"  # its requests' ids: "<name>-<its id>"
        self.requests: dict[int, str] = {}  # its unfinished requests: its id -> the engine's request id
        # answers (Result, Output, Bye) are never dropped: a lost one would leave its asker waiting
        self._answers: deque[bytes] = deque()
        self._queue: deque[bytes] = deque([welcome])
        self._ready = threading.Condition()
        self._closed = False
        self.dropped = 0
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read_loop, name="moectl-client-read", daemon=True)
        self._sender = threading.Thread(target=self._send_loop, name="moectl-client-send", daemon=True)

    def start(self) -> None:
        self._reader.start()
        self._sender.start()

    def answer(self, frame: bytes) -> None:
        """A frame the client is waiting for (Result, Output, Bye): queued ahead of the stream,
        never dropped."""
        with self._ready:
            self._answers.append(frame)
            self._ready.notify()

    def offer(self, frame: bytes) -> None:
        """A frame of the record stream (Records, Status, Alerts): the oldest are dropped, and
        counted, when a slow client lets CLIENT_QUEUE of them pile up."""
        if not self.records:
            return
        with self._ready:
            if len(self._queue) >= CLIENT_QUEUE:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append(frame)
            self._ready.notify()

    def _send_loop(self) -> None:
        sent_dropped = 0
        while True:
            with self._ready:
                while not self._queue and not self._answers and not self._closed:
                    self._ready.wait()
                if self._answers:
                    frame = self._answers.popleft()
                elif self._queue:
                    frame = self._queue.popleft()
                else:
                    return
                dropped = self.dropped
            try:
                if dropped != sent_dropped:  # says how much it lost before what follows
                    self.sock.sendall(encode(Records(steps=[], actions=[], dropped=dropped)))
                    sent_dropped = dropped
                self.sock.sendall(frame)
            except OSError:
                return

    def _read_loop(self) -> None:
        try:
            while True:
                message = read_message(self.sock)
                if message is None:
                    break
                if isinstance(message, Shutdown):
                    if self.owner:  # only the console that started the engine stops it
                        self.host.stop("its console asked it to stop")
                    else:
                        log.warning("engine host: %s asked the engine to stop; refused (not its owner)", self.name)
                        self.answer(encode(Result(id=message.id, error="shutdown: refused: only the console that "
                                                                       "started this engine stops it")))
                elif isinstance(message, Act):
                    self._act(message)
                elif isinstance(message, Generate):
                    self.host.generate(self, message)
                elif isinstance(message, Cancel):
                    self.host.cancel(self, message)
                else:
                    raise ProtocolError(f"a client does not send {type(message).__name__}")
        except (OSError, ProtocolError) as exc:
            log.info("engine host: client dropped (%s)", exc)
        finally:
            self.finish(0.0)
            self.host.abort_requests(self)
            self.host.gone(self)

    def _act(self, act: Act) -> None:
        try:
            future = self.host.act(act)
        except ActionRefused as exc:
            self.answer(encode(Result(id=act.id, error=str(exc))))
            return
        except Exception as exc:  # noqa: BLE001 - arguments no check foresaw: this action fails, nothing else
            self.answer(encode(Result(id=act.id, error=f"{act.kind}: {type(exc).__name__}: {exc}".splitlines()[0])))
            return

        def answer(done: Future) -> None:
            try:
                frame = encode(Result(id=act.id, value=_plain(done.result())))
            except Exception as exc:  # noqa: BLE001 - the action's failure, in one line
                text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                frame = encode(Result(id=act.id, error=text))
            self.answer(frame)
        future.add_done_callback(answer)

    def finish(self, timeout_s: float) -> None:
        """Send what is queued (for up to timeout_s), then close the connection."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        if self._sender.is_alive() and threading.current_thread() is not self._sender:
            self._sender.join(timeout_s)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _client_kind(client: str) -> str:
    """A client's self-description, kept to a short word for its request ids."""
    word = "".join(ch for ch in str(client) if ch.isalnum())[:16]
    return word or "client"


def _refuse(sock: socket.socket, reason: str) -> None:
    """A connection refused before its Welcome: the reason, then closed."""
    try:
        sock.settimeout(None)
        sock.sendall(encode(Bye(reason)))
    except OSError:
        pass
    sock.close()


def starter_pid() -> int | None:
    """The process that started this one, as it said (cli/engine_process.py); None if none did."""
    value = os.environ.get(protocol.PARENT_PID_ENV, "")
    return int(value) if value.isdigit() else None


_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_pid(sock: socket.socket) -> int | None:
    """The pid of the process at the other end of a Unix socket, as the kernel recorded it at
    connect (Linux's SO_PEERCRED); None where the platform does not say."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    pid, _uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, option, _PEERCRED.size))
    return pid
