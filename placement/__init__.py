"""Where experts sit, torch-free: the shared vocabulary of the engine, the simulator, the profiler and the front ends.

    topology.py        the cluster: devices grouped into nodes, their HBM, host and disk tiers, links
    placement.py       Placement: which expert sits in which slot of which device; operator edits
    placement_file.py  the one placement file every command reads and writes, fitted to a model
    rebalancer.py      the expert-parallel load balancer (EPLB's class), migration-aware; the routing window
    step_time.py       the parallel step time, the calibrated per-expert cost model, predictions
"""
