"""Wire format: one small fixed header frame, then a pickle body, then (when the batch
holds large arrays) an offsets frame and one data frame holding every array's bytes.

Why pickle protocol 5 with an out-of-band data region: a task batch is "any picklable
object", typically ``(list_of_requests, real_bsz)`` where each request carries token ids
as numpy arrays. The encoder lays every large plain array out in one data region
(``_Arrays``: same-dtype runs, back to back) instead of copying it into the pickle
stream, and pickles each as ``numpy.frombuffer(region, dtype, count, offset)``; the
region is one out-of-band buffer, so ``decode_payload()`` rebuilds each array as a view
of the received data frame with one C call: no per-array Python work and no copy on the
worker, and on the engine no buffer callback per array. Other buffers protocol 5 hands
out of band (arrays that keep numpy's reduction, ``PickleBuffer`` objects) follow the
region in the same frame, each with its own offsets pair. Token ids as numpy arrays
decode several times faster than the same ids as Python lists, whose unpickling holds
the GIL in the prefetch thread (docs/performance.md has both; docs/design.md the format).

Node-local engines put the data region of a large batch in shared memory instead of a
frame (``shm.payload``): ``encode_parts()`` collects the buffers without copying them,
the engine writes them once (``EncodedPayload.write_data``), and the worker hands its
read-only mapping to ``decode_payload()`` as the data frame (the same structure checks;
the message's checksum covers the body and the reference to the shared bytes).

Buffer lifetime: arrays decoded by ``decode()`` alias the frame memory and are
**read-only**; they stay valid for as long as the array (or anything holding it) is
alive, because the view keeps the frame alive. Copy an array (``arr.copy()``) before
writing into it.

Integrity and bounds: the body is unpickled, so a corrupted body can do worse than fail
(numpy's dtype unpickling segfaults when 'i8' becomes 'm8', a corrupted length or memo
index makes the unpickler allocate GiBs). So ``decode_payload()`` first checks the frames'
structure with arithmetic only (frame count; sizes against ``MAX_BODY_BYTES``,
``MAX_DATA_BYTES``, ``MAX_BUFFERS``), then, when the sender's ``payload_checksum()`` is
given, verifies it, then checks that every out-of-band buffer lies inside the data frame,
and only then unpickles (where ``numpy.frombuffer`` refuses an array that would reach
outside the region): with the checksum, corrupted bytes give ``ProtocolError``, never
a crash or an unbounded allocation (docs/security.md has the fuzzing). A checksum is not
authentication: a sender that computes the checksum over bytes of its choosing can still
crash the worker or run code in it. Only connect workers to an engine you trust: tcp
endpoints authenticate peers with ZeroMQ CURVE, ipc sockets are protected by file
permissions.
"""

import copyreg
import io
import pickle
import struct
from typing import Optional

import numpy as np
import xxhash

from ..errors import ProtocolError

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
    "STATUS",
    "STATUS_REPLY",
    "PUT",
    "PUT_REPLY",
    "QUERY",
    "QUERY_REPLY",
    "E_REJECTED",
    "E_PLACE_TAKEN",
    "E_STALE_ENGINE",
    "E_GROUP_LOST",
    "E_GROUP_BUSY",
    "E_TOO_MANY",
    "HEADER_SIZE",
    "payload_checksum",
    "verify_checksum",
    "verify_data_hash",
    "pack_header",
    "unpack_header",
    "encode_payload",
    "encode_parts",
    "EncodedPayload",
    "decode_payload",
    "check_payload",
]

MAGIC = b"FDSY"
VERSION = 3  # 3: plain arrays rebuilt from one region buffer (docs/design.md)

