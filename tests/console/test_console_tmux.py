"""The console in a real terminal: scripts/console_tmux_check.sh drives `moectl replay` and the live
`moectl` in a detached tmux session (keys in, screen text out) and must report every check
passed."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.paths import REPO

SCRIPT = REPO / "scripts" / "console_tmux_check.sh"


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_console_in_tmux():
    if not (REPO / ".venv" / "bin" / "moectl").exists():
        pytest.skip(".venv/bin/moectl is not installed (scripts/setup.sh)")
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    assert "FAIL" not in done.stdout, report
    assert "PASS all console checks" in done.stdout, report
