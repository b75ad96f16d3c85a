"""Record codec: one trace record (a nested dict) <-> one compressed bytes payload.

Payload = 1 version byte + zlib( u32 skeleton length | JSON skeleton | array bytes ).
The skeleton is the record with every array replaced by {"\\u0000nd": i}; the array table
beside it gives each array's dtype, shape and how its bytes were stored. Arrays go in as raw
bytes because routing for a big model (61 x 384 int32 per step) would be ~5x bigger as JSON text.

Before zlib, integer arrays are shrunk losslessly: values become (x - min) / gcd in the narrowest
unsigned dtype that holds them, so token counts fit in 1-2 bytes and byte-traffic matrices (all
multiples of the bytes per token) come down to token counts; a constant array costs no bytes.
Multi-byte values are then byte-shuffled (all first bytes, then all second bytes...), which puts
the near-constant high bytes next to each other where zlib can collapse them.

Exact round trip: dtype, shape and values of arrays (numpy scalars come back as numpy scalars),
dict key order, and Python int/float/str/bool/None leaves. Long rectangular lists of Python ints or
floats are stored as arrays too and come back as the same lists. Tuples come back as lists. torch
tensors are stored through .numpy() and come back as numpy arrays (bfloat16 as float32).
Subclasses of str/int/float (IntEnum, torch's version string) are stored as the base type.

Version 2, the step records' layout (`pack` on the engine thread, `seal` in the writer process):
1 version byte + zlib( msgpack ), every number a fixed-width binary field and every array an
extension: code 1 (u16 header length | msgpack [dtype, shape] | raw C-order bytes), code 2 a numpy
scalar the same way, code 3 (u16 header length | msgpack spec | bytes) an array shrunk and
shuffled as above. `pack` is one msgspec call, far cheaper than version 1's JSON skeleton
(whose cost is mostly float repr; `moectl bench --suite profiler`
prints both on recorded steps); `seal` only compresses, and reshapes the arrays into code 3
only when the record is big enough to pay for it (a big model's routing). Keys may be any msgpack
key (str, int, float, bool, None, tuples of those, which come back as tuples); integers past 64
bits cannot be packed (`pack` raises, and the record goes the version 1 way). Version 2 is more
lenient than version 1 where msgspec has an encoding: bytes come back as bytes, sets and
frozensets as lists and tuples, datetimes, UUIDs and Decimals as strings, dataclasses as dicts,
enums as their values. The engine's records hold none of these.

Version 3 is version 2 compressed with zstd (level 1) instead of zlib: what `seal` writes now. On
recorded engine steps it compresses about four times faster to the same size (`moectl bench
--suite profiler` prints both), and the writer process's compression was the largest single part
of the profiler's cost. Versions 1 and 2 are still read.
"""

from __future__ import annotations

import json
import struct
import threading
import zlib

import msgspec
import numpy as np
import zstandard

CODEC_VERSION = 1
PACKED_VERSION = 2  # zlib: read, no longer written
PACKED_ZSTD_VERSION = 3  # what seal writes
ZSTD_LEVEL = 1
# the first layout's level (actions, and step records that cannot be packed) and payload version
# 2's: 1, not 6, chosen when zlib sealed every step record (its encoding was then most of the
# profiler's cost: bench/README.md, the profiler section)
ZLIB_LEVEL = 1
# Z_FILTERED favours Huffman coding over short matches: 5-8% smaller on noisy counts (routing),
# 1-3% larger on the JSON skeleton; 3% smaller on whole big-model records (bench/trace_store_bench.py)
ZLIB_STRATEGY = zlib.Z_FILTERED

# Marker keys in the skeleton. A NUL-prefixed key cannot collide with a real one: a record dict
# that happens to use one is written in the escaped key/value-pairs form like non-str keys are.
_ARRAY = "\x00nd"
_PAIRS = "\x00kv"

_SHRINK_MIN = 64  # elements: below this an array is stored raw (see _add_array)
_PACK_LIST_MIN = 8  # shorter numeric lists stay JSON: an array entry's own overhead is ~40 bytes
_ARRAY_KINDS = "biufcmMSU"
_UNSIGNED = [np.dtype(t) for t in ("<u1", "<u2", "<u4", "<u8")]
_U64 = 2**64


