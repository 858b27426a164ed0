"""Wire format: one small fixed header frame, then a pickle body, then (when the batch
holds large arrays) an offsets frame and one data frame holding every array's bytes.

Why pickle protocol 5 with out-of-band buffers: a task batch is "any picklable object",
typically ``(list_of_requests, real_bsz)`` where each request carries token ids as numpy
arrays. Protocol 5 hands every large contiguous array to ``buffer_callback`` instead of
copying it into the pickle stream; the arrays travel in one data frame and
``decode_payload()`` rebuilds each as a view of a slice of the received frame: no
per-element Python work and no copy on the worker. Token ids as numpy arrays decode
several times faster than the same ids as Python lists, whose unpickling holds the GIL
in the prefetch thread (section 5 of scripts/bench_sync.py measures both).

Buffer lifetime: arrays decoded by ``decode()`` alias the frame memory and are
**read-only**; they stay valid for as long as the array (or anything holding it) is
alive, because the view keeps the frame alive. Copy an array (``arr.copy()``) before
writing into it.

Security: the body is unpickled, so only connect workers to an engine you trust (ipc
sockets are protected by file permissions; bind tcp endpoints to a private interface).
"""

import array
import pickle
import struct

from .errors import ProtocolError

__all__ = [
    "Header",
    "HELLO",
    "DATA",
    "ACK",
    "ERROR",
    "WELCOME",
    "PING",
    "PONG",
    "CLOSE",
    "HEADER_SIZE",
    "pack_header",
    "unpack_header",
    "encode_payload",
    "decode_payload",
]

MAGIC = b"FDSY"
VERSION = 2

# Message kinds. Every header names the engine instance, the worker group incarnation and
# the worker instance it belongs to, so traffic from a previous life (an engine restarted
# on the same endpoint, a worker group replaced by a new one) is recognised and ignored.
HELLO = 1  # worker -> engine: rank, tp_size, seq = first seq it lacks, aux = seq it has
#            taken; engine = the instance it is bound to (0: none yet); group, worker;
#            frames[1] = the queue name
DATA = 2  # engine -> worker: seq (group-relative), check = payload checksum; frames[1:] =
#           payload (encode_payload)
ACK = 3  # worker -> engine: seq = highest seq this rank has taken (cumulative)
ERROR = 4  # engine -> worker: aux = one of the E_* codes; frames[1] = utf-8 reason
WELCOME = 5  # engine -> worker: HELLO accepted; aux = the group's epoch (ack board tag)
PING = 6  # worker -> engine: heartbeat (see liveness.py)
PONG = 7  # engine -> worker: heartbeat reply
CLOSE = 8  # engine -> worker: the queue closed cleanly; seq = the last seq sent to the group
_KINDS = frozenset((HELLO, DATA, ACK, ERROR, WELCOME, PING, PONG, CLOSE))

# ERROR codes (Header.aux of an ERROR message): what the worker raises.
E_REJECTED = 1  # configuration mismatch (name, tp_size): EngineRejectedError
E_PLACE_TAKEN = 2  # a live worker holds this rank: EngineRejectedError
E_STALE_ENGINE = 3  # bound to an engine instance that is gone (restart): EngineGoneError
E_GROUP_LOST = 4  # the engine retired this worker group: GroupLostError
E_GROUP_BUSY = 5  # another live worker group holds the queue: EngineRejectedError

# magic, version, kind, rank, tp_size, seq, aux, engine, group, worker, check.
# 60 bytes, little-endian.
_HEADER = struct.Struct("<4sBBHiqqQQQQ")
HEADER_SIZE = _HEADER.size

# Arrays smaller than this stay inside the pickle stream: copying a few hundred bytes
# costs less than the bookkeeping of an out-of-band buffer.
OOB_MIN_BYTES = 1024
# Out-of-band buffers start at multiples of this (a cache line; numpy likes aligned data).
_ALIGN = 64


class Header:
    """A parsed header frame. ``aux`` is kind-specific; ``engine``, ``group`` and
    ``worker`` are the instance ids the message is bound to (0: not yet known);
    ``check`` is the payload checksum of a DATA message."""

    __slots__ = ("kind", "rank", "tp_size", "seq", "aux", "engine", "group", "worker", "check")

    def __init__(self, kind, rank, tp_size, seq, aux=0, engine=0, group=0, worker=0, check=0):
        self.kind, self.rank, self.tp_size, self.seq, self.aux = kind, rank, tp_size, seq, aux
        self.engine, self.group, self.worker, self.check = engine, group, worker, check

    def __repr__(self):
        return (f"Header(kind={self.kind}, rank={self.rank}, tp_size={self.tp_size}, "
                f"seq={self.seq}, aux={self.aux}, engine={self.engine:#x}, "
                f"group={self.group:#x}, worker={self.worker:#x})")


