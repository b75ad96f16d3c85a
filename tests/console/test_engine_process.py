"""The engine in a process of its own (server/engine_host.py) and consoles attached to it over
wire/protocol.py: the console drives a real engine process through Pilot, its process never
loads torch, and the process table is checked after a kill -9 of either side and after q."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest

from moectl.cli.engine_process import EngineProcess, EngineStartFailed
from moectl.console.app import MoectlApp
from moectl.console.engine_client import EngineSource
from moectl.wire import protocol
from moectl.wire.actions import ActionRefused
from tests.checkpoints import tiny_checkpoint
from tests.paths import REPO
from tests.pilot import run_app, text_of, until

WORKLOAD = "rate=40,prompt=8-24,output=8-16"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("engine_process"))


def start_engine(ckpt, *extra) -> EngineProcess:
    engine = EngineProcess(["--model", str(ckpt), "--devices", "4", "--redundant", "1", "--workload", WORKLOAD,
                            "--threads", "1", *extra])
    engine.wait_ready(timeout_s=120)
    return engine


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pid: int, timeout_s: float) -> float | None:
    """Seconds until pid exits, or None if it outlives timeout_s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if gone(pid):
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


# -- the protocol

def test_records_cross_the_protocol_as_arrays_not_lists():
    record = {"step": 3, "routing": np.arange(12, dtype=np.int32).reshape(3, 4),
              "spans": {"start_s": np.array([0.5, 1.5]), "name": np.array(["a", "bc"])},
              "devices": {"step_time": {"step_s": np.float64(0.25), "modeled": True}}, "nested": [1, (2, 3)]}
    frame = protocol.encode(protocol.Records(steps=[record], actions=[]))
    assert b"[0,1,2" not in frame  # no JSON-like lists of the array's values
    back = protocol.decode(frame[protocol.LENGTH.size:])
    got = back.steps[0]
    assert got["routing"].dtype == np.int32 and got["routing"].shape == (3, 4)
    np.testing.assert_array_equal(got["routing"], record["routing"])
    assert list(got["spans"]["name"]) == ["a", "bc"] and got["devices"]["step_time"] == {"step_s": 0.25,
                                                                                       "modeled": True}
    assert got["nested"] == [1, [2, 3]]


@pytest.mark.parametrize("body, words", [
    (b"\x01\x02", "not a message of this protocol"),
    (b"\x81\xa4type\xa6pickle", "not a message of this protocol"),  # {"type": "pickle"}: no such message
])
def test_a_malformed_message_is_one_line(body, words):
    with pytest.raises(protocol.ProtocolError) as err:
        protocol.decode(body)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_an_oversized_announcement_is_refused_before_reading_it():
    import socket

    a, b = socket.socketpair()
    with a, b:
        a.sendall(protocol.LENGTH.pack(protocol.MAX_MESSAGE + 1))
        with pytest.raises(protocol.ProtocolError, match="at most"):
            protocol.read_message(b)


def test_a_client_without_the_token_is_refused(ckpt):
    engine = start_engine(ckpt)
    try:
        sock = protocol.connect(engine.dir)
        with sock:
            sock.sendall(protocol.encode(protocol.Hello(token="wrong")))
            answer = protocol.read_message(sock)
        assert isinstance(answer, protocol.Bye) and "token" in answer.reason
        assert engine.alive()  # a refused client changes nothing
        assert oct(engine.dir.stat().st_mode & 0o777) == "0o700"
        assert oct((engine.dir / protocol.TOKEN_NAME).stat().st_mode & 0o777) == "0o600"
    finally:
        engine.terminate()


_INTRUDER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from moectl.wire import protocol
    engine_dir = Path(sys.argv[1])
    token = protocol.read_token(engine_dir)
    with protocol.connect(engine_dir) as sock:  # claims the engine: refused
        sock.sendall(protocol.encode(protocol.Hello(token=token, owner=True)))
        print(protocol.read_message(sock).reason)
    with protocol.connect(engine_dir) as sock:  # asks it to stop: refused
        sock.sendall(protocol.encode(protocol.Hello(token=token, records=False)))
        assert isinstance(protocol.read_message(sock), protocol.Welcome)
        sock.sendall(protocol.encode(protocol.Shutdown(id=3)))
        print(protocol.read_message(sock).error)
