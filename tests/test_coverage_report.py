"""scripts/coverage_report.py, .ci/run's per-package coverage floors: the table it prints and the
packages it fails, from coverage's JSON `files` (no coverage run needed)."""

from __future__ import annotations

import importlib.util
import tomllib

from tests.paths import REPO

spec = importlib.util.spec_from_file_location("coverage_report", REPO / "scripts" / "coverage_report.py")
coverage_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(coverage_report)


def entry(statements: int, missed: int) -> dict:
    return {"summary": {"num_statements": statements, "missing_lines": missed}}


FILES = {
    "engine/a.py": entry(100, 2),
    "engine/core/b.py": entry(100, 30),  # engine: 32 missed of 200, 84%
    "server/app.py": entry(50, 0),
    "cli/main.py": entry(10, 1),
}


def test_each_package_sums_its_modules_and_names_the_most_missed():
    rows = coverage_report.package_rows(FILES)
    assert sorted(rows) == ["cli", "engine", "server"]
    assert (rows["engine"]["statements"], rows["engine"]["missed"]) == (200, 32)
    assert rows["engine"]["modules"] == [(30, "engine/core/b.py"), (2, "engine/a.py")]
    assert rows["server"]["modules"] == []


def test_a_package_under_its_floor_fails_and_is_named():
    lines, failures = coverage_report.check(FILES, {"engine": 90, "server": 90, "cli": 90}, total_floor=0)
    assert failures == ["coverage: engine/ covers 84.0% of its lines, under its floor of 90%"]
    engine_row = next(line for line in lines if line.startswith("engine"))
    assert "84.0%" in engine_row and "engine/core/b.py 30" in engine_row
    assert lines[-1].startswith("TOTAL") and "87.3%" in lines[-1]  # 33 missed of 260 lines


def test_floors_met_pass_and_the_total_has_its_own_floor():
    floors = {"engine": 84, "server": 100, "cli": 90}
    assert coverage_report.check(FILES, floors, total_floor=80)[1] == []
    failures = coverage_report.check(FILES, floors, total_floor=90)[1]
    assert len(failures) == 1 and "the product covers 87.3%" in failures[0] and "fail_under" in failures[0]


def test_a_package_without_a_floor_fails():
    failures = coverage_report.check(FILES, {"engine": 0, "server": 0}, total_floor=0)[1]
    assert failures == ["coverage: cli/ has no floor in scripts/coverage_report.py FLOORS"]


def test_the_floors_keep_the_issues_minimum_and_coverage_measures_every_installed_folder():
    for name in ("engine", "profiler", "server", "console"):
        assert coverage_report.FLOORS[name] >= 90, name
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    installed = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert set(pyproject["tool"]["coverage"]["run"]["source"]) == installed == set(coverage_report.FLOORS)
