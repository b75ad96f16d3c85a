"""TraceWriter: the engine's side of a trace file, handing records to a writer process.

The engine's step loop must never wait on the disk, nor share its GIL with encoding or SQLite.
So the file is created here (schema and header, once), and every record after that is written
into a pipe to `writer_process`, which encodes and commits it: a step record packed in the codec's
binary layout (msgspec, one C call; the writer only compresses it), an action or a step that cannot
be packed pickled (the writer encodes it). The writer process
answers "ready" once the file is open; the constructor waits for that (a writer that cannot
start is a TraceError there, quoting its stderr, not a silently lost session).

A write never blocks: what the pipe cannot take at once waits in a local backlog of at most
queue_size records and max_backlog_bytes bytes; a record arriving with the backlog full is
dropped and counted; that count and the count of records that could not be pickled travel
with every frame, so the trace file itself says how much it lost, also after a crash.

With batch_s > 0 (the engine's recorder: TraceRecorder) records are batched: their frames
gather here and go into the pipe together, in one write, by the write that finds BATCH_RECORDS
of them or BATCH_BYTES waiting or the batch batch_s old, and at flush(), close() and a read of
`pending`: one system call for many steps instead of one each. A batch no write came to send
(the engine went idle) is sent by a sender thread once it is twice batch_s old: the thread
never contends with a stepping engine for the lock (whose holder may sit in a pipe write with
the GIL released: on a loaded machine such a wait cost the engine thread milliseconds) and
sleeps while no batch waits. The file's crash rule (kill -9 loses at most the last second)
holds: 2 * batch_s is well under it.

The backlog goes into the pipe at the next write, flush(), close() and read of `pending`;
when the pipe is full the writer process is woken (a byte on its kick pipe) so that it drains
promptly. Only the batch has a thread: while the engine is idle, a backlog (only ever there
when the writer process is behind) stays here, and live readers of the file do not see those
records until the next write or flush. A writer that is never closed is closed at interpreter
exit (atexit, bounded by EXIT_CLOSE_S); one garbage-collected unclosed, or a process killed
outright, loses its backlog and batch: the file then holds what reached the pipe, as a crashed
trace.
"""

from __future__ import annotations

import atexit
import contextlib
import copyreg
import fcntl
import io
import json
import logging
import math
import os
import pickle
import select
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from pathlib import Path

import numpy as np

from moectl.profiler import codec, trace_format
from moectl.profiler.codec import TraceError
from moectl.profiler.writer_process import (
    FLUSH,
    FRAME,
    NICE,
    RECORD,
    RECORD_KINDS,
    STEP,
    STEP_KEY,
    STOP,
    array_from_bytes,
)

log = logging.getLogger(__name__)

_PIPE_BYTES = 1 << 20  # the most Linux gives an unprivileged pipe by default (fs.pipe-max-size)
_WRITER_MODULE = "moectl.profiler.writer_process"
MAX_BACKLOG_BYTES = 128 << 20  # default byte budget of the local backlog: ~1000 engine step records
# (~130 KB pickled), or the 256 synthetic 410 KB records bench/console_bench.py keeps in flight
EXIT_CLOSE_S = 10.0  # the most an unclosed writer's close at interpreter exit waits
READY_TIMEOUT_S = 30.0  # the most the constructor waits for the writer process to open the file
BATCH_RECORDS = 32  # a batch goes into the pipe once it holds this many records (well under IOV_MAX frames)
BATCH_BYTES = 256 << 10  # or this many bytes
_POLL_S = 0.05  # how often waits look again (process exit, a concurrent close)


def _reduce_array(a: np.ndarray):
    # numpy's own reduce costs ~8x this for the small arrays of a step record (dtype, shape, bytes)
    if a.dtype.fields is not None or a.dtype.hasobject:
        return a.__reduce_ex__(5)
    return array_from_bytes, (a.dtype.str, a.shape, a.tobytes())


