"""`moectl web`: the console in a real browser (Debian's chromium, headless, driven by playwright)
from a real `moectl web` subprocess, the guard in front of it (token, Host, Origin), and its
up-front argument checks."""

from __future__ import annotations

import http.client
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import psutil
import pytest

from moectl.engine import sample_model_dir
from moectl.engine.models.config import ModelConfig
from moectl.profiler.trace_store import TraceReader
from tests.paths import REPO, TRACES

TOKEN = "web-test-token"
ARTIFACTS = REPO / "build" / "test-artifacts"
BROWSER_WAIT_MS = 120_000  # the first frame waits for an engine start, on a small shared machine
START_S = 60.0  # for `moectl web` to listen (imports torch)

# The page's xterm.js draws on a canvas, and the textual-serve page keeps its terminal object in a
# closure. Its constructor assigns `this.websocket_url`, so a setter on Object.prototype catches
# the instance as it is made; the test then reads the very screen buffer the browser displays.
CATCH_TERMINAL = """Object.defineProperty(Object.prototype, 'websocket_url', {configurable: true,
  set(value) {
    Object.defineProperty(this, 'websocket_url', {value, writable: true, configurable: true, enumerable: true});
    window.__moectlConsole = this;
  }});"""
SCREEN_JS = """() => {
  const term = window.__moectlConsole && window.__moectlConsole.terminal;
  if (!term) return '';
  const buffer = term.buffer.active, lines = [];
  for (let row = 0; row < term.rows; row++) {
    const line = buffer.getLine(buffer.viewportY + row);
    lines.push(line ? line.translateToString(true) : '');
  }
  return lines.join('\\n');
}"""


def chromium_or_skip() -> str:
    """The system chromium, for playwright; skips without one unless MOECTL_REQUIRE_BROWSER=1 (CI)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    reason = None
    if found is None:
        reason = "no chromium executable on PATH (scripts/setup_browser.sh installs Debian's chromium)"
    elif importlib.util.find_spec("playwright") is None:
        reason = "playwright is not installed (scripts/setup.sh)"
    if reason is not None:
        if os.environ.get("MOECTL_REQUIRE_BROWSER") == "1":
            pytest.fail(f"{reason}, and MOECTL_REQUIRE_BROWSER=1")
        pytest.skip(reason)
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def moectl(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    """The real entry point (its usage-error handling included), in a subprocess: an option
    check that failed to refuse would start a server, and the timeout then fails the test."""
    return subprocess.run([sys.executable, "-m", "moectl.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def status(port: int, path: str = "/", headers: dict | None = None) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path, headers=headers or {})
    response = conn.getresponse()
    response.read()
    conn.close()
    return response


def stop_tree(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (the consoles are in it), then SIGKILL what is left."""
    for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue


@contextmanager
def moectl_web(*args, env: dict | None = None):
    """`moectl web ARGS` on a free port, in its own process group; yields (process, port) once it
    listens. env: variables set for it (TMPDIR: where its engine directory goes)."""
    port = free_port()
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen([sys.executable, "-m", "moectl.cli", "web", "--port", str(port), *map(str, args)],
                            cwd=REPO, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + START_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None:
                    pytest.fail(f"moectl web exited {proc.returncode}: {proc.stdout.read()}")
                if time.monotonic() > deadline:
                    pytest.fail(f"moectl web did not listen on {port} within {START_S:g} s")
                time.sleep(0.2)
        yield proc, port
    finally:
        stop_tree(proc)
        proc.stdout.close()


# -- the console in a browser

@contextmanager
def console_page(port: int, token: str | None = TOKEN):
    """Headless chromium on the console at port (the token, if any, given once, in the URL); yields
    (page, shows), shows(text) waiting until the terminal's screen holds text and returning the screen."""
    chromium = chromium_or_skip()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(BROWSER_WAIT_MS)
            page.add_init_script(CATCH_TERMINAL)
            # hermetic: the page also links a web font; only this server is reachable (CI has no network)
            page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(
                f"http://127.0.0.1:{port}/") else route.abort())
            page.goto(f"http://127.0.0.1:{port}/" + (f"?token={token}" if token else ""))
            assert "token" not in page.url  # kept in a cookie, which the websocket then carries

            def shows(text: str, *, regex: bool = False) -> str:
                test = "new RegExp(text).test(screen)" if regex else "screen.includes(text)"
                page.wait_for_function(f"text => {{ const screen = ({SCREEN_JS})(); return {test}; }}", arg=text)
                return page.evaluate(SCREEN_JS)

            yield page, shows
        finally:
            browser.close()


