"""Step records from the real engine: spans, request events, deep capture, and recording them to
a trace file that reads back the same."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.engine.core.config import EngineConfig
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.llm_engine import LLMEngine
from moectl.placement.topology import Topology
from moectl.profiler.recorder import TraceRecorder, engine_header, with_memory_plan
from moectl.profiler.trace_format import FORMAT_VERSION
from moectl.profiler.trace_store import TraceReader
from moectl.wire.link_spans import with_link_spans
from tests.checkpoints import prompts, tiny_checkpoint
from tests.paths import TRACES

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("recording"))


def engine(ckpt, devices=4, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=128,
                                  topology=Topology(num_devices=devices) if devices else None, **kw))


def test_spans_cover_every_layer_and_device_and_flag_modeled_links(ckpt):
    eng = engine(ckpt)
    eng.generate(prompts(4), GREEDY)
    cfg = eng.model_config
    for stats in eng.step_log:
        spans = with_link_spans(stats.as_record())["spans"]  # the modeled link spans: derived by readers
        names = np.array(spans["names"])[spans["name"]]
        lanes = np.array(spans["lanes"])[spans["lane"]]
        for layer in range(cfg.num_layers):
            on_layer = names[(spans["layer"] == layer) & (lanes == "engine")]
            assert {"attention", "router", "experts", "dispatch", "combine"} <= set(on_layer)
        assert list(names).count("sampler") == 1
        # a device's expert spans are its measured busy time
        for d, busy in enumerate(stats.devices["busy_s"]):
            mine = (lanes == f"device {d}")
            assert spans["dur_s"][mine].sum() == pytest.approx(busy, rel=1e-9, abs=1e-12)
        link = np.char.startswith(lanes.astype(str), "link ")
        assert link.any() and (spans["modeled"] == link).all()  # modeled exactly where a link is
        assert (spans["dur_s"] >= 0).all() and (spans["start_s"] >= 0).all()
        assert (spans["start_s"] + spans["dur_s"] <= stats.t_end - stats.t_start + 1e-6).all()


def test_spans_can_be_turned_off(ckpt):
    eng = engine(ckpt, devices=0, profile_spans=False)
    eng.generate(prompts(2), GREEDY)
    assert all(s.spans is None for s in eng.step_log)


def test_request_events_tell_each_requests_story(ckpt):
    eng = engine(ckpt)
    outs = eng.generate(prompts(3), GREEDY)
    events = [e for s in eng.step_log for e in s.requests]
    for out in outs:
        story = [e["event"] for e in events if e["id"] == out.request_id]
        assert story[0] == "arrived" and story.count("first_token") == 1 and story[-1] == "finished"
        finished = next(e for e in events if e["id"] == out.request_id and e["event"] == "finished")
        assert finished["output_tokens"] == 6 and finished["ttft_s"] == out.metrics["ttft"]


def test_deep_capture_adds_kernel_events_on_the_same_clock(ckpt):
    eng = engine(ckpt, devices=2)
    eng.capture(1)
    eng.generate(prompts(2), GREEDY)
    captured = [s for s in eng.step_log if s.kernels is not None]
    assert len(captured) == 1
    kernels = captured[0].kernels
    names = set(np.array(kernels["names"])[kernels["name"]])
    assert any(n.startswith("aten::") for n in names)
    wall = captured[0].t_end - captured[0].t_start
    inside = (kernels["start_s"] >= -0.05) & (kernels["start_s"] <= wall + 0.05)
    assert inside.mean() > 0.9  # aligned with the step, not offset by the profiler's own clock
    assert any(a["kind"] == "capture" for a in eng.actions)
    with pytest.raises(ValueError, match="capture: steps"):
        eng.capture(0)


def test_a_recorded_trace_reads_back_the_engines_records(ckpt, tmp_path):
    eng = engine(ckpt, redundant_slots=1)
    path = tmp_path / "run.trace"
    with TraceRecorder(eng, path):
        eng.generate(prompts(4), GREEDY)
        plan = eng.experts.preview()
        eng.experts.apply(plan.placement, kind="rebalance_apply")
        eng.generate(prompts(2, seed=1), GREEDY)
    with TraceReader(path) as reader:
        assert reader.num_steps == len(eng.step_log) and reader.dropped == 0
        header = reader.header
        assert header["devices"]["topology"]["num_devices"] == 4 and header["devices"]["link_time"] == "modeled"
        for stats, record in zip(eng.step_log, reader.steps()):
            assert record["step"] == stats.step
            assert (record["routing"] == stats.routing.numpy()).all()
            assert record["devices"]["memory"] == stats.devices["memory"]
            # the reader derives the modeled link spans from the recorded traffic, as any reader does
            derived = with_link_spans(stats.as_record())["spans"]
            assert "links" not in record["spans"] and record["spans"]["names"] == derived["names"]
            for key in ("lane", "name", "layer", "start_s", "dur_s", "modeled"):
                assert list(record["spans"][key]) == list(derived[key])
        kinds = [a["kind"] for a in reader.actions()]
        assert kinds[0] == "record_start" and kinds[-1] == "record_stop"
        assert "rebalance_preview" in kinds and "rebalance_apply" in kinds
        applied = next(a for a in reader.actions() if a["kind"] == "rebalance_apply")
        assert applied["result"]["placement"] == plan.placement.to_dict()


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_record_and_trace_info_from_the_command_line(ckpt, tmp_path):
    path = tmp_path / "cli.trace"
    res = run("record", path, "--model", ckpt, "--steps", 15, "--devices", 2, "--workload",
              "rate=50,prompt=4-12,output=4-8,duration=30,source=random", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.splitlines()[-1])["steps"] == 15
    res = run("trace", "info", path, "--json")
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["steps"] == 15 and info["format_version"] == FORMAT_VERSION == 3 and info["duration_s"] > 0 and info["complete"]
    res = run("record", path, "--model", ckpt, "--steps", 3)
    assert res.exit_code == 2 and "exists" in res.stderr


@pytest.mark.parametrize("content", [b"", b"not a trace at all" * 100, b"SQLite format 3\x00" + b"\x00" * 200])
def test_unreadable_traces_are_one_line_errors(tmp_path, content):
    path = tmp_path / "bad.trace"
    path.write_bytes(content)
    res = run("trace", "info", path)
    assert res.exit_code == 2
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.output


def test_a_missing_trace_and_a_bad_record_request_exit_2(tmp_path):
    assert run("trace", "info", tmp_path / "nope.trace").exit_code == 2
    res = run("record", tmp_path / "x.trace")
    assert res.exit_code == 2 and "--steps" in res.stderr


def test_plan_rebalance_from_a_trace_uses_its_routing_and_placement(ckpt, tmp_path):
    """The recorded routing under the recorded placement gives 'before' exactly; the plan's
    'after' is the counterfactual balancedness of the same routing."""
    eng = engine(ckpt)
    path = tmp_path / "plan.trace"
    with TraceRecorder(eng, path):
        eng.generate(prompts(6), GREEDY)
    res = run("plan", "rebalance", path, "--redundant", 1, "--json")
    assert res.exit_code == 0, res.output
    result = json.loads(res.stdout)
    loads = sum(s.routing for s in eng.step_log).numpy()
    assert result["devices"] == 4 and result["expert_bytes"] == eng.experts.cluster.expert_bytes
    assert result["balancedness_before"] == pytest.approx(eng.experts.placement.balancedness(loads)[1])
    assert result["balancedness_after"] >= result["balancedness_before"]


def test_trace_export_and_diff_from_the_command_line(ckpt, tmp_path):
    a, b = tmp_path / "a.trace", tmp_path / "b.trace"
    for path, steps in ((a, 12), (b, 16)):
        res = run("record", path, "--model", ckpt, "--steps", steps, "--devices", 2, "--workload",
                  "rate=50,prompt=4-12,output=4-8,duration=30,source=random")
        assert res.exit_code == 0, res.output
    out = tmp_path / "a.json"
    res = run("trace", "export", a, "--format", "chrome", "-o", out, "--from-step", 3, "--to-step", 9)
    assert res.exit_code == 0, res.output
    events = json.loads(out.read_text())["traceEvents"]
    steps = {e["args"]["step"] for e in events if e.get("ph") == "X"}
    assert steps == set(range(3, 9))
    assert any(e.get("cat") == "modeled" and e["args"]["modeled"] for e in events)
    res = run("trace", "diff", a, b, "--json")
    assert res.exit_code == 0, res.output
    diff = json.loads(res.stdout)
    assert diff["a"]["steps"] == 12 and diff["b"]["steps"] == 16 and diff["a"]["tokens_per_s"] > 0
    assert run("trace", "export", a, "--format", "pprof", "-o", out).exit_code == 2


def test_trace_report_analyses_a_sample_trace_and_its_counterfactual(tmp_path):

    trace = TRACES / "steady_rebalance.trace"
    res = run("trace", "report", trace, "--to-step", 300, "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["steps"] == [1, 299] and report["balancedness"]["overall"] < 0.8
    imbalance = next(a for a in report["alerts"] if a["kind"] == "imbalance")
    assert "predicted to raise balancedness" in imbalance["message"]
    assert imbalance["predicted"]["balancedness_after"] > 0.95
    with TraceReader(trace) as reader:
        applied = next(a for a in reader.actions() if a["kind"] == "rebalance_apply")
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps(applied["result"]["placement"], default=int))
    res = run("trace", "report", trace, "--to-step", 300, "--placement", placement, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["counterfactual"]["overall"] > 0.9
    res = run("trace", "report", trace, "--placement", tmp_path / "missing.json")
    assert res.exit_code == 2


def test_trace_report_sums_the_caches_of_a_range():

    traces = TRACES
    kv = json.loads(run("trace", "report", traces / "kv_pressure.trace", "--json").stdout)["caches"]
    with TraceReader(traces / "kv_pressure.trace") as reader:
        records = list(reader.steps())
    assert kv["preemptions"] == sum(len(r["batch"]["preempted"]) for r in records) > 0
    assert kv["prefix_hit_tokens"] == records[-1]["cache"]["prefix_hits"] > 0
    assert kv["expert_cache_hit_rate"] is None
    offload = json.loads(run("trace", "report", traces / "offload_prefetch.trace", "--json").stdout)["caches"]
    assert 0.5 < offload["expert_cache_hit_rate"] < 1 and offload["expert_prefetches"] > 0


def test_a_header_without_a_memory_plan_gets_one_planned_from_its_model(ckpt):
    header = engine_header(engine(ckpt, max_model_len=256))
    assert "table" in header["memory_plan"]
    old = {k: v for k, v in header.items() if k != "memory_plan"}  # as traces before the plan was recorded
    filled = with_memory_plan(old)
    assert filled["memory_plan"] == header["memory_plan"] and "memory_plan" not in old
    assert with_memory_plan(header) is header  # one it carries is kept as it is
    moved = {**old, "model": {**old["model"], "path": "/nonexistent/model"}}
    assert "config.json" in with_memory_plan(moved)["memory_plan"]["absent"]