""")


def test_only_the_process_that_started_the_engine_owns_it(ckpt):
    """Another process with the token claims the engine and asks it to stop: both refused, and
    the engine serves on once it has gone; the starter's own console still stops it by leaving."""
    engine = start_engine(ckpt)
    try:
        intruder = subprocess.run([sys.executable, "-c", _INTRUDER, str(engine.dir)], capture_output=True, text=True,
                                  cwd=REPO, timeout=60)
        assert intruder.returncode == 0, intruder.stderr
        claimed, stopped = intruder.stdout.splitlines()
        assert claimed == f"refused: owner: only the process that started this engine owns it (pid {os.getpid()})"
        assert stopped.startswith("shutdown: refused")
        assert engine.alive()
        owner = EngineSource(engine.dir, owner=True)
        owner.close()
        assert wait_gone(engine.pid, 30) is not None  # `run`'s quit: its console's leaving stops the engine
    finally:
        engine.terminate()


def test_a_bad_engine_option_is_the_engines_one_line_and_exit_code(ckpt):
    engine = EngineProcess(["--model", str(ckpt), "--hbm", "1KiB"])
    with pytest.raises(EngineStartFailed) as err:
        engine.wait_ready(timeout_s=120)
    engine.stop()
    assert err.value.code == 2 and str(err.value).startswith("--hbm: ") and "\n" not in str(err.value)
    assert not engine.dir.exists()


# -- the console on an engine process

def test_the_console_drives_an_engine_process(ckpt):
    """Records arrive, a rebalance previewed in the engine is applied there, and two consoles
    attach to the one engine at once."""
    engine = start_engine(ckpt)
    source = EngineSource(engine.dir, owner=True)
    second = EngineSource(engine.dir)

    async def body(app, pilot):
        await until(pilot, lambda: app.state.steps_seen > 5 and app.state.throughput() > 0, timeout=60)
        assert app.state.header["model"]["num_layers"] > 0 and "emulated" in text_of(app, "#ov-title")
        # the alerts are the engine's, computed there for every client: the console computes none
        await until(pilot, lambda: source.alerts_version > 0 and app.state.alerts == source.alerts, timeout=30)
        assert app._alert_cadence.computed == 0 and not app._alerts_running
        before = app.state.placement
        # token balance: a plan that moves experts whatever this machine's costs (the default
        # step-time objective may rightly keep the placement)
        source.act("auto_rebalance", enabled=False, objective="balance").result(timeout=30)
        await pilot.press("2")
        await pilot.press("r")
        await until(pilot, lambda: app.plan is not None, timeout=30)
        await until(pilot, lambda: "predicted balancedness" in text_of(app, "#ex-preview-result"), timeout=5)
        # every throughput says what it counts and on which clock
        assert "prompt+output per predicted parallel step" in text_of(app, "#ex-preview-result")
        assert "tok/s (prompt+output, wall clock)" in text_of(app, "#ov-metrics")
        await pilot.press("A")
        await until(pilot, lambda: app.state.placement is not None and app.state.placement != before, timeout=30)
        # the apply is reported once the copy has run, with its measured bytes and time
        await until(pilot, lambda: any("bytes copied in" in str(n.message) for n in app._notifications), timeout=10)
        # the second console, attached all along, saw the same records and the apply
        await until(pilot, lambda: any(a["kind"] == "rebalance_apply" for a in seen_by_second()), timeout=10)
        with pytest.raises(ActionRefused, match="preview a plan first"):
            second.act("rebalance_apply")
        with pytest.raises(ActionRefused, match="rate"):
            second.act("workload", rate=-1).result(timeout=30)
        assert second.act("workload", rate=12.0).result(timeout=30) == {"workload": {"rate": 12.0}}
        await until(pilot, lambda: second.load.rate == 12.0 and source.load.rate == 12.0, timeout=10)

    second_actions: list = []

    def seen_by_second() -> list:
        second_actions.extend(second.poll()[1])
        return second_actions
    try:
        run_app(MoectlApp(source), body)
    finally:
        second.close()
        source.close()
        engine.stop()
    assert gone(engine.pid) and not engine.dir.exists()  # q's path: the owner's close stops the engine


