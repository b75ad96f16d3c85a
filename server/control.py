"""Operator controls under /v1/control/: the console's actions over HTTP.

Every endpoint needs `Authorization: Bearer <token>` (checked in app.py; a server started without
a token answers 403). Actions go through EngineDriver.act, so they are validated the same way as
the console's and run on the engine thread between steps; a refusal (ActionRefused, or any
ValueError such as a PlacementError) is a 400 with its one-line reason.

    GET  /knobs                 -> {"knobs": {...}}
    POST /knobs                 {knob: value, ...} -> {"knobs": the knobs with the changes, "changed"}
    POST /rebalance/preview     -> {"plan_id", "summary"}; the plan stays here (the newest MAX_PLANS)
    POST /rebalance/apply       {"plan_id"} -> {"plan_id", "summary"}
    POST /auto_rebalance        {"enabled": bool, "every_k_steps"?: int, "threshold"?: float|null,
                                 "target"?: float|null (token plans move only as much as reaching it
                                 takes), "min_gain"?: float (the gate, default 0.03), "objective"?:
                                 "step_time" (default) | "balance"}
    POST /edit                  {"edit": move|swap|replicate|drop_replica|pin|unpin, "layer", ...}
                                (Placement's arguments) -> {"edit", "placement"}
    POST /capture               {"steps": n} -> deep capture of the next n steps
    POST /recording/start       {"path"} -> a trace of everything from now (refuses an existing path)
    POST /recording/stop        -> {"path", "steps", "dropped"}
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from pathlib import Path

from aiohttp import web

from moectl.profiler.codec import TraceError
from moectl.server.api_request import ApiError, is_int, param_of, read_json
from moectl.server.state import ServerState
from moectl.wire.actions import Action

log = logging.getLogger(__name__)

MAX_PLANS = 8  # previewed plans kept for /rebalance/apply
ACTION_TIMEOUT_S = 60.0  # an action waits for the engine thread at most this long
AUTO_REBALANCE_ARGS = ("enabled", "every_k_steps", "threshold", "target", "min_gain", "objective")


class ControlApi:
    def __init__(self, state: ServerState):
        self.state = state
        self.plans: OrderedDict[str, object] = OrderedDict()
        self.recorder = None
        self._recording_lock = asyncio.Lock()

    def routes(self) -> list:
        p = "/v1/control"
        return [web.get(f"{p}/knobs", self.get_knobs), web.post(f"{p}/knobs", self.set_knobs),
                web.post(f"{p}/rebalance/preview", self.preview), web.post(f"{p}/rebalance/apply", self.apply),
                web.post(f"{p}/auto_rebalance", self.auto_rebalance), web.post(f"{p}/edit", self.edit),
                web.post(f"{p}/capture", self.capture), web.post(f"{p}/recording/start", self.start_recording),
                web.post(f"{p}/recording/stop", self.stop_recording)]

    async def _body(self, request: web.Request, allowed: tuple[str, ...] | None = None) -> dict:
        """The JSON object sent (an empty body is {}); unknown keys refused when `allowed` is given."""
        if not request.body_exists:
            return {}
        body = await read_json(request, self.state.max_request_bytes)
        if allowed is not None:
            unknown = sorted(set(body) - set(allowed))
            if unknown:
                raise ApiError(400, f"{unknown[0]}: not an argument here (arguments: {', '.join(allowed) or 'none'})",
                               param=unknown[0])
        return body

    async def _act(self, kind: str, args: dict | None = None):
        """driver.act, then its Future awaited without blocking the loop; refusals -> 400. The
        client's arguments travel as a dict, so a key such as "kind" cannot collide with ours."""
        args = dict(args or {})
        try:
            if "kind" in args:
                raise ValueError("kind: not an argument here")
            future = self.state.driver.act(kind, **args)
            async with asyncio.timeout(ACTION_TIMEOUT_S):
                return await asyncio.wrap_future(future)
        except TimeoutError:
            raise ApiError(504, f"{kind}: the engine did not get to it within {ACTION_TIMEOUT_S:.0f} s") from None
        except ValueError as exc:  # ActionRefused, KnobError, PlacementError, ...
            message = str(exc).splitlines()[0] if str(exc) else kind
            raise ApiError(400, message, param=param_of(message)) from None

    # -- knobs
    async def get_knobs(self, request: web.Request) -> web.Response:
        return web.json_response({"knobs": self.state.driver.engine.knobs.as_dict()})

    async def set_knobs(self, request: web.Request) -> web.Response:
        changes = await self._body(request)
        await self._act(Action.KNOBS, changes)
        # the engine applies the change at its next step; answer with what it will run with
        knobs = self.state.driver.engine.knobs.updated(**changes).as_dict()
        return web.json_response({"knobs": knobs, "changed": changes})

    # -- rebalancing
    async def preview(self, request: web.Request) -> web.Response:
        await self._body(request, ())
        plan = await self._act(Action.REBALANCE_PREVIEW)
        plan_id = f"plan-{uuid.uuid4().hex[:12]}"
        self.plans[plan_id] = plan
        while len(self.plans) > MAX_PLANS:
            self.plans.popitem(last=False)
        return web.json_response({"plan_id": plan_id, "summary": plan.summary()})

    async def apply(self, request: web.Request) -> web.Response:
        body = await self._body(request, ("plan_id",))
        plan_id = body.get("plan_id")
        if not isinstance(plan_id, str) or plan_id not in self.plans:
            raise ApiError(400, f"plan_id: {plan_id!r} is not a plan previewed here (preview one first; "
                           f"the newest {MAX_PLANS} are kept)", param="plan_id")
        plan = self.plans.pop(plan_id)  # before awaiting: a second apply of it gets the 400 above
        self.state.metrics.placement_requested(time.monotonic())
        try:
            applied = await self._act(Action.REBALANCE_APPLY, {"plan": plan})  # once the copy has run
        except ApiError:
            self.plans[plan_id] = plan  # refused: it can be applied later
            raise
        measured = {k: applied.get(k) for k in ("bytes_moved", "seconds")} if isinstance(applied, dict) else {}
        return web.json_response({"plan_id": plan_id, "summary": plan.summary(), "applied": measured})

    async def auto_rebalance(self, request: web.Request) -> web.Response:
        body = await self._body(request, AUTO_REBALANCE_ARGS)
        if not isinstance(body.get("enabled"), bool):
            raise ApiError(400, "enabled: must be true or false", param="enabled")
        every = body.get("every_k_steps", 0)
        if not is_int(every):  # act() would turn 2.5 into 2 silently
            raise ApiError(400, f"every_k_steps: must be an integer, got {every!r}", param="every_k_steps")
        result = await self._act(Action.AUTO_REBALANCE, body)
        return web.json_response(result)

    async def edit(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        edit = body.get("edit")
        if not isinstance(edit, str):
            raise ApiError(400, "edit: must be one of move, swap, replicate, drop_replica, pin, unpin", param="edit")
        self.state.metrics.placement_requested(time.monotonic())
        result = await self._act(Action.EDIT, body)
        return web.json_response({"edit": edit, "placement": result["placement"].to_dict()})

    # -- profiling
    async def capture(self, request: web.Request) -> web.Response:
        body = await self._body(request, ("steps",))
        steps = body.get("steps", 1)
        if not is_int(steps):  # act() would turn "3" or 2.5 into an int
            raise ApiError(400, f"steps: must be an integer, got {steps!r}", param="steps")
        await self._act(Action.CAPTURE, {"steps": steps})
        return web.json_response({"capture": {"steps": steps}})

    async def start_recording(self, request: web.Request) -> web.Response:
        from moectl.profiler.recorder import TraceRecorder

        body = await self._body(request, ("path",))
        path = body.get("path")
        if not isinstance(path, str) or not path:
            raise ApiError(400, "path: must be a non-empty string", param="path")
        async with self._recording_lock:
            if self.recorder is not None:
                raise ApiError(400, f"recording: already recording to {self.recorder.path}; stop it first")
            target = Path(path).expanduser()
            if target.exists():
                raise ApiError(400, f"path: {target} already exists (traces are never overwritten)", param="path")
            if not target.parent.is_dir():
                raise ApiError(400, f"path: {target.parent} is not a directory", param="path")
            engine = self.state.driver.engine
            try:  # opens a SQLite file: off the loop
                self.recorder = await asyncio.get_running_loop().run_in_executor(None, TraceRecorder, engine, target)
            except (ValueError, OSError) as exc:
                raise ApiError(400, f"path: {exc}", param="path") from None
        return web.json_response({"recording": str(target)})

    async def stop_recording(self, request: web.Request) -> web.Response:
        await self._body(request, ())
        async with self._recording_lock:
            recorder, self.recorder = self.recorder, None
            if recorder is None:
                raise ApiError(400, "recording: nothing is being recorded")
            # close() commits what is queued and detaches from the engine: off the loop
            try:
                await asyncio.get_running_loop().run_in_executor(None, recorder.close)
            except TraceError as exc:  # the writer process failed: its one line, no traceback
                raise ApiError(500, f"recording: {exc}") from None
        return web.json_response({"path": str(recorder.path), "steps": recorder.steps, "dropped": recorder.dropped})

    async def close(self) -> None:
        """Server shutdown: a recording in progress is finished, not lost."""
        if self.recorder is not None:
            recorder, self.recorder = self.recorder, None
            try:
                await asyncio.get_running_loop().run_in_executor(None, recorder.close)
            except TraceError as exc:
                log.warning("recording: %s", exc)

