"""`moectl serve` on a port in use: one line and exit 1 before the model loads (it once loaded the
model, then died with `OSError: [Errno 98]` and a traceback)."""

from __future__ import annotations

import socket

from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.engine.parallel import backends


def test_a_port_in_use_is_one_line_before_the_model_loads(monkeypatch):
    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(backends, "Engines", must_not_load)  # serve imports it when it starts the engine
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(app, ["serve", "--port", str(port)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1, result.output
    assert len(lines) == 1 and lines[0].startswith("moectl: error: --host/--port: cannot listen on 127.0.0.1:"), lines
    assert "Traceback" not in result.output
