"""SVG snapshots of the console (pytest-textual-snapshot): the five panels at 80x24 and 160x50 in
the dark and light themes, and the help screen.

Every screenshot comes from recorded data only: a ReplaySource on
sample_traces/steady_rebalance.trace, seeked to step 250 and paused (nothing plays, so the app's
timer re-renders the same state), with the alerts computed before the screenshot (they arrive
from a worker thread). Nothing on screen depends on the clock: the Header has no clock, replay
raises no notification here, and the transport shows trace time, not wall time.

    .venv/bin/python -m pytest tests/console/test_console_snapshots.py                    # compare
    .venv/bin/python -m pytest tests/console/test_console_snapshots.py --snapshot-update  # accept new ones

The SVGs live in tests/console/__snapshots__/test_console_snapshots/; a failing run writes an HTML diff
report (snapshot_report.html in the working directory).
"""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_textual_snapshot")

from moectl.console.app import MoectlApp  # noqa: E402
from moectl.console.sources import ReplaySource  # noqa: E402
from moectl.engine import sample_model_dir
from moectl.profiler.recorder import with_memory_plan  # noqa: E402
from tests.paths import TRACES

TRACE = TRACES / "steady_rebalance.trace"
SAMPLE_MODEL = sample_model_dir()
STEP = 250
PANELS = {"overview": "1", "experts": "2", "memory": "3", "timeline": "4", "requests": "5"}
SIZES = {"80x24": (80, 24), "160x50": (160, 50)}
THEMES = ("dark", "light")


def replay_app(theme: str) -> MoectlApp:
    source = ReplaySource(TRACE)
    # The header names the model by the absolute path it was recorded from; the Memory panel's
    # plan reads its config.json. Point it at this checkout's sample model so the snapshot does
    # not depend on where the repository lives.
    model = source.header.get("model")
    if isinstance(model, dict):
        model["path"] = str(SAMPLE_MODEL)
    source.header = with_memory_plan(source.header)  # as `moectl replay` does for a trace without one
    return MoectlApp(source, theme=theme)


async def _settle(pilot, condition, timeout_s: float = 30.0) -> None:
    """Let the app run until condition() holds (a worker thread may be involved)."""
    for _ in range(int(timeout_s / 0.05)):
        if condition():
            return
        await pilot.pause(0.05)
    raise AssertionError("the console did not settle")


def before(key: str | None, step: int = STEP):
    """run_before for snap_compare: seek to `step` (paused), wait for the alerts, show a panel."""

    async def run_before(pilot) -> None:
        app = pilot.app
        await pilot.pause()
        app.source.pause()
        app.source.seek_step(step)
        app.tick()  # refills the window before the step and starts the alerts worker
        assert app.state.latest is not None and app.state.latest["step"] == step
        await _settle(pilot, lambda: not app._alerts_running)
        if key is not None:
            await pilot.press(key)
        app.set_focus(None)  # no focused widget: no blinking cursor, no focus highlight
        app.refresh_panels()
        await pilot.pause()
        await pilot.pause()

    return run_before


@pytest.mark.parametrize("theme", THEMES)
@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("panel", list(PANELS))
def test_panel(snap_compare, panel: str, size: str, theme: str):
    """One console panel at a fixed replay position (steady_rebalance.trace, step 250, paused)."""
    assert snap_compare(replay_app(theme), terminal_size=SIZES[size], run_before=before(PANELS[panel]))


def test_help_screen(snap_compare):
    """The help screen ('?') over the Overview panel, dark theme, 80x24."""
    async def run_before(pilot) -> None:
        await before(None)(pilot)
        await pilot.press("question_mark")
        await pilot.pause()
        assert pilot.app.screen.__class__.__name__ == "HelpScreen"

    assert snap_compare(replay_app("dark"), terminal_size=(80, 24), run_before=run_before)


def test_memory_with_kv_retention(snap_compare, tmp_path):
    """The Memory tab with KV retention in force, 160x80 (tall enough for the saving's curve and
    the per-device table): a trace of synthetic records (tests/console/retention_trace.py), full
    retention, then snapkv with a 64-token budget from step 20; at its last step, paused."""
    from tests.console.retention_trace import STEPS, write_retention_trace

    path = tmp_path / "retention.trace"
    write_retention_trace(path)
    app = MoectlApp(ReplaySource(path), theme="dark")
    assert snap_compare(app, terminal_size=(160, 80), run_before=before(PANELS["memory"], STEPS))


def test_memory_with_numerics(snap_compare, tmp_path):
    """The Memory tab's activation headroom, 160x80: a trace of synthetic records with the watch
    (tests/console/numerics_trace.py: float16 activations, a float32 residual stream, layer 7's
    expert output at 1.64x of headroom, layer 9's attention-logit bound at 3.28x); its last step, paused."""
    from tests.console.numerics_trace import STEPS, write_numerics_trace

    path = tmp_path / "numerics.trace"
    write_numerics_trace(path)
    app = MoectlApp(ReplaySource(path), theme="dark")
    assert snap_compare(app, terminal_size=(160, 80), run_before=before(PANELS["memory"], STEPS))


def test_gpu_timeline(snap_compare, tmp_path):
    """The console on a GPU timeline (console/gpu_timeline.py), after a search: a two-rank Kineto
    folder as vLLM and SGLang write it (tests/kineto_traces.py)."""
    from moectl.console.gpu_timeline import gpu_timeline_app
    from moectl.profiler.kineto_import import read_source
    from tests.kineto_traces import two_rank_folder

    async def search(pilot):
        await pilot.press("slash", *"nccl", "enter")
        await pilot.pause()

    app = gpu_timeline_app(read_source([two_rank_folder(tmp_path / "profile")]), "profile")
    assert snap_compare(app, terminal_size=(160, 50), run_before=search)

