"""The tracer the model reports its spans to, and the one that does nothing.

The decoder opens a span with `mark = tracer.mark()` and closes it with
`tracer.close(mark, name, lane, layer)` around attention, the router, expert work and dense
MLPs. The engine sets a recorder (moectl.engine.core.spans.SpanRecorder) while it records
spans; otherwise the model keeps NULL_TRACER, so there is one forward path either way.
"""

from __future__ import annotations


class NullTracer:
    """Tracing off: every call returns at once. `enabled` lets callers skip work whose only use
    is a span (the expert layer's modeled link times, for one)."""

    enabled = False

    def mark(self) -> None:
        return None

    def close(self, mark, name: str, lane: int = 0, layer: int = -1) -> None:
        return None

    def add_measured(self, name: str, lane: int, layer: int, start: float, end: float) -> None:
        return None

    def add_modeled(self, name: str, lanes, layers, starts, seconds) -> None:
        return None

    def add_links(self, links: dict) -> None:
        return None


NULL_TRACER = NullTracer()
