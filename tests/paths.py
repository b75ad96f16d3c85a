"""Repository paths the tests read: shipped sample traces and documented configs."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO / "sample_traces"
DOCS = REPO / "docs"
