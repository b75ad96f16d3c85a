"""/metrics' KV retention series (server/metrics.py): per device (KV pool) and labelled with the
policy, the tokens the running sequences hold and their contexts' (gauges) and the tokens evicted
(a counter from the engine's cumulative figure). A live engine with a budget, requests long
enough to evict, the policy changed through /v1/control/knobs; then the rules on hand-made records."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from moectl.engine.core.config import EngineConfig, SchedulerKnobs  # noqa: E402
from moectl.engine.core.driver import EngineDriver  # noqa: E402
from moectl.engine.llm_engine import LLMEngine  # noqa: E402
from moectl.placement.topology import Topology  # noqa: E402
from moectl.server.app import STATE, ServerThread  # noqa: E402
from moectl.server.metrics import ServerMetrics  # noqa: E402
from tests.checkpoints import tiny_checkpoint  # noqa: E402

TOKEN = "kv-token"
HELD, CONTEXT, EVICTED = ("moectl:kv_retention_held_tokens", "moectl:kv_retention_context_tokens",
                          "moectl:kv_retention_evicted_tokens")
# about a hundred tokens of the tiny tokenizer: past a 16-token budget in blocks of 4
PROMPT = "def add(a, b):\n    return a + b\n\n" * 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory.mktemp("kv_metrics_ckpt"))
    knobs = SchedulerKnobs(kv_retention="streaming", kv_budget=16)
    driver = EngineDriver(lambda: LLMEngine(EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=256,
                                                         topology=Topology(num_devices=2), num_threads=1,
                                                         knobs=knobs)))
    with ServerThread(driver, token=TOKEN) as srv:
        srv.driver = driver
        yield srv
    driver.close()


def scrape(srv) -> dict:
    req = urllib.request.Request(srv.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return {f.name: f for f in text_string_to_metric_families(resp.read().decode())}


def series(families: dict, name: str, suffix: str = "") -> dict[tuple[str, str], float]:
    """{(device, policy): value} of one metric's samples."""
    return {(s.labels["device"], s.labels["policy"]): s.value for s in families[name].samples
            if s.name == name + suffix}


def wait_until(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def complete(srv, n: int, tag: str) -> None:
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key=TOKEN, max_retries=0, timeout=60)
    name = srv.app[STATE].model_name
    for i in range(n):
        out = c.completions.create(model=name, prompt=f"{PROMPT}{tag}{i}", max_tokens=8,
                                   extra_body={"ignore_eos": True})
        assert out.usage.prompt_tokens > 40


def set_knobs(srv, **knobs) -> dict:
    req = urllib.request.Request(srv.url + "/v1/control/knobs", data=json.dumps(knobs).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def evicted_total(engine) -> int:
    return sum(engine.blocks.evicted_tokens)


def test_retention_series_from_a_live_engine(server):
    engine = server.driver.engine
    complete(server, 4, "a")  # dealt over both devices' KV pools
    assert evicted_total(engine) > 0
    # the counter catches up with the engine's cumulative figure, device by device
    wait_until(lambda: series(scrape(server), EVICTED, "_total") == {
        (str(d), "streaming"): float(n) for d, n in enumerate(engine.blocks.evicted_tokens)},
        what="the evictions on /metrics")
    fams = scrape(server)
    assert fams[EVICTED].type == "counter" and fams[HELD].type == fams[CONTEXT].type == "gauge"
    # idle: nothing runs, so nothing is held (the engine's figure), on the policy in force
    assert series(fams, HELD) == series(fams, CONTEXT) == {("0", "streaming"): 0.0, ("1", "streaming"): 0.0}

    # a live policy change: the gauges follow it, the evictions from now count under it
    before = series(fams, EVICTED, "_total")
    assert set_knobs(server, kv_retention="h2o")["knobs"]["kv_retention"] == "h2o"
    complete(server, 4, "b")
    wait_until(lambda: sum(series(scrape(server), EVICTED, "_total").values()) == evicted_total(engine),
               what="the h2o evictions on /metrics")
    fams = scrape(server)
    counted = series(fams, EVICTED, "_total")
    assert {k: v for k, v in counted.items() if k[1] == "streaming"} == before  # what streaming evicted stays
    assert sum(v for k, v in counted.items() if k[1] == "h2o") > 0
    assert set(series(fams, HELD)) == set(series(fams, CONTEXT)) == {("0", "h2o"), ("1", "h2o")}


def test_held_and_context_while_a_request_runs(server):
    """Scraped between a running request's tokens, the gauges are the newest record's: its
    sequence holds at most its budget of the context it has."""
    set_knobs(server, kv_retention="streaming", kv_budget=16)
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=TOKEN, max_retries=0, timeout=60)
    stream = c.completions.create(model=server.app[STATE].model_name, prompt=PROMPT, max_tokens=200, stream=True,
                                  extra_body={"ignore_eos": True})
    seen = []
    for _ in stream:
        fams = scrape(server)
        held, context = series(fams, HELD), series(fams, CONTEXT)
        if any(context.values()):
            seen.append((held, context))
    assert seen, "no scrape saw the request running"
    for held, context in seen:
        assert set(held) == set(context) == {("0", "streaming"), ("1", "streaming")}
        running = [key for key, tokens in context.items() if tokens]
        assert len(running) == 1  # one sequence, on one device's KV pool
        assert 0 < held[running[0]] <= 16 < context[running[0]]


