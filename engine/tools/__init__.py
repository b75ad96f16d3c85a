"""Tools built on the engine: benchmarks, verification against transformers, KV evaluation,
workloads, training on the stdlib corpus, and tiny random checkpoints."""
