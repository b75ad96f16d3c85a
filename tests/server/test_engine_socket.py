"""The engine socket's trust and limits (server/engine_host.py, wire/protocol.py): ownership is
the starting process's, not a client's claim; many clients connecting at once all get in (or are
told the engine is busy); a connection that has not shown the token costs neither memory nor time.

Real sockets against real engine hosts, in this process: one that builds its engine (`run`,
`web`: MOECTL_PARENT_PID names its starter) and one handed a driver (`serve`)."""

from __future__ import annotations

import os
import select
import shutil
import socket
import threading
import time
import tracemalloc
from contextlib import contextmanager

import pytest

from moectl.console.engine_client import EngineSource
from moectl.engine.core.config import EngineConfig
from moectl.engine.core.driver import EngineDriver
from moectl.engine.llm_engine import LLMEngine
from moectl.placement.topology import Topology
from moectl.server import engine_host
from moectl.server.engine_host import EngineHost
from moectl.wire import protocol
from moectl.wire.actions import ActionRefused
from moectl.wire.protocol import PARENT_PID_ENV
from tests.checkpoints import tiny_checkpoint


@pytest.fixture(scope="module")
def make_engine(tmp_path_factory, single_thread):
    ckpt = tiny_checkpoint(tmp_path_factory.mktemp("engine_socket"))
    config = EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=256, topology=Topology(num_devices=2),
                          num_threads=1)
    return lambda: LLMEngine(config)


@contextmanager
def hosted(make_engine, *, starter: int | None = None, serve: bool = False):
    """An engine host started by `starter` (run's and web's shape), or handed a driver (serve's)."""
    engine_dir, token = protocol.new_engine_dir()
    driver = EngineDriver(make_engine) if serve else None
    with pytest.MonkeyPatch.context() as patch:
        if starter is None:
            patch.delenv(PARENT_PID_ENV, raising=False)
        else:
            patch.setenv(PARENT_PID_ENV, str(starter))
        host = (EngineHost(engine_dir, token, driver=driver, name="moectl serve") if serve
                else EngineHost(engine_dir, token, make_engine=make_engine))
    try:
        yield host
    finally:
        host.stop("the test ended")
        host.close()
        if driver is not None:
            driver.close()
        shutil.rmtree(engine_dir, ignore_errors=True)


def hello(host: EngineHost, **fields) -> tuple[socket.socket, protocol.Message]:
    """A raw connection's Hello with the run's token, and the engine's answer."""
    sock = protocol.connect(host.engine_dir)
    sock.settimeout(30)
    sock.sendall(protocol.encode(protocol.Hello(token=protocol.read_token(host.engine_dir), **fields)))
    return sock, protocol.read_message(sock)


