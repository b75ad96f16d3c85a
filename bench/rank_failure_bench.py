"""How fast a failed rank is named: the distributed backend under an engine driver, 2 ranks on
the sample model with requests in flight, then rank 1 killed (SIGKILL) or hung (SIGSTOP).

    python bench/rank_failure_bench.py [--json]

Prints the seconds from the signal until the driver reports the failure, against the 10 s
bound; a hung rank is named when its heartbeat is STALE_S old, and stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

from moectl.engine import sample_model_dir
from moectl.engine.core.config import EngineConfig
from moectl.engine.core.driver import EngineDriver
from moectl.engine.core.sampling import SamplingParams
from moectl.engine.parallel.group import RankGroup
from moectl.placement.topology import Topology

BOUND_S = 10.0


def detect(sig: signal.Signals) -> dict:
    group = RankGroup(EngineConfig(model=str(sample_model_dir()), topology=Topology(num_devices=2)), 2)
    driver = EngineDriver(group.make_engine)
    try:
        for _ in range(64):
            driver.engine.add_request("import os\n", SamplingParams(max_tokens=400, ignore_eos=True))
        time.sleep(2.0)  # serving, with requests in flight
        os.kill(group.procs[0].pid, sig)
        t0 = time.monotonic()
        while driver.error is None and time.monotonic() - t0 < 60:
            time.sleep(0.01)
        return {"signal": sig.name, "detected_s": time.monotonic() - t0, "error": driver.error}
    finally:
        driver.close()
        group.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = [detect(signal.SIGKILL), detect(signal.SIGSTOP)]
    if args.json:
        print(json.dumps({"bound_s": BOUND_S, "results": results}))
        return
    for r in results:
        print(f"{r['signal']:8s} named in {r['detected_s']:.2f} s (bound {BOUND_S:.0f} s): {r['error']}")


if __name__ == "__main__":
    main()
