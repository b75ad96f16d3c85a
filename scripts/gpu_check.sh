#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: run the GPU-gated NVML tests and show one live sample.
#   bash scripts/gpu_check.sh            (from the repository root, after scripts/setup.sh)
# Exit status: 0 when every test passed and none of the GPU tests was skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

echo "== driver and torch"
nvidia-smi --query-gpu=index,name,memory.used,memory.total,power.draw,temperature.gpu --format=csv || true
"$PY" - <<'PYEOF'
import sys, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "devices", torch.cuda.device_count())
if not torch.cuda.is_available():
    sys.exit("no CUDA here: the GPU tests would all be skipped")
PYEOF

echo "== one sample from the sampler"
"$PY" - <<'PYEOF'
import json, sys
from moectl.engine.core.gpu_stats import GpuSampler
s = GpuSampler()
if not s.available:
    sys.exit(f"sampler unavailable: {s.reason}")
print(json.dumps(s.latest(), indent=1))
s.close()
PYEOF

echo "== GPU-gated tests (any skip here is a failure)"
out=$(mktemp)
set +e
"$PY" -m pytest -p no:cacheprovider -rs -v tests/engine/core/test_gpu_stats.py 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
set -e
if grep -q "SKIPPED.*needs CUDA and NVML" "$out"; then
    echo "gpu_check: GPU tests were skipped (CUDA or NVML not usable)"; exit 1
fi
[ "$rc" -eq 0 ] || { echo "gpu_check: GPU tests failed"; exit "$rc"; }

echo "== display and metrics tests"
"$PY" -m pytest -p no:cacheprovider -q tests/console/test_console_gpu.py tests/server/test_metrics_gpu.py
echo "gpu_check: all passed"
