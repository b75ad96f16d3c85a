"""`moectl sim calibrate --from-trace`: a card's kernel tables from a PyTorch-profiler trace of a
few layers (profiler/trace_calibration.py). On DeepSeek's published H800 training profile (a
fixture: tests/profiler/data/README.md) the tables price each kernel class of one forward layer
back within 10%, name the kernels that exist only in training, and are the tables h800.json
ships; on a trace built here every figure can be worked by hand; bad input is one line, exit 2."""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.engine.sim.hardware import load_profile, parse_profile
from moectl.engine.sim.model_shape import load_sim_model
from moectl.profiler.trace_calibration import CalibrationError, TraceShape, calibrate_from_trace, reproduce
from tests.paths import DOCS

TRAIN = Path(__file__).parent / "data" / "deepseek_v3_train_ep64_kernels.json.gz"
DSV3 = load_sim_model(DOCS / "configs" / "deepseek-v3.json")
runner = CliRunner()
TRAIN_SHAPE = TraceShape(tokens=4096, context=4096, ep=64, training=True, comm_sms=20)


def h800_base() -> dict:
    """h800.json as the calibration's base: its datasheet figures and all-to-all tables, none of
    the tables a trace fits."""
    raw = json.loads(resources.files("moectl.engine.sim").joinpath("profiles", "h800.json").read_text())
    raw["kernels"] = {k: v for k, v in raw["kernels"].items() if k in ("comm", "overlap")}
    return raw


def test_deepseeks_profile_gives_tables_that_price_each_class_of_a_layer_back_within_10pct():
    profile, fitted = calibrate_from_trace(TRAIN, DSV3, h800_base(), TRAIN_SHAPE)
    assert fitted["layers"] == 4 and fitted["unclassed_us"] == 0  # "Each chunk contains 4 MoE layers"
    priced = reproduce(parse_profile("h800", profile), DSV3, TRAIN_SHAPE)
    for name in ("attention_core", "dense_gemm", "grouped_gemm", "norm", "cast", "rope", "topk", "permute",
                 "activation", "elementwise"):
        assert priced[name] == pytest.approx(fitted["per_layer_us"][name], rel=0.10), name
    # the small ops as the step model prices a layer (before the dispatch on the device's tokens,
    # around the experts on the rows it receives), against the trace's
    small = sum(fitted["per_layer_us"][k] for k in ("norm", "cast", "rope", "topk", "permute", "activation",
                                                    "elementwise"))
    assert priced["small_ops"] == pytest.approx(small, rel=0.10)
    # floors from kernels that ran: the fixture's zero-length memsets set none
    floors = [c["floor_us"] for c in profile["kernels"]["small_ops"]["classes"].values()]
    assert min(floors) > 0 and profile["kernels"]["kernel_floor_us"]["value"] > 0
    # the forward layer of 4K tokens: about 8.6 ms of compute, what DeepSeek's 16K-token prefill
    # (62,713 tok/s per node: 2.09 s a step of 61 layers) spends per 4K tokens
    layer_us = sum(v for k, v in fitted["per_layer_us"].items() if k != "all_to_all")
    assert 7000 < layer_us < 10000
    # the weight gradients and FlashAttention's backward exist only in training
    only = " ".join(fitted["training_only_us"])
    assert "dptp128c_acc" in only and "FlashAttnBwd" in only
    assert sum(fitted["training_only_us"].values()) > 0.25 * layer_us


def test_the_shipped_h800_tables_are_the_ones_the_profile_gives():
    profile, _ = calibrate_from_trace(TRAIN, DSV3, h800_base(), TRAIN_SHAPE)
    shipped = json.loads(resources.files("moectl.engine.sim").joinpath("profiles", "h800.json").read_text())
    assert profile["kernels"] == shipped["kernels"]


def _event(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur}


def test_a_trace_of_known_kernels_gives_figures_worked_by_hand(tmp_path):
    """Two layer passes of 1,024 tokens: every class's time chosen, every table figure computed."""
    per_pass = [("flash_fwd_kernel", 400), ("nvjet_gemm_qkv", 300), ("nvjet_gemm_o", 100),
                ("m_grouped_gemm_masked", 900), ("rms_norm_kernel", 20), ("rms_norm_kernel", 30),
                ("silu_and_mul_kernel", 50), ("moe_align_block_size", 10), ("topk_softmax", 5)]
    events, t = [], 0.0
    for _ in range(2):
        for name, dur in per_pass:
            events.append(_event(name, t, dur))
            t += dur + 1
    trace = tmp_path / "card.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    base = h800_base()
    shape = TraceShape(tokens=1024, context=1024, ep=8)
    profile, fitted = calibrate_from_trace(trace, DSV3, base, shape)
    assert fitted["layers"] == 2 and fitted["per_layer_us"]["dense_gemm"] == pytest.approx(400)
    k = profile["kernels"]
    peak = 1979e12
    grouped = 2 * 1024 * 8 * DSV3.expert_macs() / (900e-6 * peak)
    rows = 1024 * 8 * 8 / 256  # tokens x top-8 x EP8 over 256 experts
    assert dict(map(tuple, k["grouped_gemm"]["points"]))[4096] == pytest.approx(
        min(1.0, 0.61 * grouped / _at(base, rows)), abs=1e-4)
    core_macs, _ = DSV3.attention_core(1, 1, False)
    assert k["attention_prefill"]["compute"] == pytest.approx(2 * 1024 * 512 * core_macs / (400e-6 * 989e12), abs=1e-4)
    norm = k["small_ops"]["classes"]["norm"]  # two kernels a pass, 20 and 30 us: the card's floor is 5
    floor = k["kernel_floor_us"]["value"]
    assert norm["kernels"] == 2 and norm["floor_us"] == pytest.approx(min(20, floor))
    assert norm["us_per_token"] == pytest.approx((50 - 2 * norm["floor_us"]) / 1024, abs=1e-6)
    assert set(k["small_ops"]["classes"]) == {"norm", "activation", "permute", "topk"}


