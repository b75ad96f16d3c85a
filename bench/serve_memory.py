"""`moectl serve`'s memory over bursts of mixed requests: where the RSS goes, and what stays.

    python bench/serve_memory.py                          # start, 1 burst of 300, then 4 more bursts
    python bench/serve_memory.py --bursts 3 --requests 300 --json
    python bench/serve_memory.py --kernel-caches torch,serve,64 --bursts 3   # the kernel-cache trade
    python bench/serve_memory.py -- --threads 1 --dtype float32              # options after -- go to serve
    MALLOC_ARENA_MAX=2 python bench/serve_memory.py       # the same under another allocator setting

The server is the real command (`moectl serve` on the sample model, loopback, in a child
process, with the options given after `--`). Each burst sends --requests requests at once, mixed
as clients send them: completions and chats, streamed or not, prompts from a few tokens to about
a thousand (text, token ids, batches of prompts), outputs of 1-64 tokens, logprobs, echo, n and
best_of. After the server is up, and after each burst once it is idle, the child reports on
itself (SIGUSR1: the bench's probe, installed before the command runs):

- RSS, and how much of it is anonymous memory (smaps_rollup);
- glibc malloc: the bytes it has handed out, the free bytes its arenas hold, how many arenas
  (one per thread that allocated, up to 8 per core), and the RSS after a malloc_trim(0)
  (--trim-probe: the trim changes what later bursts start from, so it is off by default);
- the Python heap: pymalloc blocks, gc-tracked objects, and the most common types' growth;
- the engine's bounded structures: its step log (StepStats, up to 4,096), the prefix cache's
  cached blocks, the KV pool's bytes (allocated and touched at start: in the first figure).

Figures are printed for each point (start, after each burst), the first burst's growth split into
its parts, and that growth against the target (64 MiB), with the server's CPU seconds a burst.
--kernel-caches runs the server once per setting of oneDNN's and ideep's kernel caches (what
engine/core/native_memory.bound_kernel_caches sets for `moectl serve`), on the same bursts, and
compares them. Bursts are bounded: each waits for its requests, at most --timeout seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import aiohttp
import psutil
from serve_load_test import free_port, log, wait_ready  # beside this file: the same server's start-up

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
TARGET_FIRST_BURST = 64 * MIB  # the bound on the first burst's growth

# The probe: runs in the server's process, on its main thread, when the bench sends SIGUSR1.
PROBE_CODE = textwrap.dedent("""
    import collections, gc, json, os, signal, sys, threading
    import psutil
    from moectl.engine.core import native_memory
    from moectl.server import app as server_app
    from moectl.server.state import STATE

    _apps = []
    _make_app = server_app.make_app

    def _keep_app(driver, **options):
        app = _make_app(driver, **options)
        _apps.append(app)
        return app

    server_app.make_app = _keep_app  # run_server builds its app through this name
    _types = collections.Counter()
    _snapshots = []

    def _smaps() -> dict:
        out = {}
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    out[parts[0].rstrip(":").lower()] = int(parts[1]) << 10
        return out

    def _arenas() -> int:
        # malloc_info's XML has one <heap nr=...> per arena
        import ctypes, tempfile
        libc = ctypes.CDLL("libc.so.6")
        libc.fopen.restype = ctypes.c_void_p
        libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        with tempfile.NamedTemporaryFile(suffix=".xml") as tmp:
            fp = libc.fopen(tmp.name.encode(), b"w")
            libc.malloc_info(0, fp)
            libc.fclose(fp)
            return open(tmp.name).read().count("<heap nr=")

    def _probe(signum, frame):
        request = json.loads(open(os.environ["SERVE_MEMORY_PROBE"] + ".ask").read())
        gc.collect()
        engine = _apps[0][STATE].driver.engine if _apps else None
        counts = collections.Counter(type(o).__name__ for o in gc.get_objects())
        grown = (counts - _types).most_common(8)
        _types.clear()
        _types.update(counts)
        smaps = _smaps()
        info = native_memory.mallinfo() or {}
        out = {
            "rss": smaps.get("rss"), "anonymous": smaps.get("anonymous"),
            "malloc_in_use": info.get("in_use"), "malloc_free": info.get("free"), "malloc_heap": info.get("heap"),
            "malloc_mmapped": info.get("mmapped"), "arenas": _arenas() if native_memory.available() else None,
            "threads": len(os.listdir("/proc/self/task")),
            "pymalloc_blocks": sys.getallocatedblocks(), "gc_objects": len(gc.get_objects()),
            "gc_frozen": gc.get_freeze_count(), "types_grown": grown,
            "kernel_cache_env": {k: os.environ.get(k) for k in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY",
                                                                "LRU_CACHE_CAPACITY")},
        }
        import torch
        storages, shapes = {}, collections.Counter()
        for o in gc.get_objects():
            if isinstance(o, torch.Tensor) and o.device.type == "cpu":
                storage = o.untyped_storage()
                if storage.data_ptr() not in storages:
                    storages[storage.data_ptr()] = storage.nbytes()
                    shapes[(tuple(o.shape), str(o.dtype))] += storage.nbytes()
        out["tensor_bytes"] = sum(storages.values())
        out["tensor_count"] = len(storages)
        out["tensor_top"] = [[str(k), v] for k, v in shapes.most_common(6)]
        if engine is not None:
            kv = engine.kv_cache
            out.update(step_log=len(engine.step_log), kv_pool_bytes=sum(
                t.numel() * t.element_size() for t in (kv.k, kv.v)),
                cached_blocks=len(engine.blocks.hash_to_block))
        if request.get("tracemalloc"):
            import tracemalloc
            if tracemalloc.is_tracing():
                snapshot = tracemalloc.take_snapshot()
                out["traced_bytes"] = tracemalloc.get_traced_memory()[0]
                out["traced_top"] = [[str(d.traceback[0]), d.size_diff] for d in
                                     snapshot.compare_to(_snapshots[-1], "lineno")[:10]]
                _snapshots[-1] = snapshot
            else:
                tracemalloc.start(1)
                _snapshots.append(tracemalloc.take_snapshot())
        if request.get("trim"):
            native_memory.trim()
            out["rss_after_trim"] = _smaps().get("rss")
        with open(os.environ["SERVE_MEMORY_PROBE"] + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(os.environ["SERVE_MEMORY_PROBE"] + ".tmp", os.environ["SERVE_MEMORY_PROBE"])

    signal.signal(signal.SIGUSR1, _probe)
    from moectl.cli.main import app
    app(sys.argv[1:], prog_name="moectl")
""")

PROMPT_SOURCE = (Path(asyncio.__file__).parent / "base_events.py").read_text()  # stdlib Python: what the model knows


def mixed_requests(n: int, seed: int) -> list[tuple[str, dict]]:
    """(path, body) for n requests, mixed as the module docstring says."""
    rng = random.Random(seed)

    def text(max_chars: int) -> str:
        size = int(rng.lognormvariate(5.5, 1.0)) % max_chars + 8
        start = rng.randrange(len(PROMPT_SOURCE) - size)
        return PROMPT_SOURCE[start:start + size]

    out = []
    for i in range(n):
        kind = rng.choice(("completion", "completion", "stream", "logprobs", "echo", "choices", "ids", "batch",
                           "chat", "chat", "chat_stream", "chat_logprobs"))
        max_tokens = rng.choice((1, 4, 8, 16, 32, 64))
        body: dict = {"max_tokens": max_tokens, "temperature": rng.choice((0, 0, 0.8)), "seed": i}
        if kind.startswith("chat"):
            body["messages"] = [{"role": "user", "content": text(3000)}]
            if kind == "chat_stream":
                body.update(stream=True, stream_options={"include_usage": True})
            if kind == "chat_logprobs":
                body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
            out.append(("/v1/chat/completions", body))
            continue
        body["prompt"] = text(4000)
        if kind == "stream":
            body.update(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
        elif kind == "logprobs":
            body["logprobs"] = rng.randint(0, 5)
        elif kind == "echo":
            body.update(echo=True, logprobs=1, max_tokens=rng.choice((0, 1)))
        elif kind == "choices":
            body.update(n=2, best_of=3, temperature=0.8)
        elif kind == "ids":
            body["prompt"] = [rng.randrange(1, 4096) for _ in range(rng.randint(4, 900))]
        elif kind == "batch":
            body["prompt"] = [text(1500) for _ in range(rng.randint(2, 4))]
        out.append(("/v1/completions", body))
    return out


async def send(session: aiohttp.ClientSession, url: str, path: str, body: dict) -> str | None:
    """None when the request succeeded, else what went wrong."""
    try:
        async with session.post(url + path, json=body) as resp:
            data = await resp.read()
            if resp.status != 200:
                return f"HTTP {resp.status}: {data[:200]!r}"
            if body.get("stream") and not data.rstrip().endswith(b"data: [DONE]"):
                return "stream ended without [DONE]"
    except (TimeoutError, aiohttp.ClientError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


async def burst(url: str, requests: list[tuple[str, dict]], timeout_s: float) -> dict:
    connector = aiohttp.TCPConnector(limit=0)  # all at once: a burst
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        t0 = time.perf_counter()
        errors = [e for e in await asyncio.gather(*(send(session, url, p, b) for p, b in requests)) if e]
        wall = time.perf_counter() - t0
        await wait_idle(session, url)
    return {"requests": len(requests), "wall_s": wall, "errors": len(errors), "error_examples": errors[:3]}


async def wait_idle(session: aiohttp.ClientSession, url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        async with session.get(url + "/health") as r:
            h = await r.json()
        if h.get("running") == 0 and h.get("waiting") == 0:
            return
        await asyncio.sleep(0.1)


def probe(proc: subprocess.Popen, path: Path, trim: bool, traced: bool) -> dict:
    """The server's report on itself (PROBE_CODE), taken while it is idle."""
    path.unlink(missing_ok=True)
    path.with_name(path.name + ".ask").write_text(json.dumps({"trim": trim, "tracemalloc": traced}))
    os.kill(proc.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 60
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the server did not answer the probe")
        time.sleep(0.05)
    return json.loads(path.read_text())


KERNEL_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def kernel_cache_env(setting: str) -> dict[str, str | None]:
    """--kernel-caches: "serve" (what `moectl serve` sets: the variables unset here), "torch"
    (torch's own, 1,024 each), N (oneDNN's cache N, ideep's 1) or N/M (oneDNN's N, ideep's M)."""
    if setting == "serve":
        return {name: None for name in KERNEL_CACHE_VARS}
    if setting == "torch":
        return dict.fromkeys(KERNEL_CACHE_VARS, "1024")
    onednn, _, ideep = setting.partition("/")
    if not onednn.isdigit() or not (ideep or "1").isdigit() or int(ideep or "1") < 1:
        raise ValueError(f"--kernel-caches: {setting!r} is not serve, torch, N or N/M (M >= 1)")
    return dict(zip(KERNEL_CACHE_VARS, (onednn, ideep or "1")))


def run(args, setting: str) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    workdir = Path(tempfile.mkdtemp(prefix="serve_memory_"))
    probe_path = workdir / "probe.json"
    env = {k: v for k, v in os.environ.items() if k not in (*KERNEL_CACHE_VARS, "DNNL_PRIMITIVE_CACHE_CAPACITY")}
    env.update({k: v for k, v in kernel_cache_env(setting).items() if v is not None}, SERVE_MEMORY_PROBE=str(probe_path))
    server_log = open(workdir / "server.log", "wb")  # a pipe nobody reads could fill and stall the server
    command = [sys.executable, "-c", PROBE_CODE, "serve", "--port", str(port), *args.serve_args]
    proc = subprocess.Popen(command, cwd=workdir, env=env, stdout=server_log, stderr=subprocess.STDOUT)
    points, bursts = [], []
    try:
        asyncio.run(wait_ready(url, proc, timeout=180.0))
        points.append({"after": "start", **probe(proc, probe_path, args.trim_probe, args.tracemalloc)})
        log(f"[{setting}] start: RSS {points[-1]['rss'] / MIB:.0f} MiB")
        server = psutil.Process(proc.pid)
        for b in range(1, args.bursts + 1):
            requests = mixed_requests(args.requests, seed=b)  # the same bursts for every setting
            cpu = sum(server.cpu_times()[:2])
            bursts.append(asyncio.run(burst(url, requests, args.timeout)))
            bursts[-1]["server_cpu_s"] = sum(server.cpu_times()[:2]) - cpu  # the idle wait's polling too
            points.append({"after": f"burst {b}", **probe(proc, probe_path, args.trim_probe, args.tracemalloc)})
            log(f"[{setting}] burst {b}: {bursts[-1]['wall_s']:.1f} s, {bursts[-1]['errors']} errors; "
                f"RSS {points[-1]['rss'] / MIB:.0f} MiB")
    except RuntimeError as exc:
        server_log.flush()
        raise RuntimeError(f"{exc}\n{(workdir / 'server.log').read_text()[-2000:]}") from None
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        server_log.close()
        shutil.rmtree(workdir, ignore_errors=True)
    first = points[1]["rss"] - points[0]["rss"]
    return {"kernel_caches": setting, "kernel_cache_env": points[0]["kernel_cache_env"], "serve_args": args.serve_args,
            "requests_per_burst": args.requests, "bursts": bursts, "points": points,
            "env": {k: os.environ[k] for k in ("MALLOC_ARENA_MAX", "MOECTL_NATIVE_MEMORY", "MOECTL_GC_FREEZE")
                    if k in os.environ},
            "first_burst_growth_bytes": first, "target_first_burst_growth_bytes": TARGET_FIRST_BURST,
            "meets_target": first <= TARGET_FIRST_BURST, "loadavg_1m": os.getloadavg()[0]}


def _mib(v) -> str:
    return "-" if v is None else f"{v / MIB:.0f}"


def print_run(result: dict) -> None:
    caches = ", ".join(f"{k}={v}" for k, v in result["kernel_cache_env"].items())
    print(f"moectl serve {' '.join(result['serve_args'])}: {result['requests_per_burst']} mixed requests a burst; "
          f"kernel caches {result['kernel_caches']} ({caches})"
          + "".join(f", {k}={v}" for k, v in result["env"].items()))
    print(f"{'after':>9} {'RSS':>6} {'anon':>6} {'file':>5} {'trimmed':>7} {'malloc used':>11} {'malloc free':>11} "
          f"{'arenas':>6} {'threads':>7} {'pymalloc':>9} {'objects':>8} {'step log':>8} {'cached':>6}  (MiB)")
    for p in result["points"]:
        print(f"{p['after']:>9} {_mib(p['rss']):>6} {_mib(p['anonymous']):>6} {_mib(p['rss'] - p['anonymous']):>5} "
              f"{_mib(p.get('rss_after_trim')):>7} {_mib(p['malloc_in_use']):>11} {_mib(p['malloc_free']):>11} "
              f"{p['arenas'] or '-':>6} {p['threads']:>7} {p['pymalloc_blocks']:>9,} {p['gc_objects']:>8,} "
              f"{p.get('step_log', '-'):>8} {p.get('cached_blocks', '-'):>6}")
    start, first = result["points"][0], result["points"][1]
    print(f"KV pool: {_mib(start.get('kv_pool_bytes'))} MiB, allocated and touched before the server starts "
          "(in the start figure)")
    print(f"first burst, what grew: RSS {_mib(first['rss'] - start['rss'])} MiB = anonymous "
          f"{_mib(first['anonymous'] - start['anonymous'])} (malloc in use "
          f"{_mib(first['malloc_in_use'] - start['malloc_in_use'])}: kernels and other native buffers; malloc's arenas "
          f"hold {_mib(first['malloc_free'] - start['malloc_free'])} more free, not all of it resident; Python's heap, "
          f"thread stacks) + files {_mib(first['rss'] - first['anonymous'] - start['rss'] + start['anonymous'])} "
          "(library code run for the first time)")
    for p in result["points"][1:]:
        print(f"{p['after']}: objects grown {', '.join(f'{t} +{n:,}' for t, n in p['types_grown'][:5])}"
              + (f"; tracemalloc {_mib(p['traced_bytes'])} MiB traced, grew most at "
                 f"{', '.join(f'{where} +{size / 1024:.0f} KiB' for where, size in p['traced_top'][:3])}"
                 if "traced_top" in p else ""))
    for i, b in enumerate(result["bursts"], 1):
        print(f"burst {i}: {b['wall_s']:.1f} s, the server's CPU {b['server_cpu_s']:.1f} s, {b['errors']} errors"
              + (f" (e.g. {b['error_examples'][0]})" if b["errors"] else ""))
    print(f"first burst: RSS {result['first_burst_growth_bytes'] / MIB:+.0f} MiB (target <= {TARGET_FIRST_BURST // MIB} "
          f"MiB: {'met' if result['meets_target'] else 'NOT met'})")


def print_comparison(results: list[dict]) -> None:
    print(f"{'kernel caches':>13} {'start':>6} {'burst 1':>8} {'last':>6} {'first burst':>11} "
          f"{'server CPU a burst':>18}  (MiB, s)")
    for r in results:
        points, cpu = r["points"], [b["server_cpu_s"] for b in r["bursts"]]
        print(f"{r['kernel_caches']:>13} {_mib(points[0]['rss']):>6} {_mib(points[1]['rss']):>8} "
              f"{_mib(points[-1]['rss']):>6} {r['first_burst_growth_bytes'] / MIB:>+11.0f} "
              f"{sum(cpu) / len(cpu):>18.1f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="Options after `--` go to `moectl serve` (default: --threads 1).")
    ap.add_argument("--bursts", type=int, default=5)
    ap.add_argument("--requests", type=int, default=300, help="requests in each burst, sent at once")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a burst may take")
    ap.add_argument("--kernel-caches", default="serve",
                    help="comma-separated settings, one server run each: serve (moectl serve's own), torch "
                         "(torch's defaults), N (oneDNN's kernel cache N, ideep's 1) or N/M")
    ap.add_argument("--trim-probe", action="store_true", help="also measure the RSS after a malloc_trim(0) at "
                                                              "each point (it changes what the next burst starts from)")
    ap.add_argument("--tracemalloc", action="store_true",
                    help="trace Python's allocations from the start figure on, and name the lines that grew "
                         "(slows the server several times)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("serve_args", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.serve_args = args.serve_args or ["--threads", "1"]
    settings = args.kernel_caches.split(",")
    try:
        for setting in settings:
            kernel_cache_env(setting)
    except ValueError as exc:
        print(f"serve_memory: error: {exc}", file=sys.stderr)
        return 2
    if args.bursts < 1 or args.requests < 1 or args.timeout <= 0:
        print("serve_memory: error: --bursts, --requests and --timeout must be positive", file=sys.stderr)
        return 2
    try:
        results = [run(args, setting) for setting in settings]
    except RuntimeError as exc:
        print(f"serve_memory: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(results if len(results) > 1 else results[0], indent=2))
    else:
        for result in results:
            print_run(result)
            print()
        if len(results) > 1:
            print_comparison(results)
    return 0 if all(b["errors"] == 0 for r in results for b in r["bursts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