class TraceError(ValueError):
    """A trace or record that cannot be read or written; the message is one line."""


def encode(record: dict, *, level: int = ZLIB_LEVEL, str_keys: bool = False) -> bytes:
    """str_keys=True: the caller promises every dict key in the record is a str (the engine's
    records are), so json's C encoder walks the record and only the arrays come back to Python;
    several times faster, same format. Otherwise the general walk keeps any key type exact."""
    if not isinstance(record, dict):
        raise TraceError(f"a record must be a dict, not {type(record).__name__}")
    table: list[dict] = []
    blobs: list[bytes] = []
    if str_keys:
        def arrays(obj):
            if isinstance(obj, (np.ndarray, np.generic)) or (hasattr(obj, "detach") and hasattr(obj, "numpy")):
                return _strip(obj, table, blobs, "record")
            raise TypeError(f"cannot store a value of type {type(obj).__name__} in a trace record")
        try:  # "r" is encoded before "a", so the table is complete when json reaches it
            head = json.dumps({"r": record, "a": table}, separators=(",", ":"), default=arrays).encode()
        except TypeError as exc:
            raise TraceError(str(exc).splitlines()[0]) from None
    else:
        skeleton = _strip(record, table, blobs, "record")
        head = json.dumps({"r": skeleton, "a": table}, separators=(",", ":")).encode()
    body = b"".join([struct.pack("<I", len(head)), head, *blobs])
    z = zlib.compressobj(level, zlib.DEFLATED, zlib.MAX_WBITS, 8, ZLIB_STRATEGY)
    return bytes([CODEC_VERSION]) + z.compress(body) + z.flush()


def decode(data: bytes) -> dict:
    if not data:
        raise TraceError("corrupt record payload: empty")
    if data[0] in (PACKED_VERSION, PACKED_ZSTD_VERSION):
        return _decode_packed(data)
    if data[0] != CODEC_VERSION:
        raise TraceError(f"unknown record codec version {data[0]} (this moectl reads {CODEC_VERSION}, "
                         f"{PACKED_VERSION} and {PACKED_ZSTD_VERSION})")
    try:
        # bytearray: arrays built on it are writable, like the ones that were written
        body = bytearray(zlib.decompress(memoryview(data)[1:]))
        (n,) = struct.unpack_from("<I", body)
        head = json.loads(bytes(body[4:4 + n]))
        arrays = _unpack_arrays(head["a"], memoryview(body)[4 + n:])
        record = _rebuild(head["r"], arrays)
    except TraceError:
        raise
    except Exception as e:  # noqa: BLE001 - zlib.error, json, struct, malformed table: all mean a damaged payload
        raise TraceError(f"corrupt record payload: {type(e).__name__}: {e}") from None
    if not isinstance(record, dict):
        raise TraceError("corrupt record payload: top level is not a dict")
    return record


# --- version 2: packed on the engine thread, sealed in the writer process ------------------------

_EXT_ARRAY, _EXT_SCALAR, _EXT_SHAPED = 1, 2, 3
_HEAD = struct.Struct("<H")
SEAL_SHAPE_BYTES = 16 << 10  # packed records at least this big get their arrays shrunk and shuffled


_HEADS_KEPT = 4096  # (dtype, shape) headers remembered: a step record's arrays repeat theirs step after step
_heads: dict = {}


def _array_ext(a: np.ndarray, code: int) -> msgspec.msgpack.Ext:
    # the header (length, dtype, shape) is remembered: building it was a third of the engine
    # thread's pack time, for the same dozen arrays every step
    key = (a.dtype, a.shape)
    head = _heads.get(key)
    if head is None:
        dt = a.dtype
        if dt.kind not in _ARRAY_KINDS or dt.fields is not None or dt.hasobject:
            raise TypeError(f"cannot store an array of dtype {dt}")
        spec = msgspec.msgpack.encode((dt.str, a.shape))
        head = _HEAD.pack(len(spec)) + spec
        if len(_heads) < _HEADS_KEPT:
            _heads[key] = head
    return msgspec.msgpack.Ext(code, head + a.tobytes())


