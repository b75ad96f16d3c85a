"""/metrics' activation gauges (server/metrics.py): per layer and point, moectl:activation_max (the
largest |value| over the window's step records) and moectl:activation_headroom (the point's dtype
limit over it). Scraped through a live server's HTTP endpoint with records carrying the watch fed
into its record stream beside the engine's (the engine side of the watch may not send it yet: the
live test says so and skips); then the rules on hand-made records, as the other metrics tests do."""

from __future__ import annotations

import time
import urllib.request
from collections import deque

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from moectl.engine.core.config import EngineConfig  # noqa: E402
from moectl.engine.core.driver import EngineDriver  # noqa: E402
from moectl.engine.llm_engine import LLMEngine  # noqa: E402
from moectl.placement.topology import Topology  # noqa: E402
from moectl.profiler.analysis import numerics_headroom, numerics_peak, step_numerics  # noqa: E402
from moectl.profiler.recorder import engine_header  # noqa: E402
from moectl.server.app import STATE, ServerThread  # noqa: E402
from moectl.server.metrics import NUMERICS_WINDOW_STEPS, ServerMetrics  # noqa: E402
from tests.checkpoints import tiny_checkpoint  # noqa: E402
from tests.profiler.numerics_records import flat, record  # noqa: E402
from tests.records import make_record  # noqa: E402

TOKEN = "numerics-token"
MAX, ROOM = "moectl:activation_max", "moectl:activation_headroom"
POINTS = ("residual", "norm_sumsq", "attn_logits", "expert_out")
FP16 = 65504.0


def series(text: str, name: str) -> dict[tuple[int, str], float]:
    """{(layer, point): value} of one gauge's samples, parsed by prometheus_client's own parser."""
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    if name not in fams:
        return {}
    assert fams[name].type == "gauge"
    return {(int(s.labels["layer"]), s.labels["point"]): s.value for s in fams[name].samples}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("numerics_metrics_ckpt"))


@pytest.fixture()
def server(ckpt):
    """A live server whose record stream also carries the records a test puts in `srv.feed`:
    the engine's own, then those, through the server's one consumer (server/app.py _consume)."""
    driver = EngineDriver(lambda: LLMEngine(EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=128,
                                                         topology=Topology(num_devices=2), num_threads=1)))
    feed: deque[dict] = deque()
    engine_records: list[dict] = []
    poll = driver.poll

    def poll_and_feed():
        records, actions = poll()
        engine_records.extend(records)
        records += [feed.popleft() for _ in range(len(feed))]
        return records, actions

    driver.poll = poll_and_feed
    with ServerThread(driver, token=TOKEN) as srv:
        srv.driver, srv.feed, srv.engine_records = driver, feed, engine_records
        yield srv
    driver.close()


