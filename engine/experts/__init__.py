"""Expert parallelism in one process: placement, rebalancing, emulated devices and their clusters,
the parallel step-time model, tiered expert memory (cache, prefetch, disk), the memory ledger,
and `engine.experts` (ExpertControl)."""
