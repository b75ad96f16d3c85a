"""The numerics watch and the mixed-precision path: the watch's figures are the tensors' own, a
checkpoint built to overflow fp16 overflows where the watch says, and keeping the residual
stream in fp32 repairs it (checked against the fp32 engine and, in verify, against transformers)."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.engine.core.config import EngineConfig
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.llm_engine import LLMEngine
from moectl.engine.models import numerics
from moectl.engine.models.numerics import ActivationWatch, _note_torch
from moectl.engine.tools.verify import run_verify
from tests.checkpoints import overflow_checkpoint, tiny_checkpoint

IDS = list(range(2, 40))


@pytest.fixture(scope="module")
def overflow(tmp_path_factory):
    return overflow_checkpoint(tmp_path_factory.mktemp("overflow"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("numerics_tiny"), "mixtral")


def _expected(x: torch.Tensor) -> list[float]:
    x64 = x.double()
    return [x64.abs().max().item(), x64.pow(2).sum(-1).max().item()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_a_note_is_the_tensors_largest_value_and_row_sum_of_squares(dtype, path):
    watch = ActivationWatch(2, [1.0, 1.0])
    if path == "torch":
        watch._note = _note_torch
    elif numerics.kernel_failure() is not None:
        pytest.skip(f"no kernel here: {numerics.kernel_failure()}")
    gen = torch.Generator().manual_seed(0)
    a = (torch.randn(7, 33, generator=gen) * 50).to(dtype)
    b = (torch.randn(3, 5, 33, generator=gen) * 80).to(dtype)  # rows along the last dimension
    big = (torch.randn(numerics.DEFER_ELEMENTS // 32 + 1, 33, generator=gen) * 30).to(dtype)  # noted at once
    watch.note(1, numerics.OUTPUT, a)  # small ones wait for the step's end (flush)
    watch.note(1, numerics.OUTPUT, b[:, 1:])  # a strided view
    watch.note(1, numerics.OUTPUT, big)
    watch.flush()
    got = watch.buffer[1, numerics.OUTPUT].tolist()
    want = [max(e) for e in zip(_expected(a), _expected(b[:, 1:]), _expected(big))]
    assert got[0] == pytest.approx(want[0], rel=1e-6) and got[1] == pytest.approx(want[1], rel=1e-5)
    assert got[2] == 0 and watch.buffer[0].abs().sum() == 0
    b[1, 2, 3] = float("nan")
    watch.note(0, numerics.QUERY, b)
    watch.flush()
    assert watch.buffer[0, numerics.QUERY, 2] == 1  # the NaN is seen, not dropped by max()


def test_the_record_bounds_attention_logits_and_carries_the_limits(tiny, monkeypatch):
    from moectl.engine.core.paged_attention import PagedContext

    seen = {}
    attend = PagedContext.attend

    def capture(self, layer, q, k, v, scale, **kw):
        seen.setdefault(layer, []).append((q.double(), k.double(), scale))
        return attend(self, layer, q, k, v, scale, **kw)

    monkeypatch.setattr(PagedContext, "attend", capture)
    engine = LLMEngine(EngineConfig(model=str(tiny), dtype="fp32"))
    records = []
    engine.add_listener(on_step=lambda stats: records.append(stats.as_record()))
    engine.generate([IDS], SamplingParams(max_tokens=3))
    rec = records[-1]["numerics"]
    assert rec["points"] == list(numerics.POINTS) and rec["bound"] == [False, False, True, False]
    assert rec["dtype"] == rec["residual_dtype"] == "float32" and rec["limits"] == [rec["limit"]] * 4
    assert rec["max"].shape == (3, 4) and (rec["max"] > 0).all() and not any(map(any, rec["nonfinite"]))
    for layer, calls in seen.items():
        keys = torch.cat([k.reshape(-1, k.shape[-1]) for _, k, _ in calls])  # every key cached so far
        q, _, scale = calls[-1]  # the last step's queries
        q = q.reshape(-1, q.shape[-1])
        bound = q.norm(dim=-1).max() * keys.norm(dim=-1).max() * scale
        assert rec["max"][layer, 2] == pytest.approx(bound.item(), rel=1e-5)
        assert (q @ keys.T).abs().max() * scale <= bound  # no logit beyond it


def test_the_overflow_checkpoint_overflows_in_fp16_where_the_watch_says_and_mixed_repairs_it(overflow):
    logits, records = {}, {}
    for name, kw in (("fp32", dict(dtype="fp32")), ("fp16", dict(dtype="fp16")),
                     ("mixed", dict(dtype="fp16", mixed_precision=True))):
        engine = LLMEngine(EngineConfig(model=str(overflow), **kw))
        logits[name] = engine.score(IDS)
        records[name] = engine.numerics_record()
    assert not torch.isfinite(logits["fp16"]).all()
    pure = records["fp16"]
    assert pure["nonfinite"][0][0] and pure["max"][0, 0] > pure["limits"][0]  # layer 0's residual stream
    assert not pure["nonfinite"][0][2]  # its attention is fine: the sum overflows, not an operator
    full = records["fp32"]
    assert full["max"][0, 0] > numerics.FP16_LIMIT > full["max"][0, 3]  # in fp32: past fp16's limit, finite
    mixed = records["mixed"]
    assert mixed["residual_dtype"] == "float32" and not any(map(any, mixed["nonfinite"]))
    assert mixed["max"][0, 0] < mixed["limits"][0]
    err = (logits["mixed"] - logits["fp32"]).abs().max() / logits["fp32"].abs().max()
    assert err < 5e-3


def test_mixed_precision_needs_a_half_dtype_and_changes_nothing_in_fp32(tiny):
    a = LLMEngine(EngineConfig(model=str(tiny), dtype="fp32")).score(IDS)
    b = LLMEngine(EngineConfig(model=str(tiny), dtype="fp32", mixed_precision=True)).score(IDS)
    assert torch.equal(a, b)
    result = CliRunner().invoke(app, ["generate", "x", "--model", str(tiny), "--mixed-precision"])
    assert result.exit_code == 2 and "--mixed-precision: needs --dtype fp16 or bf16" in result.stderr
    result = CliRunner().invoke(app, ["verify", "--model", str(tiny), "--mixed-precision"])
    assert result.exit_code == 2 and "--mixed-precision: needs --dtype bf16 or fp16" in result.stderr


def test_verify_names_the_overflowing_layer_and_operator_and_that_mixed_precision_repairs_it(overflow):
    pure = run_verify(overflow, dtype="float16", max_new_tokens=4)
    report = pure["precision"]["pure"]
    assert not pure["passed"] and not pure["checks"]["half_precision"]
    assert report["first_overflow"]["layer"] == 0 and report["first_overflow"]["operator"] == "residual"
    assert report["lossy_layers"] == [0, 1, 2] and not report["repaired"]
    mixed = run_verify(overflow, dtype="float16", max_new_tokens=4, mixed_precision=True)
    assert mixed["passed"] and mixed["precision"]["mixed"]["repaired"]
    assert mixed["precision"]["mixed"]["overflows"] == [] and mixed["precision"]["mixed"]["lossy_layers"] == []
    assert mixed["precision"]["pure"]["overflows"]  # the same report shows what it repaired


def test_verify_cli_prints_the_overflow_and_the_repair(overflow):
    result = CliRunner().invoke(app, ["verify", "--model", str(overflow), "--dtype", "fp16", "--max-new-tokens", "2"])
    assert result.exit_code == 1
    assert "precision (float16, pure): overflows at layer 0 residual (inf/NaN)" in result.stdout
    result = CliRunner().invoke(app, ["verify", "--model", str(overflow), "--dtype", "fp16", "--max-new-tokens", "2",
                                      "--mixed-precision"])
    assert result.exit_code == 0, result.output
    assert "precision (float16, residual stream in float32): no overflow" in result.stdout


def test_a_step_that_fails_on_the_overflow_names_where_it_began(overflow):
    from moectl.engine.core.outputs import StepFailed

    engine = LLMEngine(EngineConfig(model=str(overflow), dtype="fp16"))
    with pytest.raises(StepFailed, match="the numerics watch saw the first inf/NaN at layer 0, residual, in float16"):
        engine.generate([IDS], SamplingParams(max_tokens=2, temperature=0.8))
    # repaired: the same request samples
    engine = LLMEngine(EngineConfig(model=str(overflow), dtype="fp16", mixed_precision=True))
    assert len(engine.generate([IDS], SamplingParams(max_tokens=2, temperature=0.8))[0].token_ids) == 2


def test_mixed_precision_runs_with_tiered_experts_whose_prefetcher_reads_the_residual(tiny):
    """The router prefetcher normalises the (fp32) residual itself: it must hand the router the
    weights' dtype as the layer does."""
    from moectl.placement.topology import Topology

    engine = LLMEngine(EngineConfig(model=str(tiny), dtype="fp16", mixed_precision=True,
                                    topology=Topology(num_devices=2), expert_cache_slots=4))
    out = engine.generate([IDS], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3
