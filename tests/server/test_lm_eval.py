"""lm-evaluation-harness against `moectl serve`, beside transformers on the same checkpoint.

Its `local-completions` model scores a multiple-choice task by log-likelihood (echo + logprobs +
token-id prompts, in batches) and runs a generation task; `local-chat-completions` runs a
multiple-choice task posed for generation (chat endpoints have no log-likelihoods) and the
generation task through the checkpoint's chat template. The data files are written here.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from moectl.engine import sample_model_dir  # noqa: E402
from moectl.engine.core.config import EngineConfig  # noqa: E402
from moectl.engine.core.driver import EngineDriver  # noqa: E402
from moectl.engine.llm_engine import LLMEngine  # noqa: E402
from moectl.server.app import ServerThread  # noqa: E402

NAME = "moectl-sample"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT] {% endif %}")
MC = [  # Python the sample model was trained on: (context, choices, answer)
    ("def add(a, b):\n    return a", [" + b", " - b", " * b"], 0),
    ("for i in range(10):\n    print(", ["i)", "10)", "range)"], 0),
    ("import os\nimport", [" sys", " 12", " ("], 0),
    ("class Point:\n    def __init__(self, x, y):\n        self.x =", [" x", " y", " self"], 0),
    ("if x is None:\n    return", [" None", " 7", " if"], 0),
    ("with open(path) as f:\n    data = f.", ["read()", "close(", "with"], 0),
    ("def __len__(self):\n    return len(self.", ["items)", "len)", "def)"], 0),
    ("try:\n    x = int(s)\nexcept", [" ValueError:", " print", " return"], 0),
]
GEN = [("def add(a, b):\n    return", " a + b"), ("import os\nimport", " sys"),
       ("for i in range(", "10):"), ("class Point:\n    def", " __init__(self, x, y):")]


def write_tasks(root) -> dict:
    data = root / "data"
    data.mkdir()
    with open(data / "mc.jsonl", "w") as f:
        for ctx, choices, answer in MC:
            f.write(json.dumps({"context": ctx, "choices": choices, "answer": answer}) + "\n")
    with open(data / "mc_gen.jsonl", "w") as f:
        for ctx, choices, answer in MC:
            question = f"Which continues `{ctx}`? A:{choices[0]} B:{choices[1]} C:{choices[2]}\nAnswer:"
            f.write(json.dumps({"question": question, "answer": "ABC"[answer]}) + "\n")
    with open(data / "gen.jsonl", "w") as f:
        for prompt, target in GEN:
            f.write(json.dumps({"prompt": prompt, "target": target}) + "\n")

    def source(name):
        return {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data / f"{name}.jsonl")}},
                "test_split": "test"}

    gen_kwargs = {"until": ["\n"], "max_gen_toks": 12, "do_sample": False}
    return {
        "mc": {"task": "moectl_mc", **source("mc"), "output_type": "multiple_choice", "doc_to_text": "{{context}}",
               "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}", "target_delimiter": "",
               "metric_list": [{"metric": "acc"}]},
        "mc_gen": {"task": "moectl_mc_gen", **source("mc_gen"), "output_type": "generate_until",
                   "doc_to_text": "{{question}}", "doc_to_target": " {{answer}}", "generation_kwargs": gen_kwargs,
                   "metric_list": [{"metric": "exact_match"}]},
        "gen": {"task": "moectl_gen", **source("gen"), "output_type": "generate_until", "doc_to_text": "{{prompt}}",
                "doc_to_target": "{{target}}", "target_delimiter": "", "generation_kwargs": gen_kwargs,
                "metric_list": [{"metric": "exact_match"}]},
    }


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    model_dir = root / "model"
    shutil.copytree(sample_model_dir(), model_dir)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    saved = dict(os.environ)
    for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[key] = "1"  # nothing is downloaded: the data files are local
    os.environ["HF_DATASETS_CACHE"] = str(root / "datasets_cache")
    # with torchrun's variables in the environment lm-eval's hf model (through accelerate) joins a
    # process group and waits for the other ranks: run it as a plain process, whatever ran before
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    driver = EngineDriver(lambda: LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", block_size=16,
                                                         num_kv_blocks=512, num_threads=1)))
    try:
        with ServerThread(driver, model_name=NAME) as srv:
            yield srv, model_dir, write_tasks(root)
    finally:
        driver.close()
        os.environ.clear()
        os.environ.update(saved)


def evaluate(model: str, model_args: dict, tasks: list[dict], **kw) -> dict:
    from lm_eval import simple_evaluate

    return simple_evaluate(model=model, model_args=model_args, tasks=tasks, log_samples=True,
                           bootstrap_iters=0, random_seed=0, **kw)


def per_doc(result: dict, task: str) -> list:
    return [s["filtered_resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


def test_local_completions_matches_transformers(setup):
    srv, model_dir, tasks = setup
    served = evaluate("local-completions", {"model": NAME, "base_url": srv.url + "/v1/completions",
                                            "num_concurrent": 1, "max_retries": 1, "batch_size": 4,
                                            "tokenized_requests": True},
                      [tasks["mc"], tasks["gen"]])
    reference = evaluate("hf", {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu"},
                         [tasks["mc"], tasks["gen"]], batch_size=1)
    print("lm-eval local-completions:", json.dumps({t: served["results"][t] for t in served["results"]}))
    print("lm-eval hf (transformers):", json.dumps({t: reference["results"][t] for t in reference["results"]}))
    for task, metric in (("moectl_mc", "acc,none"), ("moectl_gen", "exact_match,none")):
        assert served["results"][task][metric] == reference["results"][task][metric]
    # the log-likelihood of every choice of every question, within 1e-3 relative
    for mine, theirs in zip(per_doc(served, "moectl_mc"), per_doc(reference, "moectl_mc")):
        for (ll, greedy), (ref_ll, ref_greedy) in zip(mine, theirs):
            assert ll == pytest.approx(ref_ll, rel=1e-3) and greedy == ref_greedy
    assert per_doc(served, "moectl_gen") == per_doc(reference, "moectl_gen")
    assert served["results"]["moectl_mc"]["acc,none"] > 1 / 3  # better than chance: the model knows Python


def test_local_chat_completions_matches_transformers(setup):
    srv, model_dir, tasks = setup
    chat_tasks = [tasks["mc_gen"], tasks["gen"]]
    served = evaluate("local-chat-completions", {"model": NAME, "base_url": srv.url + "/v1/chat/completions",
                                                 "num_concurrent": 1, "max_retries": 1},
                      chat_tasks, apply_chat_template=True)
    reference = evaluate("hf", {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu"}, chat_tasks,
                         apply_chat_template=True, batch_size=1)
    print("lm-eval local-chat-completions:", json.dumps({t: served["results"][t] for t in served["results"]}))
    print("lm-eval hf (transformers), chat:", json.dumps({t: reference["results"][t] for t in reference["results"]}))
    for task in ("moectl_mc_gen", "moectl_gen"):
        assert per_doc(served, task) == per_doc(reference, task)
        assert served["results"][task]["exact_match,none"] == reference["results"][task]["exact_match,none"]