def test_an_engine_killed_with_sigkill_is_named_at_once_and_the_console_stays_up(ckpt):
    engine = start_engine(ckpt)
    source = EngineSource(engine.dir, owner=True)
    seen = {}

    async def body(app, pilot):
        await until(pilot, lambda: app.state.steps_seen > 0, timeout=60)
        os.kill(engine.pid, signal.SIGKILL)
        t0 = time.monotonic()
        # shown in the panel and notified: notify() posts a message, handled after the tick returns
        await until(pilot, lambda: source.error is not None and app._shown_error == source.error
                    and any(source.error in str(n.message) for n in app._notifications), timeout=10)
        seen["after_s"] = time.monotonic() - t0
        assert f"moectl engine (pid {engine.pid}) is gone" in source.error
        await pilot.press("3")  # still usable for inspection
        await until(pilot, lambda: app.query_one("#tabs").active == "memory", timeout=5)
        with pytest.raises(ActionRefused, match="is gone"):
            source.act("rebalance_preview")
    try:
        run_app(MoectlApp(source), body)
    finally:
        source.close()
        engine.stop()
    print(f"engine SIGKILL -> console says so in {seen['after_s'] * 1e3:.0f} ms")


_CONSOLE = textwrap.dedent("""
    import sys, time
    from moectl.cli.engine_process import EngineProcess
    from moectl.console.engine_client import EngineSource
    engine = EngineProcess(sys.argv[1:])
    engine.wait_ready(timeout_s=120)
    source = EngineSource(engine.dir, owner=True)
    print(engine.pid, flush=True)
    time.sleep(600)
""")


def test_killing_the_console_stops_the_engine_it_started(ckpt):
    console = subprocess.Popen([sys.executable, "-c", _CONSOLE, "--model", str(ckpt), "--devices", "2",
                                "--threads", "1", "--workload", WORKLOAD], stdout=subprocess.PIPE, text=True,
                               cwd=REPO)
    try:
        engine_pid = int(console.stdout.readline())
        assert not gone(engine_pid)
        console.kill()
        exited = wait_gone(engine_pid, 30)
    finally:
        console.kill()
        console.wait()
        console.stdout.close()
    assert exited is not None, "the engine outlived its console"
    print(f"console SIGKILL -> engine exited in {exited:.2f} s")


