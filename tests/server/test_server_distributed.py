"""`moectl serve` on the distributed backend (this process as rank 0, a second rank spawned):
the OpenAI API and the operator controls through real clients, a live rebalance across the
rank processes, and a rank killed while a request is in flight: the request fails with a clear
error, the server then answers 503 naming the rank, and nothing hangs."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

openai = pytest.importorskip("openai")

from moectl.engine.core.config import EngineConfig  # noqa: E402
from moectl.engine.core.driver import EngineDriver  # noqa: E402
from moectl.engine.parallel.group import RankGroup  # noqa: E402
from moectl.placement.topology import Topology  # noqa: E402
from moectl.server.app import STATE, ServerThread  # noqa: E402
from tests.checkpoints import tiny_checkpoint  # noqa: E402
from tests.server.test_server import PROMPT, TOKEN, client, http, sample, scrape, wait_until  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("server_dist_ckpt"))


def test_serve_on_ranks_then_a_rank_dies(checkpoint):
    config = EngineConfig(model=str(checkpoint), block_size=4, num_kv_blocks=256, topology=Topology(num_devices=2),
                          redundant_slots=1, num_threads=1)
    group = RankGroup(config, 2)
    # rank 0 is this process: torchrun's variables must not leak into it (every process it starts
    # later would take itself for a rank)
    assert not {"RANK", "WORLD_SIZE", "MASTER_PORT"} & set(os.environ)
    driver = EngineDriver(group.make_engine)
    try:
        with ServerThread(driver, token=TOKEN) as srv:
            name = srv.app[STATE].model_name
            out = client(srv, TOKEN).completions.create(model=name, prompt=PROMPT, max_tokens=8)
            assert out.choices[0].text and out.usage.completion_tokens == 8
            # a live rebalance through the control API: experts migrate between the two processes
            base = srv.url + "/v1/control"
            status, preview = http("POST", base + "/rebalance/preview", token=TOKEN)
            assert status == 200 and "predicted" in preview["summary"]
            status, _ = http("POST", base + "/rebalance/apply", {"plan_id": preview["plan_id"]}, token=TOKEN)
            assert status == 200
            client(srv, TOKEN).completions.create(model=name, prompt=PROMPT, max_tokens=4)
            wait_until(lambda: sample(scrape(srv, TOKEN), "moectl:rebalances", "_total") == 1, what="the rebalance")

            # a long request in flight when rank 1 is killed
            result: dict = {}

            def long_request():
                try:
                    result["out"] = client(srv, TOKEN).completions.create(model=name, prompt=PROMPT, max_tokens=200)
                except openai.APIError as exc:
                    result["error"] = exc
            worker = threading.Thread(target=long_request)
            worker.start()
            wait_until(lambda: driver.engine.has_unfinished() or result, what=f"the request to start ({result})")
            assert not result, result
            os.kill(group.procs[0].pid, signal.SIGKILL)
            t0 = time.monotonic()
            wait_until(lambda: driver.error is not None, timeout=15, what="the failure to be reported")
            assert time.monotonic() - t0 < 10.0 and "rank 1" in driver.error
            worker.join(30)
            assert not worker.is_alive() and "error" in result  # failed with a clear error, not left waiting
            assert "engine failed" in str(result["error"]) and "rank 1" in str(result["error"])
            status, body = http("POST", srv.url + "/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 4},
                                token=TOKEN)
            assert status == 503 and "rank 1" in body["error"]["message"]
            assert http("GET", srv.url + "/health")[0] == 503
    finally:
        driver.close()
        group.close()
    assert all(not p.is_alive() for p in group.procs)
