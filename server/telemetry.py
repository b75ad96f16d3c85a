"""GET /v1/telemetry: the record stream (profiler/records.py) over a websocket, as JSON.

On connect a client gets {"type": "hello", "header", "recent": [step records], "actions": [...]}
(the catch-up), then {"type": "step", "record"} and {"type": "action", "record"} as they come,
and, while it is losing messages, {"type": "dropped", "count": n} (n: all it has lost so far)
about once a second.

A slow client must cost nobody else anything: each record is serialized once for all clients,
each client has its own bounded queue (full: the oldest message goes and is counted), and its
own sender task. A client whose socket accepts nothing for STUCK_S is disconnected.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections import deque

import numpy as np
from aiohttp import WSCloseCode, WSMsgType, web

log = logging.getLogger(__name__)

RECENT_STEPS = 64  # step records in the hello catch-up
RECENT_ACTIONS = 256
CLIENT_QUEUE = 512  # messages waiting per client before the oldest is dropped
STUCK_S = 10.0  # a send blocked this long disconnects the client
DROPPED_REPORT_S = 1.0


def to_jsonable(obj):
    """Records hold numpy arrays and scalars; JSON wants lists and plain numbers (NaN -> null)."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind == "f" and not np.isfinite(obj).all():
            return np.where(np.isfinite(obj), obj, None).tolist()
        return obj.tolist()
    if isinstance(obj, np.generic):
        return to_jsonable(obj.item())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if hasattr(obj, "tolist"):  # torch tensors
        return obj.tolist()
    return str(obj)


def dumps(message: dict) -> str:
    return json.dumps(to_jsonable(message), separators=(",", ":"))


class TelemetryClient:
    def __init__(self, ws: web.WebSocketResponse):
        self.ws = ws
        self.queue: deque[str] = deque()
        self.ready = asyncio.Event()
        self.dropped = 0

    def offer(self, message: str) -> int:
        """Queue a message; returns how many were dropped to make room (0 or 1)."""
        dropped = 0
        if len(self.queue) >= CLIENT_QUEUE:
            self.queue.popleft()
            self.dropped += 1
            dropped = 1
        self.queue.append(message)
        self.ready.set()
        return dropped


class TelemetryHub:
    def __init__(self, header: dict, on_dropped=None):
        self.header = header
        self.recent: deque = deque(maxlen=RECENT_STEPS)
        self.actions: deque = deque(maxlen=RECENT_ACTIONS)
        self.clients: set[TelemetryClient] = set()
        self._on_dropped = on_dropped or (lambda n: None)

    def publish(self, kind: str, record: dict) -> None:
        """kind: "step" or "action". Called by the server's record consumer on the event loop."""
        (self.recent if kind == "step" else self.actions).append(record)
        if not self.clients:
            return  # nobody listening: no serialization at all
        message = dumps({"type": kind, "record": record})
        dropped = sum(client.offer(message) for client in self.clients)
        if dropped:
            self._on_dropped(dropped)

    def hello(self) -> str:
        return dumps({"type": "hello", "header": self.header, "recent": list(self.recent),
                      "actions": list(self.actions)})

    async def handle(self, request: web.Request) -> web.WebSocketResponse:
        # no per-message compression: it would compress every record once per client
        ws = web.WebSocketResponse(heartbeat=20.0, compress=False)
        await ws.prepare(request)
        client = TelemetryClient(ws)
        client.offer(self.hello())
        self.clients.add(client)
        sender = asyncio.create_task(self._send_loop(client))
        try:
            async for msg in ws:  # nothing is expected from the client; this notices it leaving
                if msg.type == WSMsgType.ERROR:
                    break
        finally:
            self.clients.discard(client)
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
        return ws

    async def _send_loop(self, client: TelemetryClient) -> None:
        ws, reported = client.ws, 0
        try:
            while not ws.closed:
                try:
                    async with asyncio.timeout(DROPPED_REPORT_S):
                        await client.ready.wait()
                except TimeoutError:
                    pass
                client.ready.clear()
                if client.dropped > reported:
                    reported = client.dropped
                    await self._send(client, dumps({"type": "dropped", "count": reported}))
                while client.queue:
                    await self._send(client, client.queue.popleft())
        except (ConnectionResetError, StuckClient):
            self.clients.discard(client)
            try:  # the close frame may not get through either: then the transport is just dropped
                async with asyncio.timeout(1.0):
                    await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"too slow")
            except TimeoutError:
                pass

    @staticmethod
    async def _send(client: TelemetryClient, message: str) -> None:
        try:
            async with asyncio.timeout(STUCK_S):
                await client.ws.send_str(message)
        except TimeoutError:
            log.info("telemetry: disconnecting a client stuck for %.0f s", STUCK_S)
            raise StuckClient() from None

    async def close_all(self) -> None:
        for client in list(self.clients):
            await client.ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown")


class StuckClient(Exception):
    """A client's socket took nothing for STUCK_S."""
