"""Large batches copied once per node: out-of-band buffers in node-local shared memory.

Why: over ``ipc://`` every rank receives its own copy of every batch (the engine's
ZeroMQ I/O thread writes it into one unix socket per rank, each worker reads it into its
own message buffer), so a large batch to a TP group moves TP copies through the kernel.
A node-local engine instead writes the batch's out-of-band buffers (the numpy arrays)
once into shared memory; the DATA message carries the pickle body and a small
*reference* frame (where the bytes are, the buffers' offsets, the bytes' hash); every
rank maps the same bytes read-only and decodes zero-copy. ``tcp://`` endpoints never use
it (ranks on other nodes cannot map this node's memory).

Where the bytes go, in order of preference (``engine.encoder`` decides):

1. **The pool** (``shm.pool``: ``PayloadPool`` writes, ``PoolView`` reads): one segment per queue and worker group,
   created at the queue's first shared batch, ``FD_SYNC_SHM_POOL_MB`` of data used as a
   ring, every page reserved and mapped in when it is created (in each rank when the
   rank first sees it), so that neither the engine's copy nor a rank's read takes a page
   fault again.
2. **A segment of its own** (``SharedPayload``), for a batch larger than the pool or
   when the pool is full: created exclusively, reserved with ``posix_fallocate``, filled
   with ``pwrite``, unlinked once every rank consumed it.
3. **The socket**, when neither fits: ``/dev/shm`` is small (Docker gives containers
   64 MiB) or full. Shared memory is an optimisation: a batch is never refused, and no
   process dies of SIGBUS, because of it. Every page either path uses is reserved before
   a rank is told about it, so a full ``/dev/shm`` shows as ``ENOSPC`` while the engine
   prepares the batch (and the batch takes the socket), never as a fault later
   (``shm.room`` says how much either path may take).

Buffer lifetime (part of the API): decoded arrays are read-only views of the mapping and
keep it alive; an array a rank still holds stays valid and unchanged until it is freed,
whatever happens to the queue. A pool region is written again only once *every* rank has
released it (``shm.release``); a pool is never reused across worker groups, and ranks of
a retired group that still hold arrays keep their pages.

Integrity: the DATA message's checksum covers the body and the reference (which holds
the offsets, the region and its stamp) and is verified before anything is mapped or
unpickled, as on the socket path; then the reference is checked by arithmetic against
what it names. The array bytes in shared memory are not hashed by default
(``FD_SYNC_SHM_CHECKSUM=1`` makes the engine hash them and every rank verify them): the
unpickler never reads them (they only become the contents of arrays whose dtype and
shape come from the checked body, built by ``numpy.frombuffer``, which refuses dtypes
that hold Python objects), no transport carries them (the rank reads the very pages the
engine wrote), and only this uid can write them (0600, created exclusively,
owner-checked on open). Hashing them costs each rank one more pass over the bytes
(``docs/large-batches.md`` has the cost).

Trust: names come from ``names`` (``batch_segment``, ``pool``), created exclusively with
mode 0600. A worker maps only names with its own queue's prefix, owned by its own uid,
whose size and header match; pool regions are checked by arithmetic against the pool's
size and must carry the stamp the reference names. A pool's memory is a memfd sealed
against shrinking behind its name (``shm.sealed``): arrays a rank keeps can never be cut
from under it; a batch's own segment is a plain ``/dev/shm`` file (truncated after the
take, its kept arrays fault: docs/failure-model.md). Ranks map the data read-only; only
their release row in the header is writable. A pool is an owned segment (its owner lock
held for the engine's life); a batch's own segment carries no lock: it lives while its
queue's engine does (the ack board's owner lock), which reclaims a dead predecessor's at
start (``reclaim_stale``).
"""

import collections
import logging
import os
import struct
import threading
from typing import Optional

from .. import names
from ..errors import ProtocolError
from ..wire import codec
from .pool import PoolView, open_reference
from .segment import create_exclusive, map_shared, open_checked, reserve, unlink_segment
from .segment import reclaim_stale as reclaim_segment
from .semaphores import unlink_semaphore

