"""The engine's client protocol: what a console (or any client) and the engine process say.

Binary: each message is a msgpack document (msgspec) behind a 4-byte little-endian length. Step
records travel as the engine built them: numpy arrays as msgpack extension ARRAY_EXT (dtype,
shape, raw bytes), never as JSON lists; nothing a peer sends is unpickled. The transport is a Unix
socket in a directory only its owner can enter (engine_dir), and a client's first message must
carry the run's token (Hello), compared in constant time. Until it has, a peer is held to a
small frame (MAX_HELLO) and one deadline for the whole Hello, so an unauthenticated connection
costs neither memory nor time.

Torch-free, like everything a console process imports.
"""

from __future__ import annotations

import ctypes
import hmac
import os
import secrets
import signal
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

LENGTH = struct.Struct("<I")
MAX_MESSAGE = 64 << 20  # a catch-up of recent records on a 61 x 384 model is a few MiB
MAX_HELLO = 4 << 10  # before the token is checked: a Hello is its token and a few short fields
CONNECT_WAIT_S = 10.0  # how long a client waits for room in a busy engine's queue of new connections
ARRAY_EXT = 1
SOCKET_NAME, TOKEN_NAME = "engine.sock", "token"
OWNER_NAME = "owner.pid"  # the pid of the process that made the directory: a sweep's test of staleness
ENGINE_DIR_PREFIX = "moectl-engine-"
PARENT_PID_ENV = "MOECTL_PARENT_PID"  # how a starter names itself to its engine process: the owner's pid


class ProtocolError(ValueError):
    """A peer sent something this protocol does not allow; the message says what."""


# -- messages (tag: the "type" field on the wire)

class Hello(msgspec.Struct, tag="hello"):
    """Client -> engine, first: the run's token; owner: the engine exits when this client goes,
    granted only to the process that started the engine (anyone else's claim is refused);
    records: False for a client of requests and actions only (no record stream, no catch-up)."""
    token: str
    client: str = "console"
    owner: bool = False
    records: bool = True


class Welcome(msgspec.Struct, tag="welcome"):
    """Engine -> client, once: the catch-up (trace header, recent steps and actions, status)."""
    engine: str  # "moectl engine (pid N)": how a client names it
    pid: int
    header: dict
    steps: list
    actions: list
    status: dict
    alerts: list | None = None  # the newest Alerts' list, None before the first


class Records(msgspec.Struct, tag="records"):
    """Engine -> client: the step and action records since the last Records; dropped counts the
    ones this client lost so far because it read too slowly."""
    steps: list
    actions: list
    dropped: int = 0


class Status(msgspec.Struct, tag="status"):
    """Engine -> client, when it changes: why the engine stopped serving (None while it serves)
    and the demo workload (rate, lengths, paused)."""
    error: str | None
    load: dict | None


class Alerts(msgspec.Struct, tag="alerts"):
    """Engine -> client, when they change: the plain-language alerts (profiler/analysis.py
    alerts) over the engine's recent window, up to `step`, computed once in the engine for every
    client."""
    step: int
    alerts: list


class Act(msgspec.Struct, tag="act"):
    """Client -> engine: an operator action (engine/core/driver.py EngineDriver.act's kinds, and
    "workload"); answered by a Result with the same id."""
    id: int
    kind: str
    args: dict


class Result(msgspec.Struct, tag="result"):
    id: int
    value: Any = None
    error: str | None = None


class Generate(msgspec.Struct, tag="generate"):
    """Client -> engine: a generation request, text or token ids, with SamplingParams' fields
    (engine/core/sampling.py) as `params`; its outputs come back as Output messages with this id.
    It runs beside whatever else the engine serves, and its steps are in every client's records."""
    id: int
    prompt: str | list[int]
    params: dict = msgspec.field(default_factory=dict)


class Output(msgspec.Struct, tag="output"):
    """Engine -> the client that asked: a request's progress, never dropped for a slow client.
    `new_token_ids` since the last Output; the last one has `finished`, its `finish_reason`, the
    request's whole `text` (the engine detokenises a request once, at its end), and `error` if it
    failed or was refused."""
    id: int
    request_id: str
    new_token_ids: list[int] = msgspec.field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0


