"""The aiohttp application in front of an engine on its driver's thread, and the ways to run it.

    make_app(driver, ...)        the Application (routes, auth, errors, the record consumer)
    run_server(driver, ...)      `moectl serve`: blocks until interrupted
    ServerThread(driver, ...)    the same server on its own thread and loop (tests, benchmarks)

The engine runs on the EngineDriver's thread (moectl.engine.core.driver). The server adds
requests to it and reads its record stream: one consumer task polls driver.poll() every
poll_interval_s and hands every step and action record, in time order, to the metrics and to the
telemetry websockets. Operator actions go through driver.act, the console's own validation.

Access: /health is always open. With a token, everything else needs `Authorization: Bearer
<token>` (an OpenAI client sends its api_key that way). Without a token the server only binds
loopback, serves the API, /metrics and /v1/telemetry openly, and refuses /v1/control/* (403).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from functools import partial

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from moectl.engine.core.driver import EngineDriver
from moectl.profiler.recorder import engine_header
from moectl.server.api_request import ApiError, error_response
from moectl.server.chat_template import ChatTemplate
from moectl.server.control import ControlApi
from moectl.server.http_auth import bearer_token, is_loopback
from moectl.server.metrics import ServerMetrics
from moectl.server.openai_api import OpenAIApi
from moectl.server.prompts import PromptEncoder
from moectl.server.state import STATE, ServerState
from moectl.server.streams import EngineBridge
from moectl.server.telemetry import TelemetryHub
from moectl.server.tokenize_api import TokenizeApi
from moectl.wire.link_spans import with_link_spans
from moectl.wire.protocol import token_matches

log = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
DEFAULT_MAX_TOKENS_LIMIT = 4096
POLL_INTERVAL_S = 0.05
SHUTDOWN_TIMEOUT_S = 5.0  # open streams get this long when the server stops
LISTEN_BACKLOG = 1024  # hundreds of clients may connect at once




def make_app(driver: EngineDriver, *, token: str | None = None, model_name: str | None = None,
             max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT,
             poll_interval_s: float = POLL_INTERVAL_S, record_sinks: tuple = ()) -> web.Application:
    """driver: the engine on its thread (the server's clients are its only requests).
    record_sinks: sink(steps, actions) for each batch of records, beside the metrics and
    /v1/telemetry (the consoles' engine host: the driver's records have one reader, this app).
    model_name: what /v1/models lists and requests must name (default: the checkpoint's directory
    name). max_request_bytes: larger bodies get 413. max_tokens_limit: the largest max_tokens."""
    _check_token(token)
    for name, value in (("max_request_bytes", max_request_bytes), ("max_tokens_limit", max_tokens_limit)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    header = engine_header(driver.engine)
    model_name = model_name or (header.get("model") or {}).get("name") or "moectl"
    metrics = ServerMetrics(header, model_name)
    state = ServerState(driver=driver, token=token, model_name=model_name,
                        max_request_bytes=max_request_bytes, max_tokens_limit=max_tokens_limit, metrics=metrics,
                        hub=TelemetryHub(header, on_dropped=metrics.dropped_telemetry), started=time.time(),
                        record_sinks=tuple(record_sinks))
    # the checkpoint's chat template, or the fallback (said once at start, and in /v1/models)
    template = ChatTemplate.from_dir(driver.engine.config.model)
    if template.is_fallback:
        log.info("chat template: the checkpoint has none; using moectl's plain fallback (see chat_template.py)")
    encoder = PromptEncoder(driver.engine, template)
    app = web.Application(middlewares=[_errors, _same_origin, _auth], client_max_size=max_request_bytes)
    app[STATE] = state
    control = ControlApi(state)
    app.add_routes(OpenAIApi(state, encoder).routes() + TokenizeApi(state, encoder).routes() + control.routes() + [
        web.get("/health", partial(_health, state)), web.get("/metrics", partial(_metrics, state)),
        web.get("/v1/telemetry", state.hub.handle)])
    app.cleanup_ctx.append(partial(_record_consumer, state, poll_interval_s))

    async def on_shutdown(app):
        await state.hub.close_all()
        await control.close()
    app.on_shutdown.append(on_shutdown)
    return app


# -- binding

def _check_token(token) -> None:
    if token is not None and (not isinstance(token, str) or not token or token != token.strip()):
        raise ValueError("--token: must be a non-empty string without surrounding spaces")


def check_bind(host: str, token: str | None) -> None:
    _check_token(token)
    if not is_loopback(host) and token is None:
        raise ValueError(f"--host {host or '(all interfaces)'}: binding beyond loopback needs --token "
                         f"(anyone who can reach the port could use the engine)")


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before the model loads: a port in use is one line at
    once (OSError, naming the address), not a traceback after the load."""
    try:
        return socket.create_server((host, port), backlog=LISTEN_BACKLOG)
    except OSError as exc:
        raise OSError(f"--host/--port: cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def run_server(driver: EngineDriver, host: str = "127.0.0.1", port: int = 8000, token: str | None = None,
               sock: socket.socket | None = None, **app_options) -> None:
    """`moectl serve`: serve until SIGINT/SIGTERM (on `sock` when the caller bound it already).
    ValueError (one line) for a bad bind."""
    check_bind(host, token)
    app = make_app(driver, token=token, **app_options)
    name = app[STATE].model_name
    sock = sock if sock is not None else listen(host, port)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request
    web.run_app(app, sock=sock, handler_cancellation=True, backlog=LISTEN_BACKLOG,
                shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                print=lambda _: print(f"moectl serve: {name} on http://{host}:{port} (Ctrl-C to stop)", flush=True))


class ServerThread:
    """The server on its own thread and event loop; port=0 picks a free port (see .port)."""

    def __init__(self, driver: EngineDriver, host: str = "127.0.0.1", port: int = 0, token: str | None = None, **app_options):
        check_bind(host, token)
        self.host = host
        self.app = make_app(driver, token=token, **app_options)
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(port,), name="moectl-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            raise RuntimeError(f"server did not start: {self._error!r}")
        return self

    def _run(self, port: int) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(self.app, handler_cancellation=True, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        try:
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, self.host, port, backlog=LISTEN_BACKLOG).start())
            self.port = runner.addresses[0][1]
        except BaseException as exc:  # noqa: BLE001 - handed to start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()

    def call(self, fn, *args):
        """Run fn(*args) on the server's loop and return its result (tests: look at state)."""
        async def run():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(SHUTDOWN_TIMEOUT_S + 10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# -- middleware

@web.middleware
async def _errors(request: web.Request, handler):
    """Every error in OpenAI's shape, whatever raised it."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        messages = {404: f"{request.method} {request.path}: no such endpoint",
                    405: f"{request.method} is not allowed on {request.path} (allowed: {exc.headers.get('Allow', '')})",
                    413: f"body: over the limit of {request.client_max_size} bytes"}
        headers = {k: v for k, v in exc.headers.items() if k in ("Allow", "WWW-Authenticate")}
        return error_response(exc.status, messages.get(exc.status, exc.text or exc.reason), headers=headers)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:  # noqa: BLE001 - a bug must still answer in the API's shape
        log.exception("%s %s", request.method, request.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def _host_of(value: str) -> str:
    """'host:port', '[::1]:port' or a URL's netloc -> the host name, lower case."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


@web.middleware
async def _same_origin(request: web.Request, handler):
    """Without a token only loopback clients can connect, but a web page open in their browser
    could still drive the API: by DNS rebinding (a name of the page's that resolves to 127.0.0.1:
    the Host header names it) or by posting across origins (an Origin header names the page).
    Both are refused; a client that is not a browser sends neither."""
    if request.app[STATE].token is None and request.path != "/health":
        host = _host_of(request.headers.get("Host", ""))
        if host not in LOOPBACK_NAMES:
            raise ApiError(403, f"Host: {host or 'none'} is not this loopback server's (without --token only "
                           "localhost, 127.0.0.1 and [::1] are served)")
        origin = request.headers.get("Origin")
        if origin is not None:  # only this server's own pages: another local port is another site too
            netloc = origin.partition("://")[2].split("/", 1)[0].lower()
            if netloc != request.headers.get("Host", "").strip().lower():
                raise ApiError(403, f"Origin: {origin[:100]} may not use this server (another site's page; "
                               "start the server with --token to serve other origins)")
    return await handler(request)


@web.middleware
async def _auth(request: web.Request, handler):
    path = request.path
    if path == "/health":
        return await handler(request)
    token = request.app[STATE].token
    control = path == "/v1/control" or path.startswith("/v1/control/")
    if control and token is None:
        raise ApiError(403, "start the server with --token to enable control")
    if token is not None and not _bearer_matches(request, token):
        raise ApiError(401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return await handler(request)


def _bearer_matches(request: web.Request, token: str) -> bool:
    given = bearer_token(request.headers.get("Authorization", ""))
    return given is not None and token_matches(given, token)  # in constant time


# -- /health, /metrics, and the record consumer

async def _health(state: ServerState, request: web.Request) -> web.Response:
    driver = state.driver
    if driver.error is not None:
        return web.json_response({"status": "error", "error": driver.error}, status=503)
    stats = driver.engine.stats()
    return web.json_response({"status": "ok", "model": state.model_name,
                              **{k: stats[k] for k in ("running", "waiting", "kv_blocks_used", "kv_blocks_total")}})


async def _metrics(state: ServerState, request: web.Request) -> web.Response:
    stats = state.driver.engine.stats() if state.driver.error is None else None
    return web.Response(body=state.metrics.render(stats), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _record_consumer(state: ServerState, interval_s: float, app: web.Application):
    """cleanup_ctx: the bridge and the consumer task live as long as the server."""
    state.bridge = EngineBridge(asyncio.get_running_loop())
    task = asyncio.create_task(_consume(state, interval_s), name="moectl-records")
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _consume(state: ServerState, interval_s: float) -> None:
    while True:
        try:
            records, actions = state.driver.poll()
            records = [with_link_spans(r) for r in records]  # every client sees the modeled link spans
            fan_out(state, records, actions)
            if records or actions:
                for sink in state.record_sinks:
                    sink(records, actions)
        except Exception:  # noqa: BLE001 - the consumer must outlive one bad record
            log.exception("record consumer")
        await asyncio.sleep(interval_s)


def fan_out(state: ServerState, records: list[dict], actions: list[dict]) -> None:
    """In engine-clock order, so a rebalance lands between the steps it came between."""
    events = [(r["t_end"], "step", r) for r in records] + [(a["time"], "action", a) for a in actions]
    events.sort(key=lambda e: e[0])
    for _, kind, record in events:
        try:
            if kind == "step":
                state.metrics.observe_step(record)
            else:
                state.metrics.observe_action(record)
        except Exception:  # noqa: BLE001
            log.exception("metrics: a %s record", kind)
        state.hub.publish(kind, record)
