"""Starting and stopping the engine process a console attaches to (server/engine_host.py).

`moectl run` and `moectl web` run the engine as `moectl engine-host` in a process of its own, so
that only that process loads torch and the console's rendering never shares a GIL with the
engine. The engine checks its own options (engine_config) before it loads anything and answers
on its stdout with one line: ready, or the one-line error its command would print, which the
starting command then prints as its own, with the same exit code.

Torch-free: it runs in the console's process.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time

from moectl.server.protocol import new_engine_dir

START_TIMEOUT_S = 600.0  # a large checkpoint's load
STOP_TIMEOUT_S = 5.0
LOG_TAIL = 10  # lines of the engine's stderr shown when it died under the console
ERROR_PREFIX = "moectl: error: "


class EngineStartFailed(Exception):
    """The engine process exited before it was ready: its one-line error and exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class EngineProcess:
    """`moectl engine-host` with `options` (run's option flags), in a private directory."""

    def __init__(self, options: list[str]):
        self.dir, _token = new_engine_dir()
        self.log_path = self.dir / "engine.log"
        env = dict(os.environ, MOECTL_PARENT_PID=str(os.getpid()))
        with open(self.log_path, "wb") as log:  # the engine's stderr: warnings, and its error if it fails
            # its own session: a Ctrl-C typed at the console is the console's, which then stops it
            self.proc = subprocess.Popen([sys.executable, "-m", "moectl.cli", "engine-host", "--engine-dir",
                                          str(self.dir), *options], stdin=subprocess.DEVNULL,
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
            if not line:  # it exited
                code = self.proc.wait()
                raise EngineStartFailed(self._error_line(code), code or 1)
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
            self.log_tail = self._log_lines()[-LOG_TAIL:]  # kept: the directory goes
            shutil.rmtree(self.dir, ignore_errors=True)

    def _log_lines(self) -> list[str]:
        try:
            return [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return []
