"""Records the vLLM /metrics scrapes tests/profiler/data/vllm_metrics holds (its README says what
they are): vLLM's CPU build (bench/peers/setup.sh) serving the sample model in fp32, an idle scrape,
three waves of greedy completions, two scrapes 1 s apart during the last, one after.

    python bench/peers/vllm_metrics_scrapes.py OUT_DIR [--python .peers/vllm/bin/python]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PORT = 8765


def get(path: str) -> bytes:
    return urllib.request.urlopen(f"http://127.0.0.1:{PORT}{path}", timeout=600).read()


def complete(prompt: str, max_tokens: int) -> None:
    body = json.dumps({"model": "sample", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/completions", body,
                                                  {"Content-Type": "application/json"}), timeout=900).read()


def wave(n: int, prompt: str, max_tokens: int, during=None) -> None:
    threads = [threading.Thread(target=complete, args=(prompt.format(i=i), max_tokens)) for i in range(n)]
    [t.start() for t in threads]
    if during is not None:
        during()
    [t.join() for t in threads]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--python", default=str(ROOT / ".peers" / "vllm" / "bin" / "python"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    server = subprocess.Popen([args.python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                               str(ROOT / "engine" / "sample_model"), "--served-model-name", "sample", "--port",
                               str(PORT), "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024"], env=env)

    def save(name: str) -> None:
        (args.out / f"{name}.prom.gz").write_bytes(gzip.compress(get("/metrics"), 9, mtime=0))

    try:
        for _ in range(600):
            try:
                get("/v1/models")
                break
            except OSError:
                time.sleep(1)
        save("idle")
        wave(16, "def fib{i}(n):\n    " * 4, 48)
        wave(64, "class Node{i}:\n    def __init__(self" * 3, 160)

        def busy():
            time.sleep(2)
            save("busy_a")
            time.sleep(1)
            save("busy_b")
        wave(300, "class Node{i}:\n    def __init__(self" * 6, 600, busy)
        save("drained")
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
