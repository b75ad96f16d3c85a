"""The OpenAI API as vLLM serves it: log-probabilities (against transformers), echo, batches,
n / best_of, penalties, stop ids, chat logprobs and templates, /tokenize, and the request guards
(Host / Origin, content type, surrogates, nesting, oversized prompts)."""

from __future__ import annotations

import json
import shutil
import urllib.request

import pytest
import torch

openai = pytest.importorskip("openai")

from moectl.engine import sample_model_dir  # noqa: E402
from moectl.engine.core.config import EngineConfig  # noqa: E402
from moectl.engine.core.driver import EngineDriver  # noqa: E402
from moectl.engine.core.sampling import SamplingParams  # noqa: E402
from moectl.engine.llm_engine import LLMEngine  # noqa: E402
from moectl.server.app import ServerThread  # noqa: E402
from moectl.server.chat_template import FALLBACK_TEMPLATE  # noqa: E402
from tests.server.test_server import assert_error, http  # noqa: E402

PROMPT = "def add(a, b):\n    return"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT] {% endif %}")


def _config(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype="float32", block_size=16, num_kv_blocks=256, num_threads=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The shipped sample model with a chat template in its tokenizer_config.json."""
    out = tmp_path_factory.mktemp("templated") / "sample"
    shutil.copytree(sample_model_dir(), out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return out


@pytest.fixture(scope="module")
def server(model_dir):
    driver = EngineDriver(lambda: LLMEngine(_config(model_dir)))
    with ServerThread(driver) as srv:
        srv.driver = driver
        yield srv
    driver.close()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def post(srv, path: str, body: dict) -> dict:
    status, out = http("POST", srv.url + path, body)
    assert status == 200, out
    return out


def tokens(srv, text: str) -> list[int]:
    return post(srv, "/tokenize", {"prompt": text})["tokens"]


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_echo_logprobs_equal_transformers(server, hf_model):
    ids = tokens(server, PROMPT + " a + b\n\ndef mul(a, b):\n    return a * b\n")
    out = post(server, "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 3, "max_tokens": 0})
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert choice["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 0
    assert choice["text"] == post(server, "/detokenize", {"tokens": ids})["prompt"]
    assert len(lp["token_logprobs"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = hf_logprobs(hf_model, ids)
    got = torch.tensor(lp["token_logprobs"][1:], dtype=torch.float64)
    ref = want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].double()
    rel = ((got - ref).abs() / ref.abs().clamp_min(1e-6)).max().item()
    assert rel < 1e-3, rel
    # the top-3 of each position are transformers' top-3
    for pos in range(1, len(ids)):
        top = lp["top_logprobs"][pos]
        best = want[pos - 1].topk(3)
        for value, token in zip(best.values.tolist(), best.indices.tolist()):
            text = post(server, "/detokenize", {"tokens": [token]})["prompt"]
            assert top[text] == pytest.approx(value, rel=1e-3)


def test_generated_logprobs_equal_transformers_and_lm_eval_shape(server, hf_model):
    ids = tokens(server, PROMPT)
    out = post(server, "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 4,
                                           "ignore_eos": True})
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 4 == len(lp["text_offset"])
    assert lp["text_offset"] == sorted(lp["text_offset"])
    full = tokens(server, out["choices"][0]["text"])
    want = hf_logprobs(hf_model, full)
    for pos in range(len(ids), len(full)):
        assert lp["token_logprobs"][pos] == pytest.approx(want[pos - 1, full[pos]].item(), rel=1e-3)
        # greedy: the chosen token's logprob is the largest of its top dict (lm-eval's is_greedy)
        assert lp["token_logprobs"][pos] == max(lp["top_logprobs"][pos].values())


def test_batch_of_prompts_matches_single_requests(server):
    prompts = [PROMPT, tokens(server, "class Point:"), "import os\n"]
    batch = post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 6, "n": 2, "ignore_eos": True})
    assert [c["index"] for c in batch["choices"]] == list(range(6))
    for i, prompt in enumerate(prompts):
        single = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "ignore_eos": True})
        assert batch["choices"][2 * i]["text"] == batch["choices"][2 * i + 1]["text"] == single["choices"][0]["text"]
    assert batch["usage"]["completion_tokens"] == 36


def test_n_with_seed_and_best_of(server):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    four = post(server, "/v1/completions", {**body, "n": 4, "logprobs": 0})
    again = post(server, "/v1/completions", {**body, "n": 4, "logprobs": 0})
    texts = [c["text"] for c in four["choices"]]
    assert texts == [c["text"] for c in again["choices"]]  # seeded: reproducible
    assert len(set(texts)) > 1  # choice j draws with seed + j
    cumulative = [sum(c["logprobs"]["token_logprobs"]) for c in four["choices"]]
    best = post(server, "/v1/completions", {**body, "n": 1, "best_of": 4})
    assert len(best["choices"]) == 1 and best["choices"][0]["logprobs"] is None  # not asked for
    assert best["choices"][0]["text"] == texts[max(range(4), key=cumulative.__getitem__)]


def test_stop_token_ids_and_penalties_reach_the_engine(server, model_dir):
    greedy = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True})
    ids = tokens(server, greedy["choices"][0]["text"])
    stopped = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "stop_token_ids": [ids[2]]})
    # lm-eval sends a task's `until` plus EOS as stop strings: often more than OpenAI's 4
    many = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True,
                                            "stop": ["\nclass", "\ndef", "\n#", "\nif", "\nprint", "</s>"]})
    assert many["choices"][0]["text"] == greedy["choices"][0]["text"].split("\nclass")[0].split("\ndef")[0] \
        .split("\n#")[0].split("\nif")[0].split("\nprint")[0].split("</s>")[0]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] <= 3
    # vLLM returns the text before the stop token ("self", not "self,"), still counting the token
    stop_at = ids.index(ids[2])
    assert tokens(server, stopped["choices"][0]["text"]) == ids[:stop_at]
    assert stopped["usage"]["completion_tokens"] == stop_at + 1
    engine = LLMEngine(_config(model_dir))
    penalties = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)
    want = engine.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True, **penalties))[0].text
    got = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, **penalties})
    assert got["choices"][0]["text"] == want


def test_streamed_logprobs_and_choices_equal_unstreamed(server):
    body = {"prompt": PROMPT, "max_tokens": 8, "logprobs": 2, "n": 2, "echo": True, "ignore_eos": True}
    whole = post(server, "/v1/completions", body)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    options = {k: v for k, v in body.items() if k != "ignore_eos"}
    chunks = list(client.completions.create(model="sample", stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}, **options))
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in mine) == whole["choices"][i]["text"]
        streamed = [t for c in mine if c.logprobs for t in c.logprobs.token_logprobs]
        assert streamed == whole["choices"][i]["logprobs"]["token_logprobs"]
    assert chunks[-1].usage.completion_tokens == 16


def test_chat_logprobs_n_and_the_checkpoint_template(server):
    messages = [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "add two numbers"}]
    rendered = "<|endoftext|>[SYSTEM] Write Python.\n[USER] add two numbers\n[ASSISTANT] "
    assert post(server, "/tokenize", {"messages": messages})["tokens"] == tokens(server, rendered)
    out = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 5, "logprobs": True,
                                                "top_logprobs": 3, "n": 2, "ignore_eos": True})
    assert [c["index"] for c in out["choices"]] == [0, 1]
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == 5 and all(len(t["top_logprobs"]) == 3 for t in content)
    assert "".join(t["token"] for t in content) == out["choices"][0]["message"]["content"]
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    assert content[0]["logprob"] == content[0]["top_logprobs"][0]["logprob"]  # greedy
    info = json.loads(urllib.request.urlopen(server.url + "/tokenizer_info").read())
    assert info["chat_template"] == TEMPLATE and info["chat_template_origin"] == "tokenizer_config.json"
    assert info["eos_token"] == "<|endoftext|>"
    assert_error(http("POST", server.url + "/v1/chat/completions", {"messages": messages, "top_logprobs": 2}),
                 400, "top_logprobs")
    assert_error(http("POST", server.url + "/v1/chat/completions", {"messages": messages, "echo": True}), 400, "echo")


def test_fallback_template_is_stated_and_applied(tmp_path):
    driver = EngineDriver(lambda: LLMEngine(_config(sample_model_dir())))
    try:
        with ServerThread(driver) as srv:
            info = json.loads(urllib.request.urlopen(srv.url + "/tokenizer_info").read())
            assert info["chat_template_origin"] == "fallback" and info["chat_template"] == FALLBACK_TEMPLATE
            models = json.loads(urllib.request.urlopen(srv.url + "/v1/models").read())
            assert models["data"][0]["chat_template"] == "fallback"
            got = post(srv, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})["tokens"]
            assert got == tokens(srv, "<|user|>\nhi\n<|assistant|>\n")
    finally:
        driver.close()


def test_a_broken_checkpoint_template_is_refused_at_start(tmp_path):
    from moectl.server.chat_template import ChatTemplate, ChatTemplateError

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}"}))
    with pytest.raises(ChatTemplateError, match="chat_template .*does not compile"):
        ChatTemplate.from_dir(tmp_path)


def test_tokenize_and_detokenize(server):
    out = post(server, "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert out["count"] == len(out["tokens"]) == len(out["token_strs"]) and out["max_model_len"] == 2048
    assert post(server, "/detokenize", {"tokens": out["tokens"]})["prompt"] == PROMPT
    assert_error(http("POST", server.url + "/detokenize", {"tokens": [99999]}), 400, "tokens")
    assert post(server, "/detokenize", {"tokens": []})["prompt"] == ""  # as vLLM
    assert_error(http("POST", server.url + "/tokenize", {}), 400, "prompt")


# -- the guards

def raw_request(srv, path: str, data: bytes, headers: dict) -> tuple[int, dict]:
    req = urllib.request.Request(srv.url + path, data=data, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_cross_site_requests_are_refused_without_a_token(server):
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1}).encode()
    as_json = {"Content-Type": "application/json"}
    assert raw_request(server, "/v1/completions", body, as_json)[0] == 200
    # DNS rebinding: the page's own name resolves to 127.0.0.1, and the Host header says so
    status, err = raw_request(server, "/v1/completions", body, {**as_json, "Host": f"evil.example:{server.port}"})
    assert status == 403 and "Host" in err["error"]["message"]
    for origin in ("https://evil.example", "http://127.0.0.1:1", "null"):  # another local port is another site
        status, err = raw_request(server, "/v1/completions", body, {**as_json, "Origin": origin})
        assert status == 403 and "Origin" in err["error"]["message"]
    assert raw_request(server, "/v1/completions", body, {**as_json, "Origin": server.url})[0] == 200
    # a form or fetch(no-cors) post is text/plain: never parsed as JSON
    status, err = raw_request(server, "/v1/completions", body, {"Content-Type": "text/plain"})
    assert status == 415 and "application/json" in err["error"]["message"]
    req = urllib.request.Request(server.url + "/v1/telemetry", headers={"Origin": "http://evil.example"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    assert info.value.code == 403


def test_surrogates_nesting_and_huge_prompts_get_400(server):
    as_json = {"Content-Type": "application/json"}
    status, err = raw_request(server, "/v1/completions", b'{"prompt": "a\\ud800b"}', as_json)
    assert status == 400 and err["error"]["param"] == "prompt" and "surrogate" in err["error"]["message"]
    status, err = raw_request(server, "/v1/chat/completions",
                              b'{"messages": [{"role": "user", "content": "\\udfff"}]}', as_json)
    assert status == 400 and err["error"]["param"] == "messages"
    deep = b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    status, err = raw_request(server, "/v1/completions", deep, as_json)
    assert status == 400 and "nested" in err["error"]["message"]
    status, err = raw_request(server, "/v1/completions", b'{"prompt": "x", "a": ' + b"[" * 40 + b"]" * 40 + b"}",
                              as_json)
    assert status == 400 and err["error"]["param"] == "a"
    # ~1 MB of text is refused from its length, before the tokenizer sees it
    status, err = raw_request(server, "/v1/completions", json.dumps({"prompt": "x" * 1_000_000}).encode(), as_json)
    assert status == 400 and err["error"]["code"] == "context_length_exceeded" and "characters" in err["error"]["message"]
    assert json.loads(urllib.request.urlopen(server.url + "/health").read())["status"] == "ok"


def test_a_template_that_fails_on_a_chat_is_refused_naming_messages(tmp_path):
    from moectl.server.chat_template import ChatTemplate, ChatTemplateError

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] + 1 }}"}))
    template = ChatTemplate.from_dir(tmp_path)
    with pytest.raises(ChatTemplateError, match=r"^messages: .*TypeError"):  # the encoder answers it as a 400
        template.render([{"role": "user", "content": "hi"}])


def sse(srv, path: str, body: dict) -> list[dict]:
    """A streamed request's chunks, read as any SSE client reads them."""
    request = urllib.request.Request(srv.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        lines = response.read().decode().splitlines()
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]", lines[-3:]
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


# the bodies guidellm (the vLLM project's benchmark client) sends from its OpenAI HTTP backend:
# streaming, usage on every chunk, a fixed output length (ignore_eos) and no stop
GUIDELLM_STREAM = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "stop": None}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_completion_tokens": 6,
                              "max_tokens": 6, "ignore_eos": True, "stop": None}),
])
def test_guidellm_requests_stream_with_usage_on_every_chunk(server, path, body):
    model = http("GET", server.url + "/v1/models")[1]["data"][0]["id"]
    chunks = sse(server, path, {"model": model, **body, **GUIDELLM_STREAM})
    prompt_tokens = chunks[-1]["usage"]["prompt_tokens"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    seen = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"]["prompt_tokens"] == prompt_tokens for c in chunks)  # every chunk carries usage
    assert all(c["usage"]["total_tokens"] == prompt_tokens + c["usage"]["completion_tokens"] for c in chunks)
    assert seen == sorted(seen) and 0 < seen[-2] <= 6  # tokens so far, growing
    # without continuous_usage_stats: usage null on each chunk, then the usage chunk (unchanged)
    plain = sse(server, path, {"model": model, **body, "stream": True,
                               "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 6
