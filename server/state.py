"""What every handler of one server shares: the engine's driver, access, limits and consumers."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from moectl.engine.core.driver import EngineDriver
from moectl.server.metrics import ServerMetrics
from moectl.server.streams import EngineBridge
from moectl.server.telemetry import TelemetryHub


@dataclass
class ServerState:
    driver: EngineDriver
    token: str | None
    model_name: str
    max_request_bytes: int
    max_tokens_limit: int
    metrics: ServerMetrics
    hub: TelemetryHub
    started: float  # unix time
    bridge: EngineBridge | None = None  # made on the server's loop at startup
    record_sinks: tuple = ()  # more consumers of the record stream: sink(steps, actions), e.g. consoles


STATE = web.AppKey("moectl_state", ServerState)
