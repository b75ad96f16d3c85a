#!/usr/bin/env bash
# Creates .venv with the CPU build of torch and moectl (editable) plus its test/reference extras.
# torch is installed first and pinned, so nothing later pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[dev]'
# Build the paged decode kernel now (a C++ extension, ~20-40 s once per machine) rather than on
# the first engine start; when no compiler is found the engine uses its torch path instead.
.venv/bin/python -c "from moectl.engine.core import paged_decode as k; k.kernel(); print('paged decode kernel:', k.failure() or 'built')"
# Compile the replica rule (numba, placement/replica_kernel.py) into numba's cache, a few seconds
# once, so no engine's first replicated step pays it
.venv/bin/python -c "from moectl.placement import replica_policy; replica_policy.prepare(); print('replica rule: compiled')"
# The browser test (`moectl web` in headless chromium) skips without a chromium on PATH; installing
# one needs root, so it is a separate step (the CI runs it).
command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
    || echo "no chromium on PATH: the browser test will skip (scripts/setup_browser.sh installs Debian's chromium)"