def _pack_hook(obj):
    if isinstance(obj, np.ndarray):
        return _array_ext(obj, _EXT_ARRAY)
    if isinstance(obj, np.generic):
        return _array_ext(np.asarray(obj), _EXT_SCALAR)
    if hasattr(obj, "detach") and hasattr(obj, "numpy"):  # torch.Tensor, without importing torch
        tensor = obj.detach().cpu()
        if str(tensor.dtype) in ("torch.bfloat16", "torch.float8_e4m3fn", "torch.float8_e5m2"):
            tensor = tensor.float()
        return _array_ext(tensor.numpy(), _EXT_ARRAY)
    for base in (str, int, float):  # subclasses (IntEnum, torch's version string) as their base
        if isinstance(obj, base):
            return base(obj)
    raise TypeError(f"cannot store a value of type {type(obj).__name__} in a trace record")


_packer = msgspec.msgpack.Encoder(enc_hook=_pack_hook)


def pack(record: dict) -> bytes:
    """The record in version 2's layout, uncompressed: what the engine thread hands the writer."""
    if not isinstance(record, dict):
        raise TraceError(f"a record must be a dict, not {type(record).__name__}")
    try:
        return _packer.encode(record)
    except (TypeError, OverflowError, ValueError) as e:
        raise TraceError(f"cannot pack the record: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


_zstd = threading.local()  # a compressor and a decompressor per thread: zstandard's are not thread-safe


def _zstd_pair() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    pair = getattr(_zstd, "pair", None)
    if pair is None:
        pair = _zstd.pair = (zstandard.ZstdCompressor(level=ZSTD_LEVEL), zstandard.ZstdDecompressor())
    return pair


def seal(packed, *, zlib_level: int | None = None) -> bytes:
    """A packed record as a version 3 payload (zstd), or version 2 (zlib at zlib_level: what
    traces before version 3 hold, kept for tests and comparison). Big records get their arrays
    shrunk and shuffled first."""
    if len(packed) >= SEAL_SHAPE_BYTES:
        packed = _packer.encode(msgspec.msgpack.Decoder(ext_hook=_shape_ext).decode(packed))
    if zlib_level is not None:
        z = zlib.compressobj(zlib_level, zlib.DEFLATED, zlib.MAX_WBITS, 8, ZLIB_STRATEGY)
        return bytes([PACKED_VERSION]) + z.compress(packed) + z.flush()
    return bytes([PACKED_ZSTD_VERSION]) + _zstd_pair()[0].compress(packed)


def _split_ext(data: memoryview):
    (n,) = _HEAD.unpack_from(data)
    return msgspec.msgpack.decode(data[2:2 + n]), data[2 + n:]


def _shape_ext(code: int, data: memoryview) -> msgspec.msgpack.Ext:
    if code == _EXT_ARRAY:
        (dtype, shape), raw = _split_ext(data)
        a = np.frombuffer(raw, dtype=dtype).reshape(shape)
        if a.size >= _SHRINK_MIN and (a.dtype.kind in "iu" or a.dtype.itemsize > 1):
            table: list[dict] = []
            blobs: list[bytes] = []
            _add_array(a, table, blobs, "")
            head = msgspec.msgpack.encode(table[0])
            return msgspec.msgpack.Ext(_EXT_SHAPED, _HEAD.pack(len(head)) + head + blobs[0])
    return msgspec.msgpack.Ext(code, bytes(data))


def _unpack_ext(code: int, data: memoryview):
    if code in (_EXT_ARRAY, _EXT_SCALAR):
        (dtype, shape), raw = _split_ext(data)
        a = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()  # writable, like what was written
        return a[()] if code == _EXT_SCALAR else a
    if code == _EXT_SHAPED:
        spec, raw = _split_ext(data)
        a = _array_from(spec, raw)
        return a.copy() if isinstance(a, np.ndarray) and not a.flags.writeable else a
    raise ValueError(f"unknown extension type {code}")


_unpacker = msgspec.msgpack.Decoder(ext_hook=_unpack_ext)


def _decode_packed(data: bytes) -> dict:
    try:
        body = memoryview(data)[1:]
        raw = zlib.decompress(body) if data[0] == PACKED_VERSION else _zstd_pair()[1].decompress(body)
        record = _unpacker.decode(raw)
    except TraceError:
        raise
    except Exception as e:  # noqa: BLE001 - zlib.error, zstd.ZstdError, msgspec, a malformed extension: a damaged payload
        raise TraceError(f"corrupt record payload: {type(e).__name__}: {e}") from None
    if not isinstance(record, dict):
        raise TraceError("corrupt record payload: top level is not a dict")
    return record


# --- encode side ----------------------------------------------------------------------------

def _strip(obj, table, blobs, where):
    """obj with arrays swapped for references into table/blobs; `where` names obj in errors."""
    t = type(obj)
    if obj is None or t in (str, int, float, bool):
        return obj
    if isinstance(obj, dict):
        if all(type(k) is str and k not in (_ARRAY, _PAIRS) for k in obj):
            return {k: _strip(v, table, blobs, k) for k, v in obj.items()}
        return {_PAIRS: [[_key(k, where), _strip(v, table, blobs, str(k))] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        packed = _pack_list(obj, table, blobs) if len(obj) >= 2 else None
        if packed is not None:
            return packed
        return [_strip(x, table, blobs, where) for x in obj]
    if isinstance(obj, np.ndarray):
        return _add_array(obj, table, blobs, where)
    if isinstance(obj, np.generic):
        return _add_array(np.asarray(obj), table, blobs, where, scalar=True)
    if hasattr(obj, "detach") and hasattr(obj, "numpy"):  # torch.Tensor, without importing torch
        tensor = obj.detach().cpu()
        if str(tensor.dtype) in ("torch.bfloat16", "torch.float8_e4m3fn", "torch.float8_e5m2"):
            tensor = tensor.float()  # no numpy dtype for these; float32 holds them exactly
        return _add_array(tensor.numpy(), table, blobs, where)
    for base in (str, int, float):  # subclasses (IntEnum, torch's version string) as their base
        if isinstance(obj, base):
            return base(obj)
    raise TraceError(f"cannot store a value of type {t.__name__} in a trace record (at {where!r})")


def _key(k, where):
    if k is None or type(k) in (str, int, float, bool):
        return k
    if type(k) is tuple and all(x is None or type(x) in (str, int, float, bool) for x in k):
        return {_PAIRS: list(k)}  # a tuple key: come back as a tuple, not a (unhashable) list
    raise TraceError(f"cannot store a dict key of type {type(k).__name__} (in {where!r})")


def _pack_list(obj, table, blobs):
    """An array reference for a long rectangular list of exact ints or floats, else None."""
    leaf = _leaf_type(obj)
    if leaf is None:
        return None
    try:
        a = np.array(obj, dtype=np.int64 if leaf is int else np.float64)
    except (OverflowError, ValueError):  # ints past int64: leave them to JSON
        return None
    if a.size < _PACK_LIST_MIN:
        return None
    ref = _add_array(a, table, blobs, "")
    table[-1]["l"] = 1
    return ref


def _leaf_type(obj):
    if type(obj) not in (list, tuple) or not obj:
        return None
    first = obj[0]
    if type(first) in (list, tuple):
        n, leaf = len(first), None
        for x in obj:
            if type(x) not in (list, tuple) or len(x) != n:
                return None
            lt = _leaf_type(x)
            if lt is None or (leaf is not None and lt is not leaf):
                return None
            leaf = lt
        return leaf
    t = type(first)
    if t not in (int, float) or any(type(x) is not t for x in obj):
        return None
    return t


def _add_array(a: np.ndarray, table, blobs, where, scalar=False):
    dt = a.dtype
    if dt.kind not in _ARRAY_KINDS or dt.fields is not None or dt.hasobject:
        raise TraceError(f"cannot store an array of dtype {dt} (at {where!r})")
    if not a.flags.c_contiguous:
        a = a.copy(order="C")  # not np.ascontiguousarray: that turns a 0-d array into 1-d
    spec = {"d": dt.str, "s": list(a.shape)}
    stored = a
    # shrinking and shuffling pay for big arrays (routing); for a few dozen values their numpy
    # calls cost more time than zlib saves bytes, so small arrays go in as they are
    if dt.kind in "iu" and a.size >= _SHRINK_MIN:
        stored = _shrink_int(a, spec)
    if stored.dtype.itemsize > 1 and stored.size >= _SHRINK_MIN:
        k = stored.dtype.itemsize
        raw = np.frombuffer(stored.tobytes(), np.uint8).reshape(-1, k).T.tobytes()
        spec["sh"] = 1
    else:
        raw = stored.tobytes()
    spec["n"] = len(raw)
    if scalar:
        spec["sc"] = 1
    table.append(spec)
    blobs.append(raw)
    return {_ARRAY: len(table) - 1}


def _shrink_int(a: np.ndarray, spec: dict) -> np.ndarray:
    lo, hi = int(a.min()), int(a.max())
    # All arithmetic in uint64, which wraps: x - lo is exact mod 2**64 and fits since hi - lo < 2**64.
    off = a.astype(np.uint64) - np.uint64(lo % _U64)
    g = int(np.gcd.reduce(off.ravel())) if hi > lo else 1
    span = (hi - lo) // g
    if span == 0:
        spec.update(q="const", lo=lo)
        return np.empty(0, np.uint8)
    q = next(u for u in _UNSIGNED if span < 2 ** (8 * u.itemsize))
    if q.itemsize >= a.dtype.itemsize:
        return a
    spec.update(q=q.str, lo=lo, g=g)
    return (off // np.uint64(g)).astype(q)


# --- decode side ----------------------------------------------------------------------------

def _unpack_arrays(table: list, buf: memoryview) -> list:
    out, pos = [], 0
    for spec in table:
        n = spec["n"]
        if pos + n > len(buf):
            raise TraceError("corrupt record payload: array bytes are cut short")
        out.append(_array_from(spec, buf[pos:pos + n]))
        pos += n
    if pos != len(buf):
        raise TraceError("corrupt record payload: trailing bytes after the arrays")
    return out


def _array_from(spec: dict, raw: memoryview):
    """One array (or list, or scalar) of a table entry, from its stored bytes."""
    if len(raw) != spec["n"]:
        raise TraceError("corrupt record payload: array bytes are cut short")
    dt, shape = np.dtype(spec["d"]), tuple(spec["s"])
    count = int(np.prod(shape, dtype=np.int64))
    q = spec.get("q")
    if q == "const":
        a = np.full(count, spec["lo"], dtype=np.uint64 if spec["lo"] >= 0 else np.int64).astype(dt)
    else:
        sdt = np.dtype(q) if q else dt
        if spec.get("sh"):
            k = sdt.itemsize
            stored = np.frombuffer(raw, np.uint8).reshape(k, -1).T.copy().view(sdt)
        else:
            stored = np.frombuffer(raw, sdt)
        if stored.size != count:
            raise TraceError("corrupt record payload: array size does not match its shape")
        if q:
            a = (stored.astype(np.uint64) * np.uint64(spec["g"]) + np.uint64(spec["lo"] % _U64)).astype(dt)
        else:
            a = stored
    a = a.reshape(shape)
    if spec.get("l"):
        return a.tolist()
    if spec.get("sc"):
        return a[()]
    return a


def _rebuild(node, arrays):
    if type(node) is list:
        return [_rebuild(x, arrays) for x in node]
    if type(node) is not dict:
        return node
    if len(node) == 1:
        if _ARRAY in node:
            return arrays[node[_ARRAY]]
        if _PAIRS in node:
            return {_unkey(k): _rebuild(v, arrays) for k, v in node[_PAIRS]}
    return {k: _rebuild(v, arrays) for k, v in node.items()}


def _unkey(k):
    return tuple(k[_PAIRS]) if type(k) is dict else k
