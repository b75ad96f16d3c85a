"""`moectl` / `moectl run` (the live console) and `moectl replay TRACE`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from console.cli import HBM_OPT, MODEL_OPT, BadInput, app, handles_errors, model_dir

THEME_OPT = typer.Option("dark", "--theme", help="dark, light or high-contrast (switch live with 't').")
DEMO_WORKLOAD = "rate=4,prompt=32-256,output=32-128"


def live_source(model: Optional[Path], devices: int, hbm: str, redundant: int, expert_cache: Optional[int],
                workload: str, dtype: Optional[str], threads: int):
    from engine.engine_config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.topology import Topology, parse_size

    from .sources import DemoLoad, LiveSource

    keys = dict(part.split("=", 1) for part in workload.split(",") if "=" in part)
    unknown = set(keys) - {"rate", "prompt", "output"}
    if unknown or not keys:
        raise BadInput(f"--workload: use rate=R,prompt=LO-HI,output=LO-HI (got {workload!r})")
    try:
        load = DemoLoad(rate=float(keys.get("rate", 4)), prompt_len=keys.get("prompt", "32-256"),
                        output_len=keys.get("output", "32-128"))
        load.spec(0, 1)
    except ValueError as exc:
        raise BadInput(f"--workload: {exc}") from None
    topology = Topology(num_devices=devices, hbm_bytes=parse_size(hbm, "--hbm"))
    config = EngineConfig(model=str(model_dir(model)), dtype=dtype, topology=topology, redundant_slots=redundant,
                          expert_cache_slots=expert_cache, num_threads=threads)
    return LiveSource(lambda: LLMEngine(config), load)


@app.command()
@handles_errors
def run(
    model: Optional[Path] = MODEL_OPT,
    devices: int = typer.Option(4, "--devices", "-d", help="Emulated devices (local backend)."),
    hbm: str = HBM_OPT,
    redundant: int = typer.Option(1, "--redundant", help="Redundant expert slots per device (room for replicas)."),
    expert_cache: Optional[int] = typer.Option(None, "--expert-cache", help="Tiered expert memory: cache slots "
                                                                             "per device."),
    workload: str = typer.Option(DEMO_WORKLOAD, "--workload", help="The demo workload: rate=R,prompt=LO-HI,"
                                                                    "output=LO-HI (editable live)."),
    dtype: Optional[str] = typer.Option(None, "--dtype"),
    threads: int = typer.Option(1, "--threads", help="torch threads for the engine (1 leaves a core for the UI)."),
    theme: str = THEME_OPT,
):
    """The live console (the default command): the embedded engine on a steady demo workload,
    experts on emulated devices in the naive contiguous placement, so imbalance shows and a
    rebalance visibly helps."""
    from themes import check_theme

    from .app import MoectlApp

    check_theme(theme)
    source = live_source(model, devices, hbm, redundant, expert_cache, workload, dtype, threads)
    MoectlApp(source, theme=theme).run()


@app.command()
@handles_errors
def replay(trace: Path = typer.Argument(..., help="A trace recorded by `moectl record`."), theme: str = THEME_OPT):
    """Replay a trace in the console: play, pause, speed, step, seek; rebalancing shows the
    counterfactual on the recorded routing."""
    from themes import check_theme

    from .app import MoectlApp
    from .sources import ReplaySource

    check_theme(theme)
    if not Path(trace).is_file():
        raise BadInput(f"{trace}: no such trace file")
    source = ReplaySource(trace)
    MoectlApp(source, theme=theme).run()


@app.command()
@handles_errors
def attach(url: str = typer.Argument(..., help="A running `moectl serve`, e.g. http://127.0.0.1:8000"),
           token: Optional[str] = typer.Option(None, "--token", help="Bearer token: lets the console's controls act "
                                                                      "on the remote engine (read-only without)."),
           theme: str = THEME_OPT):
    """Open the console on a remote engine (`moectl serve`): its telemetry stream live; with the
    server's token, rebalancing and knobs act on it."""
    from themes import check_theme

    from .app import MoectlApp
    from .sources import AttachSource

    check_theme(theme)
    source = AttachSource(url, token)
    MoectlApp(source, theme=theme).run()


@app.command()
@handles_errors
def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; anything but loopback needs --token."),
    port: int = typer.Option(8000, "--port"),
    token: Optional[str] = typer.Option(None, "--token", help="Bearer token for /v1/control/* (and required for "
                                                              "a non-loopback bind)."),
    model: Optional[Path] = MODEL_OPT,
    devices: int = typer.Option(4, "--devices", "-d", help="Emulated devices (local backend)."),
    hbm: str = HBM_OPT,
    redundant: int = typer.Option(1, "--redundant"),
    expert_cache: Optional[int] = typer.Option(None, "--expert-cache"),
    dtype: Optional[str] = typer.Option(None, "--dtype"),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch threads for the engine."),
):
    """An OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, /health),
    Prometheus /metrics, the /v1/telemetry record stream, and /v1/control/* for operators."""
    from engine.engine_config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.topology import Topology, parse_size
    from server.app import check_bind, run_server

    from .sources import LiveSource

    if not 0 < port < 65536:
        raise BadInput(f"--port: must be in 1-65535, got {port}")
    check_bind(host, token)  # before loading anything: a public bind without a token is refused
    config = EngineConfig(model=str(model_dir(model)), dtype=dtype, redundant_slots=redundant,
                          topology=Topology(num_devices=devices, hbm_bytes=parse_size(hbm, "--hbm")),
                          expert_cache_slots=expert_cache, num_threads=threads)
    source = LiveSource(lambda: LLMEngine(config), demo=False)
    try:
        run_server(source, host=host, port=port, token=token)
    finally:
        source.close()
