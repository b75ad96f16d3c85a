"""bench/figures.py: the tables it writes (the full one into docs/measurements.md and
bench/README.md, the headline one into README.md) are what its stored results (each bench's own
JSON, in bench/figures.json) render to: a figure edited by hand in any table, or a table left stale
after a run, fails here."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from tests.paths import REPO as ROOT

spec = importlib.util.spec_from_file_location("bench_figures", ROOT / "bench" / "figures.py")
figures = importlib.util.module_from_spec(spec)
spec.loader.exec_module(figures)


@pytest.fixture(scope="module")
def store():
    return json.loads((ROOT / "bench" / "figures.json").read_text())


def table_in(doc) -> str:
    text = doc.read_text()
    assert text.count(figures.BEGIN) == 1 and text.count(figures.END) == 1
    return figures.BEGIN + text.split(figures.BEGIN, 1)[1].split(figures.END, 1)[0] + figures.END


def test_each_table_goes_where_it_belongs():
    assert {doc.relative_to(ROOT).as_posix(): table_of for doc, table_of in figures.TABLES.items()} == {
        "docs/measurements.md": figures.render, "bench/README.md": figures.render,
        "README.md": figures.render_headline}


@pytest.mark.parametrize("doc", sorted(figures.TABLES), ids=lambda d: d.relative_to(ROOT).as_posix())
def test_the_docs_tables_are_the_stored_figures(store, doc):
    assert table_in(doc) == figures.TABLES[doc](store), f"{doc}: run `python bench/figures.py --render`"


def test_every_stored_bench_renders_from_its_own_json(store):
    assert set(store) == set(figures.BENCHES), "every bench has figures, and nothing else is stored"
    for bench_id, entry in store.items():
        command, rows_of = figures.BENCHES[bench_id]
        assert entry["command"] == " ".join(c for c in command if c != "--json")
        rows = rows_of(entry["raw"])
        assert rows and all(what and figure for what, figure in rows), bench_id
        assert entry["measured_on"] and entry["machine"]


def test_the_full_table_has_a_row_for_every_figure(store):
    rows = [line for line in figures.render(store).splitlines() if line.startswith("| `")]
    assert len(rows) == sum(len(rows_of(store[b]["raw"])) for b, (_, rows_of) in figures.BENCHES.items())
    assert {re.match(r"\| `([^`]+)`", row)[1] for row in rows} == set(figures.BENCHES)


def test_the_headline_is_a_few_benches_with_their_verdicts(store):
    """6-8 rows, each a stored bench's, and a full row's "not met" stays in its headline."""
    assert 6 <= len(figures.HEADLINE) <= 8 and set(figures.HEADLINE) <= set(figures.BENCHES)
    table = figures.render_headline(store)
    for bench_id, headline in figures.HEADLINE.items():
        raw = store[bench_id]["raw"]
        what, figure = headline(raw)
        assert f"| {what} | {figure} | `{store[bench_id]['command']}` " in table
        full = " ".join(f for _, f in figures.BENCHES[bench_id][1](raw))
        assert ("not met" in full) <= ("not met" in figure), f"{bench_id}: the headline hides a target not met"


def test_rewrite_needs_the_markers(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{figures.BEGIN}\nold\n{figures.END}\nrest\n")
    figures.rewrite(doc, figures.BEGIN + "\nnew\n" + figures.END)
    assert doc.read_text() == f"intro\n{figures.BEGIN}\nnew\n{figures.END}\nrest\n"
    doc.write_text("no markers")
    with pytest.raises(SystemExit, match="no .* block"):
        figures.rewrite(doc, "x")