def _reduce_tensor(torch, t):
    """A torch tensor crosses as the numpy array it holds: the writer never imports torch (nor
    initialises CUDA) to unpickle it, and reads it back as numpy, as the codec stores it."""
    t = t.detach()
    if t.dtype == torch.bfloat16 or "float8" in str(t.dtype):
        t = t.float()  # no numpy dtype for these
    return _reduce_array(np.ascontiguousarray(t.cpu().numpy()))


class _Pickler(pickle.Pickler):
    dispatch_table = {**copyreg.dispatch_table, np.ndarray: _reduce_array}

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")  # imported by whoever made the tensor; never imported here
        if torch is not None and isinstance(obj, torch.Tensor):
            return _reduce_tensor(torch, obj)
        return NotImplemented


def _dumps(obj) -> memoryview:
    out = io.BytesIO()
    _Pickler(out, protocol=5).dump(obj)
    return out.getbuffer()  # no copy: the frame's payload is the pickler's own buffer


_open_writers: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """Writers left open at interpreter exit are closed (bounded): their backlog is not lost."""
    for writer in list(_open_writers):
        try:
            writer.close(timeout=EXIT_CLOSE_S)
        except TraceError as e:
            print(f"moectl: {e}", file=sys.stderr)


class TraceWriter:
    """Appends step and action records to a new trace file through a writer process.

    Records are packed or pickled on the calling thread (numpy arrays included; torch tensors become numpy
    arrays): mutating a record after write_step/write_action returns does not change what is
    written. Every method may be called from any thread.
    """

    def __init__(self, path, header: dict, *, queue_size: int = 1024, flush_interval_s: float = 0.25,
                 overwrite: bool = False, str_keys: bool = False, max_backlog_bytes: int = MAX_BACKLOG_BYTES,
                 nice: int = NICE, batch_s: float = 0.0):
        """str_keys: every record's dict keys are str (as the engine's are): encode on the fast path.
        nice: the writer process's niceness increment (background work, but not starved).
        batch_s: > 0 batches records, each batch in the pipe at the latest this long after its first."""
        self.path = Path(path)
        if queue_size < 1 or not flush_interval_s > 0 or max_backlog_bytes < 1 or not batch_s >= 0:
            raise TraceError("queue_size and max_backlog_bytes must be >= 1, flush_interval_s > 0 and batch_s >= 0")
        if not isinstance(header, dict):
            raise TraceError(f"header must be a dict, not {type(header).__name__}")
        if self.path.exists():
            if not overwrite:
                raise TraceError(f"{self.path} already exists (pass overwrite=True to replace it)")
            for p in (self.path, Path(f"{self.path}-wal"), Path(f"{self.path}-shm")):
                p.unlink(missing_ok=True)
        full_header = dict(header)
        full_header["format_version"] = trace_format.FORMAT_VERSION
        full_header["created_unix"] = time.time()
        given = header.get("software")
        full_header["software"] = {**trace_format.software_versions(), **(given if isinstance(given, dict) else {})}
        self.header = full_header
        payload = codec.encode(full_header)  # encoded first: a bad header leaves no file
        trace_format.create(self.path, full_header["created_unix"], payload)

        self._queue_size = queue_size
        self._max_backlog_bytes = max_backlog_bytes
        self._backlog: deque = deque()  # [records, [unwritten parts of its frames]] not yet in the pipe
        self._backlog_bytes = 0
        self._backlog_records = 0
        self._batch: list[memoryview] = []  # the frames' parts of records not yet in the backlog
        self._batch_records = self._batch_bytes = 0
        self._batch_t0 = 0.0  # when the batch's first record came (time.monotonic)
        self._batch_s = batch_s
        self._batch_waits = threading.Event()  # set when a batch begins: the sender looks at it later
        self._stop = threading.Event()  # set by close: the sender thread ends
        # seconds of batch work outside write_step/write_action (batch_s > 0), each written by one
        # thread only: the sender thread's looks and sends, and flush()'s send of a waiting batch
        self._sender_thread_s = self._flush_batch_s = 0.0
        self._lock = threading.Lock()  # the backlog, the pipe's fds, the counts, _closed
        self._read_lock = threading.Lock()  # one reader of the answers at a time
        self._dropped = 0
        self._local_failed = 0
        self._local_error: str | None = None
        self._status: dict = {}  # the writer process's last answer
        self._flushes = 0  # FLUSH frames sent (their sequence numbers)
        self._answered = 0  # the highest FLUSH answered (answers come in order)
        self._answers = b""
        self._ready = False
        self._final: dict | None = None
        self._fatal: str | None = None
        self._out_eof = False
        self._broken: str | None = None
        self._lost = 0  # records in the backlog when the writer was found gone
        self._kicked = False
        self._closed = False
        self._close_ok = False
        self._done = False  # close() has finished (either way)
        self.handoff_s = 0.0  # this side's seconds in write_step/write_action (pack or pickle, and pipe)
        self._stderr = tempfile.TemporaryFile()  # the writer's stderr: quoted when it fails
        self._stderr_last = ""
        kick_read, self._kick = os.pipe()  # flush, close and a full pipe wake the writer through this
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", _WRITER_MODULE, str(self.path), repr(flush_interval_s),
                 "1" if str_keys else "0", str(kick_read), str(int(nice))], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=self._stderr, bufsize=0, close_fds=True, pass_fds=(kick_read,),
                start_new_session=True)
        except OSError as e:
            os.close(self._kick)
            self._stderr.close()
            raise TraceError(f"{self.path}: cannot start the trace writer process: {e}") from None
        finally:
            os.close(kick_read)
        os.set_blocking(self._kick, False)
        self._fd = self._proc.stdin.fileno()
        self._out = self._proc.stdout.fileno()
        with contextlib.suppress(OSError):  # a bigger pipe absorbs bursts; the default one works too
            fcntl.fcntl(self._fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        os.set_blocking(self._fd, False)
        os.set_blocking(self._out, False)
        self._wait_ready(time.monotonic() + READY_TIMEOUT_S)
        _open_writers.add(self)
        if batch_s > 0:
            _start_sender(self)

    def _wait_ready(self, deadline: float) -> None:
        """Until the writer process has the file open; a process that dies first is a TraceError
        (quoting its stderr). One still starting at deadline (a very busy machine) is let be."""
        with self._read_lock:
            while not self._ready and time.monotonic() < deadline:
                self._read_answers(min(_POLL_S * 4, max(0.0, deadline - time.monotonic())))
                if self._ready:
                    return
                if self._out_eof or self._fatal is not None:
                    break
        if self._ready or (self._fatal is None and not self._out_eof):
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(5)
        code = self._proc.poll()
        reason = self._fatal or self._stderr_tail() or "no output"
        self._release(kill=True)
        for p in (self.path, Path(f"{self.path}-wal"), Path(f"{self.path}-shm")):
            p.unlink(missing_ok=True)
        raise TraceError(f"{self.path}: the trace writer process failed at start-up (exit code {code}: {reason})")

    # --- caller side: must never block ---------------------------------------------------------

    def write_step(self, record: dict) -> bool:
        """Hand a step record ("step", "t_start", "t_end" required) over. False if it was dropped."""
        try:
            key = ("s", _step(record["step"]), _seconds(record["t_start"]), _seconds(record["t_end"]))
        except (KeyError, TypeError, ValueError) as e:
            raise TraceError(f"a step record needs int 'step' and finite 't_start', 't_end' ({e!r})") from None
        t0 = time.perf_counter()
        try:  # the packed layout: no pickle here, and the writer process only compresses it
            packed = codec.pack(record)
        except Exception:  # noqa: BLE001 - e.g. an int past 64 bits, a tensor .numpy() refuses, a cycle:
            return self._put(key, record, t0=t0)  # the general path keeps it, or counts it failed
        return self._put(key, record, STEP, STEP_KEY.pack(*key[1:]) + packed, t0=t0)

    def write_action(self, record: dict) -> bool:
        """Hand an action record ("time", "step", "kind" required) over. False if it was dropped."""
        try:
            key = ("a", _seconds(record["time"]), _step(record["step"]), str(record["kind"]))
        except (KeyError, TypeError, ValueError) as e:
            raise TraceError(f"an action record needs finite 'time', int 'step' and 'kind' ({e!r})") from None
        return self._put(key, record)

    def _put(self, key, record, kind: int = RECORD, payload=None, t0: float | None = None) -> bool:
        t0 = time.perf_counter() if t0 is None else t0
        if self._closed:  # a hint only: checked again under the lock
            raise TraceError(f"trace writer for {self.path} is closed")
        try:
            if payload is None:
                payload = _dumps((key, record))
        except Exception as e:  # noqa: BLE001 - the record cannot cross to the writer: count it as failed
            with self._lock:
                self._local_failed += 1
                self._local_error = f"encode: {type(e).__name__}: {e}".splitlines()[0]
            return False
        with self._lock:
            if self._closed:
                raise TraceError(f"trace writer for {self.path} is closed")
            if self._backlog:
                self._drain()
            size = FRAME.size + len(payload)
            if (self._broken is not None or self._backlog_records + self._batch_records >= self._queue_size
                    or self._backlog_bytes + self._batch_bytes + size > self._max_backlog_bytes):
                self._dropped += 1
                accepted = False
            elif self._batch_s > 0:
                self._add_to_batch(kind, payload)
                accepted = True
            else:
                self._append(kind, payload)
                self._drain()
                accepted = True
            self.handoff_s += time.perf_counter() - t0
        return accepted

    def _frame(self, kind: int, payload) -> list[memoryview]:
        """A frame's parts: header and payload apart (the payload is not copied)."""
        header = FRAME.pack(len(payload), self._dropped, self._local_failed, kind)
        return [memoryview(header), memoryview(payload)] if len(payload) else [memoryview(header)]

    def _append(self, kind: int, payload) -> None:
        """A frame at the end of the backlog, after the batch (records keep their order). Under self._lock."""
        self._seal_batch()
        self._backlog.append([1 if kind in RECORD_KINDS else 0, self._frame(kind, payload)])
        self._backlog_bytes += FRAME.size + len(payload)
        self._backlog_records += kind in RECORD_KINDS

    def _add_to_batch(self, kind: int, payload) -> None:
        """A record's frame into the batch; a full or batch_s old batch goes into the pipe now.
        Under self._lock."""
        now = time.monotonic()
        first = not self._batch_records
        if first:
            self._batch_t0 = now
        self._batch += self._frame(kind, payload)
        self._batch_records += 1
        self._batch_bytes += FRAME.size + len(payload)
        if first:  # after the count: a sender woken now must see the batch it was woken for
            self._batch_waits.set()
        if (self._batch_records >= BATCH_RECORDS or self._batch_bytes >= BATCH_BYTES
                or now - self._batch_t0 >= self._batch_s):
            self._seal_batch()
            self._drain()

    def _seal_batch(self) -> None:
        """The batch, whole frames one after another, becomes one backlog entry: one write. Under self._lock."""
        if not self._batch_records:
            return
        self._backlog.append([self._batch_records, self._batch])
        self._backlog_bytes += self._batch_bytes
        self._backlog_records += self._batch_records
        self._batch, self._batch_records, self._batch_bytes = [], 0, 0

    def _overdue_at(self) -> float | None:
        """When the waiting batch is the sender's to send (None: no batch waits). Read without
        the lock: a stale answer only makes the sender look once more."""
        return self._batch_t0 + 2 * self._batch_s if self._batch_records else None

    def _sender_look(self) -> float | None:
        """The sender thread's look: an overdue batch (no write came to send it) into the pipe.
        When to look next, None while no batch waits. Timed, the look included: its wake-up is
        this process's work too. The lock is taken only for an overdue batch: a stepping
        engine's writes send theirs first, so the two never wait on each other then."""
        t0 = time.perf_counter()
        due = self._overdue_at()
        if due is not None and due <= time.monotonic():
            with self._lock:
                due = self._overdue_at()
                if not self._closed and due is not None and due <= time.monotonic():
                    self._seal_batch()
                    self._drain()
                due = self._overdue_at()
        self._sender_thread_s += time.perf_counter() - t0
        return due

    @property
    def sender_s(self) -> float:
        """Seconds of batch work outside write_step/write_action: the sender thread's (its looks
        and sends) and flush()'s sends of a waiting batch."""
        return self._sender_thread_s + self._flush_batch_s

    def _drain(self) -> bool:
        """Into the pipe what fits now, frame by frame (a partial write keeps its tail first in
        line, so frames stay whole). True once the backlog is empty. Under self._lock."""
        backlog = self._backlog
        while backlog:
            if self._fd < 0 or self._broken is not None:
                return False
            parts = backlog[0][1]
            try:
                n = os.writev(self._fd, parts)
            except BlockingIOError:
                self._wake_writer()
                return False
            except OSError as e:  # EPIPE: the writer process is gone
                self._mark_broken(f"{type(e).__name__}: {e}")
                return False
            self._backlog_bytes -= n
            while parts and n >= len(parts[0]):
                n -= len(parts[0])
                parts.pop(0)
            if parts:
                parts[0] = parts[0][n:]
                self._wake_writer()
                return False
            self._backlog_records -= backlog.popleft()[0]
        self._kicked = False
        return True

    def _wake_writer(self) -> None:
        """The pipe is full: wake the writer now rather than at its next poll (once per full pipe)."""
        if not self._kicked and self._kick >= 0:
            self._kicked = True
            with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
                os.write(self._kick, b"k")

    def _mark_broken(self, reason: str) -> None:
        """The writer process is gone: what waits here can never be written (counted as dropped,
        and reported by close); one warning in the log, the first time. Under self._lock."""
        if self._broken is not None:
            return
        self._broken = reason
        self._seal_batch()
        lost = sum(records for records, _ in self._backlog)
        self._lost += lost
        self._dropped += lost
        self._backlog.clear()
        self._backlog_bytes = self._backlog_records = 0
        tail = self._stderr_tail()
        log.warning("the trace writer process for %s failed (%s)%s; recording to it stops", self.path, reason,
                    f": {tail}" if tail else "")

    def _stderr_tail(self) -> str:
        """The last line the writer process wrote to its stderr, if any."""
        if self._stderr.closed:
            return self._stderr_last
        try:
            size = os.fstat(self._stderr.fileno()).st_size
            data = os.pread(self._stderr.fileno(), 4096, max(0, size - 4096))
        except (OSError, ValueError):
            return ""
        lines = [line.strip() for line in data.decode(errors="replace").splitlines() if line.strip()]
        return lines[-1] if lines else ""

    # --- counts ----------------------------------------------------------------------------------

    @property
    def dropped(self) -> int:
        return self._dropped

    @property
    def written(self) -> int:
        """Rows committed, as of the writer process's last answer (flush() or close())."""
        return int(self._status.get("written", 0))

    @property
    def failed(self) -> int:
        """Records that could not be pickled (here) or encoded or committed (there); see last_error."""
        return self._local_failed + int(self._status.get("writer_failed", 0))

    @property
    def last_error(self) -> str | None:
        return self._status.get("last_error") or self._local_error

    @property
    def pending(self) -> int:
        """Records waiting on this side for room in the pipe, after moving what the pipe takes now
        (so a caller waiting for this to fall sees it fall). 0 once the writer is gone. It seals
        the open batch: a caller that reads it every step turns batching off (tests and drains
        read it, the engine's path does not)."""
        with self._lock:
            self._seal_batch()
            self._drain()
            return self._backlog_records

    @property
    def backlog_bytes(self) -> int:
        return self._backlog_bytes + self._batch_bytes

    @property
    def writer_pid(self) -> int:
        return self._proc.pid

    @property
    def writer_stats(self) -> dict:
        """The writer process's own figures at its last answer: cpu_s (user + system), encode_s
        (unpickle and encode, or seal), commit_s (SQLite), records."""
        return {k: self._status[k] for k in ("cpu_s", "encode_s", "commit_s", "records") if k in self._status}

    # --- flush and close -----------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything handed over so far is committed; False if that took over timeout
        or the writer process is gone. Safe from several threads at once."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            closed = self._closed
            if not closed:
                self._flushes += 1
                seq = self._flushes
                t0, batched = time.perf_counter(), self._batch_records > 0
                self._append(FLUSH, seq.to_bytes(8, "little", signed=True))  # after the batch
                tail = not self._drain()  # part of it still waits here: kick again once it is in
                if batched:  # the batch's write is the hand-off's, done here instead of in a write
                    self._flush_batch_s += time.perf_counter() - t0
                # woken after the frame is in the pipe: a writer woken before it would find nothing,
                # go back to sleep, and answer at its next poll (tests/profiler/test_trace_store.py)
                self._kicked = False
                self._wake_writer()
        if closed:
            return self._wait_closed(deadline)
        while self._answered < seq:
            if self._broken is not None:
                return False
            if self._closed:
                return self._wait_closed(deadline)
            wait = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            if wait <= 0:
                return False
            with self._lock:
                if not self._drain():
                    wait = min(wait, 0.01)  # the pipe is full: come back soon to push the rest
                    tail = True
                elif tail:  # the rest went in after the last kick: wake the writer for it
                    tail = False
                    self._wake_writer()
            if not self._read_lock.acquire(timeout=wait):
                continue
            try:
                if self._answered < seq and not self._closed:
                    self._read_answers(wait)
                    self._check_alive()
            finally:
                self._read_lock.release()
        return True

    def _wait_closed(self, deadline: float | None) -> bool:
        """flush() during or after close(): True once close() committed everything."""
        while not self._done:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)
        return self._close_ok

    def _read_answers(self, wait: float) -> None:
        """Whatever answers the writer process has written, waiting at most `wait` for the first.
        Under self._read_lock; never blocks in os.read (the fd is non-blocking)."""
        if self._out < 0 or self._out_eof:
            return
        if b"\n" not in self._answers and not select.select([self._out], [], [], max(wait, 0.0))[0]:
            return
        while True:
            try:
                data = os.read(self._out, 65536)
            except BlockingIOError:
                break
            except OSError:
                self._out_eof = True
                break
            if not data:
                self._out_eof = True
                break
            self._answers += data
        *lines, self._answers = self._answers.split(b"\n")
        for line in lines:
            try:
                answer = json.loads(line)
            except ValueError:
                continue
            if "fatal" in answer:
                self._fatal = str(answer["fatal"])
            elif "ready" in answer:
                self._ready = True
            else:
                self._status = answer
                if "flush" in answer:
                    self._answered = max(self._answered, int(answer["flush"]))
                if answer.get("final"):
                    self._final = answer
                    self._answered = max(self._answered, self._flushes)

    def _check_alive(self) -> None:
        if self._out_eof or self._fatal is not None:
            with self._lock:
                self._mark_broken(self._fatal or f"the writer process exited (code {self._proc.poll()})")

    def close(self, timeout: float = 30.0) -> None:
        """Commit everything handed over, store the final counts, and leave one self-contained
        file. A writer process that failed, or did not finish within timeout seconds (it is then
        killed), is a TraceError here, in one line. Never holds the writers' lock while waiting."""
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._closed:
                return
            self._closed = True
            _open_writers.discard(self)
            self._stop.set()  # the sender thread ends; the batch goes out here, before STOP
            self._batch_waits.set()
            if self._broken is None:
                self._append(STOP, b"")  # after the batch (a broken writer's was counted lost)
            backlog, self._backlog = self._backlog, deque()
            self._backlog_bytes = self._backlog_records = 0
            fd, self._fd = self._fd, -1
            kick, self._kick = self._kick, -1
        try:
            self._finish(backlog, fd, kick, deadline, timeout)
            self._close_ok = True
        finally:
            self._done = True

    def _finish(self, backlog: deque, fd: int, kick: int, deadline: float, timeout: float) -> None:
        timed_out = False
        with contextlib.suppress(OSError):
            os.write(kick, b"k")
        while backlog and self._broken is None:  # the rest, this thread alone owning fd now
            parts = backlog[0][1]
            try:
                n = os.writev(fd, parts)
            except BlockingIOError:
                n = 0
            except OSError as e:
                with self._lock:
                    self._backlog = backlog  # counted as lost by _mark_broken
                    self._mark_broken(f"{type(e).__name__}: {e}")
                    backlog = deque()
                break
            while parts and n >= len(parts[0]):
                n -= len(parts[0])
                parts.pop(0)
            if parts:
                parts[0] = parts[0][n:]
                if time.monotonic() >= deadline:
                    timed_out = True
                    break
                select.select([], [fd], [], min(_POLL_S, max(0.0, deadline - time.monotonic())))
                if self._proc.poll() is not None:
                    continue  # the next write fails with EPIPE
            else:
                backlog.popleft()
        lost = sum(records for records, _ in backlog)
        with contextlib.suppress(OSError):
            self._proc.stdin.close()
        with contextlib.suppress(OSError):
            os.write(kick, b"k")
        os.close(kick)
        # the answers up to the final one (or the end of the writer's output)
        got_lock = self._read_lock.acquire(timeout=max(0.0, deadline - time.monotonic()))
        try:
            while (got_lock and not timed_out and self._final is None and self._fatal is None
                   and not self._out_eof):
                wait = deadline - time.monotonic()
                if wait <= 0:
                    timed_out = True
                    break
                self._read_answers(min(wait, _POLL_S * 4))
            if not got_lock:
                timed_out = True
            code = None
            if not timed_out:
                try:
                    code = self._proc.wait(max(0.01, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
            self._release(kill=timed_out)
            code = self._proc.returncode if code is None else code
        finally:
            if got_lock:
                self._read_lock.release()
        if timed_out:
            raise TraceError(f"{self.path}: the trace writer process did not finish within {timeout:g} s and was "
                             f"killed; the trace is incomplete" + (f", {lost} records not written" if lost else ""))
        if self._final is not None and code == 0:
            return
        if self._broken is None:  # it died after taking every write (the pipe buffer held them): say so once
            with self._lock:
                self._mark_broken(self._fatal or f"the writer process exited (code {code})")
        lost += self._lost
        reason = self._fatal or self._broken or "no final answer"
        tail = self._stderr_tail()
        if tail and tail not in reason:
            reason = f"{reason}; stderr: {tail}"
        raise TraceError(f"{self.path}: the trace writer process failed (exit code {code}: {reason}); the trace "
                         f"is incomplete" + (f", {lost} records not written" if lost else ""))

    def _release(self, kill: bool) -> None:
        """The process (killed if asked) and every fd this side holds; the caller holds no lock but
        may hold _read_lock."""
        if kill and self._proc.poll() is None:
            with contextlib.suppress(OSError):
                self._proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(10)
        for f in (self._proc.stdin, self._proc.stdout):
            with contextlib.suppress(OSError):
                f.close()
        with self._lock:
            self._fd = self._out = -1
            if self._kick >= 0:
                with contextlib.suppress(OSError):
                    os.close(self._kick)
                self._kick = -1
        self._stderr_last = self._stderr_tail()
        with contextlib.suppress(OSError):
            self._stderr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _step(x) -> int:
    # checked here, on the caller's thread: a bad key would fail the insert of a whole batch
    n = int(x)
    if not -(2**63) <= n < 2**63:
        raise ValueError(f"step {n} does not fit in 64 bits")
    return n


def _seconds(x) -> float:
    t = float(x)
    if not math.isfinite(t):
        raise ValueError(f"time {t} is not finite")
    return t


def _start_sender(writer: TraceWriter) -> None:
    """The thread that sends a batch no write came to send. It holds the writer only weakly (one
    never closed is still collected, which ends the thread), sleeps on an event while no batch
    waits, and otherwise until the waiting batch is overdue."""
    ref, waits, stop = weakref.ref(writer), writer._batch_waits, writer._stop

    def run() -> None:
        while not stop.is_set():
            waits.wait()
            waits.clear()  # before looking: a batch begun after the look sets it again
            while not stop.is_set():
                w = ref()
                if w is None:
                    return
                due = w._sender_look()
                del w
                if due is None or stop.wait(max(0.0, due - time.monotonic())):
                    break

    weakref.finalize(writer, lambda: (stop.set(), waits.set()))
    threading.Thread(target=run, name="moectl-trace-batch", daemon=True).start()
