"""`moectl attach URL`: the URL parsed as a URL, and a server's refusal said in words, at once."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.console.sources import ActionRefused, AttachSource, server_url
from moectl.engine.core.config import EngineConfig
from moectl.engine.core.driver import EngineDriver
from moectl.engine.llm_engine import LLMEngine
from moectl.placement.topology import Topology
from moectl.server.app import ServerThread
from tests.checkpoints import tiny_checkpoint

TOKEN = "s3cret-token"
WAIT_S = 60.0  # what a refusal once sat out before it was reported (10 s then)


@pytest.mark.parametrize("url, base", [
    ("http://h:8000", "http://h:8000"),
    ("http://h:8000/", "http://h:8000"),
    ("http://h:8000/v1/../x", "http://h:8000/x"),  # once ws://h:8000/v1/../x?y=1/v1/telemetry
    ("https://[::1]:9/a//b/", "https://[::1]:9/a/b"),
    ("http://h/..", "http://h"),
    ("http://h//other", "http://h/other"),
    (" http://h:8000 ", "http://h:8000"),
])
def test_a_url_is_normalised_to_the_servers_base(url, base):
    assert server_url(url) == base


@pytest.mark.parametrize("url, words", [
    ("http://h:8000/v1/../x?y=1", "'?y=1'"),
    ("http://h:8000/#top", "'#top'"),
    ("http://h:99999", "not a valid URL"),
    ("http://h:port", "not a valid URL"),
    ("ftp://h", "not an http(s) URL"),
    ("http://", "not an http(s) URL"),
])
def test_a_url_that_is_not_a_servers_address_is_refused(url, words):
    with pytest.raises(ActionRefused, match="^attach: ") as refused:
        server_url(url)
    assert words in str(refused.value)
    res = CliRunner().invoke(app, ["attach", url])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1 and words in res.stderr, res.stderr


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory.mktemp("attach_refusals"))
    config = EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=64, topology=Topology(num_devices=2),
                          redundant_slots=0, num_threads=1)
    driver = EngineDriver(lambda: LLMEngine(config))
    with ServerThread(driver, token=TOKEN) as srv:
        yield srv
    driver.close()


def test_a_wrong_or_missing_token_is_said_in_words_at_once(server):
    """A wrong token was reported as a raw `WSServerHandshakeError: 401` once the wait for
    telemetry ran out; the refusal is the answer, so it is reported as it comes."""
    with pytest.raises(ActionRefused) as refused:
        AttachSource(server.url, "wrong", timeout_s=WAIT_S)
    assert str(refused.value) == "attach: telemetry: the server refused the token (401)"
    with pytest.raises(ActionRefused) as refused:
        AttachSource(server.url, timeout_s=WAIT_S)
    assert str(refused.value) == "attach: telemetry: the server needs its token (401): give --token"
    res = CliRunner().invoke(app, ["attach", server.url + "/", "--token", "wrong"])
    assert res.exit_code == 2 and res.stderr == "moectl: error: attach: telemetry: the server refused the token (401)\n"


def test_the_right_token_and_a_path_that_normalises_to_the_server_attach(server):
    attach = AttachSource(server.url + "/v1/..", TOKEN, timeout_s=WAIT_S)
    try:
        assert attach.url == server.url and attach.header["devices"]["topology"]["num_devices"] == 2
    finally:
        attach.close()
