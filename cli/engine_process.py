"""Starting and stopping the engine process a console attaches to (server/engine_host.py).

`moectl run` and `moectl web` run the engine as `moectl engine-host` in a process of its own, so
that only that process loads torch and the console's rendering never shares a GIL with the
engine. Its options go to it as JSON (EngineHostConfig, a file in its private directory), not
as flags parsed again. The engine checks them (engine_config) before it loads anything and
answers on its stdout with one line: ready, or the one-line error its command would print, which
the starting command then prints as its own, with the same exit code.

The directory (token, socket, the engine's log) goes when the engine stops: stop() removes it,
the engine removes it itself when its starter died (engine-host), and a new EngineProcess sweeps
those whose starter was SIGKILLed before either could (OWNER_NAME names it).

Torch-free: it runs in the console's process.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import typer

from moectl.cli.engine_options import DEFAULT_OPTIONS, EngineOptions, with_engine_options
from moectl.wire.protocol import ENGINE_DIR_PREFIX, OWNER_NAME, PARENT_PID_ENV, SOCKET_NAME, new_engine_dir

try:  # newer typer vendors click
    from typer._click.exceptions import UsageError
except ImportError:
    from click.exceptions import UsageError

START_TIMEOUT_S = 600.0  # a large checkpoint's load
STOP_TIMEOUT_S = 5.0
LOG_TAIL = 3  # lines of the engine's stderr shown when it died under the console
ERROR_PREFIX = "moectl: error: "
# stack dumps in the engine's stderr: C++ frames (c10's "frame #3: ...", a rank's c10d error
# after a peer died), Python's and faulthandler's tracebacks; the lines around them say what
# happened, the frames only where
STACK_LINE = re.compile(r"frame #\d+: |<omitting python frames>$|.*\(most recent call (first|last)\):$"
                        r'|\s+File ".*", line \d+|\s{4}')
CONFIG_NAME = "engine-options.json"  # the engine process's EngineHostConfig, in its directory


@dataclass(frozen=True)
class EngineHostConfig:
    """What `moectl engine-host` runs: the engine options, the demo workload (None: the default
    for the backend) and, for tests, the step from which the first engine's forward fails."""

    options: EngineOptions = DEFAULT_OPTIONS
    workload: str | None = None
    inject_fault: int | None = None

    def write(self, engine_dir: Path) -> None:
        """Into the engine's private directory, readable by this user only (it may name files)."""
        text = json.dumps({"options": self.options.absolute().to_dict(), "workload": self.workload,
                           "inject_fault": self.inject_fault})
        fd = os.open(Path(engine_dir) / CONFIG_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)

    @classmethod
    def read(cls, engine_dir: Path) -> EngineHostConfig:
        """The config write() left, checked: a damaged one is bad input (ValueError) naming the file."""
        path = Path(engine_dir) / CONFIG_NAME
        try:
            values = json.loads(path.read_text())
        except OSError as exc:
            raise ValueError(f"{path}: no engine options here ({exc.strerror or exc})") from None
        except ValueError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
        if not isinstance(values, dict) or set(values) != {"options", "workload", "inject_fault"}:
            raise ValueError(f"{path}: must be an object of options, workload and inject_fault")
        workload, inject_fault = values["workload"], values["inject_fault"]
        if workload is not None and not isinstance(workload, str):
            raise ValueError(f"{path}: workload: must be text or null, got {workload!r}")
        if inject_fault is not None and type(inject_fault) is not int:
            raise ValueError(f"{path}: inject_fault: must be an integer or null, got {inject_fault!r}")
        return cls(EngineOptions.from_dict(values["options"], str(path)), workload, inject_fault)


def config_from_flags(args: list[str]) -> EngineHostConfig:
    """`run`'s engine flags (and --inject-fault) as an EngineHostConfig: how tests and benchmarks
    describe the engine they start. A flag that does not parse is bad input (ValueError)."""
    @with_engine_options()
    def parse(options: EngineOptions = DEFAULT_OPTIONS,
              workload: str | None = typer.Option(None, "--workload"),
              inject_fault: int | None = typer.Option(None, "--inject-fault")) -> EngineHostConfig:
        return EngineHostConfig(options, workload, inject_fault)

    app = typer.Typer(add_completion=False)
    app.command()(parse)
    try:
        return typer.main.get_command(app).main(list(args), prog_name="engine-host", standalone_mode=False)
    except UsageError as exc:
        raise ValueError(exc.format_message().splitlines()[0]) from None


