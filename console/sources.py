"""Where the console's records come from, and where its actions go.

One interface, several sources (ConsoleSource, wire/interfaces.py): `poll()` hands over the step
and action records that arrived since the last call; `act(kind, **args)` asks for an operator
action and returns its result, or raises ActionRefused with a one-line reason when this source
cannot do it.

* EngineSource (engine_client.py): the engine in a process of its own (server/engine_host.py),
  over wire/protocol.py; what `moectl run` and `moectl web` attach to.
* LiveSource (live_source.py): the engine on a thread of this process; benchmarks compare
  it with the engine process. It is the one source that loads torch, and the console never
  imports it.
* ReplaySource: a trace file with a transport (play, pause, speed, step, seek). Its rebalance
  acts on the counterfactual: what the recorded routing would have done under the new placement.
"""

from __future__ import annotations

import asyncio
import math
import posixpath
import threading
import time
from collections import deque
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import numpy as np

from moectl.console.state import WINDOW_STEPS
from moectl.placement.decision import predict_from_records
from moectl.placement.placement import PlacementError
from moectl.placement.rebalancer import preview_plan
from moectl.placement.topology import Topology
from moectl.profiler.analysis import alerts
from moectl.profiler.trace_queries import placement_timeline
from moectl.profiler.trace_store import TraceError, TraceReader
from moectl.wire.actions import ACTIONS, Action, ActionRefused
from moectl.wire.interfaces import ConsoleSource
from moectl.wire.records import RECORD_BUFFER

# -- replay

