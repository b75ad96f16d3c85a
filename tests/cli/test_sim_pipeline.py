"""--pp on the command line: `moectl sim --pp`, `moectl plan memory --pp` (the seeds' 3T model per
stage), the simulated backend's records (each device's stage), and bad pipelines as one line,
exit 2."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from typer.testing import CliRunner

from moectl.cli.engine_options import EngineOptions
from moectl.cli.main import app
from moectl.engine.sim.cluster_config import SimClusterConfig
from moectl.engine.sim.cluster_engine import SimulatedEngine
from moectl.profiler.recorder import TraceRecorder
from moectl.profiler.trace_store import TraceReader
from tests.paths import DOCS

runner = CliRunner()
DSV3 = str(DOCS / "configs" / "deepseek-v3.json")
K3 = str(DOCS / "configs" / "k3-3t-1m.json")


def cli(*args):
    return runner.invoke(app, [*map(str, args)])


def test_sim_prices_a_pipeline_and_says_so():
    out = cli("sim", "--model", DSV3, "--hardware", "h800", "--devices", 64, "--pp", 4, "--batch-seqs", 64,
              "--context", 2048)
    assert out.exit_code == 0, out.output
    text = out.stdout
    assert text.startswith("SIMULATED:") and ", pp 4," in text.splitlines()[0]
    assert "pipeline: 4 stages of 16 devices, layers 0-16 | 17-31 | 32-46 | 47-60 (balanced), 4 micro-batches" in text
    assert "bubble" in text and "(inter-node)" in text and "per device, by stage: 0 (layers 0-16)" in text
    data = json.loads(cli("sim", "--model", DSV3, "--hardware", "h800", "--devices", 64, "--pp", 4,
                          "--micro-batches", 8, "--pp-layers", "15,15,15,16", "--batch-seqs", 64, "--json").stdout)
    pp = data["pp"]
    assert pp["layers_per_stage"] == [15, 15, 15, 16] and pp["layer_split"] == "given (--pp-layers)"
    assert pp["micro_batches"] == 8 and data["stage"][::16] == [0, 1, 2, 3] and data["ep"] == 16
    assert len(data["memory"]["stages"]) == 4 and "pipeline_bubble" in data["breakdown_ms"]


def test_plan_memory_per_stage_for_the_3t_model():
    out = cli("plan", "memory", "--model", K3, "--devices", 64, "--hbm", "141GiB", "--context", 131072, "--batch",
              64, "--pp", 4)
    assert out.exit_code == 0, out.output
    header = next(line for line in out.stdout.splitlines() if line.startswith("category"))
    assert header.split()[1:] == ["stage", "0:", "devices", "0-15", "stage", "1:", "devices", "16-31", "stage", "2:",
                                  "devices", "32-47", "stage", "3:", "devices", "48-63"]
    assert "pipeline PP 4 x (16 devices a stage" in out.stdout and "pp_in_flight" in out.stdout
    data = json.loads(cli("plan", "memory", "--model", K3, "--devices", 64, "--hbm", "141GiB", "--context", 131072,
                          "--batch", 64, "--pp", 4, "--json").stdout)
    assert data["pipeline"]["stage_layers"] == [[0, 20], [21, 40], [41, 60], [61, 79]]
    groups = data["device_groups"]
    assert [g["bytes"]["embeddings"] > 0 for g in groups] == [True, False, False, True]
    assert [g["bytes"]["dense_mlp"] > 0 for g in groups] == [True, False, False, False]


SIM = ("sim", "--model", DSV3, "--hardware", "h800", "--devices", 64)
PLAN = ("plan", "memory", "--model", K3, "--devices", 64, "--context", 4096)


@pytest.mark.parametrize("args, needle", [
    ((*SIM, "--pp", 0), "--pp: must be a positive integer"),
    (("sim", "--model", DSV3, "--hardware", "h800", "--devices", 128, "--pp", 64), "exceed the model's 61 layers"),
    ((*SIM, "--pp", 3), "--pp: 3 must divide the 64 devices"),
    ((*SIM, "--pp", 2, "--overlap", "five-stage"), "--overlap five-stage: not with --pp > 1"),
    ((*SIM, "--micro-batches", 4), "--micro-batches: goes with --pp > 1"),
    ((*SIM, "--pp", 2, "--micro-batches", 500), "--micro-batches: 500 exceeds the 128 sequences"),
    ((*SIM, "--pp", 2, "--pp-layers", "30,30"), "--pp-layers: needs 2 counts"),
    ((*SIM, "--pp", 4, "--ep", 32), "--ep: 32 must divide the 16 devices of a pipeline stage"),
    ((*PLAN, "--pp", 0), "--pp: must be an integer"),
    ((*PLAN, "--pp", 3), "--pp: 3 does not divide --devices 64"),
    ((*PLAN, "--pp", 4, "--offload"), "--offload: the experts' tiers are not planned per pipeline stage"),
    ((*PLAN, "--micro-batches", 2), "--micro-batches: goes with --pp > 1"),
])
def test_bad_pipelines_are_one_line_and_exit_2(args, needle):
    out = cli(*args)
    assert out.exit_code == 2, out.output
    lines = out.output.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], out.output


@dataclass(frozen=True)
class PipelineOptions(EngineOptions):
    """EngineOptions with the `pp` field cli/engine_options.py is to gain (docs/sim.md)."""
    pp: int = 1


def test_the_simulated_backend_takes_pp_from_the_engine_options():
    from moectl.cli.common import BadInput
    from moectl.cli.sim_backend import SimEngines

    engines = SimEngines(PipelineOptions(model=DSV3, backend="simulated", devices=32, pp=4))
    assert engines.first.config.pp == 4
    with pytest.raises(BadInput, match="--pp: 3 must divide the 32 devices"):
        SimEngines(PipelineOptions(model=DSV3, backend="simulated", devices=32, pp=3))


@pytest.fixture(scope="module")
def pipelined():
    engine = SimulatedEngine(SimClusterConfig(model=DSV3, devices=32, pp=4, routing="zipf:1.0"))
    flat = SimulatedEngine(SimClusterConfig(model=DSV3, devices=32, routing="zipf:1.0"))
    for e in (engine, flat):
        for i in range(48):
            e.add_lengths(512 + 16 * i, 24)
    return engine, flat


def test_the_simulated_backend_records_each_devices_stage(pipelined, tmp_path):
    engine, flat = pipelined
    path = tmp_path / "pp.trace"
    recorder = TraceRecorder(engine, path)
    for _ in range(12):
        engine.step()
    recorder.close()
    with TraceReader(path) as reader:
        header = reader.header
        steps = list(reader.steps())
    assert header["simulated"]["pp"] == 4 and header["simulated"]["stage_layers"][0][0] == 0
    assert header["devices"]["pp"]["devices_per_stage"] == 8 and header["devices"]["topology"]["num_devices"] == 8
    devices = steps[-1]["devices"]
    assert devices["pp"] == 4 and list(devices["stage"]) == [d // 8 for d in range(32)]
    pipeline = devices["pipeline"]
    assert pipeline["micro_batches"] == 4 and pipeline["modeled"] and len(pipeline["transfer_s"]) == 3
    assert 0 < pipeline["bubble"] < 1 and len(devices["busy_s"]) == 32 and len(devices["memory"]) == 32
    # each stage's devices hold their own layers: the embedding's and the first dense layers' stage
    # holds more than a middle one; the KV pool is the tightest stage's
    weights = [m["dense_weights"] for m in devices["memory"]]
    assert weights[0] > weights[8] and weights[8] == weights[16]
    assert engine.blocks_per_group > flat.blocks_per_group  # a quarter of the layers' KV a device
    spans = steps[-1]["spans"]
    assert list(spans["names"]) == ["pp_stage", "pp_send", "step_overhead"]
    assert spans["modeled"].all() and (spans["name"] == 1).sum() == 4 * 3  # 4 micro-batches x 3 sends
    assert all(s["simulated"] for s in steps)
    # without a pipeline the records say so too
    flat.step()
    flat_devices = flat.step_log[-1].record["devices"]
    assert flat_devices["pp"] == 1 and set(flat_devices["stage"]) == {0} and "pipeline" not in flat_devices


def test_a_rebalance_on_a_pipelined_cluster(pipelined):
    engine, _ = pipelined
    for _ in range(6):
        engine.step()
    plan = engine.experts.preview()
    assert plan.placement.num_devices == 8  # one stage's EP group, every stage running its own layers' rows
    engine.experts.apply(plan.placement)  # runs at the next step
    engine.step()
    assert engine.step_log[-1].record["devices"]["step_time"]["migration_stall_s"] > 0
