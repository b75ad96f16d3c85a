#!/usr/bin/env bash
# Installs Debian's chromium when no chromium is on PATH: the browser test (tests/console/test_web.py)
# drives it headless through playwright's Python API. Playwright's own browser download
# (`playwright install`) is never used. Needs root or sudo; does nothing when chromium is there.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "setup_browser.sh: installing chromium needs root or sudo" >&2; exit 1; }
    SUDO=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -q
"${SUDO[@]}" apt-get install -y -q chromium
command -v chromium >/dev/null 2>&1 || { echo "setup_browser.sh: chromium is still not on PATH" >&2; exit 1; }
