"""Request fields the server does not know are served without, as vLLM serves them, and named
(the X-Ignored-Fields header, a log line once per name); stream_options is type-checked in full."""

from __future__ import annotations

import json
import logging
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from moectl.engine.core.config import EngineConfig  # noqa: E402
from moectl.engine.core.driver import EngineDriver  # noqa: E402
from moectl.engine.llm_engine import LLMEngine  # noqa: E402
from moectl.server.api_request import MAX_IGNORED_NAMED  # noqa: E402
from moectl.server.app import ServerThread  # noqa: E402
from tests.checkpoints import tiny_checkpoint  # noqa: E402
from tests.server.test_server import assert_error, http  # noqa: E402

PROMPT = "def add(a, b):\n    return"
CHAT = [{"role": "user", "content": PROMPT}]
API_LOG = "moectl.server.api_request"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint = tiny_checkpoint(tmp_path_factory.mktemp("request_fields"))
    driver = EngineDriver(lambda: LLMEngine(EngineConfig(model=str(checkpoint), block_size=4, num_kv_blocks=128,
                                                         num_threads=1)))
    with ServerThread(driver) as srv:
        yield srv
    driver.close()


def post(srv, path: str, body: dict) -> tuple[int, dict, bytes]:
    """(status, headers, body) of a request that must succeed."""
    request = urllib.request.Request(srv.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.status, dict(response.headers), response.read()


def ignored(headers: dict):
    value = headers.get("X-Ignored-Fields")
    return None if value is None else json.loads(value)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stream": True}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "stream": True}),
    ("/tokenize", {"prompt": PROMPT}),
    ("/detokenize", {"tokens": [5, 6]}),
])
def test_an_unknown_field_is_served_without_and_named_in_a_header(server, path, body):
    status, headers, raw = post(server, path, {**body, "temprature": 0.5})
    assert status == 200 and raw
    assert ignored(headers) == ["temprature"]
    _, plain_headers, _ = post(server, path, body)
    assert ignored(plain_headers) is None


def test_the_fields_lm_eval_and_guidellm_send_are_not_reported(server):
    """lm-eval's local-completions bodies (generation and log-likelihood) and guidellm's chat body
    name only fields the server reads."""
    model = http("GET", server.url + "/v1/models")[1]["data"][0]["id"]
    generate = {"model": model, "prompt": [[5, 6, 7]], "max_tokens": 2, "temperature": 0, "stop": ["\n"],
                "seed": 1234}
    score = {"model": model, "prompt": [[5, 6, 7]], "temperature": 0, "max_tokens": 1, "logprobs": 1,
             "seed": 1234, "echo": True}
    chat = {"model": model, "messages": CHAT, "max_completion_tokens": 2, "max_tokens": 2, "ignore_eos": True,
            "stop": None, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    for path, body in (("/v1/completions", generate), ("/v1/completions", score), ("/v1/chat/completions", chat)):
        status, headers, _ = post(server, path, body)
        assert status == 200 and ignored(headers) is None, (path, body)


def test_the_openai_client_sends_extra_fields_and_reads_the_header(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    raw = client.completions.with_raw_response.create(model=model, prompt=PROMPT, max_tokens=2,
                                                      extra_body={"temprature": 0.5, "foo": 1})
    assert raw.parse().choices[0].finish_reason in ("length", "stop")
    assert json.loads(raw.headers["X-Ignored-Fields"]) == ["foo", "temprature"]


def test_the_log_names_each_ignored_field_once(server, caplog):
    caplog.set_level(logging.WARNING, logger=API_LOG)
    for _ in range(3):
        post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "once_only_field": 1})
    post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "once_only_field": 1, "another_one": 2})
    lines = [r.getMessage() for r in caplog.records if r.name == API_LOG]
    assert lines == [
        '/v1/completions: the following fields were present in the request but ignored: ["once_only_field"]',
        '/v1/completions: the following fields were present in the request but ignored: '
        '["another_one", "once_only_field"]']


def test_odd_and_many_field_names_stay_one_bounded_ascii_header(server):
    names = {f"x{i:03d}": i for i in range(MAX_IGNORED_NAMED + 4)}
    odd = {"bad\r\nSet-Cookie: a=b": 1, "café": 2, "y" * 500: 3}
    _, headers, _ = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, **odd})
    value = headers["X-Ignored-Fields"]
    assert "Set-Cookie" not in headers and value.isascii() and len(value) < 200
    assert json.loads(value) == ["bad\r\nSet-Cookie: a=b", "caf\u00e9", "y" * 61 + "..."]
    _, headers, _ = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, **names})
    listed, _, rest = headers["X-Ignored-Fields"].partition("] ")
    assert json.loads(listed + "]") == sorted(names)[:MAX_IGNORED_NAMED] and rest == "and 4 more"


@pytest.mark.parametrize("options, field", [
    ({"include_usage": False, "continuous_usage_stats": "yes"}, "continuous_usage_stats"),
    ({"continuous_usage_stats": 1}, "continuous_usage_stats"),
    ({"include_usage": "yes", "continuous_usage_stats": True}, "include_usage"),
])
@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": PROMPT}),
                                        ("/v1/chat/completions", {"messages": CHAT})])
def test_stream_options_are_type_checked_whatever_include_usage_is(server, options, field, path, body):
    error = assert_error(http("POST", server.url + path, {**body, "max_tokens": 2, "stream": True,
                                                          "stream_options": options}), 400, "stream_options")
    assert error["message"].startswith(f"stream_options.{field}: must be true or false")