__all__ = ["SharedPayload", "PayloadReader", "MappedPayload", "pack_ref", "unpack_ref",
           "map_payload", "reclaim_stale", "REF_MAGIC"]

log = logging.getLogger(__name__)

# -- the reference frame -------------------------------------------------------------------

# magic, layout version, data size, number of (start, length) pairs, name length, stamp
# (0: a segment of its own), start of the region in the pool's data, xxh3_64 of the data
# (0: not hashed). 48 bytes, so the int64 pairs that follow are aligned; then the name.
REF_MAGIC = b"FDSH"
_REF_VERSION = 2
_REF = struct.Struct("<4sIQIIQQQ")
_MAX_NAME = 255  # NAME_MAX of /dev/shm
_MAX_PAIRS = 1 << 16  # codec.MAX_BUFFERS


class Ref:
    """A parsed reference frame."""

    __slots__ = ("name", "size", "offsets", "stamp", "start", "data_hash")

    def __init__(self, name, size, offsets, stamp, start, data_hash):
        self.name, self.size, self.offsets = name, size, offsets
        self.stamp, self.start, self.data_hash = stamp, start, data_hash


def pack_ref(name: str, size: int, offsets: bytes, *, stamp: int = 0, start: int = 0,
             data_hash: int = 0) -> bytes:
    """The reference frame for a shared batch (``offsets``: codec's int64 pairs)."""
    raw = name.encode("ascii")
    return (_REF.pack(REF_MAGIC, _REF_VERSION, size, len(offsets) // 16, len(raw), stamp,
                      start, data_hash) + offsets + raw)


def unpack_ref(frame) -> Ref:
    """A ``Ref`` from a reference frame, checked by arithmetic only; ``offsets`` is a
    memoryview of the frame. ``ProtocolError`` for anything malformed."""
    buf = memoryview(frame).cast("B")
    if buf.nbytes < _REF.size:
        raise ProtocolError(f"shared-memory reference of {buf.nbytes} bytes, shorter than "
                            f"its {_REF.size}-byte header")
    magic, version, size, pairs, name_len, stamp, start, data_hash = _REF.unpack_from(buf)
    if magic != REF_MAGIC or version != _REF_VERSION:
        raise ProtocolError(f"shared-memory reference with magic {bytes(magic)!r} version "
                            f"{version}, expected {REF_MAGIC!r} version {_REF_VERSION}")
    if not 0 < pairs <= _MAX_PAIRS or not 0 < name_len <= _MAX_NAME:
        raise ProtocolError(f"shared-memory reference lists {pairs} buffers and a "
                            f"{name_len}-byte name")
    end = _REF.size + pairs * 16
    if buf.nbytes != end + name_len:
        raise ProtocolError(f"shared-memory reference of {buf.nbytes} bytes, its header "
                            f"says {end + name_len}")
    if size <= 0 or (stamp == 0 and start != 0):
        raise ProtocolError(f"shared-memory reference to {size} bytes at {start} "
                            f"(stamp {stamp})")
    try:
        name = bytes(buf[end:]).decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("shared-memory reference names a non-ascii segment") from None
    return Ref(name, size, buf[_REF.size:end], stamp, start, data_hash)


# -- a batch's own segment -----------------------------------------------------------------


