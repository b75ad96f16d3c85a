"""What every command shares: error handling, checks of common option values, and the one
translation of the engine options (engine_options.py: `--devices/--hbm/--backend/...`) into an
EngineConfig.

Exit codes: 0 success, 1 failure, 2 bad input. Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import os
import sys
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from moectl.cli.engine_options import DEFAULT_DEVICES, DEFAULT_REDUNDANT, MAX_REDUNDANT
from moectl.engine import resolve_model
from moectl.engine.core.config import RETENTION_POLICIES, EngineConfig, KnobError, SchedulerKnobs
from moectl.placement.topology import MAX_DEVICES, Topology, parse_size

if TYPE_CHECKING:
    from moectl.cli.engine_options import EngineOptions

BACKENDS = ("local", "multi-gpu", "distributed")
MAX_SIZE_BYTES = 1 << 50  # 1 PiB: more than any one device or host has; beyond it a size is a typo
MAX_SEED = 2**63 - 1  # torch.manual_seed's and the engine's range
# threads beyond a few per core only contend, and an absurd count crashes torch's thread pool (exit 139)
MAX_THREADS = 4 * (os.cpu_count() or 1)

JSON_OPT = typer.Option(False, "--json", help="Print machine-readable JSON (progress goes to stderr).")
THEME_OPT = typer.Option("dark", "--theme", help="dark, light or high-contrast (switch live with 't').")
def option_flag(ctx: typer.Context, name: str) -> str:
    """The long flag of one of the command's parameters (e.g. expert_cache -> --expert-cache)."""
    param = next(p for p in ctx.command.params if p.name == name)
    return max(param.opts, key=len)


class BadInput(ValueError):
    """Bad input from the command line: exit code 2."""


def _fail(message: str, code: int) -> None:
    typer.echo(f"moectl: error: {message}", err=True)
    raise typer.Exit(code)


# the engine's config fields as the command line spells them: the engine's errors name its field
# (right for an API user), a command's name the flag that was typed
FIELD_FLAGS = {"redundant_slots": "--redundant", "expert_cache_slots": "--expert-cache", "host_mem": "--host-mem",
               "hbm": "--hbm", "num_threads": "--threads", "kv_retention": "--kv-retention", "kv_budget": "--kv-budget",
               "kv_budget_fraction": "--kv-budget"}


def flag_words(message: str) -> str:
    """A one-line error whose leading `field:` is an engine config field, with the flag instead."""
    field, sep, rest = message.partition(":")
    return f"{FIELD_FLAGS[field]}:{rest}" if sep and field in FIELD_FLAGS else message


def handles_errors(fn):
    """Bad input (ValueError) exits 2, anything else 1; both with one line and no traceback."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except BrokenPipeError:  # the reader went away (`| head`): stop quietly, like any filter
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(0) from None
        except ValueError as exc:
            _fail(flag_words(str(exc).splitlines()[0]) if str(exc) else type(exc).__name__, 2)
        except KeyboardInterrupt:
            _fail("interrupted", 1)
        except Exception as exc:  # noqa: BLE001 - the CLI's last line of defence
            _fail(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", 1)

    return wrapper


def model_dir(model: Path | None, config_file: bool = False) -> Path:
    """--model's checkpoint directory: a path, or a shipped model's name (config_file: a bare
    config.json file will do too)."""
    try:
        path = resolve_model(model)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    if config_file and path.is_file():
        return path
    if not path.is_dir():
        raise BadInput(f"--model: {path} is not a directory" + (" or a config.json file" if config_file else ""))
    return path


def parse_threads(value: str | None) -> int | str | None:
    """--threads: "auto" or an integer in 1..MAX_THREADS."""
    if value is None or value == "auto":
        return value
    try:
        threads = int(value)
    except ValueError:
        raise BadInput(f"--threads: must be a positive integer or auto, got {value!r}") from None
    if not 1 <= threads <= MAX_THREADS:
        raise BadInput(f"--threads: must be in 1-{MAX_THREADS} (4 per core here), got {threads}")
    return threads


def parse_cli_size(value: str, option: str) -> int:
    """A size option (--hbm, --host-mem): bytes, finite and at most MAX_SIZE_BYTES."""
    try:
        size = parse_size(value, option)
    except OverflowError:  # int(inf): '1e999GiB'
        raise BadInput(f"{option}: {value!r} is not a finite size") from None
    if size > MAX_SIZE_BYTES:
        raise BadInput(f"{option}: {value!r} is more than 1 PiB")
    return size


def redundant_slots(redundant: int | None, default: int = DEFAULT_REDUNDANT) -> int:
    """--redundant: the given count (checked), else `default`."""
    if redundant is None:
        return default
    if not 0 <= redundant <= MAX_REDUNDANT:
        raise BadInput(f"--redundant: must be in 0-{MAX_REDUNDANT}, got {redundant}")
    return redundant


def check_seed(seed: int | None, option: str = "--seed") -> int | None:
    """--seed within the range torch's generators take."""
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise BadInput(f"{option}: must be in 0-{MAX_SEED}, got {seed}")
    return seed


