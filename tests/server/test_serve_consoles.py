"""`moectl serve` hosts the engine process's protocol beside its HTTP API: several consoles attach
at once (`moectl run --engine DIR`), each sees the records of the requests the API serves, and
none of them can stop the server."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from moectl.console.engine_client import EngineSource
from moectl.wire.actions import ActionRefused
from tests.checkpoints import tiny_checkpoint
from tests.paths import REPO


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def served(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moectl.cli", "serve", "--port", str(port), "--model", str(ckpt),
                             "--devices", "2", "--threads", "1"], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        engine_dir = None
        deadline = time.monotonic() + 120
        while engine_dir is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                pytest.fail(f"moectl serve exited {proc.wait()} before it offered consoles")
            found = re.search(r"moectl run --engine (\S+)`", line)
            engine_dir = Path(found.group(1)) if found else None
        while time.monotonic() < deadline:  # the HTTP side listens too
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        yield proc, port, engine_dir, ckpt.name
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        proc.stderr.close()


def test_several_consoles_attach_to_serve_and_see_its_requests(served):
    proc, port, engine_dir, name = served
    first, second = EngineSource(engine_dir), EngineSource(engine_dir)
    try:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        api.completions.create(model=name, prompt="def f(", max_tokens=8)
        seen = {id(first): [], id(second): []}

        def decoded(source) -> int:
            return sum(r["batch"]["decode_tokens"] for r in seen[id(source)])
        deadline = time.monotonic() + 30  # the records come in batches, every 20 ms
        while time.monotonic() < deadline and min(decoded(first), decoded(second)) < 7:
            for source in (first, second):
                seen[id(source)] += source.poll()[0]
            time.sleep(0.05)
        assert decoded(first) >= 7 and decoded(second) >= 7, "a console missed the API's decode steps"
        with pytest.raises(ActionRefused, match="no demo workload"):
            first.act("workload", rate=5.0).result(timeout=30)
        assert first.act("knobs", max_num_seqs=8).result(timeout=30) == {"knobs": {"max_num_seqs": 8}}
    finally:
        first.close()  # not the owner: its Shutdown is not sent, the server goes on
        second.close()
    assert proc.poll() is None
    attached = subprocess.run([sys.executable, "-m", "moectl.cli", "run", "--engine", str(engine_dir), "--check-only"],
                              cwd=REPO, capture_output=True, text=True, timeout=60)
    assert attached.returncode == 0, attached.stderr
    refused = subprocess.run([sys.executable, "-m", "moectl.cli", "run", "--engine", str(engine_dir), "--devices", "4",
                              "--check-only"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--devices: an option of the engine" in refused.stderr
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0
    assert not engine_dir.exists()  # its socket and token went with it
