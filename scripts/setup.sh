#!/usr/bin/env bash
# Creates .venv with the CPU build of torch and moectl (editable) plus its test/reference extras.
# torch is installed first and pinned, so nothing later pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[dev]'
