"""bench/figures.py: the tables it writes into README.md and bench/README.md are what its stored
results (each bench's own JSON, in bench/figures.json) render to: a figure edited by hand in
either table, or a table left stale after a run, fails here."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.paths import REPO as ROOT

spec = importlib.util.spec_from_file_location("bench_figures", ROOT / "bench" / "figures.py")
figures = importlib.util.module_from_spec(spec)
spec.loader.exec_module(figures)


@pytest.fixture(scope="module")
def store():
    return json.loads((ROOT / "bench" / "figures.json").read_text())


@pytest.mark.parametrize("doc", ["README.md", "bench/README.md"])
def test_the_docs_tables_are_the_stored_figures(store, doc):
    text = (ROOT / doc).read_text()
    assert text.count(figures.BEGIN) == 1 and text.count(figures.END) == 1
    table = figures.BEGIN + text.split(figures.BEGIN, 1)[1].split(figures.END, 1)[0] + figures.END
    assert table == figures.render(store), f"{doc}: run `python bench/figures.py --render`"


def test_every_stored_bench_renders_from_its_own_json(store):
    assert set(store) == set(figures.BENCHES), "every bench has figures, and nothing else is stored"
    for bench_id, entry in store.items():
        command, rows_of = figures.BENCHES[bench_id]
        assert entry["command"] == " ".join(c for c in command if c != "--json")
        rows = rows_of(entry["raw"])
        assert rows and all(what and figure for what, figure in rows), bench_id
        assert entry["measured_on"] and entry["machine"]


def test_rewrite_needs_the_markers(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{figures.BEGIN}\nold\n{figures.END}\nrest\n")
    figures.rewrite(doc, figures.BEGIN + "\nnew\n" + figures.END)
    assert doc.read_text() == f"intro\n{figures.BEGIN}\nnew\n{figures.END}\nrest\n"
    doc.write_text("no markers")
    with pytest.raises(SystemExit, match="no .* block"):
        figures.rewrite(doc, "x")
