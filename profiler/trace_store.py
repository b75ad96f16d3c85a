"""Crash-safe trace files: one SQLite file per profiling session.

Tables:
  header(format_version, created_unix, payload)   one row; payload = codec-encoded header dict
  steps(step, t_start, t_end, payload)            one row per engine step
  actions(time, step, kind, payload)              one row per console/engine action
  meta(key, value)                                counts kept up to date by the writer

The writer runs in WAL mode with synchronous=NORMAL: a commit is then safe against the writing
process dying (kill -9 included; only an OS crash or power loss can drop the last commits), and
commits cost no fsync. close() folds the WAL back and leaves a single self-contained file; after
a crash the committed tail may still sit in "<path>-wal", which readers pick up automatically (copy
both files together).

The engine's step loop must never wait on the disk, so TraceWriter only hands records to a
bounded queue; a thread encodes and commits them. When the queue is full the record is dropped
and counted, and the count is stored in the trace so a reader knows it has holes.
"""

from __future__ import annotations

import math
import platform
import queue
import sqlite3
import sys
import threading
import time
from pathlib import Path

import numpy as np

from moectl.profiler import codec
from moectl.profiler.codec import TraceError

__all__ = ["FORMAT_VERSION", "TraceError", "TraceReader", "TraceWriter"]

FORMAT_VERSION = 1
# PRAGMA application_id: tells a moectl trace from any other SQLite file before reading tables.
APPLICATION_ID = 0x6D6F6574  # "moet"
_SQLITE_MAGIC = b"SQLite format 3\x00"

_SCHEMA = """
CREATE TABLE header (format_version INTEGER NOT NULL, created_unix REAL NOT NULL, payload BLOB NOT NULL);
CREATE TABLE steps (step INTEGER NOT NULL, t_start REAL NOT NULL, t_end REAL NOT NULL, payload BLOB NOT NULL);
-- (step, t_start, t_end) covers step_times() and the scrub-bar queries without touching payload pages
CREATE INDEX steps_by_step ON steps (step, t_start, t_end);
CREATE INDEX steps_by_time ON steps (t_start);
CREATE TABLE actions (time REAL NOT NULL, step INTEGER NOT NULL, kind TEXT NOT NULL, payload BLOB NOT NULL);
CREATE INDEX actions_by_time ON actions (time);
CREATE INDEX actions_by_step ON actions (step);
CREATE TABLE meta (key TEXT PRIMARY KEY, value) WITHOUT ROWID;
"""

# Seeks read one index entry and one row. Ties (equal step or t_start) resolve by rowid, the
# index's hidden last column, so no query here needs a sort.
_SEEK_STEP_SQL = "SELECT payload FROM steps WHERE step >= ? ORDER BY step LIMIT 1"
_SEEK_TIME_SQL = "SELECT payload FROM steps WHERE t_start <= ? ORDER BY t_start DESC LIMIT 1"
# Range scans page by keyset (last key seen, rowid) instead of holding one statement open: an
# open read statement pins a WAL snapshot and stops the live writer's checkpoints.
_STEP_PAGE_SQL = ("SELECT step, rowid, payload FROM steps WHERE (step, rowid) > (?, ?) AND step < ? "
                  "ORDER BY step, rowid LIMIT ?")
_ACTION_PAGE_SQL = ("SELECT time, rowid, payload FROM actions WHERE (time, rowid) > (?, ?) AND time < ? "
                    "ORDER BY time, rowid LIMIT ?")

_STOP = object()
_MAX_BATCH = 512  # rows per commit when the writer is behind: bounds the memory of one batch


def software_versions() -> dict:
    """Versions of what wrote a trace. torch is looked up without importing it (an import costs
    seconds); when the process already imported it, that version is the one in use."""
    from importlib import metadata

    versions = {"python": platform.python_version(), "sqlite": sqlite3.sqlite_version, "numpy": np.__version__}
    for name in ("torch", "moectl"):
        mod = sys.modules.get(name)
        try:
            versions[name] = str(getattr(mod, "__version__", None) or metadata.version(name))
        except metadata.PackageNotFoundError:
            pass
    return versions


