"""`moectl web`: the full console in a browser, through textual-serve.

Each browser tab gets its own console: the server runs the real console command (`moectl run`,
`moectl replay` or `moectl attach`) as a subprocess per session, so the browser shows exactly
what the terminal would. Live, one engine process serves every tab: web starts it (with the
engine options given here) before it serves, and each tab's console attaches to it (`run
--engine DIR`); only that engine loads torch. Everything is validated before the server starts,
so a bad option is one line and exit 2 rather than a "Session ended" page.

Who may open it (web_server.py): on loopback without --token, only this user's own processes
(Linux tells a loopback peer's user; elsewhere --token is required); with --token, whoever holds it.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import typer

from moectl.cli.common import THEME_OPT, BadInput, handles_errors
from moectl.cli.console import DEMO_WORKLOAD_OPT, host_config
from moectl.cli.engine_options import DEFAULT_OPTIONS, REAL_ENGINE_OPTIONS, EngineOptions, given, with_engine_options
from moectl.themes import check_theme

DEFAULT_MAX_SESSIONS = 8  # browser tabs at once: each runs a console process, and its memory
MAX_SESSIONS = 256


@handles_errors
@with_engine_options(*REAL_ENGINE_OPTIONS)
def web(
    ctx: typer.Context,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on. Without --token: loopback only, "
                                                         "and only your own user's connections are served (other "
                                                         "users of this machine get 403; Linux)."),
    port: int = typer.Option(8080, "--port", min=1, max=65535, help="Port to listen on."),
    token: str | None = typer.Option(None, "--token", envvar="MOECTL_WEB_TOKEN",
                                     help="Require this token on every request instead, from any user: open "
                                          "/?token=T once (it is kept in a cookie) or send `Authorization: "
                                          "Bearer T`. Needed beyond loopback, and on systems without "
                                          "/proc/net/tcp."),
    max_sessions: int = typer.Option(DEFAULT_MAX_SESSIONS, "--max-sessions", min=1, max=MAX_SESSIONS,
                                     help="Browser tabs served at once (each runs a console process of its own); "
                                          "one more is refused (503) until a tab closes."),
    replay: Path | None = typer.Option(None, "--replay", help="Serve `moectl replay TRACE` instead of the live "
                                                              "console."),
    attach: str | None = typer.Option(None, "--attach", help="Serve `moectl attach URL` (a running `moectl serve`) "
                                                             "instead of the live console."),
    attach_token: str | None = typer.Option(None, "--attach-token", help="With --attach: the server's bearer token "
                                                                         "(`moectl attach --token`)."),
    options: EngineOptions = DEFAULT_OPTIONS,
    workload: str = DEMO_WORKLOAD_OPT,
    theme: str = THEME_OPT,
):
    """The console in a browser: live (the `moectl run` options), --replay TRACE or --attach URL.
    Each browser tab runs its own console (live: all attached to one engine process), up to
    --max-sessions at once. Without --token: loopback only, for your own user only (another user's
    browser or script is refused); with --token: anyone who has it."""
    from moectl.cli.web_server import ConsoleServer, can_tell_peer_users
    from moectl.server.http_auth import is_loopback

    if token is not None and not token:
        raise BadInput("--token: empty")
    if token is None and not is_loopback(host):
        raise BadInput(f"--host: {host} is not a loopback address; give --token (or MOECTL_WEB_TOKEN) so that "
                       "only holders of the token can open the console")
    if token is None and not can_tell_peer_users():
        raise BadInput("--token: needed here: without one only your own user may connect, and this system "
                       "cannot tell a connection's user (no /proc/net/tcp)")
    check_theme(theme)
    config = host_config(ctx, options, workload)
    if replay is not None or attach is not None:
        mode = "--replay" if replay is not None else "--attach"
        live_given = options.given_flags() + (["--workload"] if given(ctx, "workload") else [])
        if replay is not None and attach is not None:
            raise BadInput("--replay, --attach: give one of them, not both")
        if live_given:
            raise BadInput(f"{live_given[0]}: an option of the live console, not for {mode}")
    if attach_token is not None and attach is None:
        raise BadInput("--attach-token: only with --attach")

    engine = None
    if replay is not None:
        args, what = replay_args(replay), f"replay of {replay}"
    elif attach is not None:
        args, what = attach_args(attach, attach_token), f"console attached to {attach}"
    else:  # one engine process, started (and its options checked) before serving; every tab attaches to it
        engine = start_engine(config)
        args, what = ["run", "--engine", str(engine.dir)], "live console"
    # textual-serve runs it through the shell; exec, so that the process it holds is the console itself
    command = "exec " + shlex.join([sys.executable, "-m", "moectl.cli", *args, "--theme", theme])
    try:
        ConsoleServer(command, host, port, title=f"moectl · {what}", token=token, max_sessions=max_sessions).serve()
    finally:
        if engine is not None:
            engine.terminate()


def start_engine(config):
    """The live console's engine process on web's engine options (an EngineHostConfig); its
    one-line error is ours."""
    from moectl.cli.engine_process import EngineProcess, EngineStartFailed

    engine = EngineProcess(config)
    try:
        engine.wait_ready()
    except EngineStartFailed as exc:  # the engine is gone, and so is its directory
        typer.echo(f"moectl: error: {exc}", err=True)
        raise typer.Exit(exc.code) from None
    except BaseException:  # Ctrl-C while it loads
        engine.terminate()
        raise
    return engine


def replay_args(trace: Path) -> list[str]:
    from moectl.console.sources import ReplaySource
    from moectl.profiler.kineto import is_kineto, trace_files

    try:  # a missing, damaged or empty trace: one line now, not a "Session ended" in the browser
        if is_kineto(trace):  # PyTorch-profiler traces: `moectl replay` reads them in each tab
            trace_files(trace)
            return ["replay", str(Path(trace).resolve())]
        ReplaySource(trace).close()
    except ValueError as exc:
        raise BadInput(f"--replay: {exc}") from None
    return ["replay", str(Path(trace).resolve())]


def attach_args(url: str, attach_token: str | None) -> list[str]:
    from moectl.console.sources import server_url

    try:
        url = server_url(url)
    except ValueError as exc:
        raise BadInput(f"--{exc}") from None  # "attach: ..." -> "--attach: ..."
    return ["attach", url] + (["--token", attach_token] if attach_token else [])