def test_live_console_in_a_browser_overview_then_experts(capsys):
    chromium_or_skip()
    cfg = ModelConfig.from_dir(sample_model_dir())
    overview = f"{sample_model_dir().name}  {cfg.num_layers} layers x {cfg.num_experts} experts"
    with moectl_web("--token", TOKEN) as (server, port), console_page(port) as (page, shows):
        screen = shows(overview)
        assert "Expert rows per device" in screen and "tok/s" in screen, screen
        page.locator(".xterm-helper-textarea").focus()
        page.keyboard.press("2")
        shows("Routing heat map")
        # the live engine serves its demo workload: wait for routed tokens, so the shot shows a live heat map
        shows(r"[1-9][0-9,]* tokens", regex=True)  # the heat map's scale, no longer "0 tokens"
        screen = shows("Placement, layer 0")
        assert "Expert rows per device" not in screen, screen  # the Overview is gone, not drawn over
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "web_experts.png"
        page.screenshot(path=str(shot))
        assert shot.stat().st_size > 0
        with capsys.disabled():
            print(f"\nscreenshot of the Experts tab in chromium: {shot}")

        # two more tabs: three consoles, all attached to the one engine process; only it loads torch
        for _ in range(2):
            tab = page.context.browser.new_page(viewport={"width": 1400, "height": 900})
            tab.set_default_timeout(BROWSER_WAIT_MS)
            tab.add_init_script(CATCH_TERMINAL)
            tab.route("**/*", lambda route: route.continue_() if route.request.url.startswith(
                f"http://127.0.0.1:{port}/") else route.abort())
            tab.goto(f"http://127.0.0.1:{port}/?token={TOKEN}")
            tab.wait_for_function(f"() => ({SCREEN_JS})().includes('tok/s')")
        tree = psutil.Process(server.pid).children(recursive=True)
        consoles = [p for p in tree if "run" in p.cmdline() and "--engine" in p.cmdline()]
        engines = [p for p in tree if "engine-host" in p.cmdline()]
        with_torch = [p for p in [psutil.Process(server.pid), *tree] if _maps_torch(p)]
        assert len(consoles) == 3 and len(engines) == 1, [p.cmdline() for p in tree]
        assert with_torch == engines, [p.cmdline() for p in with_torch]
        with capsys.disabled():
            rss = sum(p.memory_info().rss for p in [psutil.Process(server.pid), *tree])
            print(f"moectl web, 3 tabs: {len(tree) + 1} processes, 1 with torch, {rss / 2**30:.2f} GiB RSS in all")

        # a stop with the tabs still open ends their consoles and the engine (none is left running)
        consoles += engines
        server.send_signal(signal.SIGTERM)
        assert server.wait(120) == 0
        _, alive = psutil.wait_procs(consoles, timeout=60)
        assert not alive, f"consoles still running after the server stopped: {alive}"


def _maps_torch(proc: psutil.Process) -> bool:
    try:
        with open(f"/proc/{proc.pid}/maps") as maps:
            return "libtorch" in maps.read()
    except OSError:
        return False


def test_replay_in_a_browser():
    """Without --token, as the README starts it: the browser is this user's, so it is served."""
    chromium_or_skip()
    trace = TRACES / "steady_rebalance.trace"
    with TraceReader(trace) as reader:
        name = reader.header["model"]["name"]
    with moectl_web("--replay", trace) as (_, port), console_page(port, token=None) as (_, shows):
        shows(f"replay · {name}")
        screen = shows("Expert rows per device")
        assert "Play" in screen, screen  # the replay's transport bar


# -- the guard

def test_token_is_required_on_every_request_and_accepted_in_each_form():
    with moectl_web("--token", TOKEN) as (_, port):
        for path in ("/", "/ws", "/static/js/textual.js"):
            assert status(port, path).status == 401, path
            assert status(port, path, {"Authorization": "Bearer wrong"}).status == 401, path
        assert status(port, "/?token=wrong").status == 401
        assert status(port, "/", {"Authorization": f"Bearer {TOKEN}"}).status == 200
        for scheme in ("bearer", "BEARER", "beArer"):  # RFC 7235: the scheme in any case, as `serve` takes it
            assert status(port, "/", {"Authorization": f"{scheme} {TOKEN}"}).status == 200, scheme
        moved = status(port, f"/?token={TOKEN}&fontsize=14")
        assert moved.status == 303 and moved.getheader("Location") == "/?fontsize=14"
        cookie = moved.getheader("Set-Cookie").split(";")[0]
        assert "HttpOnly" in moved.getheader("Set-Cookie")
        assert status(port, "/static/js/textual.js", {"Cookie": cookie}).status == 200
        assert status(port, "/", {"Cookie": cookie.replace(TOKEN, "x" * len(TOKEN))}).status == 401


