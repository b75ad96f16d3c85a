"""One failing step must not kill `moectl serve`: its request gets a 500 (or an error event in
its stream) naming the cause, the next request succeeds and /health stays 200. A broken model
fails each request, then /health answers 503 naming the cause. On the distributed backend a
rank that raises is named with its exception, not only its exit code.

Faults are injected into the model runner of the served engine (a prompt of POISON token ids
makes its step raise), and on the distributed backend into rank 1's forward (_faulty_worker:
rank 1 runs it in place of the real worker, by its importable name)."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from moectl.engine.core.config import EngineConfig  # noqa: E402
from moectl.engine.core.driver import EngineDriver  # noqa: E402
from moectl.engine.core.engine import MAX_FAILED_STEPS  # noqa: E402
from moectl.engine.llm_engine import LLMEngine  # noqa: E402
from moectl.engine.parallel import distributed, group  # noqa: E402
from moectl.placement.topology import Topology  # noqa: E402
from moectl.server.app import STATE, ServerThread  # noqa: E402
from tests.checkpoints import tiny_checkpoint  # noqa: E402
from tests.engine.core.test_step_faults import CAUSE, FaultyRun  # noqa: E402
from tests.server.test_server import PROMPT, TOKEN, client, http  # noqa: E402

POISON = [7, 7, 7, 7, 7, 7, 7, 299]  # a prompt whose step raises
RANK_CAUSE = "injected fault in rank 1's experts"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("step_fault_ckpt"))


def _config(checkpoint) -> EngineConfig:
    return EngineConfig(model=str(checkpoint), block_size=4, num_kv_blocks=256, topology=Topology(num_devices=2),
                        redundant_slots=1, num_threads=1)


def _driver(checkpoint, **fault) -> EngineDriver:
    """An engine whose runner raises for POISON (or, prompt=None, always), on its driver."""
    def make():
        engine = LLMEngine(_config(checkpoint))
        engine.runner.run = FaultyRun(engine, **{"prompt": POISON, **fault})
        return engine
    return EngineDriver(make)


def _failure(call) -> openai.APIError:
    with pytest.raises(openai.APIError) as info:
        call()
    return info.value


def test_a_failing_step_answers_500_with_its_cause_and_the_server_serves_on(checkpoint):
    driver = _driver(checkpoint)
    try:
        with ServerThread(driver, token=TOKEN) as srv:
            api, name = client(srv, TOKEN), srv.app[STATE].model_name
            err = _failure(lambda: api.completions.create(model=name, prompt=POISON, max_tokens=4))
            assert isinstance(err, openai.InternalServerError) and f"RuntimeError: {CAUSE}" in err.message
            assert http("GET", srv.url + "/health")[0] == 200
            out = api.completions.create(model=name, prompt=PROMPT, max_tokens=4)
            assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
            # streamed: an error event naming the cause, then the next stream runs
            with pytest.raises(openai.APIError, match=f"RuntimeError: {CAUSE}"):
                list(api.completions.create(model=name, prompt=POISON, max_tokens=4, stream=True))
            chunks = list(api.completions.create(model=name, prompt=PROMPT, max_tokens=4, stream=True))
            assert chunks[-1].choices[0].finish_reason == "length"
            status, body = http("GET", srv.url + "/health")
            assert status == 200 and body["status"] == "ok" and body["running"] == 0
            assert driver.error is None and driver.engine.blocks.num_used == 0
    finally:
        driver.close()


def test_a_broken_model_fails_each_request_then_health_names_the_cause(checkpoint):
    driver = _driver(checkpoint, prompt=None)  # every step raises
    try:
        with ServerThread(driver, token=TOKEN) as srv:
            api, name = client(srv, TOKEN), srv.app[STATE].model_name
            for _ in range(MAX_FAILED_STEPS):
                assert http("GET", srv.url + "/health")[0] == 200
                err = _failure(lambda: api.completions.create(model=name, prompt=PROMPT, max_tokens=4))
                assert err.status_code == 500 and f"RuntimeError: {CAUSE}" in err.message
            status, body = http("GET", srv.url + "/health")
            assert status == 503 and f"{MAX_FAILED_STEPS} steps failed in a row" in body["error"]
            assert f"RuntimeError: {CAUSE}" in body["error"]
            err = _failure(lambda: api.completions.create(model=name, prompt=PROMPT, max_tokens=4))
            assert err.status_code == 503 and CAUSE in err.message
    finally:
        driver.close()


# -- the distributed backend

class _PoisonedForward:
    """Rank 1's model: raises for a step whose tokens hold POISON's last id."""

    def __init__(self, model):
        self.model = model

    def __call__(self, ids, positions, ctx, *args):
        if (ids == POISON[-1]).any():
            raise ValueError(RANK_CAUSE)
        return self.model(ids, positions, ctx, *args)


def _faulty_worker(*args) -> None:
    """group._worker with rank 1's forward poisoned (runs in the spawned rank process)."""
    real = distributed.worker_loop
    distributed.worker_loop = lambda model, *rest: real(_PoisonedForward(model), *rest)
    group._worker(*args)


def test_a_rank_that_raises_is_named_with_its_error(checkpoint, monkeypatch):
    monkeypatch.setattr(group, "_worker", _faulty_worker)
    ranks = group.RankGroup(_config(checkpoint), 2)
    driver = EngineDriver(ranks.make_engine)
    try:
        with ServerThread(driver, token=TOKEN) as srv:
            api, name = client(srv, TOKEN), srv.app[STATE].model_name
            assert api.completions.create(model=name, prompt=PROMPT, max_tokens=4).usage.completion_tokens == 4
            # rank 0's own sampler fails once: the ranks are in step, so only that request fails
            engine = driver.engine
            monkeypatch.setattr(engine, "_sample", _raise_once(engine._sample, RuntimeError("sampler fault")))
            err = _failure(lambda: api.completions.create(model=name, prompt=PROMPT, max_tokens=4))
            assert err.status_code == 500 and "RuntimeError: sampler fault" in err.message
            assert api.completions.create(model=name, prompt=PROMPT, max_tokens=4).usage.completion_tokens == 4
            assert http("GET", srv.url + "/health")[0] == 200
            # rank 1's forward raises: the group ends, and every message names rank 1 and its error
            err = _failure(lambda: api.completions.create(model=name, prompt=POISON, max_tokens=4))
            cause = f"distributed: rank 1 failed: ValueError: {RANK_CAUSE} (exit code 1)"
            assert err.status_code == 500 and cause in err.message
            status, body = http("GET", srv.url + "/health")
            assert status == 503 and cause in body["error"]
            err = _failure(lambda: api.completions.create(model=name, prompt=PROMPT, max_tokens=4))
            assert err.status_code == 503 and cause in err.message
    finally:
        driver.close()
        ranks.close()
    assert all(not p.is_alive() for p in ranks.procs)


def _raise_once(real, error: Exception):
    raised = []

    def call(*args, **kwargs):
        if not raised:
            raised.append(error)
            raise error
        return real(*args, **kwargs)
    return call
