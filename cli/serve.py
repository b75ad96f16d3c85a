"""`moectl serve`: the OpenAI-compatible server, metrics, telemetry and controls."""

from __future__ import annotations

import typer

from moectl.cli.common import BadInput, check_nproc, engine_config, handles_errors
from moectl.cli.engine_options import DEFAULT_OPTIONS, REAL_ENGINE_OPTIONS, EngineOptions, with_engine_options


@handles_errors
@with_engine_options(*REAL_ENGINE_OPTIONS)
def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; anything but loopback needs --token."),
    port: int = typer.Option(8000, "--port"),
    token: str | None = typer.Option(None, "--token", help="Bearer token for /v1/control/* (and required for "
                                                           "a non-loopback bind)."),
    options: EngineOptions = DEFAULT_OPTIONS,
):
    """An OpenAI-compatible server as vLLM serves it (/v1/completions with logprobs, echo, n and
    best_of; /v1/chat/completions; /v1/models; /tokenize, /detokenize, /tokenizer_info; /health),
    Prometheus /metrics, the /v1/telemetry record stream, and /v1/control/* for operators."""
    from moectl.engine.core import gc_heap, native_memory

    gc_heap.own_process()  # this process serves one engine for its life: its heap is frozen once built
    native_memory.bound_kernel_caches()  # before any matmul: each batch shape's kernel is kept otherwise
    if not 0 < port < 65536:
        raise BadInput(f"--port: must be in 1-65535, got {port}")
    check_nproc(options.nproc, options.backend)  # the cheap checks before the server's imports
    from moectl.engine.core.driver import EngineDriver
    from moectl.engine.parallel.backends import Engines
    from moectl.server.app import check_bind, listen, run_server

    check_bind(host, token)  # before loading anything: a public bind without a token is refused
    # the option checks come before the port is taken; neither loads the model
    config = engine_config(options)
    try:
        sock = listen(host, port)  # and a port in use is said at once, not after the model loads
    except OSError as exc:
        typer.echo(f"moectl: error: {exc}", err=True)
        raise typer.Exit(1) from None
    try:
        engines = Engines(config, options.backend)
    except BaseException:
        sock.close()
        raise
    try:
        driver = EngineDriver(engines.make_engine, name="moectl-serve")
        try:
            consoles = serve_consoles(driver)
            try:
                run_server(driver, host=host, port=port, token=token, sock=sock, record_sinks=(consoles.publish,))
            finally:
                consoles.stop("the server stopped")
                consoles.close()
        finally:
            driver.close()
    finally:
        engines.close()


def serve_consoles(driver):
    """The engine process's protocol beside the API, for any number of consoles on this machine
    (`moectl run --engine DIR`): a private directory, its socket and token, removed at the end."""
    import shutil

    from moectl.server.engine_host import EngineHost
    from moectl.wire.protocol import new_engine_dir

    engine_dir, token = new_engine_dir()
    host = EngineHost(engine_dir, token, driver=driver, name="moectl serve",
                      on_close=lambda: shutil.rmtree(engine_dir, ignore_errors=True))
    typer.echo(f"moectl serve: consoles attach with `moectl run --engine {engine_dir}`", err=True)
    return host
