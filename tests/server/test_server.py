"""The HTTP server (server/): the OpenAI API through the official client, /metrics, the telemetry
websocket, auth and controls, malformed requests, client disconnects, and a bounded load test.

Each server runs on its own thread (ServerThread) over an EngineDriver on a tiny checkpoint.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
import urllib.error
import urllib.request

import psutil
import pytest

aiohttp = pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from moectl.engine.core.config import EngineConfig  # noqa: E402
from moectl.engine.core.driver import EngineDriver  # noqa: E402
from moectl.engine.llm_engine import LLMEngine, RequestOutput, RequestStream  # noqa: E402
from moectl.placement.placement import Placement  # noqa: E402
from moectl.placement.topology import Topology  # noqa: E402
from moectl.server.app import STATE, ServerThread, check_bind, run_server  # noqa: E402
from moectl.server.metrics import ServerMetrics  # noqa: E402
from moectl.server.streams import EngineBridge, TextDeltas  # noqa: E402
from moectl.server.telemetry import CLIENT_QUEUE, TelemetryClient  # noqa: E402
from tests.checkpoints import tiny_checkpoint  # noqa: E402

TOKEN = "s3cret-token"
PROMPT = "def add(a, b):\n    return"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("server_ckpt"))


def _driver(checkpoint) -> EngineDriver:
    return EngineDriver(lambda: LLMEngine(EngineConfig(model=str(checkpoint), block_size=4, num_kv_blocks=256,
                                                       topology=Topology(num_devices=2), num_threads=1)))


@pytest.fixture(scope="module")
def server(checkpoint):
    """No token: loopback only, control refused."""
    driver = _driver(checkpoint)
    with ServerThread(driver) as srv:
        srv.driver = driver
        yield srv
    driver.close()


@pytest.fixture(scope="module")
def secured(checkpoint):
    driver = _driver(checkpoint)
    with ServerThread(driver, token=TOKEN) as srv:
        srv.driver = driver
        yield srv
    driver.close()


def http(method: str, url: str, body=None, *, token: str | None = None, raw: bytes | None = None):
    """(status, parsed JSON body)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def assert_error(status_body, status: int, param: str | None = None) -> dict:
    got_status, body = status_body
    assert got_status == status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def wait_until(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def wait_idle(srv) -> None:
    engine = srv.driver.engine
    wait_until(lambda: engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0
               and not engine.has_unfinished(), what="the engine to go idle")


def scrape(srv, token: str | None = None) -> dict:
    req = urllib.request.Request(srv.url + "/metrics", headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return {f.name: f for f in text_string_to_metric_families(resp.read().decode())}


def sample(families: dict, name: str, suffix: str = "", **labels) -> float:
    for s in families[name].samples:
        if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError(f"{name}{suffix} {labels}")


def client(srv, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=api_key, max_retries=0, timeout=60)


# -- the OpenAI API, through the official client

def test_models_and_health(server):
    name = server.app[STATE].model_name
    assert [m.id for m in client(server).models.list().data] == [name]
    status, body = http("GET", server.url + "/health")
    assert status == 200 and body["status"] == "ok" and body["kv_blocks_total"] == 256


def test_completion_streamed_equals_unstreamed(server):
    c = client(server)
    name = server.app[STATE].model_name
    full = c.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0)
    text = full.choices[0].text
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(c.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert streamed == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()

    # a prompt of token ids is the same prompt
    ids = server.driver.engine.encode(PROMPT)
    by_ids = c.completions.create(model=name, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == text and by_ids.usage.prompt_tokens == len(ids)


def test_stop_string_cuts_streamed_and_unstreamed_alike(server):
    c = client(server)
    name = server.app[STATE].model_name
    text = c.completions.create(model=name, prompt=PROMPT, max_tokens=16,
                                extra_body={"ignore_eos": True}).choices[0].text
    stop = next((ch for ch in text[2:] if ch != "\ufffd"), None)
    if stop is None:
        pytest.skip("the tiny model's output has no usable stop character")
    expected = text[:text.find(stop)]
    cut = c.completions.create(model=name, prompt=PROMPT, max_tokens=16, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=name, prompt=PROMPT, max_tokens=16, stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert streamed == expected


def test_chat_streamed_equals_unstreamed(server):
    c = client(server)
    name = server.app[STATE].model_name
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Add two numbers."}]
    full = c.chat.completions.create(model=name, messages=messages, max_tokens=10, temperature=0)
    msg = full.choices[0].message
    assert msg.role == "assistant" and full.usage.completion_tokens <= 10
    # the documented template, token for token
    template = "<|system|>\nYou write Python.\n<|user|>\nAdd two numbers.\n<|assistant|>\n"
    assert full.usage.prompt_tokens == len(server.driver.engine.encode(template))

    chunks = list(c.chat.completions.create(model=name, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == msg.content
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()


# -- /metrics

def test_metrics_histograms_fill_and_series_stay_bounded(server):
    c = client(server)
    name = server.app[STATE].model_name

    def run(n):
        for i in range(n):
            c.completions.create(model=name, prompt=f"{PROMPT} {i}", max_tokens=6, extra_body={"ignore_eos": True})

    before = scrape(server)
    ttft0 = sample(before, "moectl:time_to_first_token_seconds", "_count")
    run(4)
    wait_until(lambda: sample(scrape(server), "moectl:e2e_request_latency_seconds", "_count") >= ttft0 + 4,
               what="the metrics to see the requests")
    fams = scrape(server)
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "request_time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert fams["moectl:" + hist].type == "histogram"
        assert sample(fams, "moectl:" + hist, "_count") > 0, hist
    assert sample(fams, "moectl:time_to_first_token_seconds", "_count") >= ttft0 + 4
    assert sample(fams, "moectl:request_success", "_total", finished_reason="length") >= 4
    assert sample(fams, "moectl:generation_tokens", "_total") >= 24
    assert sample(fams, "moectl:prefix_cache_queries", "_total") >= sample(fams, "moectl:prefix_cache_hits", "_total")
    assert sample(fams, "moectl:prefix_cache_queries", "_total") > 0
    assert sample(fams, "moectl:num_requests_running") == 0
    assert 0 <= sample(fams, "moectl:kv_cache_usage_perc") <= 1
    balance = sorted(s.labels["quantile"] for s in fams["moectl:expert_balancedness"].samples)
    assert balance == ["0", "0.5", "1"]
    assert all(0 < s.value <= 1 for s in fams["moectl:expert_balancedness"].samples)
    # vLLM's and SGLang's names for them, for their Grafana panels (server/eplb_metrics.py)
    worst, median = (sample(fams, f"vllm:eplb_balancedness_{k}", model_name=name, engine="0") for k in ("min", "p50"))
    assert 0 < worst <= median <= 1 and fams["vllm:eplb_balancedness_min"].type == "gauge"
    assert fams["sglang:eplb_balancedness"].type == "summary"
    assert sample(fams, "sglang:eplb_balancedness", "_count", model_name=name, moe_ep_rank="0",
                  forward_mode="decode") > 0
    for name_ in ("expert_cache_hits", "expert_cache_misses", "rebalances", "num_preemptions"):
        assert "moectl:" + name_ in fams
    assert "moectl:rebalance_seconds" in fams and "process_resident_memory_bytes" in fams

    def series(f):
        return sum(len(fam.samples) for fam in f.values())
    count = series(fams)
    run(6)
    time.sleep(0.2)
    assert series(scrape(server)) == count


# -- /v1/telemetry

def test_telemetry_websocket_hello_then_matching_steps(server):
    async def main():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(server.url + "/v1/telemetry") as ws:
                hello = await ws.receive_json(timeout=10)
                assert hello["type"] == "hello"
                assert hello["header"]["model"]["num_experts"] == 8
                assert isinstance(hello["recent"], list) and isinstance(hello["actions"], list)

                async def complete(i):
                    async with session.post(server.url + "/v1/completions",
                                            json={"prompt": f"{PROMPT} {i}", "max_tokens": 5, "ignore_eos": True}) as r:
                        return await r.json()
                done = await asyncio.gather(*(complete(i) for i in range(3)))
                wanted = {d["id"]: d["usage"]["completion_tokens"] for d in done}
                finished, seen_in_batch, link_spans = {}, set(), set()
                async with asyncio.timeout(15):
                    while set(finished) != set(wanted):
                        msg = await ws.receive_json()
                        if msg["type"] != "step":
                            continue
                        rec = msg["record"]
                        assert isinstance(rec["routing"], list) and len(rec["routing"]) == 2
                        spans = rec["spans"]  # the modeled link spans derived for the client, not the traffic
                        assert "links" not in spans
                        link_spans |= {spans["names"][i] for i, m in zip(spans["name"], spans["modeled"]) if m}
                        seen_in_batch |= set(rec["batch"]["request_ids"]) & set(wanted)
                        for ev in rec["requests"]:
                            if ev["event"] == "finished" and ev["id"] in wanted:
                                finished[ev["id"]] = ev["output_tokens"]
                assert finished == wanted and seen_in_batch == set(wanted)
                assert link_spans == {"all_to_all dispatch", "all_to_all combine"}

                # a client that does not read: the hub drops its oldest messages and says so
                hub = server.app[STATE].hub
                n = CLIENT_QUEUE + 100
                server.call(lambda: [hub.publish("action", {"time": 0.0, "step": 0, "kind": "test", "args": {},
                                                           "result": {"i": i}}) for i in range(n)])
                async with asyncio.timeout(10):
                    while True:
                        msg = await ws.receive_json()
                        if msg["type"] == "dropped":
                            assert msg["count"] >= 100
                            break
    asyncio.run(main())
    assert sample(scrape(server), "moectl:telemetry_dropped_messages", "_total") >= 100


def test_telemetry_disconnects_a_stuck_client(server, monkeypatch, caplog):
    import moectl.server.telemetry as telemetry

    monkeypatch.setattr(telemetry, "STUCK_S", 0.5)
    caplog.set_level(logging.INFO, logger="moectl.server.telemetry")
    hub = server.app[STATE].hub
    big = {"time": 0.0, "step": 0, "kind": "test", "args": {}, "result": {"blob": "x" * (1 << 20)}}

    async def main():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(server.url + "/v1/telemetry"):
                # never read: the client's buffer fills, then the sockets', then the server's send waits
                wait_until(lambda: server.call(lambda: len(hub.clients)) == 1, what="the client to register")
                server.call(lambda: [hub.publish("action", big) for _ in range(48)])
                await asyncio.to_thread(wait_until, lambda: server.call(lambda: len(hub.clients)) == 0, 20,
                                        "the stuck client to be dropped")
    asyncio.run(main())
    assert "stuck" in caplog.text
    server.call(lambda: hub.actions.clear())  # keep later hellos small


def test_telemetry_client_queue_is_bounded():
    client_ = TelemetryClient(ws=None)
    for i in range(CLIENT_QUEUE + 7):
        client_.offer(str(i))
    assert len(client_.queue) == CLIENT_QUEUE and client_.dropped == 7
    assert client_.queue[0] == "7"  # the oldest went first


# -- auth and control

def test_binding_beyond_loopback_needs_a_token(server):
    with pytest.raises(ValueError, match="--token"):
        check_bind("0.0.0.0", None)
    with pytest.raises(ValueError, match="--token"):
        run_server(server.driver, host="0.0.0.0", port=1, token=None)  # refused before binding
    check_bind("127.0.0.1", None)
    check_bind("::1", None)
    check_bind("0.0.0.0", TOKEN)


def test_control_refused_without_token_configured(server):
    assert_error(http("GET", server.url + "/v1/control/knobs"), 403)
    err = assert_error(http("POST", server.url + "/v1/control/knobs", {"max_num_seqs": 3}, token="anything"), 403)
    assert "--token" in err["message"]


def test_token_required_and_checked(secured):
    url = secured.url
    assert http("GET", url + "/health")[0] == 200  # probes need no token
    assert_error(http("GET", url + "/v1/models"), 401)
    assert_error(http("GET", url + "/v1/models", token="wrong"), 401)
    assert http("GET", url + "/v1/models", token=TOKEN)[0] == 200
    assert_error(http("GET", url + "/v1/control/knobs"), 401)
    assert_error(http("POST", url + "/v1/control/knobs", {"max_num_seqs": 3}, token="wrong"), 401)
    with pytest.raises(openai.AuthenticationError):
        client(secured, "wrong").completions.create(model=secured.app[STATE].model_name, prompt="x", max_tokens=2)
    out = client(secured, TOKEN).completions.create(model=secured.app[STATE].model_name, prompt="x", max_tokens=2)
    assert out.usage.completion_tokens >= 1


def test_control_knobs_change_the_engine(secured):
    url, engine = secured.url + "/v1/control/knobs", secured.driver.engine
    status, body = http("GET", url, token=TOKEN)
    assert status == 200 and body["knobs"]["max_num_seqs"] == engine.knobs.max_num_seqs
    status, body = http("POST", url, {"max_num_seqs": 7}, token=TOKEN)
    assert status == 200 and body["knobs"]["max_num_seqs"] == 7
    wait_until(lambda: engine.knobs.max_num_seqs == 7, what="the knob change")
    assert "max_num_seqs" in assert_error(http("POST", url, {"max_num_seqs": 0}, token=TOKEN), 400)["message"]
    assert "bogus" in assert_error(http("POST", url, {"bogus": 1}, token=TOKEN), 400)["message"]
    assert_error(http("POST", url, raw=b"{nope", token=TOKEN), 400)
    assert http("POST", url, {"max_num_seqs": 64}, token=TOKEN)[0] == 200


def test_control_rebalance_capture_edit_and_recording(secured, tmp_path):
    base, name = secured.url + "/v1/control", secured.app[STATE].model_name
    client(secured, TOKEN).completions.create(model=name, prompt=PROMPT, max_tokens=8)  # routing to plan from
    status, preview = http("POST", base + "/rebalance/preview", token=TOKEN)
    assert status == 200 and {"balancedness_before", "balancedness_after"} <= set(preview["summary"])
    assert_error(http("POST", base + "/rebalance/apply", {"plan_id": "plan-nope"}, token=TOKEN), 400, "plan_id")
    status, applied = http("POST", base + "/rebalance/apply", {"plan_id": preview["plan_id"]}, token=TOKEN)
    assert status == 200 and applied["plan_id"] == preview["plan_id"]
    # answered once the copy has run, with what it measured (it once answered before the copy)
    assert applied["applied"]["bytes_moved"] >= 0 and applied["applied"]["seconds"] > 0
    assert_error(http("POST", base + "/rebalance/apply", {"plan_id": preview["plan_id"]}, token=TOKEN), 400)
    wait_until(lambda: sample(scrape(secured, TOKEN), "moectl:rebalances", "_total") == 1, what="the rebalance")
    assert sample(scrape(secured, TOKEN), "moectl:rebalance_seconds", "_count") == 1

    assert http("POST", base + "/capture", {"steps": 2}, token=TOKEN)[0] == 200
    assert_error(http("POST", base + "/capture", {"steps": "2"}, token=TOKEN), 400, "steps")
    assert_error(http("POST", base + "/capture", {"steps": 0}, token=TOKEN), 400)

    status, edited = http("POST", base + "/edit", {"edit": "pin", "layer": 0, "expert": 1}, token=TOKEN)
    assert status == 200 and [0, 1] in edited["placement"]["pinned"]
    assert_error(http("POST", base + "/edit", {"edit": "pin", "layer": 99, "expert": 1}, token=TOKEN), 400)
    assert_error(http("POST", base + "/edit", {"edit": "teleport"}, token=TOKEN), 400)
    # arguments are named in the API's words, never as a Python signature
    for body, param, words in (({"edit": "pin", "layer": 0, "expert": 1, "colour": 3}, "colour", "layer, expert"),
                               ({"edit": "move", "layer": 0, "expert": 1, "src_device": 0}, "dst_device", "missing"),
                               ({"edit": "pin", "layer": "0", "expert": 1}, "layer", "integer")):
        error = assert_error(http("POST", base + "/edit", body, token=TOKEN), 400, param)
        assert words in error["message"] and "()" not in error["message"] and "keyword" not in error["message"]
    assert http("POST", base + "/auto_rebalance", {"enabled": False}, token=TOKEN)[0] == 200
    assert_error(http("POST", base + "/auto_rebalance", {"enabled": True, "threshold": 7}, token=TOKEN), 400)

    trace = tmp_path / "served.trace"
    assert http("POST", base + "/recording/start", {"path": str(trace)}, token=TOKEN)[0] == 200
    assert_error(http("POST", base + "/recording/start", {"path": str(tmp_path / "b")}, token=TOKEN), 400)
    client(secured, TOKEN).completions.create(model=name, prompt=PROMPT, max_tokens=4)
    status, stopped = http("POST", base + "/recording/stop", token=TOKEN)
    assert status == 200 and stopped["steps"] >= 1 and trace.is_file()
    assert_error(http("POST", base + "/recording/stop", token=TOKEN), 400)
    assert_error(http("POST", base + "/recording/start", {"path": str(trace)}, token=TOKEN), 400, "path")


# -- malformed requests

@pytest.mark.parametrize("body, param", [
    ({"prompt": PROMPT, "max_tokens": -1}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 5000}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": "8"}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": True}, "max_tokens"),
    ({"prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p"),
    ({"prompt": PROMPT, "stop": [1]}, "stop"),
    ({"prompt": PROMPT, "seed": -3}, "seed"),
    ({"prompt": PROMPT, "stream": "yes"}, "stream"),
    ({"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": PROMPT, "n": 17}, "n"),
    ({"prompt": PROMPT, "best_of": 1, "n": 2}, "best_of"),
    ({"prompt": PROMPT, "suffix": "x"}, "suffix"),
    ({"prompt": PROMPT, "logit_bias": {"5": 1}}, "logit_bias"),
    ({"prompt": PROMPT, "min_p": 0.1}, "min_p"),
    ({"prompt": PROMPT, "messages": []}, "messages"),
    ({"prompt": PROMPT, "logprobs": 21}, "logprobs"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": PROMPT, "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": PROMPT, "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": PROMPT, "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": PROMPT, "stream": True, "best_of": 2}, "best_of"),
    ({"prompt": PROMPT, "model": "gpt-4"}, "model"),
    ({"prompt": 123}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, 2, 100000]}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": ["a"] * 65}, "prompt"),
    ({"prompt": list(range(2, 302)) * 2, "max_tokens": 16}, "prompt"),  # 600 tokens: over the 512 context
])
def test_bad_completion_requests_get_400(server, body, param):
    assert_error(http("POST", server.url + "/v1/completions", body), 400, param)


def test_malformed_bodies_and_routes(server):
    url = server.url
    assert "JSON" in assert_error(http("POST", url + "/v1/completions", raw=b'{"prompt": '), 400)["message"]
    assert_error(http("POST", url + "/v1/completions", raw=b"[1, 2]"), 400)
    assert_error(http("POST", url + "/v1/chat/completions", {"messages": []}), 400, "messages")
    assert_error(http("POST", url + "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
                 400, "messages")
    assert_error(http("POST", url + "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
                 400, "messages")
    too_big = json.dumps({"prompt": "x" * (server.app[STATE].max_request_bytes + 10)}).encode()
    assert_error(http("POST", url + "/v1/completions", raw=too_big), 413)
    assert_error(http("GET", url + "/v1/completions"), 405)
    assert_error(http("GET", url + "/v1/nothing-here"), 404)
    with pytest.raises(openai.BadRequestError):
        client(server).completions.create(model="not-this-one", prompt="x", max_tokens=2)


# -- disconnects and load

def test_client_disconnect_aborts_and_frees_kv_blocks(server):
    engine = server.driver.engine
    wait_idle(server)
    aborted = engine.num_aborted
    body = {"prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}

    async def main():
        async with aiohttp.ClientSession() as session:
            resp = await session.post(server.url + "/v1/completions", json={**body, "stream": True})
            assert resp.status == 200
            await resp.content.readline()  # the first chunk: the request is running
            resp.close()  # drop the connection mid-stream
            try:  # a non-streamed request whose client gives up
                async with asyncio.timeout(0.3):
                    await session.post(server.url + "/v1/completions", json=body)
            except TimeoutError:
                pass
    asyncio.run(main())
    wait_until(lambda: engine.num_aborted >= aborted + 2, what="both requests to be aborted")
    wait_idle(server)
    assert engine.blocks.num_used == 0
    engine.blocks.check_invariants()


async def _stream_completion(session, url: str, i: int, max_tokens: int) -> tuple[str, dict | None, bool]:
    body = {"prompt": f"{PROMPT} {i}", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    text, usage, done = "", None, False
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk["choices"]:
                text += chunk["choices"][0]["text"]
            if chunk.get("usage"):
                usage = chunk["usage"]
    return text, usage, done


def _load_round(url: str, n: int, max_tokens: int) -> list:
    async def main():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            return await asyncio.gather(*(_stream_completion(session, url, i, max_tokens) for i in range(n)),
                                        return_exceptions=True)
    return asyncio.run(main())


def test_load_200_concurrent_streams_no_errors_no_leaks(server):
    engine, n, max_tokens = server.driver.engine, 200, 8
    process = psutil.Process()
    _load_round(server.url, n, max_tokens)  # warm-up: allocator pools, connections, caches
    wait_idle(server)
    gc.collect()
    baseline = process.memory_info().rss

    results = _load_round(server.url, n, max_tokens)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert all(done and usage and usage["completion_tokens"] == max_tokens for _, usage, done in results)
    wait_idle(server)
    assert engine.blocks.num_used == 0
    engine.blocks.check_invariants()
    gc.collect()
    assert process.memory_info().rss - baseline < 64 << 20


# -- the pieces

def test_text_deltas_add_up_to_the_engine_text(server):
    engine = server.driver.engine
    text = "héllo wörld ✓ naïve – done"
    ids = engine.encode(text)
    deltas = TextDeltas(engine.decode)
    streamed = "".join(deltas.update(ids[:i]) for i in range(1, len(ids) + 1))
    assert "\ufffd" not in streamed
    assert streamed + deltas.finish(engine.decode(ids)) == engine.decode(ids)
    # a stop string: the engine finishes at the step that completes it and cuts its text there;
    # nothing past the cut is sent before that
    deltas = TextDeltas(engine.decode, ("done",))
    running = [ids[:i] for i in range(1, len(ids) + 1) if "done" not in engine.decode(ids[:i])]
    streamed = "".join(deltas.update(prefix) for prefix in running)
    cut = engine.decode(ids).find("done")
    assert len(streamed) <= cut
    assert streamed + deltas.finish(engine.decode(ids)[:cut]) == engine.decode(ids)[:cut]


def test_bridge_keeps_outputs_put_before_it_took_over():
    def output(n, finished):
        return RequestOutput("r", [1], list(range(n)), [n - 1], "", finished, "length" if finished else None)

    async def main():
        bridge = EngineBridge(asyncio.get_running_loop())
        stream = RequestStream("r")
        stream.put(output(1, False))  # the engine got there first
        outputs = bridge.attach(stream)
        await asyncio.to_thread(stream.put, output(2, True))  # from another thread, as the engine does
        first, last = await outputs.get(5), await outputs.get(5)
        assert (len(first.token_ids), len(last.token_ids)) == (1, 2) and outputs.finished
    asyncio.run(main())


def test_metrics_from_synthetic_records():
    """The record -> metric rules on hand-made records (engine-clock times are given, not measured)."""
    import numpy as np

    placement = Placement.contiguous(2, 4, 2)
    header = {"model": {"sparse_layers": [False, True]}, "devices": {"placement": placement.to_dict()}}
    m = ServerMetrics(header)

    def step(t_end, ids, events, hits=0, misses=0, routing=((0, 0, 0, 0), (4, 0, 0, 0))):
        routing = np.array(routing, dtype=np.int32)
        per_layer, overall = placement.balancedness(routing)  # what the engine's window sends
        return {"step": 1, "t_start": t_end - 0.01, "t_end": t_end, "batch": {"request_ids": ids, "preempted": []},
                "requests": events, "cache": {"prefix_queries": 10, "prefix_hits": 4, "preemptions": 0},
                "devices": {"expert_cache": [{"hits": hits, "misses": misses}] * 2,
                            "window": {"balancedness": float(overall),
                                       "balancedness_per_layer": per_layer.tolist()}},
                "routing": routing}

    first = step(1.0, ["a"], [{"id": "a", "event": "arrived", "t": 0.5},
                              {"id": "a", "event": "first_token", "t": 0.9}], hits=3, misses=1)
    first["batch"].update(prefill_tokens=5, decode_tokens=1)  # SGLang's forward_mode: mixed
    m.observe_step(first)
    idle = step(1.05, [], [], routing=((0, 0, 0, 0), (0, 0, 0, 0)))  # no token reached an expert: not observed
    m.observe_step(idle)
    m.observe_step(step(1.1, ["a"], []))
    m.observe_step(step(1.3, ["a"], [{"id": "a", "event": "finished", "t": 1.3, "reason": "length",
                                      "prompt_tokens": 5, "output_tokens": 3, "ttft_s": 0.4, "tpot_s": 0.15}]))
    m.observe_action({"time": 1.35, "step": 3, "kind": "auto_rebalance_plan", "args": {}, "result": {}})
    m.observe_action({"time": 1.5, "step": 3, "kind": "rebalance_apply", "args": {},
                      "result": {"bytes_moved": 0, "placement": placement.pin(1, 0).to_dict()}})
    # an edit changes the placement too: vLLM counts it as a rearrangement (no duration of its own)
    m.observe_action({"time": 1.6, "step": 3, "kind": "move", "args": {},
                      "result": {"placement": placement.to_dict()}})
    m.observe_action({"time": 1.7, "step": 3, "kind": "pin", "args": {},  # moves no expert
                      "result": {"placement": placement.pin(1, 0).to_dict()}})
    fams = {f.name: f for f in text_string_to_metric_families(m.render(None).decode())}
    assert sample(fams, "moectl:time_to_first_token_seconds", "_sum") == pytest.approx(0.4)
    assert sample(fams, "moectl:inter_token_latency_seconds", "_count") == 2
    assert sample(fams, "moectl:inter_token_latency_seconds", "_sum") == pytest.approx(0.3)
    assert sample(fams, "moectl:e2e_request_latency_seconds", "_sum") == pytest.approx(0.8)
    assert sample(fams, "moectl:request_time_per_output_token_seconds", "_sum") == pytest.approx(0.15)
    assert sample(fams, "moectl:prefix_cache_queries", "_total") == 10  # cumulative in records: counted once
    assert sample(fams, "moectl:prefix_cache_hits", "_total") == 4
    assert sample(fams, "moectl:expert_cache_hits", "_total") == 6  # per step, summed over devices
    assert sample(fams, "moectl:expert_cache_misses", "_total") == 2
    assert sample(fams, "moectl:rebalances", "_total") == 1
    assert sample(fams, "moectl:rebalance_seconds", "_sum") == pytest.approx(0.15)  # from the plan to the apply
    # only the MoE layer counts: all its load on device 0 of 2 -> balancedness 0.5
    assert {s.labels["quantile"]: s.value for s in fams["moectl:expert_balancedness"].samples} == \
        {"0": 0.5, "0.5": 0.5, "1": 0.5}
    # vLLM's and SGLang's names for the same figures (server/eplb_metrics.py)
    vllm = {"model_name": "moectl", "engine": "0"}
    for key in ("min", "p50", "p90", "avg"):
        assert fams[f"vllm:eplb_balancedness_{key}"].type == "gauge"
        assert sample(fams, f"vllm:eplb_balancedness_{key}", **vllm) == 0.5
    assert fams["vllm:eplb_rearrangements"].type == "counter"
    assert sample(fams, "vllm:eplb_rearrangements", "_total", **vllm) == 2
    assert sample(fams, "moectl:rebalances", "_total") == 1
    assert sample(fams, "vllm:eplb_rearrangement_seconds", **vllm) == pytest.approx(0.15)
    assert fams["sglang:eplb_balancedness"].type == "summary"
    per_pass = (2 + 1e-5) / (4 + 1e-5)  # SGLang's (mean + 1e-5) / (max + 1e-5) of the MoE layer's [4, 0]
    ranks = {"model_name": "moectl", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
    assert sample(fams, "sglang:eplb_balancedness", "_count", **ranks, forward_mode="decode") == 2
    assert sample(fams, "sglang:eplb_balancedness", "_count", **ranks, forward_mode="mixed") == 1
    assert sample(fams, "sglang:eplb_balancedness", "_sum", **ranks, forward_mode="decode") == \
        pytest.approx(2 * per_pass)
