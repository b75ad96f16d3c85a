"""The options that configure an engine, declared once: their typer options, EngineOptions, whose
fields carry them, and the decorator that gives a command those options as one `options`
parameter. Torch-free, and free of the engine: the console's process reads them (engine_process.py).

Every command that starts an engine (run, web, record, generate, bench, serve, and the engine
process of run and web) takes its options from here, so each has one flag, one help text and
one default everywhere. The engine process receives them as JSON (to_dict / from_dict), not as
flags parsed again.
"""

from __future__ import annotations

import functools
import inspect
import typing
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import typer

try:  # newer typer vendors click
    from typer._click.core import ParameterSource
    from typer._click.globals import get_current_context
except ImportError:
    from click.core import ParameterSource
    from click.globals import get_current_context

MODEL_OPT = typer.Option(None, "--model", "-m", help="A Hugging Face-format checkpoint directory, or a shipped "
                                                     "model's name: sample (the default) or sample-dsv3 (`moectl "
                                                     "model list`).")
HBM_OPT = typer.Option("80GiB", "--hbm", help="HBM per device, e.g. 80GiB, 141GiB.")
DTYPE_OPT = typer.Option(None, "--dtype", help="fp32, bf16 or fp16 (default: the checkpoint's dtype).")
HOST_MEM_OPT = typer.Option(None, "--host-mem", help="Host memory for routed experts, e.g. 8GiB: a checkpoint whose "
                                                    "experts exceed it leaves them in its safetensors files (the disk "
                                                    "tier), read on demand behind a host cache of this size.")
EXPERT_CACHE_OPT = typer.Option(None, "--expert-cache", help="Tiered expert memory (with --devices): experts stay "
                                                             "in host memory and each device caches this many in HBM.")
BACKEND_OPT = typer.Option("local", "--backend", help="local (devices emulated in this process), multi-gpu (device "
                                                      "d's experts on cuda:d), distributed (one process per "
                                                      "device, torch.distributed; see --nproc) or, for run, record "
                                                      "and bench, simulated (a cluster from a hardware profile and "
                                                      "config.json; every figure simulated; see --hardware).")
NPROC_OPT = typer.Option(None, "--nproc", help="distributed: processes, one per device (default: --devices).")
THREADS_OPT = typer.Option("auto", "--threads", help="torch intra-op threads: N, or auto (the cores other processes "
                                                    "leave free, re-measured every second; `bench --contended` "
                                                    "measures why).")
# the device options, which plan and sim take too: one default each, documented here and nowhere else
DEFAULT_DEVICES = 4  # enough emulated devices for imbalance to show
DEFAULT_REDUNDANT = 1  # a spare slot per device: room for a replica of a hot expert
MAX_REDUNDANT = 64
DEVICES_OPT = typer.Option(None, "--devices", "-d", show_default=False,
                           help=f"Devices for the experts (emulated on the local backend) [default: {DEFAULT_DEVICES}; "
                                "with --nproc, one per process; a command that reads a trace: the trace's].")
REDUNDANT_OPT = typer.Option(None, "--redundant", show_default=False,
                             help=f"Spare expert slots per device, room for replicas of hot experts (0: a rebalance "
                                  f"only moves experts) [default: {DEFAULT_REDUNDANT}; a command that reads a trace "
                                  "with a placement: that placement's].")
PLACEMENT_OPT = typer.Option(None, "--placement", help="Initial expert placement: the placement file `plan rebalance "
                                                       "--json` writes (any backend); one planned for another "
                                                       "model is refused.")
ROUTING_HINT = ("balanced, zipf:S, sample (what moectl recorded on sample-dsv3, scaled), or a moectl trace "
                "(recorded, or imported with `moectl trace import`)")
HARDWARE_OPT = typer.Option("h800", "--hardware", help="simulated backend: a shipped hardware profile (h100, h800, "
                                                       "h200, a100, mi300x, ascend-910b, mtt-s5000) or a profile "
                                                       "JSON file.")
SIM_ROUTING_OPT = typer.Option("sample", "--routing", help=f"simulated backend: expert loads, {ROUTING_HINT}.")
DRIFT_OPT = typer.Option(0.0, "--drift", help="simulated backend: swaps of two experts' shares per expert and step "
                                              "(which experts are hot wanders; the skew stays).")
