"""`moectl web`: the full console in a browser, through textual-serve.

Each browser tab gets its own console: the server runs the real console command (`moectl run`,
`moectl replay` or `moectl attach`, with the options given here) as a subprocess per session,
so the browser shows exactly what the terminal would. Everything is validated here, before the
server starts, so a bad option is one line and exit 2 rather than a "Session ended" page.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import typer

from moectl.cli.common import (
    BACKEND_OPT,
    DEFAULT_DEVICES,
    DEVICES_OPT,
    DTYPE_OPT,
    EXPERT_CACHE_OPT,
    HBM_OPT,
    HOST_MEM_OPT,
    MODEL_OPT,
    NPROC_OPT,
    PLACEMENT_OPT,
    THEME_OPT,
    THREADS_OPT,
    BadInput,
    engine_config,
    given,
    handles_errors,
    parse_threads,
)
from moectl.cli.console import DEMO_WORKLOAD_OPT, LIVE_REDUNDANT_OPT, demo_load
from moectl.themes import check_theme

# the options handed on to `moectl run` (parameter names); meaningless with --replay / --attach
LIVE_OPTIONS = ("model", "devices", "hbm", "redundant", "backend", "nproc", "placement", "expert_cache", "host_mem",
                "workload", "dtype", "threads")


@handles_errors
def web(
    ctx: typer.Context,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on. Anything but loopback needs --token."),
    port: int = typer.Option(8080, "--port", min=1, max=65535, help="Port to listen on."),
    token: str | None = typer.Option(None, "--token", envvar="MOECTL_WEB_TOKEN",
                                     help="Require this token on every request: open /?token=T once (it is kept "
                                          "in a cookie) or send `Authorization: Bearer T`."),
    replay: Path | None = typer.Option(None, "--replay", help="Serve `moectl replay TRACE` instead of the live "
                                                              "console."),
    attach: str | None = typer.Option(None, "--attach", help="Serve `moectl attach URL` (a running `moectl serve`) "
                                                             "instead of the live console."),
    attach_token: str | None = typer.Option(None, "--attach-token", help="With --attach: the server's bearer token "
                                                                         "(`moectl attach --token`)."),
    model: Path | None = MODEL_OPT,
    devices: int | None = DEVICES_OPT,
    hbm: str = HBM_OPT,
    redundant: int = LIVE_REDUNDANT_OPT,
    backend: str = BACKEND_OPT,
    nproc: int | None = NPROC_OPT,
    placement: Path | None = PLACEMENT_OPT,
    expert_cache: int | None = EXPERT_CACHE_OPT,
    host_mem: str | None = HOST_MEM_OPT,
    workload: str = DEMO_WORKLOAD_OPT,
    dtype: str | None = DTYPE_OPT,
    threads: str = THREADS_OPT,
    theme: str = THEME_OPT,
):
    """The console in a browser: live (the `moectl run` options), --replay TRACE or --attach URL.
    Each browser tab runs its own console; loopback only unless --token is given."""
    from moectl.cli.web_server import ConsoleServer, is_loopback

    if token is not None and not token:
        raise BadInput("--token: empty")
    if token is None and not is_loopback(host):
        raise BadInput(f"--host: {host} is not a loopback address; give --token (or MOECTL_WEB_TOKEN) so that "
                       "only holders of the token can open the console")
    check_theme(theme)
    live = {name: value for name, value in ctx.params.items() if name in LIVE_OPTIONS}
    if replay is not None or attach is not None:
        mode = "--replay" if replay is not None else "--attach"
        live_given = [option_flag(ctx, name) for name in live if given(ctx, name)]
        if replay is not None and attach is not None:
            raise BadInput("--replay, --attach: give one of them, not both")
        if live_given:
            raise BadInput(f"{live_given[0]}: an option of the live console, not for {mode}")
    if attach_token is not None and attach is None:
        raise BadInput("--attach-token: only with --attach")

    if replay is not None:
        args, what = replay_args(replay), f"replay of {replay}"
    elif attach is not None:
        args, what = attach_args(attach, attach_token), f"console attached to {attach}"
    else:
        args, what = live_args(ctx, live), "live console"
    # textual-serve runs it through the shell; exec, so that the process it holds is the console itself
    command = "exec " + shlex.join([sys.executable, "-m", "moectl.cli", *args, "--theme", theme])
    ConsoleServer(command, host, port, title=f"moectl · {what}", token=token).serve()


def option_flag(ctx: typer.Context, name: str) -> str:
    """The long flag of one of this command's parameters (e.g. expert_cache -> --expert-cache)."""
    param = next(p for p in ctx.command.params if p.name == name)
    return max(param.opts, key=len)


def live_args(ctx: typer.Context, live: dict) -> list[str]:
    """`run` and its options, after the checks `moectl run` makes before it starts an engine."""
    demo_load(live["workload"])  # the same check and wording as `moectl run`
    options = dict(live, threads=parse_threads(live["threads"]))
    options["redundant_slots"] = options.pop("redundant")
    options["num_threads"] = options.pop("threads")
    options.pop("workload")
    engine_config(**options, default_devices=DEFAULT_DEVICES)
    args = ["run"]
    for name, value in live.items():
        if value is not None:  # paths absolute: the console runs in a fresh process
            args += [option_flag(ctx, name), str(Path(value).resolve()) if isinstance(value, Path) else str(value)]
    check_engine_builds(args)
    return args


def check_engine_builds(run_args: list[str]) -> None:
    """What `run` checks only as its engine is built (HBM too small for the model: `--hbm 1KiB`),
    checked before serving by building that engine once in a child process (this one never loads
    torch), so a tab never opens on a console that cannot start. Its one-line error is ours."""
    done = subprocess.run([sys.executable, "-m", "moectl.cli", *run_args, "--check-only"],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        typer.echo(lines[-1] if lines else f"moectl: error: run exited {done.returncode}", err=True)
        raise typer.Exit(done.returncode)


def replay_args(trace: Path) -> list[str]:
    from moectl.console.sources import ReplaySource

    try:  # a missing, damaged or empty trace: one line now, not a "Session ended" in the browser
        ReplaySource(trace).close()
    except ValueError as exc:
        raise BadInput(f"--replay: {exc}") from None
    return ["replay", str(Path(trace).resolve())]


def attach_args(url: str, attach_token: str | None) -> list[str]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadInput(f"--attach: {url!r} is not an http(s) URL of a `moectl serve`")
    return ["attach", url] + (["--token", attach_token] if attach_token else [])
