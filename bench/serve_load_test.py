"""Load test of `moectl serve`: N concurrent streaming completions through real HTTP.

    python bench/serve_load_test.py                               # sample model, 4 devices, 200 streams
    python bench/serve_load_test.py --requests 500 --max-tokens 16 --json

The server runs in a child process (the sample model on 4 emulated devices, as `moectl serve`
would run it), so the client's work does not share its interpreter. After a warm-up round the
child's RSS is the baseline; then all N requests are sent at once, each streaming
(/v1/completions, stream=true, greedy, ignore_eos, so every request produces max_tokens tokens).

Reported: requests/s (N over the wall time of the round), TTFT as the client sees it (request
sent -> first streamed chunk) at p50/p99, errors (a failed connection, a non-200, an error
chunk, or a stream without `data: [DONE]`), the KV blocks in use once the engine is idle (0
unless something leaked), and the server's RSS before and after (the baseline is taken after
a warm-up round of the same size, so the allocator's pools are already grown), with its growth
against the target: the load round must end within 16 MiB of the warm baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import aiohttp
import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_MODEL = ROOT / "engine" / "sample_model"
TARGET_RSS_GROWTH = 16 << 20  # bytes the server's RSS may grow over the load round, after the warm-up round

SERVER_CODE = textwrap.dedent("""
    import sys
    from moectl.engine.core.driver import EngineDriver
    from moectl.engine.core.config import EngineConfig
    from moectl.engine.llm_engine import LLMEngine
    from moectl.placement.topology import Topology
    from moectl.server.app import run_server
    from moectl.engine.core import gc_heap

    gc_heap.own_process()  # as `moectl serve` does: the heap frozen once the engine is built
    model, devices, threads, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    config = EngineConfig(model=model, topology=Topology(num_devices=devices), redundant_slots=1,
                          num_threads=threads)
    driver = EngineDriver(lambda: LLMEngine(config))
    try:
        run_server(driver, host="127.0.0.1", port=port)
    finally:
        driver.close()