def record(step: int, policy: str, held, context, evicted) -> dict:
    return {"step": step, "t_start": step - 0.01, "t_end": float(step), "batch": {"request_ids": [], "preempted": []},
            "requests": [], "devices": {},
            "cache": {"prefix_queries": 0, "prefix_hits": 0, "preemptions": 0,
                      "kv_retention": {"policy": policy, "budget_tokens": 64, "budget_fraction": 1.0,
                                       "token_bytes": 96, "held_tokens": held, "context_tokens": context,
                                       "evicted_tokens": evicted}}}


def test_retention_rules_on_hand_made_records():
    m = ServerMetrics({})

    def fams(stats=None):
        return {f.name: f for f in text_string_to_metric_families(m.render(stats).decode())}

    m.observe_step(record(1, "streaming", [100, 40], [300, 40], [128, 0]))
    m.observe_step(record(2, "streaming", [64, 48], [400, 48], [256, 0]))
    f = fams()
    assert series(f, HELD) == {("0", "streaming"): 64, ("1", "streaming"): 48}
    assert series(f, CONTEXT) == {("0", "streaming"): 400, ("1", "streaming"): 48}
    assert series(f, EVICTED, "_total") == {("0", "streaming"): 256, ("1", "streaming"): 0}  # cumulative: once
    # the policy changed live: only its gauges remain; evictions from now count under it
    m.observe_step(record(3, "snapkv", [60, 60], [410, 60], [320, 16]))
    f = fams()
    assert series(f, HELD) == {("0", "snapkv"): 60, ("1", "snapkv"): 60}
    assert series(f, EVICTED, "_total") == {("0", "streaming"): 256, ("1", "streaming"): 0,
                                            ("0", "snapkv"): 64, ("1", "snapkv"): 16}
    # a scrape that finds nothing running: nothing held, whatever the last record said
    f = fams({"running": 0, "waiting": 0, "kv_usage": 0.0})
    assert series(f, HELD) == series(f, CONTEXT) == {("0", "snapkv"): 0, ("1", "snapkv"): 0}
    # a restarted engine counts from 0 again
    m.observe_step(record(1, "snapkv", [16, 0], [100, 0], [32, 0]))
    assert series(fams(), EVICTED, "_total")[("0", "snapkv")] == 64 + 32
    # records without retention (older traces, the simulated backend) leave the series alone
    plain = record(2, "snapkv", [], [], [])
    del plain["cache"]["kv_retention"]
    m.observe_step(plain)
    assert series(fams(), HELD) == {("0", "snapkv"): 16, ("1", "snapkv"): 0}
