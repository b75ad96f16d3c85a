"""The moectl CLI: JSON contracts, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from moectl.cli.common import DEFAULT_DEVICES
from moectl.cli.main import app
from tests.checkpoints import tiny_checkpoint

runner = CliRunner()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("cli"))


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_generate_json_one_object_per_prompt(ckpt):
    res = run("generate", "--model", ckpt, "--prompt-ids", "1,2,3", "--prompt-ids", "4,5", "--max-tokens", 5,
              "--ignore-eos", "--json")
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["prompt_ids"] for r in rows] == [[1, 2, 3], [4, 5]]
    assert all(len(r["token_ids"]) == 5 and isinstance(r["text"], str) for r in rows)


def test_generate_text_prompt_and_seed_reproducible(ckpt):
    args = ("generate", "--model", ckpt, "def f(", "--max-tokens", 6, "--temperature", 1.0, "--seed", 3, "--json")
    first, second = (json.loads(run(*args).stdout) for _ in range(2))
    assert first["token_ids"] == second["token_ids"] and first["text"] == second["text"]
    assert len(first["token_ids"]) >= 1


def test_model_info_json_keys(ckpt):
    res = run("model", "info", "--model", ckpt, "--json")
    info = json.loads(res.stdout)
    for key in ("path", "architecture", "layers", "experts", "top_k", "params_total", "params_active"):
        assert key in info
    assert (info["layers"], info["experts"], info["top_k"]) == (2, 8, 2)
    assert info["params_active"] < info["params_total"]


@pytest.mark.parametrize("args, needle", [
    (("generate", "--prompt-ids", "1,x"), "--prompt-ids"),
    (("generate", "--prompt-ids", "1,2", "--top-p", "0"), "top_p"),
    (("generate", "--prompt-ids", "1,2", "--max-tokens", "0"), "max_tokens"),
    (("generate", "--prompt-ids", "1,2", "--kv-cache-dtype", "fp4"), "kv_cache_dtype"),
    (("generate", "--prompt-ids", "1,99999"), "token ids"),
    (("generate", "--prompt-ids", ",".join(["5"] * 600)), "exceed the context"),
    (("generate",), "PROMPT"),
])
def test_bad_input_exits_2_with_one_line(ckpt, args, needle):
    res = run(*args, "--model", ckpt)
    assert res.exit_code == 2
    assert needle in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_missing_and_corrupt_model_exit_2(tmp_path, ckpt):
    assert run("generate", "x", "--model", tmp_path / "nope").exit_code == 2
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((ckpt / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    res = run("model", "info", "--model", broken)
    assert res.exit_code == 0  # info reads config.json only
    res = run("generate", "x", "--model", broken)
    assert res.exit_code == 2 and "model.safetensors" in res.stderr


def test_real_process_has_no_traceback(tmp_path):
    """The installed entry point, in a real process: a one-line error and exit code 2."""
    proc = subprocess.run([sys.executable, "-m", "moectl.cli", "generate", "x", "--model", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.strip().startswith("moectl: error: config.json")


@pytest.mark.parametrize("args", [["generate", "--max-tokens", "abc", "x"], ["generate", "--bogus"], ["nope"]])
def test_usage_errors_are_one_line_with_exit_2(args):
    proc = subprocess.run([sys.executable, "-m", "moectl.cli", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("moectl: error:")


def test_generate_on_devices_prints_measured_and_modeled_apart(ckpt):
    res = run("generate", "--model", ckpt, "--prompt-ids", "1,2,3", "--max-tokens", 4, "--ignore-eos",
              "--devices", 4, "--expert-cache", 2, "--device-stats", "--json")
    assert res.exit_code == 0, res.output
    assert len(res.stdout.splitlines()) == 1  # stdout stays one JSON row per prompt
    lines = res.stderr.splitlines()
    assert "busy ms (measured)" in lines[0] and "link ms (modeled)" in lines[0]
    assert len(lines) == 1 + 4 + 2 and lines[-1].startswith("balancedness")
    assert lines[-2] == "experts: host tier, a 2-expert cache per device"
    # without --devices: the one default every command has (cli/common.py DEFAULT_DEVICES)
    res = run("generate", "--model", ckpt, "--prompt-ids", "1,2,3", "--max-tokens", 2, "--expert-cache", 2,
              "--device-stats", "--json")
    assert res.exit_code == 0, res.output
    assert len(res.stderr.splitlines()) == 1 + DEFAULT_DEVICES + 2
