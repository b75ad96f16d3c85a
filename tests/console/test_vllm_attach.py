"""`moectl attach --vllm URL`: the console on a vLLM server, read from its /metrics. In CI a real
HTTP server replays scrapes recorded from vLLM's CPU build (tests/profiler/data/vllm_metrics);
with vLLM's own venv present (bench/peers/setup.sh), a real `vllm serve` of the sample model.
Every figure is labelled as vLLM's, the tabs without vLLM figures say so, and moectl's controls
are refused with the reason, never faked."""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from moectl.console.app import MoectlApp
from moectl.console.vllm_source import VllmSource
from moectl.wire.actions import ActionRefused
from tests.paths import REPO
from tests.pilot import run_app, text_of, until

SCRAPES = Path(__file__).parents[1] / "profiler" / "data" / "vllm_metrics"
VLLM_PYTHON = Path(os.environ.get("MOECTL_VLLM_PYTHON", REPO / ".peers" / "vllm" / "bin" / "python"))


class Replay(BaseHTTPRequestHandler):
    """A vLLM server's read-only endpoints, its /metrics the recorded scrapes in turn."""
    pages: list[bytes] = []
    served = 0

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/v1/models":
            body = json.dumps({"object": "list", "data": [{"id": "sample", "object": "model"}]}).encode()
        elif self.path == "/version":
            body = json.dumps({"version": "0.32.0"}).encode()
        elif self.path == "/metrics":
            body = Replay.pages[min(Replay.served, len(Replay.pages) - 1)]
            Replay.served += 1
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def replayed():
    # the busy server's two scrapes, the last one repeated: the console can open at any moment
    Replay.pages = [gzip.open(SCRAPES / f"{n}.prom.gz").read() for n in ("busy_a", "busy_b")]
    Replay.served = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), Replay)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_console_shows_a_vllm_server_labelled_as_vllms_and_refuses_its_controls(replayed):
    source = VllmSource(replayed, every_s=0.2)

    async def body(app, pilot):
        await until(pilot, lambda: "running 128" in text_of(app, "#ov-metrics"), timeout=20)
        title, shown = text_of(app, "#ov-title"), text_of(app, "#ov-metrics")
        assert "sample" in title and "vLLM 0.32.0" in title and "every figure is vLLM 0.32.0's own" in title
        assert "waiting 172" in shown and "ITL p50/p90/p99" in shown and "not exported by vLLM" in shown
        # the second scrape: 5,120 output tokens since the first (their rate over the real interval)
        await until(pilot, lambda: "output -" not in text_of(app, "#ov-metrics"), timeout=20)
        assert "absent: not exported by vLLM" in text_of(app, "#ov-load")
        await pilot.press("2")
        await until(pilot, lambda: "absent" in text_of(app, "#ex-cell"))
        assert "not exported by vLLM 0.32.0's /metrics" in text_of(app, "#ex-cell")
        await pilot.press("r")  # a rebalance preview: refused with the reason
        await until(pilot, lambda: any("unavailable on a vLLM server" in str(n.message)
                                       for n in app._notifications) or "unavailable" in text_of(app, "#ex-error"),
                    timeout=10)
    try:
        run_app(MoectlApp(source), body)
    finally:
        source.close()
    with pytest.raises(ActionRefused, match="unavailable on a vLLM server"):
        source.act("set_knobs", max_num_seqs=4)


def test_what_is_not_a_vllm_server_is_one_line(replayed, tmp_path):
    from typer.testing import CliRunner

    from moectl.cli.main import app

    Replay.pages = [b"# TYPE http_requests counter\nhttp_requests_total 3\n"]
    res = CliRunner().invoke(app, ["attach", "--vllm", replayed])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1 and "no vllm: metric" in res.stderr
    res = CliRunner().invoke(app, ["attach", "--vllm", "http://127.0.0.1:9"])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1 and "cannot reach" in res.stderr
    res = CliRunner().invoke(app, ["attach", "--vllm", replayed, "--token", "x"])
    assert res.exit_code == 2 and "--token" in res.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM's CPU build is not set up (bench/peers/setup.sh)")
def test_a_real_vllm_server_of_the_sample_model():
    port = _free_port()
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    server = subprocess.Popen([str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model",
                               str(REPO / "engine" / "sample_model"), "--served-model-name", "sample", "--port",
                               str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                source = VllmSource(url, every_s=0.5)
                break
            except ActionRefused:
                time.sleep(1)
        else:
            pytest.fail("vLLM did not come up in 300 s")
        import urllib.request

        body = json.dumps({"model": "sample", "prompt": "def f(x):", "max_tokens": 32, "temperature": 0}).encode()
        urllib.request.urlopen(urllib.request.Request(f"{url}/v1/completions", body,
                                                      {"Content-Type": "application/json"}), timeout=120).read()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (source.figures.get("generation_tokens") or 0):
            time.sleep(0.2)
        assert source.header["external"]["engine"] == "vLLM" and source.figures["generation_tokens"] >= 32
        source.close()
    finally:
        server.terminate()
        server.wait(30)
