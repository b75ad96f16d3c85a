"""The trace file's SQLite layout, and the writes every trace writer shares.

Tables:
  header(format_version, created_unix, payload)   one row; payload = codec-encoded header dict
  steps(step, t_start, t_end, payload)            one row per engine step
  actions(time, step, kind, payload)              one row per console/engine action
  meta(key, value)                                counts kept up to date by the writer

Writers run in WAL mode with synchronous=NORMAL: a commit is then safe against the writing
process dying (kill -9 included; only an OS crash or power loss can drop the last commits), and
commits cost no fsync. `finish` folds the WAL back and leaves a single self-contained file.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sqlite3
import struct
import sys
import time
from pathlib import Path

import numpy as np

from moectl.profiler.codec import TraceError

# 2: step records in the codec's packed layout (payload version 2); a reader of 1 would open the
# file and then fail on every step, so it refuses the file at open instead. 3: that layout
# compressed with zstd (payload version 3), refused by readers of 2 the same way. This reader
# reads all three.
FORMAT_VERSION = 3
# PRAGMA application_id: tells a moectl trace from any other SQLite file before reading tables.
APPLICATION_ID = 0x6D6F6574  # "moet"
SQLITE_MAGIC = b"SQLite format 3\x00"
# SQLite's file header: bytes 18 and 19 (write and read format) are 2 for a WAL-mode database
_HEADER_FORMAT_BYTES = slice(18, 20)
# SQLite's unix VFS: every connection to a WAL database holds a read lock on this byte of the
# -shm file (the "dead man switch"); a lock held there by another process means it is open there
_SHM_DMS_BYTE = 128
SIDECARS = ("-wal", "-shm")  # SQLite's files beside a WAL-mode trace

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


def sidecar(path, suffix: str) -> Path:
    return Path(f"{path}{suffix}")


@contextlib.contextmanager
def written_whole(path, overwrite: bool = False):
    """A path beside `path` for a writer to make a whole trace at (an import): moved onto `path`
    when the block ends, removed when it raises. So a failed write leaves no half-written trace,
    one its closed writer made "complete", and replaces no trace that was there (a process
    killed meanwhile leaves its "<name>.<pid>.partial" file, never a trace by the name asked for)."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise TraceError(f"{path} already exists (pass overwrite=True to replace it)")
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        yield partial
    except BaseException:
        for p in (partial, *(sidecar(partial, s) for s in SIDECARS)):
            p.unlink(missing_ok=True)
        raise
    for suffix in SIDECARS:  # an old trace's -wal beside the new file would be read as part of it
        sidecar(path, suffix).unlink(missing_ok=True)
    os.replace(partial, path)
    for suffix in SIDECARS:  # what closing left beside the partial file (its -wal checkpointed, empty)
        sidecar(partial, suffix).unlink(missing_ok=True)


def file_sizes(path) -> dict[str, int]:
    """Bytes on disk of the trace file ("") and of each -wal/-shm file beside it that exists: a
    trace whose writer did not close it may hold most of its records in the -wal."""
    sizes = {"": Path(path).stat().st_size}
    for suffix in SIDECARS:
        try:
            sizes[suffix] = sidecar(path, suffix).stat().st_size
        except FileNotFoundError:
            pass
    return sizes


def in_wal_mode(path) -> bool:
    """The file's own header says WAL mode: its writer had it open (finish() leaves rollback mode)."""
    with open(path, "rb") as f:
        return f.read(_HEADER_FORMAT_BYTES.stop)[_HEADER_FORMAT_BYTES] == b"\x02\x02"


def open_elsewhere(path) -> bool | None:
    """Another process has this WAL-mode trace open (a writer still recording, or a reader): it
    holds SQLite's read lock on the -shm's dead-man-switch byte. None: cannot tell (no fcntl)."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fd = os.open(sidecar(path, "-shm"), os.O_RDONLY)
    except FileNotFoundError:
        return False  # every connection to a WAL database maps the -shm: no -shm, nobody has it open
    except OSError:
        return None
    try:
        # struct flock on Linux: l_type, l_whence (short), l_start, l_len (off_t), l_pid (pid_t), padding
        probe = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, _SHM_DMS_BYTE, 1, 0)
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, probe)  # our own process's locks never conflict
        return struct.unpack("hhqqi4x", answer)[0] != fcntl.F_UNLCK
    except (OSError, struct.error):
        return None
    finally:
        os.close(fd)


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


def create(path: Path, created_unix: float, header_payload: bytes) -> None:
    """A new trace file with its schema and header row, committed and closed."""
    conn = None
    try:
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")  # persistent: the writer process finds it set
        conn.execute("BEGIN")
        conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                conn.execute(statement)
        conn.execute("INSERT INTO header VALUES (?, ?, ?)", (FORMAT_VERSION, created_unix, header_payload))
        store_counts(conn, {"dropped": 0, "written": 0, "failed": 0})
        conn.execute("COMMIT")
    except sqlite3.Error as e:
        raise TraceError(f"cannot create trace {path}: {e}") from None
    finally:
        if conn is not None:
            conn.close()


def open_for_append(path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


def commit(conn: sqlite3.Connection, steps: list, actions: list, counts: dict) -> None:
    """One transaction: the rows, then the counts, so a crashed trace still says what it lost."""
    conn.execute("BEGIN")
    try:
        if steps:
            conn.executemany("INSERT INTO steps VALUES (?, ?, ?, ?)", steps)
        if actions:
            conn.executemany("INSERT INTO actions VALUES (?, ?, ?, ?)", actions)
        store_counts(conn, counts)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def store_counts(conn: sqlite3.Connection, counts: dict) -> None:
    conn.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", [(k, v) for k, v in counts.items() if v is not None])


def finish(conn: sqlite3.Connection, counts: dict, *, abandoned: bool = False) -> None:
    """The final counts and closed_unix, then one self-contained file (no -wal beside it).
    abandoned: the engine went without closing the trace (killed): abandoned_unix instead of
    closed_unix, so the trace still reads as not closed, but as sealed by its writer with every
    record it received, not as one whose -wal may be missing."""
    conn.execute("BEGIN")
    store_counts(conn, {**counts, ("abandoned_unix" if abandoned else "closed_unix"): time.time()})
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    try:  # a finished trace is one file, copyable alone; a reader still attached keeps it WAL
        conn.execute("PRAGMA journal_mode=DELETE")
    except sqlite3.OperationalError:
        pass