class Cancel(msgspec.Struct, tag="cancel"):
    """Client -> engine: abort the request this client sent with this id."""
    id: int


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Client -> engine: stop (an owner's quit). From any other client it is refused: a Result
    with this id and the reason."""
    id: int = 0


class Bye(msgspec.Struct, tag="bye"):
    """Engine -> client, last: why the engine is going."""
    reason: str


Message = Hello | Welcome | Records | Status | Alerts | Act | Result | Generate | Output | Cancel | Shutdown | Bye


# -- encoding

def _enc_hook(obj):
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError("an object array cannot be sent")
        arr = np.ascontiguousarray(obj)
        return msgspec.msgpack.Ext(ARRAY_EXT, msgspec.msgpack.encode((arr.dtype.str, arr.shape, arr.tobytes())))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (tuple, set, frozenset)):
        return list(obj)
    tolist = getattr(obj, "tolist", None)  # a torch tensor, without importing torch here
    if callable(tolist):
        return tolist()
    raise TypeError(f"{type(obj).__name__} cannot be sent")


def _ext_hook(code: int, data: memoryview):
    if code != ARRAY_EXT:
        raise ProtocolError(f"unknown extension type {code}")
    try:
        dtype, shape, raw = msgspec.msgpack.decode(data)
        arr = np.frombuffer(raw, dtype=np.dtype(dtype))
        return arr.reshape(shape).copy()  # writable, and free of the frame's buffer
    except (TypeError, ValueError, msgspec.DecodeError) as exc:
        raise ProtocolError(f"a malformed array ({exc})") from None


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder(Message, ext_hook=_ext_hook)


def encode(message: Message) -> bytes:
    """One framed message."""
    body = _encoder.encode(message)
    if len(body) > MAX_MESSAGE:
        raise ProtocolError(f"a message of {len(body):,} bytes; at most {MAX_MESSAGE:,}")
    return LENGTH.pack(len(body)) + body


def decode(body: bytes) -> Message:
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"not a message of this protocol ({str(exc).splitlines()[0]})") from None


def read_message(sock: socket.socket, max_bytes: int = MAX_MESSAGE, deadline: float | None = None) -> Message | None:
    """The next message, or None when the peer closed the connection between messages. A body
    over max_bytes is refused from its announced length, before anything is allocated for it.
    deadline (time.monotonic()): the whole message must have arrived by then, however slowly it
    trickles in (TimeoutError after it); without one, the socket's own timeout applies per read."""
    head = _read_exactly(sock, LENGTH.size, eof_ok=True, deadline=deadline)
    if head is None:
        return None
    (length,) = LENGTH.unpack(head)
    if length > max_bytes:
        raise ProtocolError(f"a message of {length:,} bytes announced; at most {max_bytes:,}")
    return decode(_read_exactly(sock, length, deadline=deadline))


def _read_exactly(sock: socket.socket, n: int, eof_ok: bool = False, deadline: float | None = None) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the message did not arrive in time")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if eof_ok and got == 0:
                return None
            raise ProtocolError("the connection closed in the middle of a message")
        got += k
    return bytes(buf)


# -- where an engine listens

try:  # loaded once, here: die_with_parent may run in a forked child, which should do as little as it can
    _LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:
    _LIBC = None
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None) -> bool:
    """SIGTERM this process when its parent dies, however it dies (Linux's PR_SET_PDEATHSIG;
    elsewhere a no-op). False when parent_pid is no longer the parent: it died before the signal
    was set, so the caller should exit. Used by the engine process (for its starter) and by web's
    tab consoles (a preexec_fn, for the server)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    return parent_pid is None or os.getppid() == parent_pid


def new_engine_dir() -> tuple[Path, str]:
    """A fresh directory only this user can enter, holding the run's token (mode 0600) and the
    pid of the process that made it (OWNER_NAME); the engine's socket goes beside them. Returns
    (directory, token)."""
    path = Path(tempfile.mkdtemp(prefix=ENGINE_DIR_PREFIX))  # mode 0700
    token = secrets.token_urlsafe(32)
    for name, text in ((TOKEN_NAME, token), (OWNER_NAME, str(os.getpid()))):
        fd = os.open(path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    return path, token


def read_token(engine_dir: Path) -> str:
    try:
        return (Path(engine_dir) / TOKEN_NAME).read_text().strip()
    except OSError as exc:
        raise ProtocolError(f"{engine_dir}: no engine's token here ({exc.strerror or exc})") from None


def token_matches(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def connect(engine_dir: Path, wait_s: float = CONNECT_WAIT_S) -> socket.socket:
    """A connection to the engine listening in engine_dir (ProtocolError when none is there, or
    when its queue of new connections stays full for wait_s: many clients connecting at once)."""
    path = Path(engine_dir) / SOCKET_NAME
    deadline = time.monotonic() + wait_s
    pause_s = 0.001
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # non-blocking: a full queue answers EAGAIN at once (a blocking connect would wait on an
        # engine that no longer accepts for as long as it lives)
        sock.setblocking(False)
        try:
            sock.connect(str(path))
        except BlockingIOError:
            sock.close()
            if time.monotonic() >= deadline:
                raise ProtocolError(f"the engine at {path} is busy: no room for a new connection within "
                                    f"{wait_s:g} s (too many clients connecting at once); try again") from None
            time.sleep(pause_s)  # room comes as the engine accepts the queued ones
            pause_s = min(2 * pause_s, 0.05)
            continue
        except OSError as exc:
            sock.close()
            raise ProtocolError(f"no engine listening at {path} ({exc.strerror or exc})") from None
        sock.setblocking(True)
        return sock
