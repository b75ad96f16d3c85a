"""`moectl attach`: the full console on a real `moectl serve` in the same test run; its controls
act on the remote engine with the token and say so without it."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest

from moectl.console.app import MoectlApp
from moectl.console.sources import ActionRefused, AttachSource
from moectl.engine.core.config import EngineConfig
from moectl.engine.core.driver import EngineDriver
from moectl.engine.llm_engine import LLMEngine
from moectl.placement.topology import Topology
from moectl.server.app import ServerThread
from tests.checkpoints import tiny_checkpoint
from tests.pilot import run_app, text_of, until

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory.mktemp("attach"))
    config = EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=256, topology=Topology(num_devices=4),
                          redundant_slots=1, num_threads=1)
    driver = EngineDriver(lambda: LLMEngine(config))
    with ServerThread(driver, token=TOKEN) as srv:
        yield srv, driver
    driver.close()


def traffic(url: str, stop: threading.Event) -> threading.Thread:
    """Completions in a loop until stopped, so the remote engine keeps stepping."""
    def loop():
        body = json.dumps({"prompt": "def f(x):", "max_tokens": 8, "temperature": 0}).encode()
        while not stop.is_set():
            req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {TOKEN}"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                resp.read()
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def test_attached_console_shows_the_remote_engine_and_controls_it(server):
    srv, driver = server
    stop = threading.Event()
    traffic(srv.url, stop)
    attach = AttachSource(srv.url, TOKEN)
    assert attach.header["devices"]["topology"]["num_devices"] == 4

    async def body(app, pilot):
        await until(pilot, lambda: app.state.steps_seen > 5 and app.state.throughput() > 0)
        await until(pilot, lambda: "attach" in text_of(app, "#ov-title") and "tok/s" in text_of(app, "#ov-metrics"),
                    timeout=5)
        before = driver.engine.experts.placement
        # token balance: a plan that moves experts whatever this machine's costs (the default
        # step-time objective may rightly keep the placement)
        attach.act("auto_rebalance", enabled=False, objective="balance").result(timeout=30)
        await pilot.press("2")
        await pilot.press("r")
        await until(pilot, lambda: app.plan is not None)
        await until(pilot, lambda: "predicted balancedness" in text_of(app, "#ex-preview-result"), timeout=5)
        await pilot.press("A")
        await until(pilot, lambda: driver.engine.experts.placement != before)
        await until(pilot, lambda: app.state.placement == driver.engine.experts.placement)
        await pilot.press("5")
        await until(pilot, lambda: app.query_one("#rq-max_num_seqs").value != "")
        app.query_one("#rq-max_num_seqs").value = "12"
        app.query_one("#rq-apply").press()
        await until(pilot, lambda: driver.engine.scheduler.knobs.max_num_seqs == 12)
        app.query_one("#rq-max_num_seqs").value = "0"
        app.query_one("#rq-apply").press()
        await until(pilot, lambda: "max_num_seqs" in text_of(app, "#rq-error"))
        assert driver.engine.scheduler.knobs.max_num_seqs == 12
    try:
        run_app(MoectlApp(attach), body)
    finally:
        stop.set()


def test_attached_without_a_token_is_read_only_and_says_so(server):
    """A loopback server started without a token streams telemetry to anyone, and its controls
    are off; a token-protected server refuses an attach without its token."""
    srv, driver = server
    with pytest.raises(ActionRefused, match="401"):
        AttachSource(srv.url, timeout_s=3)
    with ServerThread(driver) as open_srv:
        attach = AttachSource(open_srv.url)
        try:
            assert attach.header["model"]["num_experts"] == driver.engine.model_config.num_experts
            with pytest.raises(ActionRefused, match="read-only"):
                attach.act("knobs", max_num_seqs=3)
        finally:
            attach.close()
    assert driver.engine.scheduler.knobs.max_num_seqs != 3


def test_attach_to_nothing_is_a_one_line_error(tmp_path):
    from typer.testing import CliRunner

    from moectl.cli.main import app

    res = CliRunner().invoke(app, ["attach", "http://127.0.0.1:9", "--token", "x"])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1 and "attach:" in res.stderr
    res = CliRunner().invoke(app, ["attach", "ftp://host"])
    assert res.exit_code == 2 and "not an http(s) URL" in res.stderr