# Message kinds. Every header names the engine instance, the worker group incarnation and
# the worker instance it belongs to, so traffic from a previous life (an engine restarted
# on the same endpoint, a worker group replaced by a new one) is recognised and ignored.
HELLO = 1  # worker -> engine: rank, tp_size, seq = first seq it lacks, aux = seq it has
#            taken; engine = the instance it is bound to (0: none yet); group, worker;
#            frames[1] = the queue name
DATA = 2  # engine -> worker: seq (group-relative), check = payload checksum; frames[1:] =
#           payload (encode_payload), or [body, reference] when a node-local engine put
#           the arrays in shared memory (shm.payload; check covers body and reference)
ACK = 3  # worker -> engine: seq = highest seq this rank has taken (cumulative)
ERROR = 4  # engine -> worker: aux = one of the E_* codes; frames[1] = utf-8 reason
WELCOME = 5  # engine -> worker: HELLO accepted; aux = the group's epoch (ack board tag)
PING = 6  # worker -> engine: heartbeat (see wire/liveness.py)
PONG = 7  # engine -> worker: heartbeat reply
CLOSE = 8  # engine -> worker: the queue closed cleanly; seq = the last seq sent to the group
STATUS = 9  # anyone who passed authentication -> engine: asks for the queue's state
STATUS_REPLY = 10  # engine -> asker: frames[1] = the state as utf-8 JSON (TaskQueue.stats())
# On the queue's node-local producer endpoint only (TaskProducer, engine.producer_endpoint):
PUT = 11  # producer -> engine: a batch; seq = request id, aux = ms the producer waits for
#           room, check = payload checksum; frames[1:] = payload (encode_payload)
PUT_REPLY = 12  # engine -> producer: seq = request id, aux = P_* status, group = the queue's
#                 seq for the batch when accepted
QUERY = 13  # producer -> engine: how many batches are in flight
QUERY_REPLY = 14  # engine -> producer: aux = batches not yet consumed by every rank
BYE = 15  # worker -> engine: this rank closed its client on purpose (TaskClient.close()),
#           or it received the engine's CLOSE (the engine closes its socket once every
#           rank answered); seq = the highest seq it has taken. The engine knows at once
#           instead of waiting for the rank's connection or heartbeats to go silent.
_KINDS = frozenset((HELLO, DATA, ACK, ERROR, WELCOME, PING, PONG, CLOSE, STATUS, STATUS_REPLY,
                    PUT, PUT_REPLY, QUERY, QUERY_REPLY, BYE))

# PUT_REPLY status (Header.aux).
P_ACCEPTED = 0
P_TIMEOUT = 1  # no room within the producer's wait: the batch was not enqueued
P_CLOSED = 2  # the queue is closed: not enqueued
P_INVALID = 3  # the payload failed its checksum or structure check: not enqueued
P_BUSY = 4  # too many producers' batches wait for room already: not enqueued, retry later
P_TOO_LARGE = 5  # larger than the queue sends (frames[1]: why): not enqueued

# ERROR codes (Header.aux of an ERROR message): what the worker raises.
E_REJECTED = 1  # configuration mismatch (name, tp_size): EngineRejectedError
E_PLACE_TAKEN = 2  # a live worker holds this rank: EngineRejectedError
E_STALE_ENGINE = 3  # bound to an engine instance that is gone (restart): EngineGoneError
E_GROUP_LOST = 4  # the engine retired this worker group: GroupLostError
E_GROUP_BUSY = 5  # another live worker group holds the queue: EngineRejectedError
E_TOO_MANY = 6  # producer endpoint: the queue serves as many producers as it may already

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


# Bounds checked on both sides (encode refuses, decode rejects) before anything is
# allocated for a batch. Module attributes, read at every call: raise them here if a
# deployment really sends bigger batches.
#: Largest pickle body. Unpickled Python objects take several times the body's size (a
#: list of ints: ~10x), so this bounds what one batch can make the worker allocate. Token
#: ids sent as numpy arrays travel out of band and do not count.
MAX_BODY_BYTES = 256 << 20
#: Largest data frame (every out-of-band array of one batch). Decoded arrays are views of
#: the received frame, so this bounds no decode-time allocation; it rejects nonsense sizes.
MAX_DATA_BYTES = 8 << 30
#: Most out-of-band buffers in one batch (the offsets frame then holds 16 bytes each), and
#: most large arrays the encoder sends (every plain array of the region counts as one):
#: each becomes an object on decode; a FastDeploy batch carries hundreds at most.
MAX_BUFFERS = 1 << 16

