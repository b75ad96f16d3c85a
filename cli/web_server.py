"""The HTTP side of `moectl web`: textual-serve's Server with access control in front of it.

textual-serve has no authentication: anyone who reaches the port gets a console (and, live, the
engine's controls). So one middleware guards every route, the websocket included:
- with a token, each request must carry it (`?token=`, which sets a cookie, the cookie, or
  `Authorization: Bearer`); 401 otherwise;
- on a loopback bind without a token, the connection must come from this server's own user
  (Linux tells which user's socket a loopback peer is in /proc/net/tcp{,6}: the engine's socket
  and `serve`'s controls refuse other users too); 403 otherwise;
- and there, the Host header must be a loopback name with our port, so a web page cannot reach
  the console through DNS rebinding; 403 otherwise;
- a request that names an Origin (every websocket does) must come from the page's own origin,
  so another site open in the same browser cannot drive the console; 403 otherwise.
Each browser session is a console process of its own: at most max_sessions at once, the next
refused with 503 until one ends. Each console dies with the server, even a SIGKILLed one.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp_jinja2
import typer
from aiohttp import web
from textual_serve.app_service import AppService
from textual_serve.server import Server, to_int
from yarl import URL

from moectl.server.http_auth import bearer_token
from moectl.wire.protocol import die_with_parent, token_matches

log = logging.getLogger("textual-serve")  # textual-serve's own log, which serve() sets up
QUIT_S = 15.0  # how long a console gets to quit (engine shutdown included) before it is killed
PROC_NET_TCP = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))


def url_host(host: str) -> str:
    """host as it appears in a URL or a Host header (IPv6 in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def loopback_host_headers(host: str, port: int) -> frozenset[str]:
    names = {"localhost", "127.0.0.1", "[::1]", url_host(host).lower()}
    return frozenset({f"{name}:{port}" for name in names} | (names if port == 80 else set()))


def can_tell_peer_users() -> bool:
    """Whether this system shows which user a TCP connection's other end is (peer_uid)."""
    return all(path.exists() for path in PROC_NET_TCP)


def _socket_address(hex_address: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """/proc/net/tcp's `0100007F:1F90`: the address in 32-bit words of host byte order, the port in hex."""
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if sys.byteorder == "little":
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return _unmapped(ipaddress.ip_address(raw)), int(port, 16)


def _unmapped(address):
    """::ffff:127.0.0.1 (an IPv4 peer on an IPv6 socket) as 127.0.0.1."""
    return getattr(address, "ipv4_mapped", None) or address


def _peer_address(name) -> tuple | None:
    """A transport's peername/sockname (host, port, ...) as (address, port)."""
    if not name:
        return None
    return _unmapped(ipaddress.ip_address(name[0].split("%")[0])), int(name[1])


def peer_uid(peer, local) -> int | None:
    """The user whose socket is the other end of the TCP connection peer -> local (transport
    peername and sockname), from /proc/net/tcp{,6}; None when it is not there to see (another
    network namespace, or the connection is gone)."""
    want = (_peer_address(peer), _peer_address(local))
    if None in want:
        return None
    port = f":{want[0][1]:04X}"  # the peer's port: a cheap test before an address is parsed
    for path in PROC_NET_TCP:
        try:
            rows = path.read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 7 and fields[1].endswith(port) and \
                    (_socket_address(fields[1]), _socket_address(fields[2])) == want:
                return int(fields[7])
    return None


def same_origin_path(path: str, query) -> str:
    """A redirect target on this server only: `//host/x` (or `/\\host`, or their %2F forms, which
    arrive decoded) would be another origin to a browser, so the path keeps one leading slash."""
    return str(URL.build(path="/" + path.lstrip("/\\"), query=query))


class ConsoleSession(AppService):
    """One browser tab's console: textual-serve's AppService, whose stop also waits for the
    console's process to end, so that no console outlives the server (and no pipe of one
    outlives the event loop: asyncio reports those as errors at exit); and whose process dies
    with the server's (die_with_parent, in the fork)."""

    async def _open_app_process(self, width: int = 80, height: int = 24) -> asyncio.subprocess.Process:
        """textual-serve's, with die_with_parent in the child: a console is any command, so the
        signal is set in the fork, and the child exits if the server is already gone."""
        server_pid = os.getpid()
        self._process = process = await asyncio.create_subprocess_shell(
            self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=self._build_environment(width=width, height=height),
            preexec_fn=lambda: die_with_parent(server_pid) or os._exit(1))
        self._stdin = process.stdin
        return process

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

    def __init__(self, command: str, host: str, port: int, title: str, token: str | None,
                 max_sessions: int):
        super().__init__(command, host=host, port=port, title=title)
        self.public_url = f"http://{url_host(host)}:{port}"
        self.token = token
        self.cookie = f"moectl_web_{port}"  # cookies are per host, not per port: one name per server
        self.host_headers = loopback_host_headers(host, port) if token is None else None
        self.own_user_only = token is None  # web refuses a bind beyond loopback without a token
        self.max_sessions = max_sessions
        self.sessions: set[web.WebSocketResponse] = set()

    # -- access control
    def refusal(self, request: web.Request) -> web.Response | None:
        if self.own_user_only:
            transport = request.transport
            uid = peer_uid(transport.get_extra_info("peername"), transport.get_extra_info("sockname")) \
                if transport is not None else None
            if uid != os.getuid():
                who = "an unknown user" if uid is None else f"user id {uid}"
                return web.Response(status=403, text=f"moectl web: a connection from {who} refused: without "
                                                     f"--token this console serves its own user only (uid "
                                                     f"{os.getuid()}); start it with --token to share it\n")
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
        given = [request.query.get("token"), request.cookies.get(self.cookie),
                 bearer_token(request.headers.get("Authorization", ""))]
        return any(token_matches(value, self.token) for value in given if value)

    def full(self) -> web.Response | None:
        """503 when max_sessions consoles are running: each is a process of its own."""
        if len(self.sessions) < self.max_sessions:
            return None
        return web.Response(status=503, text=f"moectl web: no room for another console ({self.max_sessions} "
                                             f"running, --max-sessions {self.max_sessions}): close a tab, or "
                                             "restart `moectl web` with a larger --max-sessions\n")

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
    async def handle_index(self, request: web.Request) -> web.Response:
        """The page, or why there is no console for it (503) in place of one that would fail."""
        return self.full() or await self._index_page(request)

    @aiohttp_jinja2.template("app_index.html")
    async def _index_page(self, request: web.Request) -> dict:
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
        how = " (token required: open /?token=T once)" if self.token else " (your user only)"
        typer.echo(f"moectl web: {self.title} on {self.public_url}/{how}; one console per browser tab, "
                   "Ctrl+C stops", err=True)

    async def handle_websocket(self, request: web.Request) -> web.WebSocketResponse:
        """textual-serve's handler with ConsoleSession, each websocket kept so that a stop can end it
        (and counted, so that no more than max_sessions consoles run)."""
        full = self.full()
        if full is not None:
            return full
        websocket = web.WebSocketResponse(heartbeat=15)
        self.sessions.add(websocket)  # before the first await: two handshakes cannot both take the last place
        try:
            await websocket.prepare(request)
            session = ConsoleSession(self.command, write_bytes=websocket.send_bytes, write_str=websocket.send_str,
                                     close=websocket.close, download_manager=self.download_manager,
                                     debug=self.debug)
            try:
                await session.start(to_int(request.query.get("width", "80"), 80),
                                    to_int(request.query.get("height", "24"), 24))
                await self._process_messages(websocket, session)
            except Exception as exc:  # noqa: BLE001 - a malformed message ends its own session, not the server
                log.warning("moectl web: session ended: %s: %s", type(exc).__name__, exc)
            finally:
                await session.stop()
                await websocket.close()
        finally:
            self.sessions.discard(websocket)  # once its console has ended: the place is free again
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