TP_OPT = typer.Option(1, "--tp", help="simulated backend: attention tensor-parallel size (1: data-parallel "
                                      "attention, each device its own batch).")
OVERLAP_OPT = typer.Option("none", "--overlap", help="simulated backend: none | two-batch | five-stage (two "
                                                     "micro-batches, one's all-to-all behind the other's compute, "
                                                     "scheduled as SGLang and DeepSeek run them); distributed "
                                                     "backend: none | two-batch (each step of at least 512 tokens as "
                                                     "two micro-batches, one's collectives in flight while the "
                                                     "other computes).")
SIM_SEED_OPT = typer.Option(0, "--sim-seed", help="simulated backend: the routing draws and the workload's seed.")
PP_OPT = typer.Option(1, "--pp", help="simulated backend: pipeline stages; the devices split into this many stages "
                                      "of consecutive devices, each holding a contiguous run of layers (docs/sim.md).")
KV_RETENTION_OPT = typer.Option("full", "--kv-retention", help="Which KV of the full-attention layers a sequence "
                                                               "keeps: full (all of it), streaming (the attention "
                                                               "sinks and the most recent tokens), snapkv or h2o "
                                                               "(sinks, recent tokens and the blocks that drew the "
                                                               "most attention); all but full need --kv-budget. Not "
                                                               "on the simulated backend.")
KV_BUDGET_OPT = typer.Option(None, "--kv-budget", show_default=False,
                             help="With --kv-retention other than full: the KV a sequence keeps, N tokens or P% of "
                                  "its context (e.g. 4096, 25%), in whole blocks.")
MIXED_PRECISION_OPT = typer.Option(False, "--mixed-precision",
                                   help="With --dtype fp16 or bf16: keep the residual stream (and the norms' inputs "
                                        "and sums) in fp32 while the matmuls run in the half dtype; repairs a "
                                        "residual that outgrows fp16 (`moectl verify --dtype fp16 "
                                        "--mixed-precision` shows where).")
# the options only the simulated backend reads (sim_backend.py)
SIM_OPTIONS = ("hardware", "routing", "drift", "tp", "overlap", "sim_seed", "pp")


def given(ctx: typer.Context, name: str) -> bool:
    """Whether the option `name` was given (command line or environment), not left at its default."""
    return ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)


def _option(info):
    """A field whose default is its typer option's, the option kept in the field's metadata."""
    return field(default=info.default, metadata={"typer": info})


@dataclass(frozen=True)
class EngineOptions:
    """What configures an engine (engine_config, SimEngines); `given`: the fields given on the
    command line rather than left at their default (a backend that ignores one refuses it)."""

    model: Path | None = _option(MODEL_OPT)
    devices: int | None = _option(DEVICES_OPT)
    hbm: str = _option(HBM_OPT)
    redundant: int | None = _option(REDUNDANT_OPT)
    backend: str = _option(BACKEND_OPT)
    nproc: int | None = _option(NPROC_OPT)
    placement: Path | None = _option(PLACEMENT_OPT)
    expert_cache: int | None = _option(EXPERT_CACHE_OPT)
    host_mem: str | None = _option(HOST_MEM_OPT)
    dtype: str | None = _option(DTYPE_OPT)
    threads: str = _option(THREADS_OPT)
    hardware: str = _option(HARDWARE_OPT)
    routing: str = _option(SIM_ROUTING_OPT)
    drift: float = _option(DRIFT_OPT)
    tp: int = _option(TP_OPT)
    overlap: str = _option(OVERLAP_OPT)
    sim_seed: int = _option(SIM_SEED_OPT)
    pp: int = _option(PP_OPT)
    kv_retention: str = _option(KV_RETENTION_OPT)
    kv_budget: str | None = _option(KV_BUDGET_OPT)
    mixed_precision: bool = _option(MIXED_PRECISION_OPT)
    given: frozenset[str] = frozenset()

    def given_flags(self) -> list[str]:
        """The flags of the options given on the command line, in declaration order."""
        return [flag(name) for name in ALL_OPTIONS if name in self.given]

    def absolute(self) -> EngineOptions:
        """The same options with the files they name as absolute paths, for another process (a
        shipped model's name, sample-dsv3, is no file and stays a name)."""
        paths = {name: Path(getattr(self, name)).resolve() for name in ("model", "placement")
                 if getattr(self, name) is not None and Path(getattr(self, name)).exists()}
        return replace(self, **paths)

    def to_dict(self) -> dict:
        """The options as JSON values (paths as text, `given` as a sorted list)."""
        values = {name: str(value) if isinstance(value, Path) else value for name, value in asdict(self).items()}
        values["given"] = sorted(self.given)
        return values

    @classmethod
    def from_dict(cls, values, where: str) -> EngineOptions:
        """The options to_dict gave, each field type-checked (`where` names the source in errors)."""
        if not isinstance(values, dict):
            raise ValueError(f"{where}: the engine options are not a JSON object")
        unknown = sorted(set(values) - set(OPTION_TYPES) - {"given"})
        if unknown:
            raise ValueError(f"{where}: unknown engine option {unknown[0]!r}")
        names = values.get("given", [])
        if not isinstance(names, list) or any(not isinstance(name, str) or name not in OPTION_TYPES for name in names):
            raise ValueError(f"{where}: given: must be a list of engine option names")
        return cls(**{name: _typed(where, name, value) for name, value in values.items() if name != "given"},
                   given=frozenset(names))