# Payload checksum: xxh3_64 (the `xxhash` package) rather than zlib.crc32, which is several
# times slower on a batch (docs/performance.md) and only 32 bits wide. xxhash releases the
# GIL for updates above 64 KiB (so does zlib), so the prefetch thread does not hold it for
# the data frame.
_LENGTH = struct.Struct("<Q")
_PICKLE5_PREFIX = b"\x80\x05"  # PROTO 5, the first opcode of every body encode_payload makes
_PICKLE_STOP = b"."  # STOP, its last
_ZEROS = bytes(64)  # an alignment gap is shorter than _ALIGN
# write_data copies buffers of at least this size with numpy (GIL released); below it the
# per-call cost of a numpy copy outweighs the GIL time it would free.
_GIL_FREE_COPY_BYTES = 1 << 20


class EncodedPayload:
    """A batch pickled with its out-of-band bytes collected, not yet copied anywhere.

    ``body`` (bytes): the pickle stream; ``offsets`` (bytes): the (start, length) int64
    pairs of the out-of-band buffers the body names, in the order it names them (the
    offsets frame; ``b""`` when there are none); ``data_size``: the bytes the data region
    needs (0 when there are none). The data region is laid out in ``pieces``, each
    ``(start, length, source)`` in increasing ``start`` order, starts 64-byte aligned:
    ``source`` is a flat memoryview of a buffer the pickler handed out of band (a
    ``PickleBuffer``), or a *run*: a list of same-dtype 1-d arrays laid back to back (the
    plain arrays of the batch, ``_Arrays``). ``buffers`` is true when there is a data
    region. Nothing is copied.

    The sources alias the caller's objects: copy them (``frames()``, ``write_data()``)
    before the caller may mutate or free what was passed to ``encode_parts()``.

    ``data_hash()`` hashes the data region as the copy will hold it (for node-local
    shared memory, whose bytes do not travel in a frame, see ``shm.payload``).
    """

    __slots__ = ("body", "pieces", "offsets", "data_size")

    def __init__(self, body, pieces, offsets, data_size):
        self.body, self.pieces = body, pieces
        self.offsets, self.data_size = offsets, data_size

    @property
    def buffers(self) -> bool:
        """True when the batch has a data region (an offsets and a data frame)."""
        return bool(self.pieces)

    def chunks(self):
        """``(start, bytes-like)`` for every source buffer of the data region, in order
        (each array of a run on its own); the gaps between them are zero."""
        for start, _, source in self.pieces:
            if type(source) is memoryview:
                yield start, source
            else:
                for array in source:
                    yield start, array
                    start += array.nbytes

    def write_data(self, dest) -> None:
        """Copy every piece to its offset in ``dest`` (a writable buffer of at least
        ``data_size`` bytes, such as a reused shared-memory region) and zero the alignment
        gaps between them: the one copy of the batch, after which ``dest`` holds exactly
        the bytes ``data_hash()`` describes. A run of arrays is copied by C loops, not one
        Python call per array: below 1 MiB ``bytes.join`` then one assignment (less per
        call than numpy's concatenate, measured), from 1 MiB one ``numpy.concatenate``
        into a typed view of its place, which releases the GIL while it copies (a
        memoryview assignment or a join holds it for the whole copy, long enough to delay
        the engine's I/O thread); likewise another buffer of 1 MiB and more is copied by
        numpy, a smaller one by memoryview assignment, which costs less per call."""
        view = memoryview(dest).cast("B")
        if view.nbytes < self.data_size:
            raise ValueError(f"{view.nbytes}-byte destination for a {self.data_size}-byte "
                             f"data region")
        array = None
        end = 0
        for start, length, source in self.pieces:
            if start > end:
                view[end:start] = _ZEROS[:start - end]
            if type(source) is not memoryview:
                if length < _GIL_FREE_COPY_BYTES:
                    view[start:start + length] = b"".join(source)
                else:
                    run = np.frombuffer(view, dtype=source[0].dtype,
                                        count=length // source[0].dtype.itemsize, offset=start)
                    np.concatenate(source, out=run)
                    del run
            elif length >= _GIL_FREE_COPY_BYTES:
                if array is None:
                    array = np.frombuffer(view, dtype=np.uint8)
                np.copyto(array[start:start + length], np.frombuffer(source, dtype=np.uint8))
            else:
                view[start:start + length] = source
            end = start + length
        del array
        view.release()

    def data_hash(self) -> int:
        """xxh3_64 of the data region (``frames()[2]``, or what ``write_data`` writes), never
        0, streamed from the caller's buffers without building the region: the alignment
        gaps hash as the zero bytes the region holds there. Valid only while the caller
        leaves the arrays unchanged, as the copy is. 0 when there is no data region."""
        if not self.pieces:
            return 0
        hasher = xxhash.xxh3_64()
        update = hasher.update
        end = 0
        for start, length, source in self.pieces:
            if start > end:
                update(_ZEROS[:start - end])
            if type(source) is memoryview:
                update(source)
            else:
                for array in source:  # a run: back to back
                    update(array)
            end = start + length
        return hasher.intdigest() or 1

    def frames(self) -> list:
        """``[body]`` or ``[body, offsets, data]`` (bytes), as ``encode_payload()``.

        ``bytes.join`` sizes the result first and copies each buffer into it once:
        building a bytearray and converting it to bytes would copy the batch twice and
        briefly hold both copies plus the bytearray's over-allocation."""
        if not self.pieces:
            return [self.body]
        pieces: list = []  # bytes and memoryviews, for bytes.join
        end = 0
        for start, length, source in self.pieces:
            if start > end:
                pieces.append(_ZEROS[:start - end])  # alignment gap, < 64 bytes
            if type(source) is memoryview:
                pieces.append(source)
            else:
                pieces += source  # a run: back to back
            end = start + length
        return [self.body, self.offsets, b"".join(pieces)]


# Kinds of dtype whose arrays travel in a run (``_Arrays``): numbers and booleans, which
# export their bytes through the buffer protocol (``frames()``, the checksum) and cannot
# hold Python objects. Others (structured, strings, datetimes) keep numpy's reduction.
_RUN_KINDS = frozenset("biufc")


class _Region:
    """The data region as the body names it: pickled as ``memoryview(<out-of-band
    buffer>)``, once per batch (the pickler memoizes it; later arrays name it by a memo
    index), so every array of the batch is rebuilt from the one buffer."""

    __slots__ = ("buffer",)

    def __init__(self, buffer):
        self.buffer = buffer

    def __reduce__(self):
        return memoryview, (self.buffer,)


class _Arrays:
    """The plain arrays of one batch, laid out in runs while the pickler meets them.

    ``reduce`` (the pickler's reduction for ``numpy.ndarray``) places a large
    C-contiguous array of a number or boolean dtype at the end of the current run (a new
    run, 64-byte aligned, when its dtype differs) and pickles it as
    ``numpy.frombuffer(region, dtype, count, offset)``, one C call on decode, where
    ``region`` is a memoryview of the whole data region (one out-of-band buffer for the
    batch, ``_Region``): the worker builds no per-array buffer and the encoder runs no
    per-array buffer callback. An n-d array is rebuilt by ``_array`` (the same call, then
    ``reshape``). Like ``numpy.frombuffer`` itself, decode refuses a dtype flagged as
    holding Python objects and an array that does not fit the region (``ValueError``;
    decode turns it into ``ProtocolError``): ``numpy.ndarray(shape, dtype, buffer)``, one
    call too, would build an object array over raw bytes, read as pointers when touched.
    (A dtype whose pickled state was corrupted can carry wrong flags and pass that check,
    as it can numpy's: what the body checksum is for.) Arrays this does not cover (below
    ``OOB_MIN_BYTES``, not C-contiguous, of another dtype kind) keep numpy's
    reduction: in band, or out of band as a buffer of their own."""

    __slots__ = ("region", "runs", "count", "size", "_dtype", "_run")

    def __init__(self):
        self.region = None  # _Region, made at the first array
        self.runs = []  # [start, length, [arrays]] in region order
        self.count = 0  # arrays placed
        self.size = 0  # end of the last run, in bytes from the region's start
        self._dtype = self._run = None  # the current run's dtype and entry

    def reduce(self, arr):
        # every array of the batch passes here: the common case (the dtype of the array
        # before it) reads four attributes and makes one tuple
        nbytes = arr.nbytes
        if nbytes < OOB_MIN_BYTES or not arr.flags.c_contiguous:
            return arr.__reduce_ex__(5)
        dtype = arr.dtype
        run = self._run
        if dtype is not self._dtype:
            run = self._run_for(dtype)
            if run is None:
                return arr.__reduce_ex__(5)
        offset = run[0] + run[1]
        run[1] += nbytes
        self.size = offset + nbytes
        self.count += 1
        # a run's dtype holds at most 32 bytes an item, so an array of 1024 bytes or more
        # has at least one dimension
        if arr.ndim == 1:
            run[2].append(arr)
            return np.frombuffer, (self.region, dtype, arr.size, offset)
        run[2].append(arr.reshape(-1))  # C-contiguous: a view
        return _array, (self.region, dtype, arr.size, offset, arr.shape)

    def _run_for(self, dtype):
        """The run an array of ``dtype`` goes at the end of: the current one when the
        dtypes are equal, else a new one; None when ``dtype`` cannot travel in a run."""
        if dtype.kind not in _RUN_KINDS:
            return None
        if self._run is None or dtype != self._dtype:
            if self.region is None:
                self.region = _Region(pickle.PickleBuffer(_REGION_MARK))
            start = (self.size + _ALIGN - 1) & -_ALIGN
            self._run = [start, 0, []]
            self.runs.append(self._run)
        self._dtype = dtype
        return self._run


# What the region's out-of-band buffer wraps while pickling (the buffer callback knows
# the region's ``PickleBuffer`` by identity); its byte is never sent.
_REGION_MARK = bytearray(1)


def _array(region, dtype, count, offset, shape):
    """Decode side of ``_Arrays.reduce`` for n-d arrays: ``count`` items of ``dtype`` at
    ``offset`` in the region (``numpy.frombuffer``: no Python objects, inside the
    region), in ``shape`` (``ValueError`` when the count differs)."""
    return np.frombuffer(region, dtype, count, offset).reshape(shape)


def _dispatch_table(arrays):
    """copyreg's reductions (read at every call: a registration made at any time counts)
    plus ``arrays.reduce`` for ndarray, unless the application registered its own."""
    table = copyreg.dispatch_table.copy()
    table.setdefault(np.ndarray, arrays.reduce)
    return table


class _BodyTooLarge(Exception):
    """Raised by ``_CappedBody.write``: the pickle stream passed its cap."""


class _CappedBody(io.BytesIO):
    """The pickle stream, refused as soon as it passes ``cap`` bytes: the pickler writes it
    in frames of ~64 KiB (protocol 4+; large strings and bytes at once), so a batch too big
    to send stops growing the process at the cap instead of being pickled whole first."""

    def __init__(self, cap: int):
        super().__init__()
        self.cap = cap

    def write(self, data) -> int:
        if self.tell() + len(data) > self.cap:
            raise _BodyTooLarge(self.tell() + len(data))
        return super().write(data)


def encode_parts(obj, max_body_bytes: Optional[int] = None) -> EncodedPayload:
    """Pickle ``obj`` (protocol 5) and lay out its out-of-band bytes without copying them.

    The first half of ``encode_payload()``: the same checks and errors (``TypeError`` if
    ``obj`` cannot be pickled, ``ValueError`` beyond ``MAX_BODY_BYTES``, ``MAX_BUFFERS`` or
    ``MAX_DATA_BYTES``); the data region is left for the caller to fill, into a frame
    (``EncodedPayload.frames()``) or into shared memory (``shm.payload``).

    ``max_body_bytes`` (None: ``MAX_BODY_BYTES``; the smaller of the two counts): pickling
    stops with ``ValueError`` once the body passes it, so a batch too large to send costs
    at most that much memory to refuse, not its whole pickle. Nothing is copied for the
    out-of-band bytes: their total (``data_size``) is known before any copy, for the
    caller to check.

    Layout: the plain arrays' runs first (``_Arrays``), then every other out-of-band
    buffer as it came, each at a 64-byte aligned start; the region's pair in the offsets
    frame covers the runs (it is named where the first array was met, the buffers' pairs
    where they were).
    """
    arrays = _Arrays()
    named = []  # what each out-of-band buffer of the body is: None for the region

    def keep_out_of_band(pickle_buffer):
        # called once for the region and for every other buffer the pickler meets
        region = arrays.region
        if region is not None and pickle_buffer is region.buffer:
            named.append(None)
            return False
        raw = pickle_buffer.raw()
        if raw.nbytes < OOB_MIN_BYTES:
            return True  # in-band
        named.append(raw)
        return False

    cap = MAX_BODY_BYTES if max_body_bytes is None else min(MAX_BODY_BYTES, max_body_bytes)
    out = _CappedBody(cap)
    pickler = pickle.Pickler(out, protocol=5, buffer_callback=keep_out_of_band)
    pickler.dispatch_table = _dispatch_table(arrays)
    try:
        pickler.dump(obj)
    except _BodyTooLarge:
        raise ValueError(
            f"task batch pickles to more than {cap} bytes (pickling stopped there), the "
            f"limit for its body (codec.MAX_BODY_BYTES, FD_SYNC_MAX_MESSAGE_MB); send token "
            f"ids as numpy arrays (they travel out of band) or split the batch") from None
    except Exception as exc:  # pickle raises PicklingError, TypeError, AttributeError...
        raise TypeError(f"task batch is not picklable: {exc}") from exc
    body = out.getvalue()
    if not named:
        return EncodedPayload(body, [], b"", 0)
    # each array is one object the worker builds: they count against MAX_BUFFERS as the
    # buffers of their own do
    count = arrays.count + len(named) - (arrays.region is not None)
    if count > MAX_BUFFERS:
        raise ValueError(f"task batch holds {count} arrays of "
                         f"{OOB_MIN_BYTES} bytes or more, more than codec.MAX_BUFFERS "
                         f"({MAX_BUFFERS}); split the batch")
    pieces = [(start, length, run) for start, length, run in arrays.runs]
    size = arrays.size
    pairs: list[int] = []
    for raw in named:
        if raw is None:
            pairs += (0, arrays.size)
            continue
        start = (size + _ALIGN - 1) & -_ALIGN
        pieces.append((start, raw.nbytes, raw))
        pairs += (start, raw.nbytes)
        size = start + raw.nbytes
    if size > MAX_DATA_BYTES:
        raise ValueError(f"task batch's arrays take {size} bytes, more than "
                         f"codec.MAX_DATA_BYTES ({MAX_DATA_BYTES}); split the batch")
    offsets = struct.pack(f"<{len(pairs)}q", *pairs)
    return EncodedPayload(body, pieces, offsets, size)


def encode_payload(obj) -> list:
    """Serialize ``obj`` into ``[body]`` or ``[body, offsets, data]`` (bytes objects).

    Large contiguous buffers (numpy arrays, bytes-like objects supporting protocol 5) go
    out of band, concatenated into one ``data`` frame at 64-byte aligned offsets
    (``offsets`` holds (start, length) pairs as int64). One frame rather than one per
    array, because every ZeroMQ frame costs the worker a receive and a free, and a
    64-request batch would otherwise carry 64 of them.

    The concatenation is the one copy made, on the engine side, so a caller who mutates an
    array after ``put_tasks()`` returns cannot change a batch that is still retained for a
    late-joining rank.

    Raises ``TypeError`` (with the pickling error chained) if ``obj`` cannot be pickled, and
    ``ValueError`` if the batch exceeds ``MAX_BODY_BYTES``, ``MAX_DATA_BYTES`` or
    ``MAX_BUFFERS`` (a worker would reject it).
    """
    return encode_parts(obj).frames()


def payload_checksum(frames) -> int:
    """64-bit integrity hash (xxh3_64) of the payload frames ``encode_payload()`` returned.

    Each frame's length is hashed before its bytes, so moving bytes from one frame to
    another, dropping, duplicating or reordering frames all change the result. Never 0 (on
    the wire 0 means "no checksum"; a hash of 0 is reported as 1). ``frames`` may be
    ``zmq.Frame`` objects (their ``.buffer`` is read), bytes or memoryviews; nothing is
    copied (docs/performance.md has its cost).

    This detects corruption, not forgery: anyone who can send a batch can compute it.
    """
    return _checksum([_buffer(frame) for frame in frames])


def _checksum(views) -> int:
    hasher = xxhash.xxh3_64()
    for view in views:
        hasher.update(_LENGTH.pack(view.nbytes))
        hasher.update(view)
    return hasher.intdigest() or 1


def decode_payload(frames, checksum=None) -> object:
    """Rebuild the object from ``[body]`` or ``[body, offsets, data]``; buffers zero-copy.

    ``frames`` may be ``zmq.Frame`` objects or bytes-like objects. Nothing blocks. First
    every check of ``check_payload()``, before anything is unpickled or allocated for the
    batch; then the body is unpickled.

    Arrays that travelled out of band come back as read-only views of the data frame (the
    view keeps the frame alive); ``arr.copy()`` before writing.

    Raises ``ProtocolError`` for any failed check, naming what was expected and what
    arrived, and (chained) for any exception raised while unpickling.
    """
    body, buffers = _checked(frames, checksum)
    try:
        return pickle.loads(body, buffers=buffers)
    except Exception as exc:
        raise ProtocolError(f"task batch does not decode: {exc!r}") from exc


def verify_checksum(covered, check: int, what: str) -> None:
    """Raise ``ProtocolError`` (naming ``what``, the expected and the computed value) unless
    ``payload_checksum(covered) == check``. For a batch in shared memory, which the
    checksum covers by its body and its offsets or reference, not by its arrays' bytes:
    the first check of every shared store's read, before anything it names is read, mapped
    or unpickled (then ``verify_data_hash``, then ``decode_payload``). Never blocks."""
    actual = payload_checksum(covered)
    if actual != check:
        raise ProtocolError(
            f"{what}: payload checksum mismatch: expected {check:#018x}, computed "
            f"{actual:#018x} over the body and its offsets or reference: the batch was "
            f"corrupted between the engine's write and this decode")


def verify_data_hash(data, data_hash: int, what: str) -> None:
    """Raise ``ProtocolError`` unless ``data`` (a shared batch's array bytes) hashes to
    ``data_hash`` (xxh3_64, 0 counted as 1); nothing is checked when ``data_hash`` is 0
    (the engine hashed nothing). Never blocks; one pass over the bytes."""
    if not data_hash:
        return
    found = xxhash.xxh3_64(data).intdigest() or 1
    if found != data_hash:
        raise ProtocolError(f"{what}: its {_buffer(data).nbytes} bytes of arrays hash to "
                            f"{found:#018x}, the engine wrote {data_hash:#018x}")


def check_payload(frames, checksum=None) -> None:
    """Every check ``decode_payload()`` makes before it unpickles, without unpickling
    (the engine runs it on a producer's batch before enqueueing it). In this order:

    1. structure: 1 or 3 frames; a body of at most ``MAX_BODY_BYTES`` that starts and ends
       like a protocol-5 pickle; an offsets frame of 16-byte (start, length) pairs, at most
       ``MAX_BUFFERS`` of them; a data frame of at most ``MAX_DATA_BYTES``;
    2. ``checksum``, when given (not None): ``payload_checksum(frames)`` must equal it. 0
       never matches (``payload_checksum`` never returns 0): map "no checksum on the wire"
       to None yourself, and only if unchecked batches are acceptable;
    3. every (start, length) pair non-negative and inside the data frame.

    Raises ``ProtocolError`` for the first failed check. A body that passes may still
    fail to unpickle (only unpickling can tell). Never blocks; copies nothing.
    """
    _checked(frames, checksum)


def _checked(frames, checksum):
    """(body view, out-of-band buffers) once every check of ``check_payload`` passed."""
    count = len(frames)
    if count not in (1, 3):
        raise ProtocolError(f"DATA message with {count} payload frames, expected 1 or 3")
    views = [_buffer(frame) for frame in frames]
    body = views[0]
    if body.nbytes > MAX_BODY_BYTES:
        raise ProtocolError(f"payload body of {body.nbytes} bytes, more than "
                            f"codec.MAX_BODY_BYTES ({MAX_BODY_BYTES})")
    if body[:2] != _PICKLE5_PREFIX or body[-1:] != _PICKLE_STOP:
        raise ProtocolError(f"payload body of {body.nbytes} bytes is not a protocol-5 pickle "
                            f"(starts {bytes(body[:2])!r}, ends {bytes(body[-1:])!r})")
    if count == 3:
        offsets, data = views[1], views[2]
        if offsets.nbytes == 0 or offsets.nbytes % 16:
            raise ProtocolError(f"offsets frame of {offsets.nbytes} bytes, expected a "
                                f"non-zero multiple of 16 ((start, length) int64 pairs)")
        if offsets.nbytes // 16 > MAX_BUFFERS:
            raise ProtocolError(f"offsets frame lists {offsets.nbytes // 16} buffers, more "
                                f"than codec.MAX_BUFFERS ({MAX_BUFFERS})")
        if data.nbytes > MAX_DATA_BYTES:
            raise ProtocolError(f"data frame of {data.nbytes} bytes, more than "
                                f"codec.MAX_DATA_BYTES ({MAX_DATA_BYTES})")
    if checksum is not None:
        actual = _checksum(views)
        if actual != checksum:
            raise ProtocolError(
                f"payload checksum mismatch: expected {checksum:#018x} (sent with the batch), "
                f"computed {actual:#018x} over the {count} frames received "
                f"({', '.join(str(view.nbytes) for view in views)} bytes): the batch was "
                f"corrupted between the engine's encode and this decode")
    buffers = _out_of_band_buffers(views[1], views[2]) if count == 3 else ()
    return body, buffers


def _out_of_band_buffers(offsets, data) -> list:
    """Slices of ``data`` named by the (start, length) int64 pairs in ``offsets``, each
    checked to lie inside ``data``. Slicing a memoryview copies nothing."""
    pairs = offsets.cast("B").cast("q")
    size = data.nbytes
    buffers = []
    for i in range(0, len(pairs), 2):
        start, length = pairs[i], pairs[i + 1]
        if start < 0 or length < 0 or start + length > size:
            raise ProtocolError(f"out-of-band buffer {i // 2} at ({start}, {length}) lies "
                                f"outside the {size}-byte data frame")
        buffers.append(data[start:start + length])
    return buffers


def _buffer(frame):
    # zmq.Frame exposes .buffer, a memoryview of the message that keeps it alive. It is
    # writable, and over inproc it may even be the sender's own memory, so hand pickle a
    # read-only view: decoded arrays are then read-only (writes raise instead of
    # corrupting a message another rank or the engine may still hold).
    if type(frame) is memoryview and frame.readonly:
        return frame  # already what pickle is handed (the ring's and the pool's slices)
    buf = getattr(frame, "buffer", None)
    return memoryview(buf if buf is not None else frame).toreadonly()
