"""Multi-node launch on localhost: two separate `torchrun` invocations (one per "node", one process
each) that meet through torchrun's c10d rendezvous, running the distributed entry point; rank 0's
greedy tokens must equal the single-process engine's on the same checkpoint.

Rendezvous form: `--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT` (dynamic rendezvous; whichever
agent binds the endpoint first hosts the store). Under c10d the global ranks come from the
rendezvous, not from --node-rank, so either invocation may turn out to be rank 0: the test takes
the JSON from whichever one printed it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from moectl.engine.llm_engine import EngineConfig, LLMEngine, SamplingParams
from tests.checkpoints import tiny_checkpoint

PROMPTS = [[1, 2, 3], [5, 6]]
MAX_TOKENS = 8
TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun() -> list[str]:
    """The torchrun next to this interpreter (the venv's), else the module it wraps."""
    exe = Path(sys.executable).with_name("torchrun")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("multinode") / "mixtral")


def _kill(proc: subprocess.Popen) -> None:
    """Kills the torchrun agent and its worker (each launch is its own process group)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def test_two_torchrun_nodes_match_single_process(model_dir, tmp_path, single_thread):
    ref = [o.token_ids for o in LLMEngine(EngineConfig(model=str(model_dir), device="cpu", num_threads=1))
           .generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))]

    port = _free_port()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    entry = ["-m", "moectl.engine.parallel.distributed", "--model", str(model_dir), "--device", "cpu",
             "--max-tokens", str(MAX_TOKENS), "--json"]
    for ids in PROMPTS:
        entry += ["--prompt-ids", ",".join(map(str, ids))]
    procs = []
    try:
        for node_rank in range(2):
            cmd = [*_torchrun(), "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node_rank),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "moectl-multinode",
                   "--local-addr", "127.0.0.1", "--max-restarts", "0", "--monitor-interval", "0.2", *entry]
            procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, start_new_session=True))
        results = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            _kill(p)

    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-4000:]
    printed = [out.strip() for out, _ in results if out.strip()]
    assert len(printed) == 1, results  # rank 0 prints the JSON; the other rank prints nothing
    outs = json.loads(printed[0].splitlines()[-1])
    assert [o["token_ids"] for o in outs] == ref
    assert [o["prompt_ids"] for o in outs] == PROMPTS
    assert all(len(t) >= 1 for t in ref)