class ReplaySource(ConsoleSource):
    mode = "replay"
    MAX_PER_POLL = 256  # records handed over per poll when playing fast

    def __init__(self, path: str | Path):
        self.reader = TraceReader(path)
        self.path = Path(path)
        self.header = self.reader.header
        self.steps, self.t_start, self.t_end = self.reader.step_times()
        if not len(self.steps):
            self.reader.close()
            raise ActionRefused(f"{path}: the trace has no steps")
        self.all_actions = list(self.reader.actions())
        self.playing = False
        self.speed = 1.0
        self.index = -1  # index of the last step handed over
        self._clock = None  # (wall time, trace time) when play started
        self._pending_reset = False
        self.skipped = 0  # damaged steps skipped
        # the first poll hands over steps up to the opening one: the console opens on real figures
        self._target = self.opening_index

    @property
    def opening_index(self) -> int:
        """Where a replay opens: the first step at which the console's window is full (every
        windowed figure then has data behind it), or the last step of a shorter trace. Step 1 alone
        would show an empty window: zero loads and no accounting."""
        return min(WINDOW_STEPS, len(self.steps)) - 1

    @property
    def first_step(self) -> int:
        return int(self.steps[0])

    @property
    def last_step(self) -> int:
        return int(self.steps[-1])

    @property
    def position(self) -> int:
        return int(self.steps[max(self.index, 0)])

    @property
    def trace_time(self) -> float:
        return float(self.t_start[max(self.index, 0)] - self.t_start[0])

    def markers(self) -> list[tuple[int, str]]:
        """Scrub-bar markers: every operator action, and where an alert condition begins."""
        actions = [(int(a["step"]), "action") for a in self.all_actions
                   if a["kind"] not in ("record_start", "record_stop")]
        return actions + self._alert_markers()

    def _alert_markers(self, samples: int = 400, window: int = WINDOW_STEPS) -> list[tuple[int, str]]:
        """Steps where an alert starts to hold, found by the analysis the console's alert bar runs
        (profiler.analysis.alerts) over the same moving window, under the placement in force at
        each step: on a trace of up to `samples` steps a marker is where the alert bar would turn
        on. Longer traces are sampled every len/samples steps (the window then spans that many
        times more), so a long trace costs the same."""
        timeline = placement_timeline(self.reader)
        stride = max(1, len(self.steps) // samples)
        recent: deque = deque(maxlen=window)
        out, was = [], set()
        for i in range(0, len(self.steps), stride):
            try:
                record = self.reader.seek_step(int(self.steps[i]))
            except TraceError:
                continue  # a damaged row: no marker from it
            recent.append(record)
            in_force = [p for s, p in timeline if s < record["step"]]
            now = {a["kind"] for a in alerts(list(recent), in_force[-1] if in_force else None)}
            if now - was:
                out.append((int(record["step"]), "alert"))
            was = now
        return out

    # transport
    def play(self) -> None:
        self.playing = True
        self._clock = (time.monotonic(), float(self.t_start[max(self.index, 0)]))

    def pause(self) -> None:
        self.playing = False

    def set_speed(self, speed: float) -> None:
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0.05 <= speed <= 1000:
            raise ActionRefused(f"speed: must be between 0.05 and 1000, got {speed!r}")
        self.speed = float(speed)
        if self.playing:
            self.play()

    def step_forward(self, n: int = 1) -> None:
        self.pause()
        self._target = min(self.index + n, len(self.steps) - 1)

    def seek_step(self, step: int) -> None:
        """Jump to `step` (the nearest recorded one at or after it); the state is rebuilt from the
        window before it."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise ActionRefused(f"seek: step must be an integer, got {step!r}")
        if not self.first_step <= step <= self.last_step:
            raise ActionRefused(f"seek: step {step} is outside the trace ({self.first_step}-{self.last_step})")
        self.index = int(np.searchsorted(self.steps, step)) - 1
        self._target = self.index + 1
        self._pending_reset = True
        if self.playing:
            self.play()

    def seek_time(self, seconds: float) -> None:
        """Jump to `seconds` after the trace's first step."""
        if not isinstance(seconds, (int, float)) or math.isnan(seconds) or seconds < 0:
            raise ActionRefused(f"seek: time must be >= 0 seconds, got {seconds!r}")
        t = self.t_start[0] + seconds
        i = int(np.searchsorted(self.t_start, t, side="right")) - 1
        self.seek_step(int(self.steps[min(max(i, 0), len(self.steps) - 1)]))

    def poll(self) -> tuple[list[dict], list[dict]]:
        self.needs_reset = False
        target = getattr(self, "_target", None)
        if self.playing and target is None:
            wall0, trace0 = self._clock
            now = trace0 + (time.monotonic() - wall0) * self.speed
            target = int(np.searchsorted(self.t_start, now, side="right")) - 1
            if target >= len(self.steps) - 1:
                target = len(self.steps) - 1
                self.playing = False
        self._target = None
        if target is None or target <= self.index and not self._pending_reset:
            return [], []
        target = max(target, 0)
        lo = self.index + 1
        reset = self._pending_reset or target - lo > self.MAX_PER_POLL
        if reset:  # refill the window before the target instead of streaming everything
            lo = max(target - WINDOW_STEPS + 1, 0)
        records = self._read(lo, target)
        # actions between steps belong to the step after them; the last step takes everything after it
        t_prev = float(self.t_end[self.index]) if self.index >= 0 and not reset else -math.inf
        t_hi = math.inf if target == len(self.steps) - 1 else float(self.t_end[target])
        actions = [a for a in self.all_actions if t_prev < a["time"] <= t_hi]
        self.index = target
        self._pending_reset = False
        self.needs_reset = reset
        return records, actions

    def _read(self, lo: int, hi: int) -> list[dict]:
        """Steps lo..hi (indexes); a step whose row cannot be decoded is skipped (and counted),
        so one damaged row cannot stop the replay."""

        try:
            return list(self.reader.steps(int(self.steps[lo]), int(self.steps[hi]) + 1))
        except TraceError:
            records = []
            for i in range(lo, hi + 1):
                try:
                    records.append(self.reader.seek_step(int(self.steps[i])))
                except TraceError:
                    self.skipped += 1
            return [r for r in records if int(r["step"]) <= int(self.steps[hi])]

    def act(self, kind: str, **args):
        """Replay changes nothing recorded: rebalancing is answered by counterfactual_plan (the
        console does it); every other action is refused with the reason."""
        raise ActionRefused(f"{kind}: a replayed trace cannot change the recorded engine "
                            f"(rebalance works here as a counterfactual)")

    def close(self) -> None:
        self.reader.close()


def counterfactual_plan(state, redundant: int | None = None):
    """A rebalance plan for the state's window routing, from the placement in force: what the
    recorded routing would have done under it (exact: routing does not depend on placement)."""

    topology = (state.header.get("devices") or {}).get("topology")
    if not topology or state.placement is None:
        raise ActionRefused("rebalance: this trace was recorded without devices")
    # a simulated trace's step times are the step model's: the replay has no model of that cluster to
    # predict with (the simulated engine's own preview does, live), so it predicts balancedness only
    predict = None if state.simulated else partial(predict_from_records, list(state.window), state.placement)
    try:
        return preview_plan(state.routing_window(), Topology.from_mapping(topology), state.placement,
                            expert_bytes=state.expert_bytes or 0, redundant=redundant, predict=predict)
    except PlacementError as exc:
        raise ActionRefused(str(exc)) from None


# -- attach

class RemotePlan:
    """A rebalance plan previewed on a remote server: its summary here, the plan itself there."""

    def __init__(self, plan_id: str, summary: dict):
        self.plan_id = plan_id
        self._summary = summary

    def summary(self) -> dict:
        return self._summary

    @staticmethod
    def apply_args(args: dict) -> dict:
        """An apply's arguments for the engine that holds the plan: the previewed plan's id."""
        plan = args.get("plan")
        if not isinstance(plan, RemotePlan):
            raise ActionRefused("rebalance_apply: preview a plan first")
        return {"plan_id": plan.plan_id}


def server_url(url: str) -> str:
    """A `moectl serve` URL as the base its routes hang off: http(s), a host, a valid port, the path
    normalised (`/v1/../x` is `/x`), no trailing slash. A query or fragment is refused: the
    routes go after the path, where they would end up inside it."""
    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 - raises ValueError for a port out of range or not a number
    except ValueError as exc:
        raise ActionRefused(f"attach: {url!r} is not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ActionRefused(f"attach: {url!r} is not an http(s) URL of a `moectl serve`")
    if parts.query or parts.fragment:
        extra = "?" + parts.query if parts.query else "#" + parts.fragment
        raise ActionRefused(f"attach: {url!r} has {extra!r}: give the server's address alone (e.g. http://host:8000)")
    path = posixpath.normpath("/" + parts.path.lstrip("/")).rstrip("/")  # "/" and "" are the root
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


class AttachSource(ConsoleSource):
    """A remote `moectl serve`: records from its /v1/telemetry websocket, actions through its
    /v1/control endpoints (bearer token). Network I/O runs on a background thread with its own
    event loop, so the console's loop never waits on the network."""

    mode = "attach"

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 10.0):
        self.url = server_url(url)
        self.token = token
        self._records: deque = deque(maxlen=RECORD_BUFFER)
        self._actions: deque = deque(maxlen=RECORD_BUFFER)
        self._error: str | None = None
        self._closed = False
        self._last_step, self._last_action_time = -1, -math.inf  # dedupe the catch-up on reconnect
        self._hello = threading.Event()
        self._answered = threading.Event()  # the first connection's outcome: a hello, or a refusal
        self.header: dict = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="moectl-attach", daemon=True)
        self._thread.start()
        self._session = self._call(self._open_session()).result(timeout_s)
        self._reader = asyncio.run_coroutine_threadsafe(self._read_telemetry(), self._loop)
        self._answered.wait(timeout_s)
        if not self._hello.is_set():
            reason = self._error or f"no telemetry from {self.url} within {timeout_s:g} s"
            self.close()
            raise ActionRefused(f"attach: {reason}")

    def _call(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _open_session(self):

        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=60))

    async def _read_telemetry(self) -> None:

        ws_url = self.url.replace("http", "ws", 1) + "/v1/telemetry"
        while not self._closed:
            try:
                async with self._session.ws_connect(ws_url, heartbeat=20) as ws:
                    self._error = None
                    async for msg in ws:
                        if msg.type != aiohttp.WSMsgType.TEXT:
                            break
                        self._on_message(msg.json())
            except aiohttp.WSServerHandshakeError as exc:  # an answer, not a network fault: no point waiting
                self._error = f"telemetry: {self._refusal(exc.status)}"
                self._answered.set()
            except Exception as exc:  # noqa: BLE001 - shown in the console; we reconnect
                self._error = f"telemetry: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if not self._closed:
                if self._error is None:
                    self._error = "telemetry: the server closed the stream"

                await asyncio.sleep(1.0)

    def _refusal(self, status: int) -> str:
        if status == 401:
            return ("the server refused the token (401)" if self.token else
                    "the server needs its token (401): give --token")
        if status == 403:
            return "the server refused this client (403)"
        return f"the server answered HTTP {status} to the telemetry stream (is {self.url} a `moectl serve`?)"

    def _on_message(self, message: dict) -> None:
        kind = message.get("type")
        if kind == "hello":  # on every (re)connect: keep only what was not seen before it
            header = message.get("header") or {}
            if header.get("clock_origin") != self.header.get("clock_origin"):  # another engine: start over
                self._last_step, self._last_action_time = -1, -math.inf
            self.header = header
            self._take_records(message.get("recent") or ())
            self._take_actions(message.get("actions") or ())
            self._hello.set()
            self._answered.set()
        elif kind == "step":
            self._take_records([message["record"]])
        elif kind == "action":
            self._take_actions([message["record"]])

    def _take_records(self, records) -> None:
        for record in records:
            if record["step"] > self._last_step:
                self._last_step = record["step"]
                self._records.append(_arrays(record))

    def _take_actions(self, actions) -> None:
        for action in actions:
            if action["time"] > self._last_action_time:
                self._last_action_time = action["time"]
                self._actions.append(action)

    @property
    def error(self) -> str | None:
        return self._error

    def poll(self) -> tuple[list[dict], list[dict]]:
        records = [self._records.popleft() for _ in range(len(self._records))]
        actions = [self._actions.popleft() for _ in range(len(self._actions))]
        return records, actions

    def act(self, kind: str, **args) -> Future:
        if not self.token:
            raise ActionRefused(f"{kind}: attached read-only; reattach with --token to control the remote engine")
        spec = ACTIONS.get(kind)
        if spec is None or spec.route is None:
            raise ActionRefused(f"{kind}: not available on an attached engine")
        if kind == Action.REBALANCE_APPLY:
            args = RemotePlan.apply_args(args)
        return self._call(self._post(kind, spec.route, args))

    async def _post(self, kind: str, route: str, body: dict):
        async with self._session.post(f"{self.url}/v1/control/{route}", json=body) as resp:
            try:
                data = await resp.json(content_type=None)
            except ValueError:
                data = {}
            if resp.status != 200:
                message = (data.get("error") or {}).get("message") if isinstance(data, dict) else None
                raise ActionRefused(message or f"{kind}: the server answered HTTP {resp.status}")
        if kind == Action.REBALANCE_PREVIEW:
            return RemotePlan(data["plan_id"], data["summary"])
        return data

    async def _shutdown(self) -> None:

        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if getattr(self, "_session", None) is not None:
            await self._session.close()

    def close(self) -> None:
        self._closed = True
        try:
            self._call(self._shutdown()).result(5)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


def _arrays(record: dict) -> dict:
    """JSON lists back to the numpy arrays the console's code expects where it does arithmetic."""
    if "routing" in record and record["routing"] is not None:
        record["routing"] = np.asarray(record["routing"], dtype=np.int64)
    spans = record.get("spans")
    if spans:
        for key in ("lane", "name", "layer", "start_s", "dur_s", "modeled"):
            if key in spans:
                spans[key] = np.asarray(spans[key])
    return record