class TraceWriter:
    """Appends step and action records to a new trace file from a background thread.

    Records are handed over, not copied: do not mutate a record (or its arrays) after passing it
    to write_step/write_action. torch tensors are fine; they are converted on the writer thread.
    """

    def __init__(self, path, header: dict, *, queue_size: int = 1024, flush_interval_s: float = 0.25,
                 overwrite: bool = False, str_keys: bool = False):
        """str_keys: every record's dict keys are str (as the engine's are): encode on the fast path."""
        self.path = Path(path)
        self._str_keys = str_keys
        if queue_size < 1 or flush_interval_s <= 0:
            raise TraceError("queue_size must be >= 1 and flush_interval_s > 0")
        if not isinstance(header, dict):
            raise TraceError(f"header must be a dict, not {type(header).__name__}")
        if self.path.exists():
            if not overwrite:
                raise TraceError(f"{self.path} already exists (pass overwrite=True to replace it)")
            for p in (self.path, Path(f"{self.path}-wal"), Path(f"{self.path}-shm")):
                p.unlink(missing_ok=True)

        full_header = dict(header)
        full_header["format_version"] = FORMAT_VERSION
        full_header["created_unix"] = time.time()
        given = header.get("software")
        full_header["software"] = {**software_versions(), **(given if isinstance(given, dict) else {})}
        self.header = full_header
        self._conn = self._create(codec.encode(full_header))  # encoded first: a bad header leaves no file

        self._flush_interval_s = flush_interval_s
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._drop_lock = threading.Lock()
        self._dropped = 0
        self._written = 0  # rows committed (steps + actions)
        self.failed = 0  # records the thread could not encode or commit; see last_error
        self.last_error: str | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"trace-writer:{self.path.name}", daemon=True)
        self._thread.start()

    # --- caller side: must never block ---------------------------------------------------------

    def write_step(self, record: dict) -> bool:
        """Queue a step record ("step", "t_start", "t_end" required). False if it was dropped."""
        try:
            key = ("s", _step(record["step"]), _seconds(record["t_start"]), _seconds(record["t_end"]))
        except (KeyError, TypeError, ValueError) as e:
            raise TraceError(f"a step record needs int 'step' and finite 't_start', 't_end' ({e!r})") from None
        return self._put(key, record)

    def write_action(self, record: dict) -> bool:
        """Queue an action record ("time", "step", "kind" required). False if it was dropped."""
        try:
            key = ("a", _seconds(record["time"]), _step(record["step"]), str(record["kind"]))
        except (KeyError, TypeError, ValueError) as e:
            raise TraceError(f"an action record needs finite 'time', int 'step' and 'kind' ({e!r})") from None
        return self._put(key, record)

    def _put(self, key, record) -> bool:
        if self._closed:
            raise TraceError(f"trace writer for {self.path} is closed")
        try:
            self._queue.put_nowait((key, record))
            return True
        except queue.Full:
            with self._drop_lock:  # callers may write from several threads
                self._dropped += 1
            return False

    @property
    def dropped(self) -> int:
        return self._dropped

    @property
    def written(self) -> int:
        return self._written

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is committed; False if that took over timeout."""
        if self._closed:
            return True
        committed = threading.Event()  # rides the queue behind the records; set once they commit
        try:
            self._queue.put(committed, timeout=timeout)
        except queue.Full:
            return False
        return committed.wait(timeout)

    def close(self) -> None:
        """Commit everything queued, store the final counts, and leave one self-contained file."""
        if self._closed:
            return
        self._closed = True
        while self._thread.is_alive():  # close may wait for room in the queue, not for a dead thread
            try:
                self._queue.put(_STOP, timeout=0.1)
                break
            except queue.Full:
                pass
        self._thread.join()
        conn = self._conn
        try:
            conn.execute("BEGIN")
            self._store_counts(conn, final=True)
            conn.execute("COMMIT")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            try:  # a finished trace is one file, copyable alone; a reader still attached keeps it WAL
                conn.execute("PRAGMA journal_mode=DELETE")
            except sqlite3.OperationalError:
                pass
        except sqlite3.Error as e:
            raise TraceError(f"{self.path}: could not finish the trace: {e}") from None
        finally:
            conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- writer thread ----------------------------------------------------------------------------

    def _create(self, header_payload: bytes) -> sqlite3.Connection:
        try:
            # check_same_thread=False: created here, then used only by the writer thread until
            # close() has joined it
            conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("BEGIN")
            conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
            conn.execute("INSERT INTO header VALUES (?, ?, ?)",
                         (FORMAT_VERSION, self.header["created_unix"], header_payload))
            conn.execute("COMMIT")
        except sqlite3.Error as e:
            raise TraceError(f"cannot create trace {self.path}: {e}") from None
        return conn

    def _run(self) -> None:
        stop = False
        while not stop:
            item = self._queue.get()
            deadline = time.monotonic() + self._flush_interval_s
            steps, actions, waiting = [], [], None
            while True:
                if item is _STOP:
                    stop = True
                    break
                if isinstance(item, threading.Event):  # flush(): commit now, then tell it
                    waiting = item
                    break
                self._encode_into(item, steps, actions)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or len(steps) + len(actions) >= _MAX_BATCH:
                    break
                try:
                    item = self._queue.get(timeout=remaining)
                except queue.Empty:
                    break
            self._commit(steps, actions)
            if waiting is not None:
                waiting.set()

    def _encode_into(self, item, steps: list, actions: list) -> None:
        key, record = item
        try:
            payload = codec.encode(record, str_keys=self._str_keys)
        except Exception as e:  # noqa: BLE001 - one bad record must not stop the trace
            self._fail(1, f"encode: {e}")
            return
        (steps if key[0] == "s" else actions).append((*key[1:], payload))

    def _commit(self, steps: list, actions: list) -> None:
        conn = self._conn
        try:
            conn.execute("BEGIN")
            if steps:
                conn.executemany("INSERT INTO steps VALUES (?, ?, ?, ?)", steps)
            if actions:
                conn.executemany("INSERT INTO actions VALUES (?, ?, ?, ?)", actions)
            self._store_counts(conn, written=self._written + len(steps) + len(actions))
            conn.execute("COMMIT")
            self._written += len(steps) + len(actions)
        except Exception as e:  # noqa: BLE001 - e.g. disk full: count the loss, keep the thread alive
            self._fail(len(steps) + len(actions), f"commit: {e}")
            try:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass

    def _store_counts(self, conn, written: int | None = None, final: bool = False) -> None:
        # kept current at every commit, so a crashed trace still says how much it dropped
        counts = {"dropped": self._dropped, "written": self._written if written is None else written,
                  "failed": self.failed}
        if self.last_error:
            counts["last_error"] = self.last_error
        if final:
            counts["closed_unix"] = time.time()
        conn.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", counts.items())

    def _fail(self, n: int, message: str) -> None:
        self.failed += n
        self.last_error = message.splitlines()[0] if message else message


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


class TraceReader:
    """Reads a trace file, also while another process is still writing it."""

    PAGE = 64  # records fetched per query when iterating

    def __init__(self, path):
        self.path = Path(path)
        self._lock = threading.Lock()  # one connection, maybe used by a UI thread and a loader
        self._conn = None
        if not self.path.is_file():
            raise TraceError(f"{self.path}: no such trace file")
        with open(self.path, "rb") as f:
            if f.read(len(_SQLITE_MAGIC)) != _SQLITE_MAGIC:
                raise TraceError(f"{self.path}: not a moectl trace (not an SQLite database)")
        try:
            # mode=ro: never writes the trace; a live writer's WAL is still read through its -shm
            self._conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True,
                                         check_same_thread=False)
            app_id = self._conn.execute("PRAGMA application_id").fetchone()[0]
            if app_id != APPLICATION_ID:
                raise TraceError(f"{self.path}: not a moectl trace (an SQLite database of another kind)")
            row = self._conn.execute("SELECT format_version, payload FROM header").fetchone()
        except TraceError:
            self.close()
            raise
        except sqlite3.Error as e:
            self.close()
            raise TraceError(f"{self.path}: not a readable moectl trace ({e})") from None
        if row is None:
            self.close()
            raise TraceError(f"{self.path}: not a moectl trace (header row missing)")
        version, payload = row
        if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
            self.close()
            raise TraceError(f"{self.path}: trace format version {version} is not one this moectl reads "
                             f"(it reads up to {FORMAT_VERSION}; a newer moectl may)")
        self.format_version = version
        self.header = self._decode(payload, "header")

    # --- summary ------------------------------------------------------------------------------------

    @property
    def num_steps(self) -> int:
        return self._one("SELECT count(*) FROM steps")

    @property
    def first_step(self) -> int | None:
        return self._one("SELECT min(step) FROM steps")

    @property
    def last_step(self) -> int | None:
        return self._one("SELECT max(step) FROM steps")

    @property
    def duration_s(self) -> float:
        """Last step's t_end - first step's t_start; 0.0 for a trace without steps."""
        first = self._one("SELECT t_start FROM steps ORDER BY step LIMIT 1")
        last = self._one("SELECT t_end FROM steps ORDER BY step DESC LIMIT 1")
        return 0.0 if first is None else last - first

    @property
    def num_actions(self) -> int:
        return self._one("SELECT count(*) FROM actions")

    @property
    def meta(self) -> dict:
        """The writer's counts: dropped, written, failed, last_error; closed_unix once closed."""
        with self._lock:
            rows = self._query(lambda c: c.execute("SELECT key, value FROM meta").fetchall())
        return dict(rows)

    @property
    def dropped(self) -> int:
        return int(self.meta.get("dropped", 0))

    @property
    def complete(self) -> bool:
        """False while the writer is still going, or when it died before close()."""
        return "closed_unix" in self.meta

    # --- random access ------------------------------------------------------------------------------

    def seek_step(self, n: int) -> dict:
        """The record of step n, or of the first step after n when n is missing."""
        payload = self._one(_SEEK_STEP_SQL, (int(n),))
        if payload is None:
            raise TraceError(f"step {n} is past the end of the trace (last step: {self.last_step})")
        return self._decode(payload, f"step {n}")

    def seek_time(self, t: float, *, relative: bool = False) -> dict:
        """The step running at time t: the latest one with t_start <= t. t is on the trace's
        clock (the engine's monotonic seconds), or seconds since the first step's t_start."""
        t = float(t)
        if relative:
            t0 = self._one("SELECT min(t_start) FROM steps")
            if t0 is None:
                raise TraceError("the trace has no steps")
            t += t0
        payload = self._one(_SEEK_TIME_SQL, (t,))
        if payload is None:
            raise TraceError(f"time {t:.6f} s is before the first step of the trace")
        return self._decode(payload, f"step at t={t}")

    def step_times(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(step int64, t_start float64, t_end float64) of every step, in step order; read from
        the covering index, so no payload is touched."""
        with self._lock:
            rows = self._query(lambda c: c.execute(
                "SELECT step, t_start, t_end FROM steps INDEXED BY steps_by_step ORDER BY step").fetchall())
        if not rows:
            return np.zeros(0, np.int64), np.zeros(0), np.zeros(0)
        step, t_start, t_end = zip(*rows)
        return np.array(step, np.int64), np.array(t_start, np.float64), np.array(t_end, np.float64)

    # --- streaming ----------------------------------------------------------------------------------

    def steps(self, start: int | None = None, stop: int | None = None):
        """Records of steps start <= step < stop (None: open end), in step order."""
        lo = -(2**63) if start is None else int(start)
        hi = 2**63 - 1 if stop is None else int(stop)
        yield from self._pages(_STEP_PAGE_SQL, lo, hi, "step")

    def actions(self, start_time: float | None = None, end_time: float | None = None):
        """Action records with start_time <= time < end_time (None: open end), in time order."""
        lo = float("-inf") if start_time is None else float(start_time)
        hi = float("inf") if end_time is None else float(end_time)
        yield from self._pages(_ACTION_PAGE_SQL, lo, hi, "action")

    def _pages(self, sql, after_key, hi, what):
        # Keyset: each page is the rows after (last key, last rowid) seen. Rowids start at 1, so
        # (start, 0) as the first "seen" key makes the start inclusive.
        after_rowid = 0
        while True:
            with self._lock:
                rows = self._query(lambda c: c.execute(sql, (after_key, after_rowid, hi, self.PAGE)).fetchall())
            for key, rowid, payload in rows:
                yield self._decode(payload, f"{what} {key}")
            if len(rows) < self.PAGE:
                return
            after_key, after_rowid = rows[-1][0], rows[-1][1]

    # --- plumbing -----------------------------------------------------------------------------------

    def _one(self, sql, params=()):
        with self._lock:
            row = self._query(lambda c: c.execute(sql, params).fetchone())
        return None if row is None else row[0]

    def _query(self, fn):
        if self._conn is None:
            raise TraceError(f"{self.path}: trace reader is closed")
        try:
            return fn(self._conn)
        except sqlite3.Error as e:
            raise TraceError(f"{self.path}: cannot read trace ({e})") from None

    def _decode(self, payload, what) -> dict:
        try:
            return codec.decode(payload)
        except TraceError as e:
            raise TraceError(f"{self.path}: {what}: {e}") from None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"TraceReader({str(self.path)!r})"