def test_the_console_process_never_imports_torch():
    """What `moectl run` imports in the console's process, and what it imports to draw."""
    code = ("import sys\n"
            "import moectl.cli.main, moectl.cli.engine_process, moectl.console.app, moectl.console.engine_client\n"
            "from moectl.cli import console, web\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:3]\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr


def test_knobs_edits_auto_and_a_capture_from_the_console_reach_the_engine_process(ckpt):
    """The Requests, Experts and Timeline panels' controls on an engine process: each shows up in
    the engine's own records (its knobs, its placement, its auto policy, a deep capture)."""
    engine = start_engine(ckpt)
    source = EngineSource(engine.dir, owner=True)

    async def body(app, pilot):
        def recorded(kind: str) -> list[dict]:
            return [a for a in app.state.actions if a["kind"] == kind]

        await until(pilot, lambda: app.state.steps_seen > 3, timeout=60)
        await pilot.press("5")
        await until(pilot, lambda: app.query_one("#rq-max_num_seqs").value != "")
        app.query_one("#rq-max_num_seqs").value = "0"
        app.query_one("#rq-apply").press()
        await until(pilot, lambda: "max_num_seqs" in text_of(app, "#rq-error"), timeout=10)
        app.query_one("#rq-max_num_seqs").value = "8"
        app.query_one("#rq-apply").press()
        await until(pilot, lambda: (app.state.latest or {}).get("knobs", {}).get("max_num_seqs") == 8, timeout=30)
        await pilot.press("2")
        await pilot.pause(0.2)
        app.query_one("#ex-edit").value = "pin"
        app.query_one("#ex-layer").value = "0"
        app.query_one("#ex-expert").value = "99"
        app.query_one("#ex-do").press()
        await until(pilot, lambda: "expert" in text_of(app, "#ex-error"), timeout=10)  # refused by the engine
        app.query_one("#ex-expert").value = "1"
        app.query_one("#ex-do").press()
        await until(pilot, lambda: app.state.placement is not None and app.state.placement.is_pinned(0, 1), timeout=30)
        app.query_one("#ex-threshold").value = "0.85"
        app.query_one("#ex-auto").value = True
        await until(pilot, lambda: any(a["args"].get("mode") == "auto" and a["args"].get("threshold") == 0.85
                                       for a in recorded("auto_rebalance")), timeout=30)
        await pilot.press("3")
        await until(pilot, lambda: "KV blocks" in text_of(app, "#mem-tiers"), timeout=10)
        await pilot.press("4")
        await until(pilot, lambda: app.query_one("#tl-timeline").span_count > 0, timeout=10)
        app.query_one("#tl-capture").press()
        await until(pilot, lambda: any(r.get("kernels") for r in app.state.window), timeout=60)
    try:
        run_app(MoectlApp(source), body)
    finally:
        source.close()
        engine.stop()


def test_heat_map_selection_themes_and_help_on_an_engine_process(ckpt):
    engine = start_engine(ckpt)
    source = EngineSource(engine.dir, owner=True)

    async def body(app, pilot):
        assert app.theme == "moectl-light"
        await pilot.press("2")
        await until(pilot, lambda: app.state.steps_seen > 3, timeout=60)
        app.query_one("#ex-heatmap").focus()
        await pilot.press("right", "down")
        await until(pilot, lambda: text_of(app, "#ex-cell").startswith("L1/E1:"), timeout=10)
        cell = text_of(app, "#ex-cell")
        assert "tokens" in cell and "on d" in cell and "layer 1" in text_of(app, "#ex-placement-title")
        await pilot.press("t")
        assert app.theme == "moectl-high-contrast" and app.query_one("#ex-heatmap").scale_name == "grey"
        await pilot.press("question_mark")
        await pilot.pause(0.1)
        assert app.screen.__class__.__name__ == "HelpScreen"
        await pilot.press("escape")
        assert app.screen.__class__.__name__ != "HelpScreen"
    try:
        run_app(MoectlApp(source, theme="light"), body)
    finally:
        source.close()
        engine.stop()


def test_bad_actions_from_the_owner_fail_alone_and_the_engine_serves_on(ckpt):
    engine = start_engine(ckpt)
    try:
        sock = protocol.connect(engine.dir)
        with sock:
            sock.sendall(protocol.encode(protocol.Hello(token=protocol.read_token(engine.dir), owner=True)))
            assert isinstance(protocol.read_message(sock), protocol.Welcome)
            bad = [("self_destruct", {}), ("knobs", {"max_num_seqs": [1, 2]}), ("workload", {"rate": "fast"}),
                   ("edit", {"edit": "pin", "layer": "zero", "expert": 1}), ("rebalance_apply", {"plan_id": 7}),
                   ("capture", {"steps": None})]
            for i, (kind, args) in enumerate(bad):
                sock.sendall(protocol.encode(protocol.Act(id=i, kind=kind, args=args)))
            answers = {}
            while len(answers) < len(bad):
                message = protocol.read_message(sock)
                if isinstance(message, protocol.Result):
                    answers[message.id] = message
            assert all(a.error and "\n" not in a.error and a.value is None for a in answers.values()), answers
            assert engine.alive()
            sock.sendall(protocol.encode(protocol.Act(id=99, kind="knobs", args={"max_num_seqs": 8})))
            while not (isinstance(message := protocol.read_message(sock), protocol.Result) and message.id == 99):
                pass
            assert message.error is None and message.value == {"knobs": {"max_num_seqs": 8}}
    finally:
        engine.stop()
    assert not engine.alive()  # the owner's connection closed: the engine went with it


def test_a_burst_of_sigterms_stops_the_engine_process(ckpt):
    """The SIGTERM handler once took the host's lock: a second SIGTERM (the parent-death signal on
    top of another) arrived while the first held it, and the engine hung forever."""
    engine = start_engine(ckpt)
    source = EngineSource(engine.dir, owner=True)
    try:
        for _ in range(5):
            os.kill(engine.pid, signal.SIGTERM)
        assert wait_gone(engine.pid, 30) is not None, "the engine hung on its SIGTERMs"
        deadline = time.monotonic() + 10
        while source.error is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert source.error is not None and "SIGTERM" in source.error
    finally:
        source.close()
        engine.stop()


# -- requests over the protocol

def test_requests_travel_over_the_protocol_beside_the_record_stream(ckpt, single_thread):
    """A client's Generate runs in the engine process and streams back to that client only; its
    tokens are what the same engine configuration generates in this process; every client sees
    its steps in the records; a refused one, a cancelled one and a client that leaves end cleanly."""
    from moectl.engine.core.config import EngineConfig
    from moectl.engine.core.sampling import SamplingParams
    from moectl.engine.llm_engine import LLMEngine
    from moectl.placement.topology import Topology

    prompt = [5, 9, 14, 3, 7]
    local = LLMEngine(EngineConfig(model=str(ckpt), topology=Topology(num_devices=4), redundant_slots=1,
                                   num_threads=1))
    expected = local.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    engine = start_engine(ckpt)
    try:
        sender = EngineSource(engine.dir, client="script")
        watcher = EngineSource(engine.dir)
        handle = sender.generate(prompt, max_tokens=12, ignore_eos=True)
        outputs = list(handle.outputs(timeout_s=60))
        assert [t for o in outputs for t in o.new_token_ids] == expected
        assert outputs[-1].finished and outputs[-1].finish_reason == "length" and len(outputs) > 1  # streamed
        request_id = handle.request_id
        assert request_id.startswith("script")
        seen = []
        assert until_true(lambda: seen.extend(watcher.poll()[0]) or any(
            request_id in r["batch"]["request_ids"] for r in seen), timeout_s=10)
        refused = sender.generate(prompt, max_tokens=12, temperature=-1).result(10)
        assert refused["finish_reason"] == "error" and refused["error"].startswith("refused: temperature")
        # the outputs went to the sender only: a client that asked nothing got none
        assert watcher.unclaimed_outputs == 0 and sender.unclaimed_outputs == 0
        long = sender.generate(prompt, max_tokens=200, ignore_eos=True)
        next(long.outputs(timeout_s=60))
        long.cancel()
        assert long.result(30)["finish_reason"] == "abort"
        leaving = sender.generate(prompt, max_tokens=200, ignore_eos=True)
        next(leaving.outputs(timeout_s=60))
        leaving_id = leaving.request_id
        sender.close()  # its unfinished request is aborted, not left running for nobody
        assert until_true(lambda: seen.extend(watcher.poll()[0]) or any(
            e["id"] == leaving_id and e["event"] == "finished" and e.get("reason") == "abort"
            for r in seen for e in r.get("requests") or ()), timeout_s=10)
        watcher.close()
    finally:
        engine.stop()


def until_true(condition, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.05)
    return bool(condition())


def test_generate_engine_sends_prompts_to_a_running_engine(ckpt):
    """`moectl generate --engine DIR`: the prompts run in that engine; options that would configure
    an engine are refused; a refused request exits 2 with its one line."""
    engine = start_engine(ckpt)
    try:
        def cli(*args):
            return subprocess.run([sys.executable, "-m", "moectl.cli", "generate", "--engine", str(engine.dir), *args],
                                  capture_output=True, text=True, timeout=120)

        ok = cli("--prompt-ids", "5,9,14", "--max-tokens", "4", "--ignore-eos", "--json")
        assert ok.returncode == 0, ok.stderr
        row = json.loads(ok.stdout)
        assert len(row["token_ids"]) == 4 and row["finish_reason"] == "length"
        bad = cli("--prompt-ids", "5,9,14", "--temperature", "-1")  # refused here, before anything is sent
        assert bad.returncode == 2 and bad.stderr.startswith("moectl: error: temperature")
        # refused there: only the engine knows its context length
        remote = cli("--prompt-ids", "5,9,14", "--max-tokens", "1000000")
        assert remote.returncode == 2, remote.stderr
        assert remote.stderr.startswith("moectl: error: refused: prompt:") and len(remote.stderr.splitlines()) == 1
        other = cli("--prompt-ids", "5", "--devices", "2")
        assert other.returncode == 2 and "--devices: configures an engine" in other.stderr
    finally:
        engine.stop()