class SharedPayload:
    """The engine's handle on one batch's own segment: ``name`` and ``size``.

    The engine writes with ``pwrite`` (into fresh tmpfs pages twice as fast as copying
    into a fresh mapping, whose every page faults) and never maps it, except to decode
    it again (``map()``)."""

    stamp = start = 0  # what a pool region has and a segment of its own does not

    def __init__(self, name: str, size: int, fd: int):
        self.name, self.size = name, size
        self._fd: Optional[int] = fd
        self._released = False

    @classmethod
    def create(cls, name: str, size: int) -> "SharedPayload":
        """Create segment ``name`` of ``size`` (> 0) zero-filled bytes, exclusively, mode
        0600, every page reserved. ``FileExistsError`` if the name exists (never opened
        nor unlinked here); ``OSError`` (``ENOSPC`` when ``/dev/shm`` has no room) with
        the name removed again."""
        if size <= 0:
            raise ValueError(f"shared batch {name}: size {size}, expected > 0")
        shm = create_exclusive(name, size)
        fd = os.dup(shm.fd)  # a plain fd we own; posix_ipc's object can go
        shm.close_fd()
        try:
            reserve(fd, size)
        except BaseException:
            os.close(fd)
            unlink_segment(name)
            raise
        return cls(name, size, fd)

    def write(self, offset: int, data) -> None:
        """Copy ``data`` (bytes-like) to ``offset``. Blocks for the copy (GIL released)."""
        view = memoryview(data).cast("B")
        if offset < 0 or offset + view.nbytes > self.size:
            raise ValueError(f"shared batch {self.name}: write of {view.nbytes} bytes at "
                             f"{offset} outside its {self.size} bytes")
        fd = self._fd
        if fd is None:
            raise ValueError(f"shared batch {self.name}: write after seal() (its file is "
                             f"closed); write every part before sealing")
        done = 0
        while done < view.nbytes:  # one write() moves at most ~2 GiB
            done += os.pwrite(fd, view[done:], offset + done)

    def write_payload(self, parts) -> None:
        """Copy ``parts``' buffers (``codec.EncodedPayload``) to their offsets, then close
        the file (the name keeps the memory). The gaps stay zero (fresh pages)."""
        for start, raw in parts.chunks():
            self.write(start, raw)
        self.seal()

    def seal(self) -> None:
        """Writing is done: close the file descriptor (the name keeps the memory)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def map(self) -> memoryview:
        """A read-only, zero-copy view of the whole batch (for decoding it again on the
        engine); it keeps its mapping alive after ``release()``."""
        mapping = map_payload(self.name, self.size, self.name)
        return mapping.view

    def release(self) -> None:
        """Unlink the name. Idempotent; never raises for a name already gone. Mappings
        (the ranks' decoded arrays, a ``LostBatch``'s) stay valid until they are garbage."""
        self.seal()
        if not self._released:
            self._released = True
            unlink_segment(self.name)


class MappedPayload:
    """A worker's read-only mapping of one batch's own segment (``view``: a read-only
    memoryview). Decoded arrays are slices of ``view`` and keep the mapping alive; it is
    unmapped when the last of them is garbage."""

    __slots__ = ("name", "view")

    def __init__(self, name, view):
        self.name, self.view = name, view


def _open_checked(name: str, prefix: str, read_only: bool):
    """``(posix_ipc.SharedMemory, os.stat_result)`` of shared batch ``name`` after the
    checks every rank makes before mapping anything (``pool.open_reference``): the name
    has this queue's prefix, the object exists and is owned by this uid."""
    return open_reference(name, prefix, "shared batch",
                          lambda n: open_checked(n, read_only=read_only))


def map_payload(name: str, size: int, prefix: str) -> MappedPayload:
    """Map batch segment ``name`` read-only, zero-copy. Never blocks beyond the system
    calls.

    Refuses (``ProtocolError``), before mapping anything: a name outside ``prefix`` (the
    queue's own batches; a reference cannot point a rank at another segment), a segment
    owned by another uid (another user could otherwise feed it batches), one whose size is
    not ``size``. A name that no longer exists raises ``GroupLostError``: the engine
    releases a batch no rank has mapped only when it retires the group or closes.
    """
    shm, st = _open_checked(name, prefix, read_only=True)
    try:
        if st.st_size != size or size <= 0:
            raise ProtocolError(f"shared batch {name} holds {st.st_size} bytes, its "
                                f"reference says {size}")
        mapping = map_shared(shm.fd, size, writable=False)
    finally:
        shm.close_fd()  # the mapping does not need the fd
    return MappedPayload(name, memoryview(mapping))