""")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            try:
                async with session.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError("the server did not come up")


async def health(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url + "/health") as r:
        return await r.json()


async def wait_idle(session: aiohttp.ClientSession, url: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = await health(session, url)
        if (h["running"] == 0 and h["waiting"] == 0) or time.monotonic() > deadline:
            return h
        await asyncio.sleep(0.05)


async def one_stream(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int) -> dict:
    body = {"prompt": f"def function_{i}(values):\n    ", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    ttft, done, error = None, False, None
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                return {"ttft": None, "error": f"HTTP {resp.status}: {(await resp.text())[:200]}"}
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                if ttft is None:
                    ttft = time.perf_counter() - t0
                if line.strip() == b"data: [DONE]":
                    done = True
                elif b'"error"' in line and "error" in json.loads(line[6:]):
                    error = json.loads(line[6:])["error"]["message"]
    except (TimeoutError, aiohttp.ClientError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    if error is None and not done:
        error = "stream ended without [DONE]"
    return {"ttft": ttft, "error": error}


async def round_of(url: str, n: int, max_tokens: int) -> tuple[list[dict], float]:
    connector = aiohttp.TCPConnector(limit=0)  # all N at once
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(session, url, i, max_tokens) for i in range(n)))
        return results, time.perf_counter() - t0


async def run(args, url: str, server: psutil.Process) -> dict:
    log(f"warm-up: {args.warmup} streams")
    await round_of(url, args.warmup, args.max_tokens)
    async with aiohttp.ClientSession() as session:
        await wait_idle(session, url)
    rss_before = server.memory_info().rss
    log(f"load: {args.requests} concurrent streams of {args.max_tokens} tokens")
    results, wall = await round_of(url, args.requests, args.max_tokens)
    async with aiohttp.ClientSession() as session:
        idle = await wait_idle(session, url)
    rss_after = server.memory_info().rss
    ttfts = np.array([r["ttft"] for r in results if r["ttft"] is not None])
    errors = [r["error"] for r in results if r["error"] is not None]
    return {
        "requests": args.requests, "max_tokens": args.max_tokens, "devices": args.devices,
        "model": str(args.model), "wall_s": wall, "requests_per_s": args.requests / wall,
        "output_tokens_per_s": args.requests * args.max_tokens / wall,
        "ttft_p50_s": float(np.percentile(ttfts, 50)) if len(ttfts) else None,
        "ttft_p99_s": float(np.percentile(ttfts, 99)) if len(ttfts) else None,
        "errors": len(errors), "error_examples": errors[:3],
        "kv_blocks_used_after": idle["kv_blocks_used"], "kv_blocks_total": idle["kv_blocks_total"],
        "rss_before_bytes": rss_before, "rss_after_bytes": rss_after, "rss_growth_bytes": rss_after - rss_before,
        "target_rss_growth_bytes": TARGET_RSS_GROWTH, "meets_rss_target": rss_after - rss_before <= TARGET_RSS_GROWTH,
        "loadavg_1m": os.getloadavg()[0],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=SAMPLE_MODEL)
    ap.add_argument("--devices", type=int, default=4, help="emulated devices")
    ap.add_argument("--requests", type=int, default=200, help="concurrent streaming requests")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=None,
                    help="streams in the round before the RSS baseline (default: --requests, so the allocator's "
                         "pools have grown to the load's size and a leak is what remains)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in the server")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    args.warmup = args.requests if args.warmup is None else args.warmup
    if args.requests < 1 or args.max_tokens < 1 or args.warmup < 0 or args.devices < 1:
        print("serve_load_test: error: --requests, --max-tokens and --devices must be >= 1", file=sys.stderr)
        return 2
    if not (args.model / "config.json").is_file():
        print(f"serve_load_test: error: {args.model} is not a model directory", file=sys.stderr)
        return 2

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    server_log = tempfile.TemporaryFile()  # a pipe nobody reads could fill and stall the server
    proc = subprocess.Popen([sys.executable, "-c", SERVER_CODE, str(args.model), str(args.devices),
                             str(args.threads), str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=server_log)
    try:
        asyncio.run(wait_ready(url, proc))
        result = asyncio.run(run(args, url, psutil.Process(proc.pid)))
    except RuntimeError as exc:
        proc.kill()
        server_log.seek(0)
        print(f"serve_load_test: error: {exc}\n{server_log.read().decode()[-2000:]}", file=sys.stderr)
        return 1
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()

    if args.json:
        print(json.dumps(result, indent=2))
    else:
        mib = 1 << 20
        print(f"{result['requests']} concurrent streams x {result['max_tokens']} tokens, {args.devices} emulated "
              f"devices ({args.model.name})")
        print(f"  throughput      {result['requests_per_s']:.1f} requests/s, {result['output_tokens_per_s']:.0f} "
              f"output tokens/s ({result['wall_s']:.2f} s)")
        print(f"  TTFT (client)   p50 {result['ttft_p50_s'] * 1e3:.0f} ms, p99 {result['ttft_p99_s'] * 1e3:.0f} ms")
        print(f"  errors          {result['errors']}" + (f"  e.g. {result['error_examples'][0]}" if result["errors"]
                                                          else ""))
        print(f"  KV blocks used  {result['kv_blocks_used_after']} of {result['kv_blocks_total']} after the run")
        print(f"  server RSS      {result['rss_before_bytes'] / mib:.0f} MiB before, "
              f"{result['rss_after_bytes'] / mib:.0f} MiB after: {result['rss_growth_bytes'] / mib:+.1f} MiB "
              f"(target <= {TARGET_RSS_GROWTH / mib:.0f} MiB: {'met' if result['meets_rss_target'] else 'NOT met'})")
        print(f"  load average    {result['loadavg_1m']:.2f} (1 min)")
    return 0 if result["errors"] == 0 and result["kv_blocks_used_after"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