def test_the_token_redirect_stays_on_this_origin():
    """`//evil.example/x?token=T` once answered `Location: ////evil.example/x`, which a browser
    follows to the other host."""
    with moectl_web("--token", TOKEN) as (_, port):
        for path in ("//evil.example/x", "///evil.example/x", "/\\evil.example/x", "/%2F%2Fevil.example/x",
                     "/%5Cevil.example/x"):
            moved = status(port, f"{path}?token={TOKEN}")
            location = moved.getheader("Location")
            assert moved.status == 303 and location.startswith("/") and not location.startswith(("//", "/\\")), \
                (path, location)
            assert location.split("?")[0].endswith("evil.example/x"), location  # the same path, on this server


def test_loopback_without_token_refuses_other_hosts_and_origins():
    with moectl_web() as (_, port):
        assert status(port, "/").status == 200
        assert status(port, "/", {"Host": f"localhost:{port}"}).status == 200
        assert status(port, "/", {"Host": f"attacker.example:{port}"}).status == 403  # DNS rebinding
        assert status(port, "/", {"Host": "localhost:1"}).status == 403
        assert status(port, "/ws", {"Origin": "http://attacker.example"}).status == 403
        assert status(port, "/", {"Origin": f"http://127.0.0.1:{port}"}).status == 200


# A real client (aiohttp) in a process of its own, optionally as another user: it imports as
# root (the interpreter is under /root), then drops to `uid` before it opens a socket, so the
# connection is that user's. It prints the page's status and text, then the websocket's status.
CLIENT = """
import asyncio, os, sys
import aiohttp
port, uid = int(sys.argv[1]), int(sys.argv[2])
if uid != os.getuid():
    os.setgroups([]); os.setgid(uid); os.setuid(uid)

async def main():
    base = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as session:
        async with session.get(base + "/") as page:
            print(page.status, (await page.text()).splitlines()[0])
        try:
            async with session.ws_connect(base + "/ws", origin=base) as ws:
                print(101)
        except aiohttp.WSServerHandshakeError as exc:
            print(exc.status)
asyncio.run(main())
"""
NOBODY = 65534


