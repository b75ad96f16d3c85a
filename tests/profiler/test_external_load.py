"""`moectl trace import`: SGLang's expert distribution dumps and vLLM's saved EplbState, built here
the way their source writes them (docs/external_load.md names the commits), become traces whose
routing is exactly the engine's counts mapped to logical experts, with nothing else invented."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.profiler.external_load import ABSENT, read_source
from moectl.profiler.trace_store import TraceReader

runner = CliRunner()
L, E, D, LOCAL = 3, 8, 4, 3  # 12 physical experts: 4 redundant, 3 per EP rank
P2L = np.array([list(range(E)) + [0, 1, 2, 3], list(range(E)) + [7, 6, 5, 4], list(range(E)) + [0, 0, 1, 1]])


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def to_logical(physical: np.ndarray) -> np.ndarray:
    """[L, P] physical counts -> [L, E], one slot at a time (independent of the importer's scatter)."""
    out = np.zeros((L, E), np.int64)
    for layer in range(L):
        for p in range(P2L.shape[1]):
            out[layer, P2L[layer, p]] += physical[layer, p]
    return out


def sglang_per_pass(tmp_path, passes: int = 5, ranks: int = 2, seed: int = 0):
    """_DetailAccumulator.dump: {"records": [{forward_pass_id, rank, gatherer_key, global_physical_count}],
    "last_physical_to_logical_map"} per rank, as torch.save writes it."""
    rng = np.random.default_rng(seed)
    files, per_pass = [], np.zeros((passes, L, P2L.shape[1]), np.int64)
    for rank in range(ranks):
        records = []
        for fid in range(passes):
            count = rng.integers(0, 50, size=P2L.shape)
            per_pass[fid] += count
            records.append({"forward_pass_id": fid, "rank": rank, "gatherer_key": "primary",
                            "global_physical_count": torch.tensor(count, dtype=torch.int32)})
        path = tmp_path / f"expert_distribution_recorder_1733000000.0_{rank}.pt"
        torch.save({"records": records, "last_physical_to_logical_map": torch.tensor(P2L)}, path)
        files.append(path)
    return files, np.stack([to_logical(c) for c in per_pass])


def import_trace(tmp_path, files, *options, name="imported.trace"):
    out = tmp_path / name
    res = run("trace", "import", *files, "-o", out, *options)
    assert res.exit_code == 0, res.output
    return out


def test_sglang_per_pass_dumps_become_a_trace_of_the_measured_load(tmp_path):
    files, expected = sglang_per_pass(tmp_path)
    out = import_trace(tmp_path, files, "--ep-size", D, "--engine-version", "0.5.4")
    with TraceReader(out) as reader:
        header, records = reader.header, list(reader.steps())
    imported = header["imported"]
    assert (imported["engine"], imported["mode"], imported["engine_version"]) == ("sglang", "per_pass", "0.5.4")
    assert [f["name"] for f in imported["files"]] == [f.name for f in files]
    assert set(ABSENT) <= set(imported["absent"]) and "step_times" in imported["absent"]
    assert imported["forward_pass_ids"] == list(range(len(expected)))
    assert len(records) == len(expected)
    for record, counts in zip(records, expected):
        np.testing.assert_array_equal(record["routing"], counts)  # both ranks' counts added, then logical
        assert record["t_start"] == record["t_end"] == 0.0  # the source has no time: none is made up
        assert record["devices"] is None and record["spans"] is None and record["requests"] == []
    placement = header["devices"]["placement"]
    assert header["devices"]["topology"] == {"num_devices": D}
    assert np.array_equal(np.array(placement["layers"]).reshape(L, -1), P2L)  # rank r holds slots r*3..r*3+2
    assert (header["model"]["num_layers"], header["model"]["num_experts"]) == (L, E)


def test_sglang_per_token_topk_ids_are_counted_per_physical_expert(tmp_path):
    rng = np.random.default_rng(1)
    ids = rng.integers(0, P2L.shape[1], size=(L, 20, 8))
    ids[:, 15:, :] = -1  # _DetailSinglePassGatherer.reset fills with -1: slots no token used
    path = tmp_path / "expert_distribution_recorder_1.0_0.pt"
    torch.save({"records": [{"forward_pass_id": 7, "rank": 0, "gatherer_key": "primary", "input_ids": list(range(15)),
                             "positions": list(range(15)), "extend_seq_lens": [15], "forward_mode": 1,
                             "topk_ids_of_layer": torch.tensor(ids, dtype=torch.int32), "misc_objects": []}],
                "last_physical_to_logical_map": torch.tensor(P2L)}, path)
    physical = np.zeros(P2L.shape, np.int64)
    for layer in range(L):
        for p in ids[layer].ravel():
            if p >= 0:
                physical[layer, p] += 1
    with TraceReader(import_trace(tmp_path, [path])) as reader:
        (record,) = list(reader.steps())
        assert reader.header["imported"]["mode"] == "per_token"
        assert reader.header["devices"] is None  # no --ep-size: the placement is absent, not guessed
    np.testing.assert_array_equal(record["routing"], to_logical(physical))


def test_sglang_stat_dump_keeps_its_filled_rows_and_has_no_placement(tmp_path):
    rng = np.random.default_rng(2)
    logical = rng.integers(0, 100, size=(6, L, E))
    logical[[1, 4]] = 0  # ring-buffer slots never written
    path = tmp_path / "expert_distribution_recorder_1.0.pt"
    torch.save({"rank": 0, "logical_count": torch.tensor(logical, dtype=torch.int32),
                "average_utilization_rate_over_window": None}, path)
    with TraceReader(import_trace(tmp_path, [path])) as reader:
        routing = np.stack([r["routing"] for r in reader.steps()])
        header = reader.header
    np.testing.assert_array_equal(routing, logical[[0, 2, 3, 5]])
    assert header["devices"] is None and header["imported"]["mode"] == "stat"
    assert any("ring" in note for note in header["imported"]["notes"])


def vllm_state(tmp_path, rank: int, window: np.ndarray, step: int, name=None):
    """EplbModelState's fields saved from one rank (vLLM writes no file; docs/external_load.md)."""
    path = tmp_path / (name or f"eplb_rank{rank}.pt")
    torch.save({"physical_to_logical_map": torch.tensor(P2L), "expert_load_window": torch.tensor(window, dtype=torch.int32),
                "expert_load_window_step": step, "ep_size": D, "rank": rank, "vllm_version": "0.11.1"}, path)
    return path


def test_vllm_windows_are_summed_over_ranks_oldest_row_first(tmp_path):
    rng = np.random.default_rng(3)
    windows = [rng.integers(1, 40, size=(5, L, P2L.shape[1])) for _ in range(2)]
    files = [vllm_state(tmp_path, r, w, step=2) for r, w in enumerate(windows)]
    with TraceReader(import_trace(tmp_path, files)) as reader:
        routing = np.stack([r["routing"] for r in reader.steps()])
        header = reader.header
    # the ring's next write is row 2: rows 2, 3, 4 are older than 0, 1
    expected = [to_logical(windows[0][i] + windows[1][i]) for i in (2, 3, 4, 0, 1)]
    np.testing.assert_array_equal(routing, np.stack(expected))
    assert header["imported"]["engine_version"] == "0.11.1" and header["imported"]["layer_indexing"] == "moe"
    assert header["devices"]["topology"]["num_devices"] == D  # from the saved ep_size
    assert header["model"]["sparse_layers"] == [True] * L


def test_a_vllm_state_saved_as_json_is_not_taken_for_a_profiler_trace(tmp_path):
    """A saved EplbState may be .json, as PyTorch-profiler traces are: the contents decide."""
    window = np.random.default_rng(4).integers(1, 40, size=(5, L, P2L.shape[1]))
    path = tmp_path / "eplb_rank0.json"
    path.write_text(json.dumps({"physical_to_logical_map": P2L.tolist(), "expert_load_window": window.tolist(),
                                "expert_load_window_step": 0, "ep_size": D, "rank": 0, "vllm_version": "0.11.1"}))
    with TraceReader(import_trace(tmp_path, [path])) as reader:
        assert reader.header["imported"]["engine"] == "vllm"
        routing = np.stack([r["routing"] for r in reader.steps()])
    np.testing.assert_array_equal(routing, np.stack([to_logical(w) for w in window]))


def test_imported_report_shows_the_load_and_says_what_is_absent(tmp_path):
    files, expected = sglang_per_pass(tmp_path)
    out = import_trace(tmp_path, files, "--ep-size", D)
    res = run("trace", "report", out, "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    for section in ("breakdown", "latency", "utilisation", "caches", "memory_growth"):
        assert report[section] is None  # not zeros: the source did not measure them
    assert "step_times" in report["absent"]
    # balancedness under the source's placement, worked out slot by slot (replicas share evenly)
    total = expected.sum(0)
    replicas = np.array([[np.count_nonzero(P2L[layer] == e) for e in range(E)] for layer in range(L)])
    loads = np.array([[sum(total[layer, e] / replicas[layer, e] for e in P2L[layer, d * LOCAL:(d + 1) * LOCAL])
                       for d in range(D)] for layer in range(L)])
    assert report["balancedness"]["overall"] == pytest.approx(loads.mean(1).sum() / loads.max(1).sum())
    top = report["hottest_experts"][0]
    assert top["tokens"] == total.max()
    text = run("trace", "report", out)
    assert text.exit_code == 0, text.output
    assert "absent (not measured by the source): step_times" in text.stdout
    assert "step time, mean" not in text.stdout and "throughput" not in text.stdout


def test_replay_experts_panel_shows_the_imported_load(tmp_path):
    from moectl.console.app import MoectlApp
    from moectl.console.sources import ReplaySource
    from tests.pilot import run_app, text_of, until

    files, expected = sglang_per_pass(tmp_path)
    source = ReplaySource(import_trace(tmp_path, files, "--ep-size", D))

    async def body(app, pilot):
        source.seek_step(source.last_step)
        app.tick()
        await pilot.press("2")
        await until(pilot, lambda: app.state.latest is not None and app.state.latest["step"] == source.last_step)
        await until(pilot, lambda: "tokens in the window" in text_of(app, "#ex-cell"), timeout=5)
        homes = ", ".join(f"d{p // LOCAL}" for p in np.flatnonzero(P2L[0] == 0))  # SGLang: slot p on rank p // 3
        assert f"L0/E0: {int(expected[:, 0, 0].sum()):,} tokens in the window; on {homes} (2 replicas)" \
            in text_of(app, "#ex-cell")
        for key, where in (("3", "#mem-categories"), ("4", "#tl-status"), ("5", "#rq-counts")):
            await pilot.press(key)  # the other panels open, and say what the source did not measure
            await until(pilot, lambda: "absent" in text_of(app, where), timeout=5)
            assert "imported from its expert-load records" in text_of(app, where)
        await pilot.press("1")
        await until(pilot, lambda: "imported" in text_of(app, "#ov-metrics"), timeout=5)
        metrics = text_of(app, "#ov-metrics")
        assert "imported from sglang (per_pass)" in metrics and "absent" in metrics and "tok/s" not in metrics
        assert "absent" in text_of(app, "#ov-hbm") and "measured by the source" in text_of(app, "#ov-load-title")
    run_app(MoectlApp(source), body, size=(120, 40))


def _one_pass(path, **record):
    count = record.pop("count", torch.zeros(L, P2L.shape[1], dtype=torch.int64))
    p2l = record.pop("p2l", torch.tensor(P2L))
    torch.save({"records": [{"forward_pass_id": 0, "rank": 0, "global_physical_count": count, **record}],
                "last_physical_to_logical_map": p2l}, path)


BIG_ID = torch.tensor(P2L)
BIG_ID[0, 0] = 3_000_000
HUGE = torch.zeros(L, P2L.shape[1], dtype=torch.int64)
HUGE[0, 0] = 2**62


@pytest.mark.parametrize("make, message", [
    # 2^62 once imported as "0 routed tokens" (the trace's int32 counts wrapped)
    (lambda p: _one_pass(p, count=HUGE), "beyond the trace's counts"),
    # an expert id of 3,000,000 once made a 3,000,001-expert trace (plan rebalance: MemoryError at 4.7 GB)
    (lambda p: _one_pass(p, p2l=BIG_ID), "names logical expert 3,000,000; at most 4096"),
    (lambda p: _one_pass(p, forward_pass_id=None), "records[0]: forward_pass_id must be an integer, got None"),
    (lambda p: _one_pass(p, forward_pass_id=[1]), "forward_pass_id must be an integer, got [1]"),
    (lambda p: _one_pass(p, forward_pass_id=float("nan")), "forward_pass_id must be an integer, got nan"),
    (lambda p: _one_pass(p, forward_pass_id=1.5), "forward_pass_id must be an integer, got 1.5"),  # once merged
    (lambda p: _one_pass(p, rank=[0]), "records[0]: rank must be an integer, got [0]"),
])
def test_an_sglang_dump_out_of_bounds_is_a_one_line_error_naming_file_and_field(tmp_path, make, message):
    path = tmp_path / "dump.pt"
    make(path)
    res = run("trace", "import", path, "--format", "sglang", "-o", tmp_path / "out.trace")
    assert res.exit_code == 2, res.output
    assert message in res.stderr and str(path) in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert not (tmp_path / "out.trace").exists()


@pytest.mark.parametrize("make, message", [
    (lambda p: torch.save([1, 2], p), "not an SGLang expert distribution dump"),
    (lambda p: torch.save({"records": [{"forward_pass_id": 0, "global_physical_count": torch.zeros(2, 5, dtype=torch.int32)}],
                           "last_physical_to_logical_map": torch.tensor(P2L)}, p), "counts are [2, 5]"),
    (lambda p: torch.save({"logical_count": torch.zeros(3, L, E)}, p), "logical_count must be a 3-d integer array"),
    (lambda p: p.write_bytes(b"not a torch file"), "not a torch.save file"),
    # a stat dump taken before the first forward pass: once "cannot reshape array of size 0"
    (lambda p: torch.save({"logical_count": torch.zeros(0, L, E, dtype=torch.int32)}, p),
     "dump.pt: logical_count holds no passes (shape [0, 3, 8])"),
])
def test_a_bad_sglang_dump_is_a_one_line_error(tmp_path, make, message):
    path = tmp_path / "dump.pt"
    make(path)
    res = run("trace", "import", path, "--format", "sglang", "-o", tmp_path / "out.trace")
    assert res.exit_code == 2, res.output
    assert message in res.stderr and res.stderr.count("\n") == 1 and "Traceback" not in res.output
    assert not (tmp_path / "out.trace").exists()


def test_a_vllm_window_of_no_rows_is_a_one_line_error_naming_the_file(tmp_path):
    path = vllm_state(tmp_path, 0, np.zeros((0, L, P2L.shape[1]), np.int32), step=0)
    res = run("trace", "import", path, "-o", tmp_path / "out.trace")
    assert res.exit_code == 2 and res.stderr.count("\n") == 1, res.output
    assert f"{path}: the expert load window holds no rows" in res.stderr


def test_import_refuses_mismatched_ranks_and_a_bad_ep_size(tmp_path):
    rng = np.random.default_rng(4)
    a = vllm_state(tmp_path, 0, rng.integers(1, 9, size=(4, L, 12)), 0)
    other = P2L.copy()
    other[0, 8] = 5
    b = tmp_path / "eplb_rank1.pt"
    torch.save({"physical_to_logical_map": torch.tensor(other), "expert_load_window": torch.ones(4, L, 12, dtype=torch.int32)}, b)
    with pytest.raises(ValueError, match="physical_to_logical_map differs"):
        read_source("vllm", [a, b])
    files, _ = sglang_per_pass(tmp_path)
    res = run("trace", "import", *files, "--ep-size", 5, "-o", tmp_path / "x.trace")
    assert res.exit_code == 2 and "do not split over 5 devices" in res.stderr and "--ep-size 5" in res.stderr
    assert res.stderr.count("physical_to_logical_map") == 1, res.stderr  # the field named once
    res = run("trace", "import", files[0], files[0], "-o", tmp_path / "x.trace")  # the same rank twice
    assert res.exit_code == 2 and "rank 0" in res.stderr
    out = import_trace(tmp_path, files, name="kept.trace")
    res = run("trace", "import", *files, "-o", out)
    assert res.exit_code == 2 and "--overwrite" in res.stderr


def test_trace_info_says_an_imported_trace_has_no_step_times(tmp_path):
    from tests.paths import TRACES

    files, _ = sglang_per_pass(tmp_path)
    out = import_trace(tmp_path, files, "--ep-size", D, "--engine-version", "0.5.4")
    res = run("trace", "info", out)
    assert res.exit_code == 0, res.output
    first = res.stdout.splitlines()[0]
    assert "step times absent (imported from sglang 0.5.4 [per_pass]: " + files[0].name in first
    assert " s, " not in first.split("absent")[0] and "over" not in first  # no "over 0.00 s": the source has no time
    info = json.loads(run("trace", "info", out, "--json").stdout)
    assert info["duration_s"] is None and info["step_times"] == "absent"
    assert (info["imported"]["engine"], info["imported"]["mode"]) == ("sglang", "per_pass")
    recorded = run("trace", "info", TRACES / "steady_rebalance.trace")  # a recorded trace keeps its duration
    assert recorded.exit_code == 0 and " s, 4 actions" in recorded.stdout.splitlines()[0]
    assert "over" in recorded.stdout and "absent" not in recorded.stdout


def test_trace_diff_refuses_an_imported_trace_in_one_line(tmp_path):
    from tests.paths import TRACES

    files, _ = sglang_per_pass(tmp_path)
    out = import_trace(tmp_path, files, "--ep-size", D)
    recorded = TRACES / "steady_rebalance.trace"
    for a, b in ((recorded, out), (out, recorded), (out, out)):
        res = run("trace", "diff", a, b)
        assert res.exit_code == 2, res.output
        assert res.stderr.startswith(f"moectl: error: {out}: imported from sglang [per_pass]") and res.stderr.count("\n") == 1
        assert "no step times" in res.stderr and "Traceback" not in res.output and res.stdout == ""
    assert run("trace", "diff", recorded, recorded).exit_code == 0  # two recorded traces still diff


def test_a_pickle_that_is_not_torch_save_is_one_line_with_no_torch_warning_before_it(tmp_path):
    """torch.load warns about a plain pickle's protocol before it fails: in a real process (pytest
    would catch the warning) stderr is the one error line alone."""
    import pickle
    import subprocess
    import sys

    path = tmp_path / "dump.pt"
    with open(path, "wb") as f:
        pickle.dump({"records": []}, f, protocol=4)
    res = subprocess.run([sys.executable, "-m", "moectl.cli", "trace", "import", str(path), "--format", "sglang",
                          "-o", str(tmp_path / "out.trace")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1 and str(path) in res.stderr, res.stderr
