"""The trace writer's own process: decodes frames from its stdin, encodes records, commits them.

Run by TraceWriter as `python -m moectl.profiler.writer_process PATH POLL_S STR_KEYS KICK_FD NICE`; never
imports torch or the engine, so it starts in a fraction of a second and none of its work runs
under the engine's GIL.

Frames (stdin): "<IqqB" header (payload length, the sender's dropped count so far, the sender's
failed count so far (records it could not pickle), kind), then the payload. Kinds: STEP (a
step record: "<qdd" step, t_start, t_end, then the record in the codec's packed layout, which
this process only seals), RECORD (pickle of (key, record): actions, and steps that cannot be
packed), FLUSH (an 8-byte sequence number: commit now and answer), STOP
(commit, finish the file, answer, exit). Answers (stdout) are JSON lines: {"ready": pid} once the
file is open, then one per FLUSH and STOP; {"fatal": one line} if the process fails. End of input
without STOP means the engine died: what arrived is committed and the file sealed with
abandoned_unix instead of closed_unix (a crashed trace, every record that reached this process in
it). Anything unexpected also goes to stderr, which TraceWriter
keeps and quotes.
"""

from __future__ import annotations

import json
import os
import pickle
import select
import signal
import struct
import sys
import time
import traceback

from moectl.profiler import codec, trace_format

FRAME = struct.Struct("<IqqB")
STEP_KEY = struct.Struct("<qdd")
RECORD, FLUSH, STOP, STEP = 0, 1, 2, 3
RECORD_KINDS = (RECORD, STEP)
MAX_BATCH = 512  # rows per commit when the writer is behind: bounds the memory of one batch
_READ = 1 << 20
NICE = 10  # default niceness: below the engine, but not so low that a CPU-bound engine starves it


def array_from_bytes(dtype: str, shape: tuple, data: bytes):
    """The writer's side of TraceWriter's array reducer (plain dtypes only)."""
    import numpy as np

    return np.frombuffer(data, dtype=dtype).reshape(shape)


class _Writer:
    def __init__(self, path: str, str_keys: bool):
        self.formats = trace_format
        self.conn = trace_format.open_for_append(path)
        self.str_keys = str_keys
        self.steps: list = []
        self.actions: list = []
        self.dropped = self.written = self.failed = 0  # failed: this process's own
        self.sender_failed = 0  # records the engine's side could not pickle (from the frame header)
        self._stored_lost = (0, 0)  # the dropped and sender-failed counts in the file's meta
        self.last_error: str | None = None
        self.encode_s = self.commit_s = 0.0
        self.records = 0

    def record(self, payload) -> None:
        t0 = time.perf_counter()
        self.records += 1
        try:
            key, record = pickle.loads(payload)
            blob = codec.encode(record, str_keys=self.str_keys)
        except Exception as e:  # noqa: BLE001 - one bad record must not stop the trace
            self._fail(1, f"encode: {e}")
        else:
            (self.steps if key[0] == "s" else self.actions).append((*key[1:], blob))
        self.encode_s += time.perf_counter() - t0
        if len(self.steps) + len(self.actions) >= MAX_BATCH:
            self.commit()

    def step(self, payload) -> None:
        t0 = time.perf_counter()
        self.records += 1
        try:
            key = STEP_KEY.unpack_from(payload)
            blob = codec.seal(payload[STEP_KEY.size:])
        except Exception as e:  # noqa: BLE001 - one bad record must not stop the trace
            self._fail(1, f"encode: {e}")
        else:
            self.steps.append((*key, blob))
        self.encode_s += time.perf_counter() - t0
        if len(self.steps) + len(self.actions) >= MAX_BATCH:
            self.commit()

    def commit(self) -> None:
        rows = len(self.steps) + len(self.actions)
        lost = (self.dropped, self.sender_failed)
        if not rows and lost == self._stored_lost:
            return
        self._stored_lost = lost
        t0 = time.perf_counter()
        try:
            self.formats.commit(self.conn, self.steps, self.actions, self.counts(self.written + rows))
            self.written += rows
        except Exception as e:  # noqa: BLE001 - e.g. disk full: count the loss, keep going
            self._fail(rows, f"commit: {e}")
        self.steps, self.actions = [], []
        self.commit_s += time.perf_counter() - t0

    def counts(self, written: int | None = None) -> dict:
        return {"dropped": self.dropped, "written": self.written if written is None else written,
                "failed": self.failed + self.sender_failed, "last_error": self.last_error}

    def status(self, **extra) -> dict:
        times = os.times()
        return {**self.counts(), "writer_failed": self.failed, "cpu_s": times.user + times.system, "encode_s": self.encode_s,
                "commit_s": self.commit_s, "records": self.records, **extra}

    def _fail(self, n: int, message: str) -> None:
        self.failed += n
        self.last_error = message.splitlines()[0] if message else message


