"""Offline planning from config.json alone: per-device memory (`memory_plan`) and where the
experts live across HBM, host memory and disk (`offload_plan`)."""
