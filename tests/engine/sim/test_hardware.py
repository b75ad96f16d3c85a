"""Hardware profiles (engine/sim/profiles/*.json): every shipped one loads, every figure it gives
has a source, borrowed figures are listed as assumed, and a bad profile is a one-line error."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from moectl.engine.sim.hardware import Curve, ProfileError, load_profile, profile_names


def test_the_seeds_hardware_ships_and_every_figure_has_a_source():
    assert {"h100", "h800", "h200", "a100", "mi300x", "ascend-910b"} <= set(profile_names())
    for name in profile_names():
        profile = load_profile(name)
        assert profile.bf16_tflops > 0 and profile.gpus_per_node == 8
        assert all(source.strip() for source in profile.sources.values())
        given = [f for f in ("hbm_gbps", "intra_node_gbps", "inter_node_gbps") if getattr(profile, f) is not None]
        assert {f for f in given} <= set(profile.sources)
    h100 = load_profile("h100")
    assert (h100.bf16_tflops, h100.fp8_tflops, h100.hbm_gbps) == (989, 1979, 3350)  # dense, not sparse
    assert load_profile("a100").fp8_tflops is None and load_profile("a100").peak_tflops("fp8") == 312
    # DeepSeek's own hardware: its own benchmarks; only the FP8 peak and capacity are the H100's
    assert load_profile("h800").assumed == ("hbm_bytes", "peak_tflops.fp8")
    assert "efficiency.grouped_gemm" in load_profile("mi300x").assumed


def test_a_figure_no_source_gives_is_refused_by_name_when_needed():
    ascend = load_profile("ascend-910b")
    assert ascend.hbm_gbps is None
    with pytest.raises(ProfileError, match="^hardware ascend-910b: hbm_gbps has no sourced figure"):
        ascend.need("hbm_gbps")


def test_efficiency_curve_interpolates_in_log_size_and_is_flat_beyond_its_ends():
    curve = Curve(((256, 0.4), (1024, 0.6)))
    assert curve.at(512) == pytest.approx(0.5) and curve.at(16) == 0.4 and curve.at(1 << 20) == 0.6
    with pytest.raises(ProfileError, match="sizes must increase"):
        Curve(((1024, 0.6), (256, 0.4)))


@pytest.mark.parametrize("edit, message", [
    (lambda p: p["peak_tflops"]["bf16"].pop("source"), "peak_tflops.bf16 must be"),
    (lambda p: p["hbm_gbps"].update(value=-1), "hbm_gbps must be a positive number"),
    (lambda p: p.pop("gpus_per_node"), "gpus_per_node is missing"),
    (lambda p: p["efficiency"]["all_to_all"].update(intra_node=1.5), "all_to_all.intra_node must be a fraction"),
    (lambda p: p["efficiency"]["grouped_gemm"].update(points=[[0, 0.5]]), "efficiency points"),
])
def test_a_bad_profile_file_is_one_line_naming_the_figure(tmp_path, edit, message):
    raw = json.loads(resources.files("moectl.engine.sim").joinpath("profiles", "h800.json").read_text())
    edit(raw)
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ProfileError, match=message) as info:
        load_profile(path)
    assert "\n" not in str(info.value) and str(info.value).startswith(("hardware mine:", "efficiency points"))


def test_unknown_names_and_broken_files(tmp_path):
    with pytest.raises(ProfileError, match="neither a shipped profile"):
        load_profile("b200")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="^hardware bad: not valid JSON"):
        load_profile(bad)