def until(condition, timeout_s: float = 30.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and not condition():
        time.sleep(0.02)
    return bool(condition())


# -- item 4: ownership belongs to the process that started the engine

def test_a_claim_of_ownership_from_another_process_is_refused_and_the_engine_serves_on(make_engine):
    """Web's shared engine: started by web (here: this process's parent), attached by others."""
    with hosted(make_engine, starter=os.getppid()) as host:
        sock, answer = hello(host, owner=True)
        sock.close()
        assert isinstance(answer, protocol.Bye) and answer.reason.startswith("refused: owner:")
        assert f"pid {os.getppid()}" in answer.reason
        with pytest.raises(ActionRefused, match="only the process that started this engine owns it"):
            EngineSource(host.engine_dir, owner=True)
        # a client's Shutdown: refused, said, and the engine serves on
        sock, answer = hello(host)
        with sock:
            assert isinstance(answer, protocol.Welcome)
            sock.sendall(protocol.encode(protocol.Shutdown(id=7)))
            while not isinstance(answer := protocol.read_message(sock), protocol.Result):
                assert not isinstance(answer, protocol.Bye), answer.reason
            assert answer.id == 7 and answer.error.startswith("shutdown: refused")
        assert host.stop_reason is None
        others = [EngineSource(host.engine_dir, timeout_s=10) for _ in range(2)]
        try:
            assert others[1].act("knobs", max_num_seqs=8).result(timeout=30) == {"knobs": {"max_num_seqs": 8}}
        finally:
            for other in others:
                other.close()
        assert host.stop_reason is None


def test_the_starting_process_owns_its_engine_and_its_quit_stops_it(make_engine):
    """`moectl run`: the console that started the engine is its owner; its close stops it."""
    with hosted(make_engine, starter=os.getpid()) as host:
        owner = EngineSource(host.engine_dir, owner=True)
        other = EngineSource(host.engine_dir)
        other.close()
        assert host.stop_reason is None  # not the owner's leaving
        owner.close()
        assert until(lambda: host.stop_reason is not None)
        assert host.stop_reason == "its console asked it to stop"


def test_serves_engine_has_no_owner_and_a_leaving_claimant_leaves_it_serving(make_engine):
    """The engine `moectl serve` runs in-process: nobody's to stop, even from the pid in the
    environment; consoles attach after a claimant has come and gone."""
    with hosted(make_engine, starter=os.getpid(), serve=True) as host:
        sock, answer = hello(host, owner=True)
        sock.close()
        assert isinstance(answer, protocol.Bye) and "this one has none" in answer.reason
        sock, answer = hello(host, client="intruder")
        with sock:
            sock.sendall(protocol.encode(protocol.Shutdown()))
            while not isinstance(answer := protocol.read_message(sock), protocol.Result):
                pass
            assert answer.error.startswith("shutdown: refused")
        consoles = [EngineSource(host.engine_dir, timeout_s=10) for _ in range(3)]
        for console in consoles:
            console.close()
        assert host.stop_reason is None


def test_a_stopped_host_refuses_new_clients_at_once_instead_of_queueing_them(make_engine):
    """serve's console endpoint once went dead after its engine host stopped: the socket still
    queued connections that nothing would accept, and each waited for its Welcome until it gave up."""
    with hosted(make_engine, serve=True) as host:
        EngineSource(host.engine_dir, timeout_s=10).close()
        host.stop("stopped by the test")
        for _ in range(3):
            with pytest.raises(ActionRefused, match="no engine listening"):
                EngineSource(host.engine_dir, timeout_s=10)


# -- item 5: many clients at once

def test_fifty_clients_connecting_at_once_all_get_a_welcome(make_engine):
    """... while a silent connection and a half-sent Hello wait for their deadline: the accept
    loop greets nobody itself."""
    with hosted(make_engine, starter=os.getppid()) as host:
        silent = protocol.connect(host.engine_dir)
        half = protocol.connect(host.engine_dir)
        half.sendall(protocol.encode(protocol.Hello(token="x"))[:6])
        sources, errors = [], []
        go = threading.Barrier(50)

        def attach(i: int) -> None:
            go.wait()
            try:
                sources.append(EngineSource(host.engine_dir, client=f"c{i}"))
            except ActionRefused as exc:
                errors.append(str(exc))
        threads = [threading.Thread(target=attach, args=(i,)) for i in range(50)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        try:
            assert not errors, f"{len(errors)} of 50 refused, e.g. {errors[0]}"
            assert len(sources) == 50
        finally:
            for source in sources:
                source.close()
            silent.close()
            half.close()


def test_a_full_queue_is_waited_out_and_then_named_busy(tmp_path):
    """protocol.connect against a listener that does not accept: EAGAIN is retried for a bounded
    time, then refused as busy; once the listener accepts, the same call gets in."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    engine_dir = protocol.new_engine_dir()[0]
    queued, accepted = [], []
    try:
        listener.bind(str(engine_dir / protocol.SOCKET_NAME))
        listener.listen(1)
        while True:  # fill its queue
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.connect(str(engine_dir / protocol.SOCKET_NAME))
            except BlockingIOError:
                sock.close()
                break
            queued.append(sock)
        with pytest.raises(protocol.ProtocolError, match="is busy: no room for a new connection") as err:
            protocol.connect(engine_dir, 0.2)
        assert "no engine listening" not in str(err.value) and "\n" not in str(err.value)

        def accept_later() -> None:
            time.sleep(0.3)
            for _ in range(len(queued) + 1):
                accepted.append(listener.accept()[0])
        acceptor = threading.Thread(target=accept_later)
        acceptor.start()
        protocol.connect(engine_dir, 30).close()
        acceptor.join()
    finally:
        for sock in queued + accepted:
            sock.close()
        listener.close()
        shutil.rmtree(engine_dir, ignore_errors=True)


# -- item 6: before the token, a small frame and one deadline

def test_the_reader_refuses_an_oversized_frame_without_allocating_it():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(protocol.LENGTH.pack(protocol.MAX_MESSAGE))  # 64 MiB announced, then nothing
        a.shutdown(socket.SHUT_WR)
        tracemalloc.start()
        try:
            with pytest.raises(protocol.ProtocolError, match=f"at most {protocol.MAX_HELLO:,}"):
                protocol.read_message(b, max_bytes=protocol.MAX_HELLO)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 1 << 20


def test_a_large_frame_before_the_token_is_refused_by_the_host_without_allocating_it(make_engine):
    with hosted(make_engine, starter=os.getppid()) as host:
        tracemalloc.start()
        try:
            with protocol.connect(host.engine_dir) as sock:
                sock.settimeout(30)
                sock.sendall(protocol.LENGTH.pack(protocol.MAX_MESSAGE))
                answer = protocol.read_message(sock)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 16 << 20, f"{peak:,} bytes allocated"  # not the 64 MiB announced
        assert isinstance(answer, protocol.Bye) and f"at most {protocol.MAX_HELLO:,}" in answer.reason
        EngineSource(host.engine_dir, timeout_s=10).close()  # and it serves on


def test_a_slow_drip_hello_is_cut_at_one_deadline(make_engine, monkeypatch):
    """A byte at a time, each well within the old per-read timeout: closed all the same."""
    monkeypatch.setattr(engine_host, "HELLO_TIMEOUT_S", 0.5)
    with hosted(make_engine, starter=os.getppid()) as host:
        closed = False
        with protocol.connect(host.engine_dir) as sock:
            sock.sendall(protocol.LENGTH.pack(1000))
            for _ in range(400):  # 20 s of drip at most, 40 times the deadline
                readable, _, _ = select.select([sock], [], [], 0.05)
                try:
                    if readable and not sock.recv(1):
                        closed = True
                        break
                    sock.sendall(b"\x00")
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
        assert closed, "a Hello trickling in a byte at a time held its connection open"
        EngineSource(host.engine_dir, timeout_s=10).close()
