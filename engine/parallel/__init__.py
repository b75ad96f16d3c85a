"""Tensor and expert parallelism over torch.distributed ranks: sharding, rank experts and live
migration, rank 0's cluster, the rank processes and their step channel, and the group watchdog."""
