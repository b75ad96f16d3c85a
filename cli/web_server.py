"""The HTTP side of `moectl web`: textual-serve's Server with access control in front of it.

textual-serve has no authentication: anyone who reaches the port gets a console (and, live, the
engine's controls). So one middleware guards every route, the websocket included:
- with a token, each request must carry it (`?token=`, which sets a cookie, the cookie, or
  `Authorization: Bearer`); 401 otherwise;
- on a loopback bind without a token, the Host header must be a loopback name with our port, so
  a web page cannot reach the console through DNS rebinding; 403 otherwise;
- a request that names an Origin (every websocket does) must come from the page's own origin,
  so another site open in the same browser cannot drive the console; 403 otherwise.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
from urllib.parse import urlsplit

import aiohttp_jinja2
import typer
from aiohttp import web
from textual_serve.app_service import AppService
from textual_serve.server import Server, to_int
from yarl import URL

log = logging.getLogger("textual-serve")  # textual-serve's own log, which serve() sets up
QUIT_S = 15.0  # how long a console gets to quit (engine shutdown included) before it is killed


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def url_host(host: str) -> str:
    """host as it appears in a URL or a Host header (IPv6 in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def loopback_host_headers(host: str, port: int) -> frozenset[str]:
    names = {"localhost", "127.0.0.1", "[::1]", url_host(host).lower()}
    return frozenset({f"{name}:{port}" for name in names} | (names if port == 80 else set()))


def same_origin_path(path: str, query) -> str:
    """A redirect target on this server only: `//host/x` (or `/\\host`, or their %2F forms, which
    arrive decoded) would be another origin to a browser, so the path keeps one leading slash."""
    return str(URL.build(path="/" + path.lstrip("/\\"), query=query))


class ConsoleSession(AppService):
    """One browser tab's console: textual-serve's AppService, whose stop also waits for the
    console's process to end, so that no console outlives the server (and no pipe of one
    outlives the event loop: asyncio reports those as errors at exit)."""

    async def stop(self) -> None:
        try:
            await asyncio.wait_for(super().stop(), QUIT_S)  # asks the console to quit, reads it out
        except TimeoutError:
            pass
        process = self._process
        if process is None or process.returncode is not None:
            return
        try:
            await asyncio.wait_for(process.wait(), QUIT_S)
        except TimeoutError:
            process.kill()
            await process.wait()


class ConsoleServer(Server):
    """textual-serve's Server, guarded; one console subprocess per browser session."""

    def __init__(self, command: str, host: str, port: int, title: str, token: str | None):
        super().__init__(command, host=host, port=port, title=title)
        self.public_url = f"http://{url_host(host)}:{port}"
        self.token = token
        self.cookie = f"moectl_web_{port}"  # cookies are per host, not per port: one name per server
        self.host_headers = loopback_host_headers(host, port) if token is None else None
        self.sessions: set[web.WebSocketResponse] = set()

    # -- access control
    def refusal(self, request: web.Request) -> web.Response | None:
        host = (request.host or "").lower()
        if self.host_headers is not None and host not in self.host_headers:
            return web.Response(status=403, text=f"moectl web: Host {request.host!r} refused: open "
                                                 f"{self.public_url}/\n")
        origin = request.headers.get("Origin")
        if origin is not None and urlsplit(origin).netloc.lower() != host:
            return web.Response(status=403, text=f"moectl web: cross-origin request from {origin!r} refused\n")
        if self.token is not None and not self.has_token(request):
            return web.Response(status=401, headers={"WWW-Authenticate": "Bearer"},
                                text="moectl web: this console needs its token: open /?token=T once, "
                                     "or send Authorization: Bearer T\n")
        return None

    def has_token(self, request: web.Request) -> bool:
        bearer = request.headers.get("Authorization", "")
        given = [request.query.get("token"), request.cookies.get(self.cookie),
                 bearer[len("Bearer "):] if bearer.startswith("Bearer ") else None]
        expected = self.token.encode()
        return any(hmac.compare_digest(value.encode(), expected) for value in given if value)

    async def _make_app(self) -> web.Application:
        app = await super()._make_app()

        @web.middleware
        async def guard(request: web.Request, handler):
            refused = self.refusal(request)
            if refused is not None:
                return refused
            if self.token is not None and "token" in request.query and request.path != "/ws":
                # keep the token in a cookie (the websocket and static files then carry it) and out of the
                # address bar and history
                query = request.query.copy()
                del query["token"]
                moved = web.HTTPSeeOther(same_origin_path(request.path, query))
                moved.set_cookie(self.cookie, self.token, httponly=True, samesite="Strict", path="/")
                return moved
            return await handler(request)

        app.middlewares.append(guard)
        return app

    # -- textual-serve's hooks
    @aiohttp_jinja2.template("app_index.html")
    async def handle_index(self, request: web.Request) -> dict:
        """textual-serve's page, its URLs from the Host the browser used (which this guard checked):
        the bind address (0.0.0.0, say) is not one a browser can open."""
        base = f"{request.scheme}://{request.host}"
        return {"font_size": to_int(request.query.get("fontsize", "16"), 16),
                "app_websocket_url": f"{'wss' if request.scheme == 'https' else 'ws'}://{request.host}/ws",
                "config": {"static": {"url": f"{base}/static/"}}, "application": {"name": self.title}}

    async def on_startup(self, app: web.Application) -> None:
        """Nothing: textual-serve's would print its banner and the console's command line (which
        may hold --attach-token); announce() says where we serve, once we do."""

    def announce(self, *_) -> None:
        how = " (token required: open /?token=T once)" if self.token else ""
        typer.echo(f"moectl web: {self.title} on {self.public_url}/{how}; one console per browser tab, "
                   "Ctrl+C stops", err=True)

    async def handle_websocket(self, request: web.Request) -> web.WebSocketResponse:
        """textual-serve's handler with ConsoleSession, each websocket kept so that a stop can end it."""
        websocket = web.WebSocketResponse(heartbeat=15)
        await websocket.prepare(request)
        session = ConsoleSession(self.command, write_bytes=websocket.send_bytes, write_str=websocket.send_str,
                                 close=websocket.close, download_manager=self.download_manager, debug=self.debug)
        self.sessions.add(websocket)
        try:
            await session.start(to_int(request.query.get("width", "80"), 80),
                                to_int(request.query.get("height", "24"), 24))
            await self._process_messages(websocket, session)
        except Exception as exc:  # noqa: BLE001 - a malformed message ends its own session, not the server
            log.warning("moectl web: session ended: %s: %s", type(exc).__name__, exc)
        finally:
            self.sessions.discard(websocket)
            await session.stop()
            await websocket.close()
        return websocket

    async def on_shutdown(self, app: web.Application) -> None:
        # a websocket lasts as long as its tab: close each one, so its handler stops the console
        # (aiohttp then waits for the handlers) instead of the stop waiting out aiohttp's timeout
        for websocket in list(self.sessions):
            await websocket.close()

    def serve(self, debug: bool = False) -> None:
        self.debug = debug
        self.initialize_logging()  # textual-serve logs a console that fails to start, with its stderr
        try:
            # no access log: its request lines would carry ?token=
            web.run_app(self._make_app(), host=self.host, port=self.port, access_log=None, print=self.announce)
        except OSError as exc:  # the address is taken or not ours: a valid request that failed, exit 1
            reason = (exc.strerror or str(exc)).rsplit(": ", 1)[-1]  # aiohttp prefixes the address we print
            typer.echo(f"moectl: error: --host/--port: cannot listen on {self.public_url}: {reason}", err=True)
            raise typer.Exit(1) from None