def _answer(out, message: dict) -> None:
    out.write((json.dumps(message) + "\n").encode())


def serve(path: str, poll_s: float, str_keys: bool, fd: int, kick: int, out) -> int:
    """Wakes every poll_s (or when kicked: flush and close write a byte to `kick`) and takes
    whatever the pipe holds. It never waits on the data pipe itself: a reader blocked there is
    woken by every write, and on a busy machine that wake-up took the engine thread's core
    for milliseconds per step (measured: 20 us per write with this process stopped, 9 ms with it
    waiting in select on the pipe)."""
    writer = _Writer(path, str_keys)
    _answer(out, {"ready": os.getpid()})
    os.set_blocking(fd, False)
    buf = bytearray()
    while True:
        if select.select([kick], [], [], poll_s)[0]:
            os.read(kick, 4096)
        eof = False
        while True:
            try:
                data = os.read(fd, _READ)
            except BlockingIOError:
                break
            if not data:
                eof = True
                break
            buf += data
            if _frames(writer, buf, out):
                return 0
        writer.commit()
        if eof:  # the engine is gone without STOP: keep what arrived, sealed, and say it was not closed
            writer.formats.finish(writer.conn, writer.counts(), abandoned=True)
            writer.conn.close()
            return 0


def _frames(writer: _Writer, buf: bytearray, out) -> bool:
    """Handles the whole frames at the start of buf (and removes them); True after STOP."""
    at = 0
    view = memoryview(buf)  # payloads are read in place (released before buf is trimmed)
    try:
        while len(buf) - at >= FRAME.size:
            length, dropped, failed, kind = FRAME.unpack_from(buf, at)
            end = at + FRAME.size + length
            if end > len(buf):
                break
            writer.dropped, writer.sender_failed = dropped, failed
            with view[at + FRAME.size:end] as payload:  # released before buf is trimmed
                at = end
                if _frame(writer, kind, payload, out):
                    return True
    finally:
        view.release()
        del buf[:at]
    return False


def _frame(writer: _Writer, kind: int, payload: memoryview, out) -> bool:
    """One frame; True after STOP."""
    if kind == STEP:
        writer.step(payload)
    elif kind == RECORD:
        writer.record(payload)
    elif kind == FLUSH:
        writer.commit()
        _answer(out, writer.status(flush=struct.unpack("<q", payload)[0]))
    elif kind == STOP:
        writer.commit()
        writer.formats.finish(writer.conn, writer.counts())
        writer.conn.close()
        _answer(out, writer.status(final=True))
        return True
    else:
        raise ValueError(f"unknown frame kind {kind}")
    return False


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle; close() flushes
    # background work: on a busy machine the engine's threads go first; the pipe and close() absorb the delay
    try:
        os.nice(int(argv[4]) if len(argv) > 4 else NICE)
    except (OSError, ValueError):
        pass
    out = os.fdopen(sys.stdout.fileno(), "wb", buffering=0)
    try:
        path, poll_s, str_keys, kick = argv[0], float(argv[1]), argv[2] == "1", int(argv[3])
        return serve(path, poll_s, str_keys, sys.stdin.fileno(), kick, out)
    except BaseException as e:  # noqa: BLE001 - the engine reads this one line at close
        traceback.print_exc()  # to the stderr file TraceWriter keeps
        message = f"{type(e).__name__}: {e}".splitlines()[0]
        try:
            _answer(out, {"fatal": message})
        except OSError:
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
