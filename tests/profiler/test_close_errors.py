"""A trace writer that fails at close reaches users as a one-line error: a 400/500 API error
(no traceback) from the control API, exit 1 (not "bad input") from `moectl record`."""

from __future__ import annotations

import asyncio
import types

import pytest
from typer.testing import CliRunner

from moectl.cli import record as record_cli
from moectl.cli.main import app
from moectl.profiler.recorder import TraceRecorder
from moectl.profiler.trace_store import TraceError
from moectl.server.control import ControlApi
from moectl.server.openai_api import ApiError
from tests.checkpoints import tiny_checkpoint

FAILURE = "x.trace: the trace writer process failed (exit code -9: gone); the trace is incomplete"


class FailingRecorder:
    path, steps, dropped = "x.trace", 3, 0

    def close(self):
        raise TraceError(FAILURE)


def test_stop_recording_answers_the_one_line_error():
    api = ControlApi.__new__(ControlApi)
    api.state, api.plans, api.recorder = None, {}, FailingRecorder()

    async def go():
        api._recording_lock = asyncio.Lock()
        request = types.SimpleNamespace(body_exists=False)
        with pytest.raises(ApiError) as e:
            await api.stop_recording(request)
        return e.value

    error = asyncio.run(go())
    assert error.status == 500 and FAILURE in error.message and "\n" not in error.message
    assert api.recorder is None


def test_server_shutdown_logs_the_failure_and_goes_on(caplog):
    api = ControlApi.__new__(ControlApi)
    api.recorder = FailingRecorder()
    asyncio.run(api.close())
    assert api.recorder is None and any(FAILURE in r.getMessage() for r in caplog.records)


def test_record_cli_exits_1_with_the_close_failure(tmp_path, monkeypatch):
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    real_close = TraceRecorder.close

    def failing_close(self):
        real_close(self)
        raise TraceError(FAILURE)

    monkeypatch.setattr(TraceRecorder, "close", failing_close)
    res = CliRunner().invoke(app, ["record", str(tmp_path / "t.trace"), "--model", str(ckpt), "--steps", "2"])
    assert res.exit_code == 1, res.output
    assert FAILURE in res.output and "Traceback" not in res.output


def test_close_failure_does_not_mask_an_earlier_error():
    assert record_cli._close_recorder(FailingRecorder()) == FAILURE  # returned, not raised from a finally