def check_nproc(nproc: int | None, backend: str) -> None:
    """--nproc: a process count, only for the distributed backend."""
    if nproc is None:
        return
    if nproc < 1:
        raise BadInput(f"--nproc: must be >= 1, got {nproc}")
    if backend != "distributed":
        raise BadInput("--nproc: only with --backend distributed")


def check_device(device: str) -> str:
    """--device: a torch device this machine has (an unknown or absent one is bad input)."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise BadInput(f"--device: {device!r} is not a torch device (e.g. cpu, cuda:0)") from None
    if dev.type == "cpu":
        return device
    backend = getattr(torch, dev.type, None)  # torch.cuda, torch.mps, torch.xpu: each says what it has
    available = getattr(backend, "is_available", lambda: False)()
    count = getattr(backend, "device_count", lambda: 1)() if available else 0
    if (dev.index or 0) >= count:
        raise BadInput(f"--device: {device} is not available here ({count} {dev.type} devices)")
    return device


def check_output_file(out: Path, option: str, *inputs: Path) -> None:
    """An output file path: its folder exists, it is not a folder, and it is none of `inputs`."""
    out = Path(out)
    if out.is_dir():
        raise BadInput(f"{option}: {out} is a directory; give a file path")
    if not out.parent.is_dir():
        raise BadInput(f"{option}: {out.parent} is not an existing directory")
    for src in inputs:
        if out.exists() and Path(src).exists() and os.path.samefile(out, src):
            raise BadInput(f"{option}: {out} is the input {src}; give another file")


def parse_ids(spec: str) -> list[int]:
    try:
        ids = [int(x) for x in spec.replace(" ", "").split(",") if x]
    except ValueError:
        raise BadInput(f"--prompt-ids: {spec!r} is not a comma-separated list of integers") from None
    if not ids:
        raise BadInput("--prompt-ids: empty")
    return ids


def read_placement(path: Path, model: Path, devices: int) -> dict:
    """The --placement file (placement/placement_file.py: a placement or a `plan rebalance
    --json` result) fitted to the checkpoint's config.json and checked against the device count,
    before anything is loaded, so the error names the option."""
    from moectl.engine.models.config import ModelConfig
    from moectl.placement.placement import PlacementError
    from moectl.placement.placement_file import fit_to_model, model_identity, read_placement_file

    try:
        placement, planned_for = read_placement_file(path)
        identity = model_identity(ModelConfig.from_dir(model), Path(model).resolve().name)
        placement = fit_to_model(placement, planned_for, identity)
    except PlacementError as exc:
        raise BadInput(f"--placement: {path}: {exc}") from None
    if placement.num_devices != devices:
        raise BadInput(f"--placement: {path} places experts on {placement.num_devices} devices, this run has {devices}")
    return placement.to_dict()


def _check_ranks(model: Path | None, ranks: int, flag: str) -> None:
    """Every rank must own at least one expert (engine/parallel/distributed.py checks it too, later)."""
    from moectl.engine.models.config import ModelConfig

    experts = ModelConfig.from_dir(model_dir(model)).num_experts
    if ranks > experts:
        raise BadInput(f"{flag}: {ranks} ranks exceed the model's {experts} experts (every rank must own at least one)")


def retention_knobs(retention: str, budget: str | None) -> SchedulerKnobs:
    """--kv-retention and --kv-budget as the engine's initial knobs (the rest at their defaults):
    a policy other than full needs a budget, and full takes none."""
    from moectl.wire.kv_budget import parse_kv_budget

    if retention not in RETENTION_POLICIES:
        raise BadInput(f"--kv-retention: must be one of {', '.join(RETENTION_POLICIES)}, got {retention!r}")
    if budget is None:
        if retention != "full":
            raise BadInput(f"--kv-retention {retention}: needs --kv-budget (N tokens or P% of the context)")
        return SchedulerKnobs()
    if retention == "full":
        raise BadInput("--kv-budget: only with --kv-retention streaming, snapkv or h2o (full keeps every token)")
    try:
        tokens, fraction = parse_kv_budget(budget, "--kv-budget")
        return SchedulerKnobs(kv_retention=retention, kv_budget=tokens, kv_budget_fraction=fraction)
    except KnobError as exc:  # a token count past the engine's range
        raise BadInput(flag_words(str(exc))) from None
    except ValueError as exc:
        raise BadInput(str(exc)) from None


def engine_config(options: EngineOptions, *, device: str = "cpu", **fields) -> EngineConfig:
    """The EngineConfig the engine options describe. devices None (not given): DEFAULT_DEVICES,
    which --nproc replaces; redundant None: DEFAULT_REDUNDANT; the knobs: the defaults with
    --kv-retention and --kv-budget (retention_knobs).
    fields: any other EngineConfig field (num_kv_blocks, kv_cache_dtype, ...)."""
    fields["num_threads"] = parse_threads(options.threads)
    fields["knobs"] = retention_knobs(options.kv_retention, options.kv_budget)
    if options.mixed_precision:
        if options.dtype not in ("fp16", "bf16", "float16", "bfloat16"):
            raise BadInput("--mixed-precision: needs --dtype fp16 or bf16 (the residual stream is kept in fp32 "
                           "beside half-precision matmuls)")
        fields["mixed_precision"] = True
    fields["dtype"] = options.dtype
    model, devices, backend, nproc = options.model, options.devices, options.backend, options.nproc
    expert_cache, host_mem, placement = options.expert_cache, options.host_mem, options.placement
    if backend not in BACKENDS:
        raise BadInput(f"--backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
    check_nproc(nproc, backend)
    hbm_bytes = parse_cli_size(options.hbm, "--hbm")  # checked even where no topology uses it
    if backend != "multi-gpu":  # multi-gpu picks cuda:0 itself, checked below
        check_device(device)
    if devices is not None and devices < 1:
        raise BadInput(f"--devices: must be >= 1, got {devices}")
    devices_given = devices is not None
    devices = devices if devices_given else DEFAULT_DEVICES
    fields["redundant_slots"] = redundant_slots(options.redundant)
    count_flag = "--devices"
    if backend == "distributed":
        if expert_cache is not None:
            raise BadInput("--expert-cache: not on the distributed backend (each rank holds its experts)")
        if nproc is not None and devices is not None and devices_given and devices != nproc:
            raise BadInput(f"--devices {devices}, --nproc {nproc}: the distributed backend runs one process per "
                           "device; give one of them")
        count_flag = "--nproc" if nproc is not None else count_flag
        devices = nproc if nproc is not None else devices
    if devices > MAX_DEVICES:
        raise BadInput(f"{count_flag}: must be in 1-{MAX_DEVICES}, got {devices}")
    if backend == "distributed":
        _check_ranks(model, devices, count_flag)
        fields["overlap"] = options.overlap  # none or two-batch (refuse_sim_options checked it)
    if host_mem is not None:
        if backend == "distributed":
            raise BadInput("--host-mem: not on the distributed backend (each rank loads its own experts)")
        fields["host_mem"] = parse_cli_size(host_mem, "--host-mem")
    if placement is not None:
        fields["placement"] = read_placement(placement, model_dir(model), devices)
    topology = Topology(num_devices=devices, hbm_bytes=hbm_bytes)
    if backend == "multi-gpu":
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if devices > have:
            raise BadInput(f"--backend multi-gpu: needs --devices N with N <= the {have} CUDA devices here")
        fields["expert_devices"] = tuple(f"cuda:{d}" for d in range(devices))
        device = "cuda:0"
    return EngineConfig(model=str(model_dir(model)), device=device, topology=topology,
                        expert_cache_slots=expert_cache, **fields)


def emit_json(result, as_json: bool) -> None:
    if as_json:
        import json

        typer.echo(json.dumps(result, default=str))


def progress(as_json: bool):
    """Human progress lines: on stdout normally, on stderr when stdout carries JSON."""
    return (lambda line: typer.echo(line, err=True)) if as_json else typer.echo


def open_trace(path: Path, gpu_timeline: bool = False):
    """A TraceReader on path (a context manager); a missing file is bad input, and so is a GPU
    timeline (a Kineto import: no engine steps or routing) where the command needs those."""
    from moectl.profiler.kineto_import import is_timeline
    from moectl.profiler.trace_store import TraceReader

    if Path(path).is_dir():
        raise BadInput(f"{path}: is a directory, not a trace")
    if not Path(path).is_file():
        raise BadInput(f"{path}: no such trace file")
    reader = TraceReader(path)
    if not gpu_timeline and is_timeline(reader.header):
        reader.close()
        raise BadInput(f"{path}: a GPU timeline imported from PyTorch-profiler traces: it has no engine steps or "
                       f"routing (read it with `moectl trace report`, `trace info` or `replay`)")
    return reader