def _typed(where: str, name: str, value):
    """A JSON value as the field's type (a path from a string, a float from an integer)."""
    allowed = OPTION_TYPES[name]
    if value is None and type(None) in allowed:
        return None
    if Path in allowed and isinstance(value, str):
        return Path(value)
    if float in allowed and type(value) is int:
        return float(value)
    if type(value) not in allowed:  # not isinstance: a bool is no int here
        kinds = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
        raise ValueError(f"{where}: {name}: must be {kinds}, got {value!r}")
    return value


_HINTS = typing.get_type_hints(EngineOptions)
_INFO = {f.name: f.metadata["typer"] for f in fields(EngineOptions) if "typer" in f.metadata}
ALL_OPTIONS = tuple(_INFO)  # declaration order (`given` is not an option)
REAL_ENGINE_OPTIONS = tuple(name for name in ALL_OPTIONS if name not in SIM_OPTIONS)  # no simulated cluster
# each option's types, from its annotation (Path | None: Path, NoneType)
OPTION_TYPES = {name: typing.get_args(_HINTS[name]) or (_HINTS[name],) for name in ALL_OPTIONS}
DEFAULT_OPTIONS = EngineOptions()  # a command's `options` parameter's default, which with_engine_options replaces


def flag(name: str) -> str:
    """An engine option's long flag (expert_cache -> --expert-cache)."""
    return max(_INFO[name].param_decls, key=len)


def with_engine_options(*names: str):
    """Gives a command the engine options `names` (default: all) in place of its `options`
    parameter: typer sees each as a parameter, and the command gets one EngineOptions (the
    others at their defaults). A direct call may pass `options=` itself."""
    chosen = names or ALL_OPTIONS

    def decorate(fn):
        signature = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
        own = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in signature.parameters.values()]
        at = next(i for i, p in enumerate(own) if p.name == "options")
        engine = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=_INFO[name],
                                    annotation=_HINTS[name]) for name in chosen]
        params = own[:at] + engine + own[at + 1:]

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if "options" not in kwargs:
                values = {name: kwargs.pop(name) for name in chosen if name in kwargs}
                ctx = get_current_context(silent=True)
                typed = {name for name in values if ctx is not None and given(ctx, name)}
                kwargs["options"] = EngineOptions(**values, given=frozenset(typed))
            return fn(*args, **kwargs)

        wrapper.__signature__ = signature.replace(parameters=params)
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper

    return decorate


def refuse_given(options: EngineOptions, names, why: str) -> None:
    """The first of `names` given on the command line is bad input: `--flag: why`."""
    for name in names:
        if name in options.given:
            raise ValueError(f"{flag(name)}: {why}")

