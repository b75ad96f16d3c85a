"""Crash-safe trace files: one SQLite file per profiling session (layout: trace_format).

TraceWriter (trace_writer) creates the file and hands every record to a writer process that
encodes and commits it, so the engine's step loop never waits on the disk or shares its GIL
with that work. A commit is safe against the writing process dying (kill -9 included); after a
crash the committed tail may still sit in "<path>-wal", which readers pick up automatically
(copy both files together). TraceReader reads a trace, also while it is being written.
"""

from __future__ import annotations

import math
import sqlite3
import threading
from pathlib import Path

import numpy as np

from moectl.profiler import codec, trace_format
from moectl.profiler.codec import TraceError
from moectl.profiler.trace_format import APPLICATION_ID, FORMAT_VERSION, software_versions
from moectl.profiler.trace_format import SQLITE_MAGIC as _SQLITE_MAGIC
from moectl.profiler.trace_writer import TraceWriter
from moectl.wire.link_spans import with_link_spans

__all__ = ["FORMAT_VERSION", "TraceError", "TraceReader", "TraceWriter", "software_versions"]

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
_DAMAGED = ("SQLITE_CORRUPT", "SQLITE_NOTADB")  # SQLite's errors for a file whose pages are not what it wrote
# the meta rows a writer keeps (trace_format.store_counts / finish) and what each must hold
_META_COUNTS = ("dropped", "written", "failed")


def _meta_problem(key, value) -> str | None:
    """What is wrong with one meta row, or None: the counts are non-negative integers,
    closed_unix and abandoned_unix times, last_error text; other keys are left to whoever wrote them."""
    if key in _META_COUNTS and (not isinstance(value, int) or value < 0):
        return "must be a non-negative integer"
    if key in ("closed_unix", "abandoned_unix") and (not isinstance(value, (int, float)) or not math.isfinite(value)):
        return "must be a time in seconds"
    if key == "last_error" and not isinstance(value, str):
        return "must be text"
    return None


def _short(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class TraceReader:
    """Reads a trace file, also while another process is still writing it."""

    PAGE = 64  # records fetched per query when iterating

    def __init__(self, path):
        self.path = Path(path)
        self._lock = threading.Lock()  # one connection, maybe used by a UI thread and a loader
        self._conn = None
        if self.path.is_dir():
            raise TraceError(f"{self.path}: is a directory, not a trace")
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
            if app_id != APPLICATION_ID and self._lost_its_wal():
                raise TraceError(f"{self.path}: a moectl trace whose writer did not close it, copied without its "
                                 "-wal file, which holds every record: nothing was checkpointed into this file, so "
                                 f"nothing can be read from it alone (put the -wal beside it as {self.path.name}-wal)")
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
        """The writer's counts: dropped, written, failed, last_error; closed_unix once closed.
        A row that does not hold what its key says is a TraceError naming the key."""
        with self._lock:
            rows = self._query(lambda c: c.execute("SELECT key, value FROM meta").fetchall())
        for key, value in rows:
            problem = _meta_problem(key, value)
            if problem:
                raise TraceError(f"{self.path}: meta row {key!r} is corrupt: {problem}, got {_short(value)}")
        return dict(rows)

    @property
    def dropped(self) -> int:
        return int(self.meta.get("dropped", 0))

    @property
    def complete(self) -> bool:
        """False while the writer is still going, or when it died before close()."""
        return "closed_unix" in self.meta

    def file_status(self) -> dict:
        """What is on disk: bytes (the trace file with its -wal and -shm, where a trace whose writer
        did not close it keeps its recent records), files (bytes of each), and state: complete,
        open (another process has it open: a recording in progress?), unclosed (its writer stopped
        without closing it; everything it committed is readable), abandoned (the recording
        process died, killed perhaps; its writer process sealed the file with every record it had
        received) or wal_missing (not closed, and no -wal beside it: if it was copied without its
        -wal, what was still in there is not here); summary: that, in words."""
        sizes = trace_format.file_sizes(self.path)
        meta = self.meta
        if "closed_unix" in meta:
            state, summary = "complete", "complete"
        elif "abandoned_unix" in meta:
            state = "abandoned"
            summary = (f"not closed: the recording process ended without closing it (killed?); its writer sealed "
                       f"the file with every record it had received ({self.num_steps} steps, all readable)")
        elif trace_format.open_elsewhere(self.path):
            state, summary = "open", "not closed: another process has it open (still being recorded?)"
        elif not sizes.get("-wal") and trace_format.in_wal_mode(self.path):  # a reader may leave an empty -wal
            state = "wal_missing"
            summary = (f"not closed cleanly, and no -wal file beside it: the {self.num_steps} steps in this file can "
                       f"be read; if it was copied without {self.path.name}-wal, steps still in that are not here")
        else:
            state = "unclosed"
            summary = "not closed cleanly (its writer stopped before closing it; every step it committed is readable)"
        return {"bytes": sum(sizes.values()), "files": sizes, "state": state, "summary": summary}

    def check_integrity(self) -> None:
        """SQLite's quick_check of every page and index of the file: a damaged one (pages
        overwritten, or cut short) is a TraceError saying what SQLite found. It reads the whole
        file (seconds for gigabytes); a record's payload damaged inside its page passes, and is
        named when the record is read."""
        def quick_check(conn):
            try:
                return [str(row[0]) for row in conn.execute("PRAGMA quick_check(1)").fetchall()]
            except sqlite3.DatabaseError as e:  # a damaged page can stop the check itself
                if getattr(e, "sqlite_errorname", "") not in _DAMAGED:
                    raise
                return [str(e)]

        with self._lock:
            found = self._query(quick_check)
        if found != ["ok"]:
            first = (found[0].strip().splitlines() or ["?"])[-1]  # past SQLite's "*** in database main ***" line
            raise TraceError(f"{self.path}: damaged: SQLite's integrity check finds {first[:200]!r}, so its records "
                             f"cannot all be read (a copy cut short, or overwritten?)")

    def _lost_its_wal(self) -> bool:
        """This WAL-mode file has no schema and no -wal beside it: a trace's writer had it open and
        nothing was checkpointed into it yet (a reader held a snapshot), and it was copied alone."""
        if trace_format.file_sizes(self.path).get("-wal") or not trace_format.in_wal_mode(self.path):
            return False  # (an empty -wal is what opening the lone copy read-only leaves beside it)
        return self._conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0

    # --- random access ------------------------------------------------------------------------------

    def seek_step(self, n: int) -> dict:
        """The record of step n, or of the first step after n when n is missing."""
        payload = self._one(_SEEK_STEP_SQL, (int(n),))
        if payload is None:
            raise TraceError(f"step {n} is past the end of the trace (last step: {self.last_step})")
        return self._decode_step(payload, f"step {n}")

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
        return self._decode_step(payload, f"step at t={t}")

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
            decode = self._decode_step if what == "step" else self._decode
            for key, rowid, payload in rows:
                yield decode(payload, f"{what} {key}")
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
            damaged = getattr(e, "sqlite_errorname", "") in _DAMAGED
            raise TraceError(f"{self.path}: {'damaged, ' if damaged else ''}cannot read trace ({e})") from None

    def _decode(self, payload, what) -> dict:
        try:
            return codec.decode(payload)
        except TraceError as e:
            raise TraceError(f"{self.path}: {what}: {e}") from None

    def _decode_step(self, payload, what) -> dict:
        """A step record with its modeled link spans derived (moectl.wire.link_spans): the engine
        records only their traffic, and every reader of the file sees the spans it once wrote."""
        return with_link_spans(self._decode(payload, what))

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