def scrape(srv) -> str:
    req = urllib.request.Request(srv.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.read().decode()


def wait_for(srv, predicate, what: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = scrape(srv)
        if predicate(text):
            return text
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_gauges_on_a_live_servers_metrics(server):
    model = engine_header(server.driver.engine)["model"]
    layers, experts = model["num_layers"], model["num_experts"]  # records the engine could have sent
    assert layers >= 2
    assert series(scrape(server), MAX) == {}  # no record with the watch yet: no series
    peak = flat(layers, 1000.0)
    peak[1, 3] = 40000.0
    first = flat(layers, 10.0)
    first[0, 1] = peak[0, 1] = 0.0
    flags = np.zeros((layers, 4), bool)
    flags[0, 2] = True
    peak[0, 2] = np.inf
    t = time.monotonic()
    fed = [record(1, first, experts), record(2, peak, experts, nonfinite=flags)]
    for i, rec in enumerate(fed):
        rec["t_start"], rec["t_end"] = t + i * 0.01, t + i * 0.01 + 0.005
    server.feed.extend(fed)
    text = wait_for(server, lambda text: series(text, MAX).get((1, "expert_out")) == 40000.0, "the activation gauges")
    maxima, rooms = series(text, MAX), series(text, ROOM)
    assert set(maxima) == set(rooms) == {(layer, p) for layer in range(layers) for p in POINTS}
    assert maxima[(1, "expert_out")] == 40000.0 and rooms[(1, "expert_out")] == pytest.approx(FP16 / 40000)
    assert maxima[(0, "residual")] == 1000.0 and rooms[(0, "residual")] == pytest.approx(65.504)
    assert maxima[(0, "attn_logits")] == np.inf and rooms[(0, "attn_logits")] == 0.0  # an inf seen there
    assert maxima[(0, "norm_sumsq")] == 0.0 and rooms[(0, "norm_sumsq")] == np.inf  # nothing to overflow
    assert "# HELP moectl:activation_headroom" in text

    # the window moves on: records without the watch age the figures out, and the series go
    server.feed.extend(make_record(3 + i, routing=np.ones((layers, experts), np.int32), t_start=t + 1 + i * 0.01)
                       for i in range(NUMERICS_WINDOW_STEPS))
    wait_for(server, lambda text: series(text, MAX) == {} and series(text, ROOM) == {}, "the series to go")


def test_the_engines_own_records(server):
    """When the engine sends the watch, /metrics shows its window's peak; until then, skipped."""
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=TOKEN, max_retries=0, timeout=60)
    c.completions.create(model=server.app[STATE].model_name, prompt="def add(a, b):\n    return", max_tokens=8)
    deadline = time.monotonic() + 10
    while not server.engine_records and time.monotonic() < deadline:
        time.sleep(0.05)
    watched = [r for r in server.engine_records if "numerics" in r]
    if not watched:
        pytest.skip("the engine's step records carry no numerics yet (its side of the watch is not in this tree)")
    found = numerics_headroom(numerics_peak(step_numerics(r) for r in server.engine_records[-NUMERICS_WINDOW_STEPS:]))
    text = wait_for(server, lambda text: len(series(text, MAX)) == found["max"].size, "the engine's gauges")
    maxima, rooms = series(text, MAX), series(text, ROOM)
    for (layer, p), value in np.ndenumerate(np.where(found["nonfinite"], np.inf, found["max"])):
        point = found["points"][p]
        assert maxima[(layer, point)] == pytest.approx(value, rel=1e-6)
        assert rooms[(layer, point)] == pytest.approx(found["headroom"][layer, p], rel=1e-6)


def test_the_rules_on_hand_made_records():
    m = ServerMetrics({})

    def scraped():
        text = m.render(None).decode()
        return series(text, MAX), series(text, ROOM)

    m.observe_step(make_record(1))  # an older engine's record: no series at all
    assert scraped() == ({}, {})
    first = flat(2, 100.0)
    first[0, 3] = 30000.0
    m.observe_step(record(2, first, residual_dtype="float32"))
    m.observe_step(record(3, flat(2, 200.0), residual_dtype="float32"))
    maxima, rooms = scraped()
    assert maxima[(0, "expert_out")] == 30000.0 and maxima[(1, "expert_out")] == 200.0  # the window's peak
    assert rooms[(0, "expert_out")] == pytest.approx(FP16 / 30000)
    for point in ("residual", "norm_sumsq"):  # the float32 residual stream and its sum of squares
        assert rooms[(0, point)] == pytest.approx(3.4028234663852886e38 / 200)
    # a model of another shape (the engine restarted on another checkpoint): its layers only
    m.observe_step(record(4, flat(3, 50.0), dtype="bfloat16"))
    maxima, rooms = scraped()
    assert set(maxima) == {(layer, p) for layer in range(3) for p in POINTS}
    assert maxima[(2, "attn_logits")] == 50.0 and rooms[(2, "attn_logits")] == pytest.approx(3.3895313892515355e38 / 50)
    for step in range(5, 5 + NUMERICS_WINDOW_STEPS):  # the watch switched off: the window empties of it
        m.observe_step(make_record(step))
    assert scraped() == ({}, {})