def client(port: int, uid: int) -> list[str]:
    done = subprocess.run([sys.executable, "-c", CLIENT, str(port), str(uid)], capture_output=True, text=True,
                          timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_loopback_without_token_serves_this_user_only():
    """Another local user once completed the websocket handshake and got a console with the
    engine's controls; the engine socket and `serve`'s controls refuse such users, and so does web."""
    if os.getuid() != 0:
        pytest.skip("making another user's client needs root")
    with moectl_web("--replay", TRACES / "steady_rebalance.trace") as (_, port):
        page, websocket = client(port, NOBODY)
        assert page.startswith("403 ") and f"user id {NOBODY} refused" in page and "--token" in page, page
        assert websocket == "403"
        page, websocket = client(port, os.getuid())
        assert page.startswith("200 ") and websocket == "101", (page, websocket)


def test_with_a_token_any_user_who_holds_it_is_served():
    if os.getuid() != 0:
        pytest.skip("making another user's client needs root")
    with moectl_web("--token", TOKEN, "--replay", TRACES / "steady_rebalance.trace") as (_, port):
        assert client(port, NOBODY) == ["401 moectl web: this console needs its token: open /?token=T once, "
                                        "or send Authorization: Bearer T", "401"]


def test_sessions_are_capped_and_the_next_one_is_refused_until_one_ends():
    """12 websockets once started 12 console processes (1.16 GB)."""
    import asyncio

    import aiohttp

    async def scenario(port: int) -> None:
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            first = await session.ws_connect(base + "/ws", origin=base)
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await session.ws_connect(base + "/ws", origin=base)
            assert refused.value.status == 503
            async with session.get(base + "/") as page:  # the tab says why, in place of a console that fails
                assert page.status == 503 and "--max-sessions 1" in await page.text()
            await first.close()
            deadline = time.monotonic() + 60
            while True:  # its console ends, and its place is free again
                try:
                    await (await session.ws_connect(base + "/ws", origin=base)).close()
                    return
                except aiohttp.WSServerHandshakeError as exc:
                    assert exc.status == 503 and time.monotonic() < deadline
                    await asyncio.sleep(0.2)

    with moectl_web("--replay", TRACES / "steady_rebalance.trace", "--max-sessions", "1") as (_, port):
        asyncio.run(scenario(port))


def console_processes(pid: int) -> list[psutil.Process]:
    """The server's moectl processes, each with its command line as info_cmdline."""
    processes = []
    for process in psutil.Process(pid).children(recursive=True):
        process.info_cmdline = process.cmdline()
        if "moectl.cli" in process.info_cmdline:
            processes.append(process)
    return processes


def open_a_tab_then_sigkill(server: subprocess.Popen, port: int, console: str) -> list[psutil.Process]:
    """A websocket (a tab) on the server until its console (a process with `console` in its
    command line) draws, then SIGKILL for the server: returns its moectl processes as they were.
    (A console killed while it starts fails on its closed pipes anyway; one that has drawn
    idles on, and outlived the server.)"""
    import asyncio

    import aiohttp

    async def scenario() -> list[psutil.Process]:
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session, session.ws_connect(base + "/ws", origin=base) as ws:
            await ws.receive(timeout=BROWSER_WAIT_MS / 1000)  # its first screen
            processes = console_processes(server.pid)
            assert any(console in p.info_cmdline for p in processes), [p.info_cmdline for p in processes]
            server.kill()
            server.wait()
            return processes
    return asyncio.run(scenario())


def test_a_sigkilled_server_takes_its_tabs_consoles_with_it():
    """SIGKILL of `moectl web` with a tab open once left that tab's console running, reparented
    to PID 1."""
    with moectl_web("--replay", TRACES / "steady_rebalance.trace") as (server, port):
        consoles = open_a_tab_then_sigkill(server, port, "replay")
        assert consoles
        _, alive = psutil.wait_procs(consoles, timeout=60)
        assert not alive, f"still running after the server's SIGKILL: {[p.info_cmdline for p in alive]}"


def test_a_sigkilled_server_takes_its_engine_and_the_engine_directory_with_it(tmp_path):
    """... and the engine's directory (its token) in /tmp."""
    with moectl_web("--threads", "1", env={"TMPDIR": str(tmp_path)}) as (server, port):
        assert len(list(tmp_path.glob("moectl-engine-*"))) == 1
        processes = open_a_tab_then_sigkill(server, port, "--engine")
        assert {"engine-host", "run"} <= {word for p in processes for word in p.info_cmdline}
        _, alive = psutil.wait_procs(processes, timeout=60)
        assert not alive, f"still running after the server's SIGKILL: {[p.info_cmdline for p in alive]}"
    assert not list(tmp_path.glob("moectl-engine-*"))  # the engine removed its directory as it went


@pytest.mark.parametrize("hbm", ["0", "abc", "-5GiB", "2PiB", "1e999GiB"])
def test_a_bad_engine_option_leaves_no_engine_directory(tmp_path, hbm):
    done = subprocess.run([sys.executable, "-m", "moectl.cli", "web", "--hbm", hbm], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--hbm" in done.stderr, done.stderr
    assert not list(tmp_path.glob("moectl-engine-*"))


# -- argument checks, before anything is served

@pytest.mark.parametrize("args, option", [
    (["--host", "0.0.0.0"], "--host"),
    (["--host", "192.0.2.7", "--port", "8080"], "--host"),
    (["--port", "0"], "--port"),
    (["--port", "70000"], "--port"),
    (["--replay", "no-such.trace"], "--replay"),
    (["--replay", "README.md"], "--replay"),
    (["--replay", TRACES / "steady_rebalance.trace", "--devices", "2"], "--devices"),
    (["--attach", "ftp://example"], "--attach"),
    (["--attach", "http://h:8000/v1/../x?y=1"], "--attach"),
    (["--max-sessions", "0"], "--max-sessions"),
    (["--attach-token", "t"], "--attach-token"),
    (["--workload", "rate=0"], "--workload"),
    (["--theme", "sepia"], "--theme"),
    (["--hbm", "1KiB"], "--hbm"),  # found only as the engine is built: it once served tabs that hung blank
    (["--expert-cache", "0"], "--expert-cache"),
])
def test_bad_arguments_exit_2_with_one_line_before_serving(args, option):
    done = moectl("web", *args)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moectl: error:") and option in lines[0], done.stderr


def test_a_port_in_use_is_one_line_and_exit_1():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = moectl("web", "--port", taken.getsockname()[1])
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "cannot listen" in lines[0], done.stderr