class PayloadReader:
    """A rank's decoder of shared batches of queue ``name``/``dp_id``: maps each pool once
    (the two most recent stay mapped) and each batch's own segment per batch.

    ``decode`` may run in several threads at once (the socket's receiver, the ring's
    prefetch thread, the event loop), also for one batch: its decodes share the region's
    release (``shm.pool.PoolView.region``)."""

    _KEEP_POOLS = 2

    def __init__(self, name: str, dp_id: int, tp_size: int, tp_rank: int):
        self.prefix = names.payload_prefix(name, dp_id)
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self._pools: collections.OrderedDict = collections.OrderedDict()  # name -> pool.PoolView
        self._pools_lock = threading.Lock()

    def decode(self, body, ref, check: int):
        """The batch a DATA message ``[body, ref]`` with checksum ``check`` refers to.

        In this order, each before anything later is mapped or unpickled: the checksum
        over the body and the reference (as for the socket path; a corrupted reference
        can point nowhere); the reference's structure; the name (this queue's prefix),
        owner and size of what it names; the region's bounds and stamp; the array bytes'
        hash when the engine sent one (``FD_SYNC_SHM_CHECKSUM=1``). Then
        ``codec.decode_payload`` (structure, bounds, unpickling) on the mapped bytes, which
        the decoded arrays view read-only.

        Raises ``ProtocolError`` for any failed check (naming what was expected and what
        was found), ``GroupLostError`` when the name is gone (the engine retired the group
        or closed). Blocks only on system calls; the first batch of a pool maps it (once
        per pool).
        """
        codec.verify_checksum([body, ref], check, "shared batch")
        r = unpack_ref(ref)
        if r.stamp:
            data = self._pool(r.name).region(r.start, r.size, r.stamp)
        else:
            data = map_payload(r.name, r.size, self.prefix).view
        codec.verify_data_hash(data, r.data_hash, f"shared batch {r.name}")
        return codec.decode_payload([body, r.offsets, data], None)

    def close(self) -> None:
        """Let go of every pool mapped: each is unmapped (and its descriptor closed) now,
        or with the last array that views it. Decoding after close maps a pool again."""
        with self._pools_lock:
            self._pools = collections.OrderedDict()

    def _pool(self, name):
        # under a lock: the socket's receiver, the ring's prefetch thread and the event loop
        # may decode at once, and each pool must be mapped once (its release bookkeeping)
        with self._pools_lock:
            pool = self._pools.get(name)
            if pool is None:
                pool = PoolView.open(name, self.prefix, self.tp_size, self.tp_rank)
                self._pools[name] = pool
                while len(self._pools) > self._KEEP_POOLS:  # views keep an evicted one mapped
                    self._pools.popitem(last=False)
            return pool


# -- leftovers -----------------------------------------------------------------------------


def reclaim_stale(name: str, dp_id: int) -> list:
    """Unlink the shared batches, pools and rings (with their semaphores) of queue
    ``name``/``dp_id`` left by engines that are gone. Call it only while holding the
    queue's node-local endpoint exclusively (``TaskQueue`` calls it once its ack board is
    created): then no other engine of this queue lives, and any such name is a killed
    engine's, whatever pid it carries (pids are reused, and differ between pid
    namespaces). A pool or ring whose owner lock is held anyway is left alone, as are
    names of other uids (``shm.segment.reclaim_stale``). Returns the names removed."""
    removed: list = []
    try:
        entries = os.listdir(names.SHM_DIR)
    except OSError:
        return removed
    for entry in entries:
        if names.is_payload_of(entry, name, dp_id):
            try:
                if reclaim_segment("/" + entry) == 0 and not os.path.lexists(
                        names.shm_path("/" + entry)):
                    removed.append("/" + entry)
            except PermissionError:
                pass  # another user's: not ours to judge, nor to remove
    for entry in entries:  # a ring's semaphores, once its segment is gone
        if (names.is_ring_semaphore_of(entry, name, dp_id)
                and not os.path.lexists(names.shm_path(names.ring_of_semaphore(entry)))
                and unlink_semaphore("/" + entry[len("sem."):])):
            removed.append(entry)
    if removed:
        log.warning("reclaimed %d shared batch(es) and pool(s) of %s dp_id=%d left by exited "
                    "engine(s): %s", len(removed), name, dp_id, ", ".join(removed[:8]))
    return removed
