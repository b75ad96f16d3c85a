"""Expert parallelism in one process: emulated devices and their clusters, replica routing,
tiered expert memory (cache, prefetch, disk), the memory ledger, and `engine.experts`
(ExpertControl). Placement, rebalancing and the step-time model are moectl.placement."""