def _at(base: dict, rows: float) -> float:
    import numpy as np

    points = base["efficiency"]["grouped_gemm"]["points"]
    return float(np.interp(np.log2(rows), np.log2([x for x, _ in points]), [y for _, y in points]))


def test_what_cannot_be_calibrated_is_refused(tmp_path):
    zero = tmp_path / "zero.json"
    zero.write_text(json.dumps({"traceEvents": [_event("flash_fwd_kernel", 0, 5), _event("nvjet_gemm", 6, 0),
                                                _event("m_grouped_gemm_masked", 7, 9)]}))
    with pytest.raises(CalibrationError, match="dense gemm kernels take no time"):
        calibrate_from_trace(zero, DSV3, h800_base(), TraceShape(tokens=16, context=16, ep=8))
    no_comm = h800_base()
    no_comm["kernels"] = {"comm": None}
    with pytest.raises(CalibrationError, match="gives no kernels.comm.device_sms"):
        calibrate_from_trace(TRAIN, DSV3, no_comm, TraceShape(tokens=4096, context=4096, ep=64, training=True,
                                                              comm_sms=20))
    with pytest.raises(CalibrationError, match="pass --training"):
        calibrate_from_trace(TRAIN, DSV3, h800_base(), TraceShape(tokens=4096, context=4096, ep=64))
    with pytest.raises(CalibrationError, match="above 1"):  # the trace's tokens misread 8x
        calibrate_from_trace(TRAIN, DSV3, h800_base(), TraceShape(tokens=32768, context=4096, ep=64, training=True))
    only_norms = tmp_path / "norms.json"
    only_norms.write_text(json.dumps({"traceEvents": [_event("rms_norm_kernel", 0, 5)]}))
    with pytest.raises(CalibrationError, match="--layers"):
        calibrate_from_trace(only_norms, DSV3, h800_base(), TraceShape(tokens=16, context=16, ep=8))
    with pytest.raises(CalibrationError, match="no attention core kernels"):
        calibrate_from_trace(only_norms, DSV3, h800_base(), TraceShape(tokens=16, context=16, ep=8, layers=1))


def _cli(args):
    return runner.invoke(app, ["sim", "calibrate", *args])


def test_the_command_writes_a_profile_that_moectl_sim_runs_on(tmp_path):
    out = tmp_path / "card.json"
    base = tmp_path / "base.json"
    base.write_text(json.dumps(h800_base()))
    res = _cli(["--from-trace", str(TRAIN), "--model", str(DOCS / "configs" / "deepseek-v3.json"), "--base", str(base),
                "--tokens", "4096", "--ep", "64", "--training", "--comm-sms", "20", "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert got["layers"] == 4 and got["priced_us"]["grouped_gemm"] == pytest.approx(
        got["per_layer_us"]["grouped_gemm"], rel=0.1)
    assert load_profile(out).kernels is not None
    sim = runner.invoke(app, ["sim", "--model", str(DOCS / "configs" / "deepseek-v3.json"), "--hardware", str(out),
                              "--devices", "32", "--phase", "prefill", "--overlap", "two-batch"])
    assert sim.exit_code == 0, sim.output
    assert "priced from the profile's kernel tables" in sim.stdout


@pytest.mark.parametrize("args, message", [
    (["--tokens", "4096", "--ep", "64"], "pass --training"),
    (["--tokens", "4096", "--ep", "64", "--training", "--comm-sms", "500"], "is not fewer than the card's"),
    (["--tokens", "0", "--ep", "64", "--training"], "--tokens: must be a positive integer"),
    (["--tokens", "4096", "--ep", "7", "--training"], "--ep: 7 does not divide"),
    (["--ep", "64", "--training"], "--tokens: required with --from-trace"),
    (["--tokens", "4096", "--ep", "16", "--context", "999999", "--training"], "--context: must be in"),
])
def test_bad_calibration_input_is_one_line_and_exit_2(tmp_path, args, message):
    res = _cli(["--from-trace", str(TRAIN), "--model", str(DOCS / "configs" / "deepseek-v3.json"), "--base", "h800",
                "--out", str(tmp_path / "x.json"), *args])
    assert res.exit_code == 2, res.output
    assert message in res.stderr and res.stderr.count("\n") == 1
    assert not (tmp_path / "x.json").exists()  # nothing written that does not read back


def test_the_trace_read_is_never_the_profile_written(tmp_path):
    trace = tmp_path / "card.json.gz"
    trace.write_bytes(TRAIN.read_bytes())
    res = _cli(["--from-trace", str(trace), "--model", str(DOCS / "configs" / "deepseek-v3.json"), "--base", "h800",
                "--tokens", "4096", "--ep", "64", "--training", "--out", str(trace), "--overwrite"])
    assert res.exit_code == 2 and "is the input" in res.stderr and trace.read_bytes() == TRAIN.read_bytes()


def test_a_corrupt_trace_is_one_line(tmp_path):
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(gzip.compress(b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "a", "ts": "x"'))
    res = _cli(["--from-trace", str(bad), "--model", str(DOCS / "configs" / "deepseek-v3.json"), "--base", "h800",
                "--tokens", "16", "--ep", "8", "--out", str(tmp_path / "x.json")])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert not (tmp_path / "x.json").exists()