class EngineStartFailed(Exception):
    """The engine process exited before it was ready: its one-line error and exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class EngineProcess:
    """`moectl engine-host` on `config` (or on `run`'s engine flags: config_from_flags), in a
    private directory."""

    def __init__(self, config: EngineHostConfig | list[str]):
        if not isinstance(config, EngineHostConfig):
            config = config_from_flags(config)
        sweep_stale_engine_dirs()
        self.dir, _token = new_engine_dir()
        config.write(self.dir)
        self.log_path = self.dir / "engine.log"
        env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}
        with open(self.log_path, "wb") as log:  # the engine's stderr: warnings, and its error if it fails
            # its own session: a Ctrl-C typed at the console is the console's, which then stops it
            self.proc = subprocess.Popen([sys.executable, "-m", "moectl.cli", "engine-host", "--engine-dir",
                                          str(self.dir)], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True)
        self.pid = self.proc.pid
        self.log_tail: list[str] = []

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> dict:
        """The engine's ready line; EngineStartFailed when it exits (or is silent) first."""
        deadline = time.monotonic() + timeout_s
        out = self.proc.stdout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                raise EngineStartFailed(f"the engine process was not ready within {timeout_s:g} s", 1)
            ready, _, _ = select.select([out], [], [], min(left, 1.0))
            if not ready:
                continue
            line = out.readline()
            if not line:  # it exited: its error line, then its directory goes
                code = self.proc.wait()
                message = self._error_line(code)
                self.stop()
                raise EngineStartFailed(message, code or 1)
            try:
                message = json.loads(line)
            except ValueError:
                continue  # not ours (a library printing to stdout)
            if isinstance(message, dict) and "ready" in message:
                return message

    def _error_line(self, code: int) -> str:
        lines = self._log_lines()
        for line in reversed(lines):
            if line.startswith(ERROR_PREFIX):
                return line[len(ERROR_PREFIX):]
        tail = next((line for line in reversed(lines) if line.strip()), "")
        return f"the engine process exited with code {code}" + (f": {tail}" if tail else "")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> int | None:
        """Stop an engine no client owns (web's): SIGTERM, then stop()."""
        if self.alive():
            self.proc.terminate()
        return self.stop()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """Waits for the engine to exit (its owner's Shutdown has usually told it to), then
        terminates, then kills it; removes its directory. Returns its exit code."""
        try:
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait()
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            if self.dir.exists():  # kept: the directory goes (a second stop keeps the first's)
                self.log_tail = meaningful_lines(self._log_lines())[-LOG_TAIL:]
            shutil.rmtree(self.dir, ignore_errors=True)

    def _log_lines(self) -> list[str]:
        try:
            return [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return []


def meaningful_lines(lines: list[str]) -> list[str]:
    """The engine's stderr without its stack dumps' frames (STACK_LINE)."""
    return [line for line in lines if not STACK_LINE.match(line)]


def exit_lines(code: int, tail: list[str]) -> list[str]:
    """What a console says when its engine process died under it: how (a signal by name), then
    the meaningful last lines of its stderr."""
    how = f"exited with code {code}"
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    head = f"the engine process {how}" + ("; its last lines:" if tail else " (it wrote nothing)")
    return [head, *(f"  {line}" for line in tail)]


def sweep_stale_engine_dirs(root: Path | None = None) -> list[Path]:
    """Remove this user's engine directories whose starter is gone and whose socket no engine
    answers on (a SIGKILLed console's, or a SIGKILLed `moectl web`'s): returns them. A directory
    without OWNER_NAME is left alone: it may be one being made right now."""
    root = Path(root or tempfile.gettempdir())
    swept = []
    for path in root.glob(f"{ENGINE_DIR_PREFIX}*"):
        try:
            if path.is_symlink() or not path.is_dir() or path.stat().st_uid != os.getuid():
                continue
            owner = int((path / OWNER_NAME).read_text())
        except (OSError, ValueError):
            continue
        if _pid_alive(owner) or _engine_answers(path / SOCKET_NAME):
            continue
        shutil.rmtree(path, ignore_errors=True)
        swept.append(path)
    return swept


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process has that pid now
        return True
    return True


def _engine_answers(path: Path) -> bool:
    """Whether an engine listens on this socket (the owner's pid may be invisible here: another
    pid namespace sharing /tmp)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.setblocking(False)
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            return False
        except OSError:  # busy (EAGAIN) or not ours to tell: alive
            return True
    return True