def pack_header(kind: int, rank: int = 0, tp_size: int = 0, seq: int = 0, aux: int = 0,
                engine: int = 0, group: int = 0, worker: int = 0, check: int = 0) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, kind, rank, tp_size, seq, aux, engine, group, worker,
                        check)


def unpack_header(frame) -> Header:
    """Parse a header frame. Raises ``ProtocolError`` for anything that is not ours."""
    buf = memoryview(frame)
    if buf.nbytes != _HEADER.size:
        raise ProtocolError(f"header frame of {buf.nbytes} bytes, expected {_HEADER.size}")
    magic, version, kind, *fields = _HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise ProtocolError(f"wire version {version}, this build speaks {VERSION}")
    if kind not in _KINDS:
        raise ProtocolError(f"unknown message kind {kind}")
    return Header(kind, *fields)


def encode_payload(obj) -> list:
    """Serialize ``obj`` into ``[body]`` or ``[body, offsets, data]`` (bytes objects).

    Large contiguous buffers (numpy arrays, bytes-like objects supporting protocol 5) go
    out of band, concatenated into one ``data`` frame at 64-byte aligned offsets
    (``offsets`` holds (start, length) pairs as int64). One frame rather than one per
    array, because every ZeroMQ frame costs ~1 µs to receive and again to free on the
    worker, and a 64-request batch would otherwise carry 64 of them.

    The concatenation is the one copy made, on the engine side, so a caller who mutates an
    array after ``put_tasks()`` returns cannot change a batch that is still retained for a
    late-joining rank.

    Raises ``TypeError`` (with the pickling error chained) if ``obj`` cannot be pickled.
    """
    buffers = []

    def keep_out_of_band(pickle_buffer):
        raw = pickle_buffer.raw()
        if raw.nbytes < OOB_MIN_BYTES:
            return True  # in-band
        buffers.append(raw)
        return False

    try:
        body = pickle.dumps(obj, protocol=5, buffer_callback=keep_out_of_band)
    except Exception as exc:  # pickle raises PicklingError, TypeError, AttributeError...
        raise TypeError(f"task batch is not picklable: {exc}") from exc
    if not buffers:
        return [body]
    offsets = array.array("q")
    data = bytearray()
    for raw in buffers:
        start = (len(data) + _ALIGN - 1) // _ALIGN * _ALIGN
        data.extend(bytes(start - len(data)))
        offsets.extend((start, raw.nbytes))
        data += raw
    return [body, offsets.tobytes(), bytes(data)]


def decode_payload(frames) -> object:
    """Rebuild the object from ``[body]`` or ``[body, offsets, data]``; buffers zero-copy.

    ``frames`` may be ``zmq.Frame`` objects or bytes-like objects. Raises
    ``ProtocolError`` (chained) if the frames are malformed or the body does not unpickle.
    """
    if len(frames) not in (1, 3):
        raise ProtocolError(f"DATA message with {len(frames)} payload frames, expected 1 or 3")
    try:
        buffers = []
        if len(frames) == 3:
            offsets = _buffer(frames[1]).cast("B").cast("q")
            data = _buffer(frames[2])
            for i in range(0, len(offsets), 2):
                start, length = offsets[i], offsets[i + 1]
                if start < 0 or start + length > data.nbytes:
                    raise ValueError(f"buffer ({start}, {length}) outside a {data.nbytes}-byte frame")
                buffers.append(data[start:start + length])
        return pickle.loads(_buffer(frames[0]), buffers=buffers)
    except Exception as exc:
        raise ProtocolError(f"task batch does not decode: {exc!r}") from exc


def _buffer(frame):
    # zmq.Frame exposes .buffer, a memoryview of the message that keeps it alive. It is
    # writable, and over inproc it may even be the sender's own memory, so hand pickle a
    # read-only view: decoded arrays are then read-only (writes raise instead of
    # corrupting a message another rank or the engine may still hold).
    buf = getattr(frame, "buffer", None)
    return memoryview(buf if buf is not None else frame).toreadonly()
