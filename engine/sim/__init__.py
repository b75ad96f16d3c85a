"""Simulated clusters at the seeds' scale: hardware profiles as data (profiles/*.json, a source for
every figure) and, built on them, the per-layer step model behind `moectl sim`."""
