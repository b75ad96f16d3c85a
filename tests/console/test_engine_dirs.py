"""The engine process's private directory (its token, socket and log) never outlives the engine:
not after a start that failed, not after its starter was SIGKILLed; and what a console says when
its engine died (cli/engine_process.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from moectl.cli.engine_process import (
    OWNER_NAME,
    EngineProcess,
    EngineStartFailed,
    exit_lines,
    meaningful_lines,
    sweep_stale_engine_dirs,
)
from moectl.wire.protocol import SOCKET_NAME, TOKEN_NAME
from tests.checkpoints import tiny_checkpoint
from tests.console.test_engine_process import WORKLOAD, wait_gone
from tests.paths import REPO


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("engine_dirs"))


@pytest.fixture
def tmpdir_here(tmp_path, monkeypatch):
    """tempfile's directory (where engine directories go) is tmp_path: other tests' engines stay out."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def engine_dir(root: Path, owner: int | None) -> Path:
    """An engine directory as EngineProcess makes one (owner: the starter's pid; None: no owner file)."""
    path = root / f"moectl-engine-{owner}"
    path.mkdir(mode=0o700)
    (path / TOKEN_NAME).write_text("secret")
    if owner is not None:
        (path / OWNER_NAME).write_text(str(owner))
    return path


def _exited_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_sweep_removes_only_directories_whose_starter_is_gone_and_no_engine_answers(tmp_path):
    stale = engine_dir(tmp_path, _exited_pid())
    mine = engine_dir(tmp_path, os.getpid())  # its starter runs (an engine loading: no socket yet)
    unowned = engine_dir(tmp_path, None)  # just made: its owner file comes next
    answering = engine_dir(tmp_path, _exited_pid() + 1_000_000)  # a starter we cannot see, an engine we can
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(answering / SOCKET_NAME))
        listener.listen()
        assert sweep_stale_engine_dirs(tmp_path) == [stale]
    assert not stale.exists() and mine.exists() and unowned.exists() and answering.exists()


def test_a_failed_start_removes_its_directory_and_a_new_engine_sweeps_a_stale_one(ckpt, tmpdir_here):
    """`moectl web --hbm 0` (and `abc`, `-5GiB`, ...) once left /tmp/moectl-engine-* with its token;
    so did a SIGKILLed console."""
    stale = engine_dir(tmpdir_here, _exited_pid())
    engine = EngineProcess(["--model", str(ckpt), "--hbm", "0"])
    assert not stale.exists()
    with pytest.raises(EngineStartFailed, match="--hbm"):
        engine.wait_ready(timeout_s=120)
    assert not engine.dir.exists()


_CONSOLE = textwrap.dedent("""
    import sys, time
    from moectl.cli.engine_process import EngineProcess
    from moectl.console.engine_client import EngineSource
    engine = EngineProcess(sys.argv[1:])
    engine.wait_ready(timeout_s=120)
    source = EngineSource(engine.dir, owner=True)
    print(engine.pid, engine.dir, flush=True)
    time.sleep(600)
""")


def test_an_engine_whose_console_was_sigkilled_removes_its_directory(ckpt, tmp_path):
    console = subprocess.Popen([sys.executable, "-c", _CONSOLE, "--model", str(ckpt), "--devices", "2",
                                "--threads", "1", "--workload", WORKLOAD], stdout=subprocess.PIPE, text=True,
                               cwd=REPO, env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        pid, path = console.stdout.readline().split()
        console.kill()
        assert wait_gone(int(pid), 60) is not None, "the engine outlived its console"
    finally:
        console.kill()
        console.wait()
        console.stdout.close()
    assert not list(tmp_path.glob("moectl-engine-*")), path


# A distributed engine's stderr after it was SIGKILLed (rank 1 finds its store gone), as one
# was written (C++ template arguments and library paths shortened).
STRING = "std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >"
C10D_AFTER_SIGKILL = [
    "[rank1]:[W1205 04:11:28.775129554 TCPStore.cpp:106] [c10d] sendBytes failed on SocketImpl(fd=5, "
    "addr=[::ffff:127.0.0.1]:51596, remote=[::ffff:127.0.0.1]:35049): Broken pipe",
    "Exception raised from sendBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/Utils.hpp:758 "
    "(most recent call first):",
    f"frame #0: c10::Error::Error(c10::SourceLocation, {STRING}) + 0x9d (0x7f9a81179b8d in torch/lib/libc10.so)",
    f"frame #1: c10::DistError::DistError(c10::SourceLocation, {STRING}) + 0x72 (0x7f9a8117ab62 in libc10.so)",
    "frame #3: <unknown function> + 0x6747a52 (0x7f9a72d47a52 in torch/lib/libtorch_cpu.so)",
    f"frame #6: c10d::TCPStore::check(std::vector<{STRING}> const&) + 0x35d (0x7f9a72d41acd in libtorch_cpu.so)",
    "frame #8: <unknown function> + 0x3d2825 (0x7f9a815d2825 in torch/lib/libtorch_python.so)",
    "<omitting python frames>",
    "frame #21: __libc_start_main + 0x85 (0x7f9a83445305 in /lib/x86_64-linux-gnu/libc.so.6)",
    "frame #22: _start + 0x21 (0x55fd61920081 in bin/python)",
]

PYTHON_TRACEBACK = """\
Traceback (most recent call last):
  File "engine/parallel/distributed.py", line 210, in step
    out = self._forward(batch)
          ^^^^^^^^^^^^^^^^^^^^
RuntimeError: Connection closed by peer [127.0.0.1]:35049
""".splitlines()


def test_an_engine_that_died_is_reported_by_its_signal_and_its_meaningful_lines_not_a_stack_dump():
    """After a distributed engine's SIGKILL the console once printed ten C++ c10d frames as the
    engine's "last lines"."""
    assert meaningful_lines(C10D_AFTER_SIGKILL) == [C10D_AFTER_SIGKILL[0]]
    assert meaningful_lines(PYTHON_TRACEBACK) == [PYTHON_TRACEBACK[-1]]
    assert exit_lines(-9, meaningful_lines(C10D_AFTER_SIGKILL)) == [
        "the engine process was killed by SIGKILL; its last lines:", f"  {C10D_AFTER_SIGKILL[0]}"]
    assert exit_lines(3, []) == ["the engine process exited with code 3 (it wrote nothing)"]


def test_the_tail_kept_when_an_engine_stops_is_its_meaningful_lines(ckpt, tmpdir_here):
    """EngineProcess.stop keeps the log's meaningful last lines for the console's message (the
    directory, and the log with it, then go)."""
    engine = EngineProcess(["--model", str(ckpt), "--threads", "1"])
    engine.proc.kill()
    engine.proc.wait()
    engine.log_path.write_text("\n".join(C10D_AFTER_SIGKILL + PYTHON_TRACEBACK) + "\n")
    assert engine.stop() == -9
    assert engine.log_tail == [C10D_AFTER_SIGKILL[0], PYTHON_TRACEBACK[-1]] and not engine.dir.exists()
