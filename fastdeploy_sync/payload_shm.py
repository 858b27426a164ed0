"""Large batches copied once per node: out-of-band buffers in node-local shared memory.

Why: over ``ipc://`` every rank receives its own copy of every batch (the engine's
ZeroMQ I/O thread writes it into one unix socket per rank, each worker reads it into its
own message buffer), so a 64 MiB batch to a TP=4 group moves 256 MiB through the kernel
and takes hundreds of ms. A node-local engine instead writes the batch's out-of-band
buffers (the numpy arrays) once into shared memory; the DATA message carries the pickle
body and a small *reference* frame (where the bytes are, the buffers' offsets, the
bytes' hash); every rank maps the same bytes read-only and decodes zero-copy. ``tcp://``
endpoints never use it (ranks on other nodes cannot map this node's memory).

Where the bytes go, in order of preference (``batch_encoder`` decides):

1. **The pool** (``PayloadPool``): one segment per queue and worker group, created at the
   queue's first shared batch, ``FD_SYNC_SHM_POOL_MB`` (default 256 MiB) of data used as a
   ring, every page reserved (``posix_fallocate``) and mapped in the engine
   (``MAP_POPULATE``) when it is created, and in each rank when the rank first sees it.
   Batches reuse its pages, so neither the engine's copy nor a rank's read ever takes a
   page fault again: writing into fresh tmpfs pages costs ~33 ms per 64 MiB on these
   machines, copying into the pool's ~4 ms.
2. **A segment of its own** (``SharedPayload``), for a batch larger than the pool or
   when the pool is full: created exclusively, reserved with ``posix_fallocate``, filled
   with ``pwrite``, unlinked once every rank consumed it.
3. **The socket**, when neither fits: ``/dev/shm`` is small (Docker gives containers
   64 MiB) or full. Shared memory is an optimisation: a batch is never refused, and no
   process dies of SIGBUS, because of it. Every page either path uses is reserved before
   a rank is told about it, so a full ``/dev/shm`` shows as ``ENOSPC`` while the engine
   prepares the batch (and the batch takes the socket), never as a fault later. Neither
   path may leave less than a quarter of ``/dev/shm`` free for the rest of the node
   (NCCL, other processes), and the pool takes at most half of it.

Buffer lifetime (part of the API): decoded arrays are read-only views of the mapping and
keep it alive; an array a rank still holds stays valid and unchanged until it is freed,
whatever happens to the queue. For the pool this means a region may be written again only
once *every* rank has released it: each batch's arrays keep one small object per rank
alive (a numpy view of the region), whose finalizer stores the batch's stamp in that
rank's row of the pool's header when the last array is freed; the engine reuses a
region only when the batch was consumed by every rank and every rank's row shows it
released. A rank that holds arrays for long (or forever) holds its region: the ring
cannot pass it, and batches take a segment of their own or the socket meanwhile. A pool
is never reused across worker groups: when a group is retired, its pool is retired with
it (unlinked once no batch of the next group still sits in it) and the next group gets a
new one; ranks of the old group that still hold arrays keep their pages.

Integrity: the DATA message's checksum covers the body and the reference (which holds
the offsets, the region and its stamp) and is verified before anything is mapped or
unpickled, as on the socket path; then the reference is checked by arithmetic against
what it names. The array bytes in shared memory are not hashed by default
(``FD_SYNC_SHM_CHECKSUM=1`` makes the engine hash them and every rank verify them): the
unpickler never reads them (they only become the contents of arrays whose dtype and
shape come from the checked body, built by ``numpy.frombuffer``, which refuses dtypes
that hold Python objects), no transport carries them (the rank reads the very pages the
engine wrote), and only this uid can write them (0600, created exclusively,
owner-checked on open). Hashing them costs each rank one more pass over the bytes: about
half of the delivery time of a 64 MiB batch to TP=4 here (see
``docs/large-batches.md``).

Trust: names are ``/fdsync.NAME.dpN.b<K>.<engine-pid>`` (own segment) and
``/fdsync.NAME.dpN.bp<K>.<engine-pid>`` (pool), created exclusively with mode 0600. A
worker maps only names with its own queue's prefix, owned by its own uid, whose size and
header match; pool regions are checked by arithmetic against the pool's size and must
carry the stamp the reference names. Ranks map the data read-only; only their release
row in the header is writable. The engine holds an exclusive ``flock`` on each pool it
owns for the pool's life; a process it forks closes its inherited copy of that descriptor at
once (``shm.forget_in_child``), so the lock dies with the engine.
"""

import collections
import errno
import fcntl
import logging
import mmap
import os
import re
import stat
import struct
import threading
import weakref

import numpy as np
import posix_ipc
import xxhash

from . import codec
from .errors import GroupLostError, ProtocolError
from .shm import create_exclusive, forget_in_child, owner_lock_held, unlink_segment

__all__ = ["SharedPayload", "PayloadPool", "PoolRegion", "PayloadReader", "MappedPayload",
           "payload_prefix", "payload_name", "pool_name", "pack_ref", "unpack_ref",
           "map_payload", "reclaim_stale", "pool_locked", "shm_room", "pool_size", "fresh_fits",
           "REF_MAGIC", "PoolTruncated"]

log = logging.getLogger(__name__)

_SHM_DIR = "/dev/shm"
MiB = 1 << 20

# -- names ---------------------------------------------------------------------------------


def payload_prefix(name: str, dp_id: int) -> str:
    """The name prefix of every shared batch and pool of queue ``name``/``dp_id``."""
    return f"/fdsync.{name}.dp{dp_id}.b"


def payload_name(name: str, dp_id: int, number: int, pid: int = None) -> str:
    """The name of a batch's own segment."""
    return f"{payload_prefix(name, dp_id)}{number}.{os.getpid() if pid is None else pid}"


def pool_name(name: str, dp_id: int, number: int, pid: int = None) -> str:
    """The name of a pool."""
    return f"{payload_prefix(name, dp_id)}p{number}.{os.getpid() if pid is None else pid}"


def _name_re(name: str, dp_id: int):
    # b<K>.<pid>: a batch's own segment; bp<K>.<pid>: a pool; br<epoch>.<pid>: a worker
    # group's ring (batch_ring), whose semaphores are sem.<ring>.w<rank>
    return re.compile(re.escape(payload_prefix(name, dp_id).lstrip("/")) + r"[pr]?\d+\.\d+")


def _sem_re(name: str, dp_id: int):
    return re.compile("sem." + re.escape(payload_prefix(name, dp_id).lstrip("/"))
                      + r"r\d+\.\d+\.w\d+")


# -- room in /dev/shm ----------------------------------------------------------------------


def shm_room(path: str = _SHM_DIR):
    """``(size, free)`` of the filesystem holding ``path``, in bytes (statvfs: ~2 µs)."""
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def _reserve_left(total: int) -> int:
    # what the payload paths leave free for the rest of the node
    return total // 4


def pool_size(requested: int, min_bytes: int, path: str = _SHM_DIR):
    """``(bytes, why)``: how big a pool of ``requested`` data bytes may be in ``path`` now,
    rounded down to MiB; 0 when it would be smaller than ``min_bytes``. ``why`` says what
    limited it (None: nothing did)."""
    total, free = shm_room(path)
    limits = [(requested, None),
              (total // 2, f"half of {path} ({total // MiB} MiB)"),
              (free - _reserve_left(total), f"{path} has {free // MiB} MiB free of "
                                            f"{total // MiB} MiB and the pool leaves a "
                                            f"quarter of it free")]
    size, why = min(limits, key=lambda limit: limit[0])
    size = max(0, size) // MiB * MiB
    if size < min_bytes:
        return 0, (f"{why}: " if why else "") + (f"{size // MiB} MiB is less than the "
                                                 f"{-(-min_bytes // MiB)} MiB a pool needs")
    return size, why


def fresh_fits(size: int, path: str = _SHM_DIR):
    """``None`` if a segment of ``size`` bytes leaves a quarter of ``path`` free, else a
    sentence saying why it does not."""
    total, free = shm_room(path)
    if free - size >= _reserve_left(total):
        return None
    return (f"{path} has {free // MiB} MiB free of {total // MiB} MiB: a {size / MiB:.1f} MiB "
            f"segment would leave less than a quarter of it free")


def _reserve(fd: int, size: int) -> None:
    """Allocate every page of the file now (tmpfs supports fallocate): a full /dev/shm is
    an ``OSError(ENOSPC)`` here, never a SIGBUS when the memory is first touched."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # not tmpfs: touch every page
            page = bytes(mmap.PAGESIZE)
            for offset in range(0, size, mmap.PAGESIZE):
                os.pwrite(fd, page[:min(mmap.PAGESIZE, size - offset)], offset)
        else:
            raise


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
        self._fd = fd
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
            _reserve(fd, size)
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
        done = 0
        while done < view.nbytes:  # one write() moves at most ~2 GiB
            done += os.pwrite(self._fd, view[done:], offset + done)

    def write_payload(self, parts) -> None:
        """Copy ``parts``' buffers (``codec.EncodedPayload``) to their offsets, then close
        the file (the name keeps the memory). The gaps stay zero (fresh pages)."""
        for (start, _), raw in zip(parts.layout, parts.buffers):
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
    """``(posix_ipc.SharedMemory, os.stat_result)`` of shared batch or pool ``name`` after
    the checks every rank makes before mapping anything: the name has this queue's
    prefix, the object exists and is owned by this uid."""
    if not name.startswith(prefix) or "/" in name[1:]:
        raise ProtocolError(f"shared-memory reference to {name!r}, outside this queue's "
                            f"batches ({prefix}*)")
    try:
        shm = posix_ipc.SharedMemory(name, read_only=read_only)
    except posix_ipc.ExistentialError:
        raise GroupLostError(
            f"shared batch {name} is gone before this rank mapped it: the engine retired "
            f"this worker group or closed the queue; restart the group") from None
    except posix_ipc.PermissionsError as exc:
        raise ProtocolError(f"shared batch {name}: this process (uid {os.geteuid()}) may "
                            f"not open it: another user created it") from exc
    try:
        st = os.fstat(shm.fd)  # the object we opened, not a name that may be swapped
        if st.st_uid != os.geteuid():
            raise ProtocolError(
                f"shared batch {name} is owned by uid {st.st_uid}, not by this process's uid "
                f"{os.geteuid()} (mode {oct(stat.S_IMODE(st.st_mode))}): not mapped")
    except BaseException:
        shm.close_fd()
        raise
    return shm, st


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
        mapping = mmap.mmap(shm.fd, size, access=mmap.ACCESS_READ)
    finally:
        shm.close_fd()  # the mapping does not need the fd
    return MappedPayload(name, memoryview(mapping))


# -- the pool ------------------------------------------------------------------------------

# Header, int64 words: magic, layout version, tp_size, entries, data offset, data size,
# ready (written last), owner pid (for people); then `entries` FILLED words (FILLED[e]:
# the stamp of the last batch the engine wrote into a region of entry e = stamp %
# entries); then one RELEASED row of `entries` words per rank (RELEASED[r][e]: the stamp
# of the last batch of entry e whose arrays rank r freed). Rows are 8 * entries bytes
# apart, so ranks never share a cache line. The data starts at the next page.
_POOL_MAGIC = int.from_bytes(b"FDSYPOOL", "little")
_POOL_VERSION = 1
_H_MAGIC, _H_VERSION, _H_TP, _H_ENTRIES, _H_DATA_OFFSET, _H_DATA_SIZE, _H_READY, _H_PID = range(8)
_H_FILLED = 8
POOL_ENTRIES = 256  # batches a pool holds at most at once
_MAX_ENTRIES = 1 << 16
_MAX_TP = 1 << 12
_ALIGN = 64  # regions start on cache lines (and codec aligns buffers inside them)


def _header_bytes(tp_size: int, entries: int) -> int:
    words = _H_FILLED + entries * (tp_size + 1)
    return -(-words * 8 // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY


def _released_index(entries: int, rank: int, entry: int) -> int:
    return _H_FILLED + entries * (rank + 1) + entry


# region states (engine side)
_PENDING, _KEPT, _CONSUMED, _DISCARDED, _ABANDONED = range(5)


class PoolRegion:
    """One batch's place in a pool (engine side): ``start``/``size`` in the pool's data,
    ``stamp`` (the pool's batch counter, > 0) and what became of it."""

    __slots__ = ("pool", "start", "size", "span", "stamp", "state")

    def __init__(self, pool, start, size, span, stamp):
        self.pool, self.start, self.size, self.span, self.stamp = pool, start, size, span, stamp
        self.state = _PENDING

    @property
    def name(self) -> str:
        return self.pool.name

    def write_payload(self, parts) -> None:
        """Copy ``parts``' buffers (``codec.EncodedPayload``) into the region (gaps zeroed),
        then record the region as holding this stamp. Blocks for the copy; buffers of
        1 MiB or more are copied with the GIL released."""
        self.pool.write(self, parts)

    def view(self) -> memoryview:
        """A read-only view of the region's bytes (for decoding it again on the engine)."""
        return self.pool.view(self)


class PayloadPool:
    """The engine's ring of reused shared memory for one worker group: one segment
    (``name``) of ``data_size`` bytes of data behind a small header, pre-faulted at
    creation, regions handed out in ring order and reused only once every rank released
    them (see the module docstring).

    Not thread-safe: ``batch_encoder.BatchEncoder`` serialises every call under its lock,
    except ``write`` and ``view`` of a region it handed out (regions are disjoint)."""

    def __init__(self, name, tp_size, entries, data_size, fd, mapping, header):
        self.name, self.tp_size, self.entries, self.data_size = name, tp_size, entries, data_size
        self._fd = fd
        self._mapping = mapping
        self._header = header
        self._words = memoryview(mapping)[:header].cast("q")
        self._data = memoryview(mapping)[header:header + data_size]
        self._live = collections.deque()  # regions in ring order, oldest first
        self._stamps = 0
        self.retired = False  # no more regions: its group was retired or the queue closed
        self.closed = False
        forget_in_child(self)  # a forked child must not hold the flock, nor unlink the name

    @classmethod
    def create(cls, name: str, tp_size: int, data_size: int,
               entries: int = POOL_ENTRIES) -> "PayloadPool":
        """Create pool ``name`` with ``data_size`` bytes of data for ``tp_size`` ranks:
        exclusively, mode 0600, every page reserved and mapped (the one-time cost of the
        page faults: 0.17 s for 256 MiB here, bench_large_batches.py section 2).
        ``FileExistsError`` if the name exists, ``OSError`` (``ENOSPC``: no room in
        ``/dev/shm``) with the name removed again."""
        if data_size <= 0 or data_size % _ALIGN:
            raise ValueError(f"pool {name}: data size {data_size}, expected a positive "
                             f"multiple of {_ALIGN}")
        header = _header_bytes(tp_size, entries)
        total = header + data_size
        shm = create_exclusive(name, total)
        fd = -1
        try:
            # The ownership lock on a descriptor of its own: mmap keeps a dup of the
            # descriptor it maps, which would share (and, in a forked child, keep) the lock.
            fd = os.open(f"{_SHM_DIR}{name}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            a, b = os.fstat(fd), os.fstat(shm.fd)
            if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
                raise FileExistsError(f"pool {name} was replaced while it was created")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while this engine lives
            _reserve(shm.fd, total)
            mapping = mmap.mmap(shm.fd, total, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            shm.close_fd()
            unlink_segment(name)
            raise
        shm.close_fd()  # the mapping keeps its own
        pool = cls(name, tp_size, entries, data_size, fd, mapping, header)
        words = pool._words
        words[_H_MAGIC], words[_H_VERSION], words[_H_TP] = _POOL_MAGIC, _POOL_VERSION, tp_size
        words[_H_ENTRIES], words[_H_DATA_OFFSET], words[_H_DATA_SIZE] = entries, header, data_size
        words[_H_PID] = os.getpid()
        words[_H_READY] = 1  # last: a rank that sees it sees the rest
        return pool

    # -- regions -----------------------------------------------------------------------

    def allocate(self, size: int):
        """A region of ``size`` bytes, or None when the ring has no room for it now (it
        first reuses what every rank released). Never blocks."""
        if self.retired:
            return None
        self._reclaim()
        span = (size + _ALIGN - 1) & -_ALIGN
        if span > self.data_size or len(self._live) >= self.entries:
            return None
        start = self._place(span)
        if start is None:
            return None
        self._stamps += 1
        region = PoolRegion(self, start, size, span, self._stamps)
        self._live.append(region)
        return region

    def _place(self, span):
        live = self._live
        if not live:
            return 0
        tail, newest = live[0].start, live[-1]
        head = newest.start + newest.span
        if newest.start >= tail:  # live regions lie in [tail, head): room after head, then before tail
            if self.data_size - head >= span:
                return head
            return 0 if tail >= span else None
        return head if tail - head >= span else None  # wrapped: room in [head, tail)

    def _reclaim(self):
        """Drop the oldest regions while they are free: never enqueued, or consumed by
        every rank and released by every rank's arrays."""
        live, words = self._live, self._words
        while live:
            region = live[0]
            if region.state == _CONSUMED:
                entry = region.stamp % self.entries
                if any(words[_released_index(self.entries, rank, entry)] != region.stamp
                       for rank in range(self.tp_size)):
                    return
            elif region.state != _DISCARDED:
                return
            live.popleft()

    def write(self, region, parts) -> None:
        """Copy ``parts`` into ``region``; ``PoolTruncated`` (nothing written) if another
        process truncated the pool's file."""
        _check_length(self._fd, self.name, self._words.nbytes + self.data_size)
        base = region.start
        parts.write_data(self._data[base:base + region.size])
        self._words[_H_FILLED + region.stamp % self.entries] = region.stamp

    def view(self, region) -> memoryview:
        if self._fd >= 0:  # a closed pool cannot be asked (its mapping stays, unchecked)
            _check_length(self._fd, self.name, self._words.nbytes + self.data_size)
        return self._data[region.start:region.start + region.size].toreadonly()

    def kept(self, region):
        region.state = _KEPT

    def consumed(self, region):
        if region.state == _KEPT:
            region.state = _CONSUMED

    def discarded(self, region):
        region.state = _DISCARDED
        # the newest regions can be given back at once (usually the case: a put that
        # timed out); older ones wait for the ring's tail to reach them
        while self._live and self._live[-1].state == _DISCARDED:
            self._live.pop()

    def abandon_kept(self):
        """The group was retired: its batches' regions are never reused (ranks of the old
        group may still view them), and the pool takes no new batch."""
        self.retired = True
        for region in self._live:
            if region.state in (_KEPT, _CONSUMED):
                region.state = _ABANDONED

    def busy(self) -> bool:
        """Some region is still being written, or enqueued and not yet consumed by every
        rank: a rank may still have to open the pool by its name."""
        return any(region.state in (_PENDING, _KEPT) for region in self._live)

    def stats(self) -> dict:
        """``regions`` (held now), ``bytes_held``, ``data_size``."""
        if not self.retired:
            self._reclaim()
        held = [r for r in self._live if r.state not in (_DISCARDED,)]
        return {"regions": len(held), "bytes_held": sum(r.span for r in held),
                "data_size": self.data_size}

    def close(self) -> None:
        """Unlink the name and close the file (dropping the ownership lock). Idempotent.
        The mapping stays until this object is garbage: a region still being written by
        a put that is about to fail, or decoded again for a ``LostBatch`` (whose arrays
        then keep it), must find it mapped; the memory returns to the system with the
        last of them."""
        if self.closed:
            return
        self.closed = self.retired = True
        unlink_segment(self.name)
        fd, self._fd = self._fd, -1
        os.close(fd)

    def _forget_in_child(self):
        """In a forked child: drop the inherited descriptor (and with it the child's share
        of the ``flock`` that says this engine owns the pool); the child never unlinks the
        parent's pool (``close()`` does nothing)."""
        if not self.closed:
            self.closed = self.retired = True
            fd, self._fd = self._fd, -1
            try:
                os.close(fd)
            except OSError:
                pass


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux; elsewhere pages fault in on first use


class PoolTruncated(ProtocolError):
    """A pool's file is shorter than its layout: another process of this uid truncated it.
    Reading (rank) or writing (engine) its pages would kill the process with SIGBUS, so
    it is checked (``fstat``) before they are touched."""


def _check_length(fd: int, name: str, total: int) -> None:
    """``PoolTruncated`` unless the file ``fd`` still holds the pool's ``total`` bytes."""
    have = os.fstat(fd).st_size
    if have < total:
        raise PoolTruncated(f"pool {name} holds {have} bytes, its layout {total}: another "
                            f"process of this user truncated it; its batches are gone (not "
                            f"read: touching them would be a SIGBUS)")


class _PoolView:
    """A rank's mapping of one pool: the data read-only (populated once), the header
    read-write (its release row), and a descriptor of its own to check the file's length
    before each batch is read (``PoolTruncated``)."""

    __slots__ = ("name", "entries", "data_size", "rank", "_words", "_data", "_fd", "_total",
                 "_holders", "_holders_lock", "__weakref__")

    def __init__(self, name, entries, data_size, rank, words, data, fd, total):
        self.name, self.entries, self.data_size, self.rank = name, entries, data_size, rank
        self._words, self._data = words, data
        self._fd, self._total = fd, total
        weakref.finalize(self, os.close, fd)
        # entry -> (stamp, weakref to the region's array): two decodes of one batch (the
        # prefetch thread's and the event loop's) share it, so the release waits for both
        self._holders = {}
        self._holders_lock = threading.Lock()

    @classmethod
    def open(cls, name: str, prefix: str, tp_size: int, rank: int) -> "_PoolView":
        shm, st = _open_checked(name, prefix, read_only=False)
        try:
            raw = os.pread(shm.fd, _H_FILLED * 8, 0)
            if len(raw) != _H_FILLED * 8:
                raise ProtocolError(f"pool {name} holds {st.st_size} bytes, less than its header")
            magic, version, tp, entries, data_offset, data_size, ready, _ = struct.unpack(
                "<8q", raw)
            if magic != _POOL_MAGIC or version != _POOL_VERSION or ready != 1:
                raise ProtocolError(f"pool {name}: not a ready pool of this layout (magic "
                                    f"{magic:#x}, version {version}, ready {ready})")
            if tp != tp_size or not 0 < entries <= _MAX_ENTRIES or not 0 < tp <= _MAX_TP:
                raise ProtocolError(f"pool {name} is laid out for tp_size {tp} and {entries} "
                                    f"entries; this rank's group has tp_size {tp_size}")
            if (data_offset != _header_bytes(tp, entries) or data_size <= 0
                    or data_offset + data_size != st.st_size):
                raise ProtocolError(f"pool {name}: header says data at {data_offset}, "
                                    f"{data_size} bytes; the segment holds {st.st_size}")
            header = mmap.mmap(shm.fd, data_offset, flags=mmap.MAP_SHARED)
            data = mmap.mmap(shm.fd, data_size, flags=mmap.MAP_SHARED | _POPULATE,
                             prot=mmap.PROT_READ, offset=data_offset)
            fd = os.dup(shm.fd)
        finally:
            shm.close_fd()
        return cls(name, entries, data_size, rank, memoryview(header).cast("q"), data, fd,
                   data_offset + data_size)

    def region(self, start: int, size: int, stamp: int):
        """The batch ``stamp``'s bytes as a read-only numpy array of ``size`` bytes, after
        checking by arithmetic that they lie in the pool and that the engine recorded this
        stamp as the region's last fill. When the array and every view derived from it
        (the decoded arrays) are freed, this rank's release of ``stamp`` is published."""
        if not 0 <= start <= self.data_size - size or stamp <= 0:
            raise ProtocolError(f"pool {self.name}: region of {size} bytes at {start} "
                                f"(stamp {stamp}) outside its {self.data_size} bytes")
        _check_length(self._fd, self.name, self._total)  # before any page is touched
        entry = stamp % self.entries
        filled = self._words[_H_FILLED + entry]
        if filled != stamp:
            raise ProtocolError(f"pool {self.name}: the region of batch stamp {stamp} holds "
                                f"stamp {filled}: reused before this rank read it")
        with self._holders_lock:
            held = self._holders.get(entry)
            region = held[1]() if held is not None and held[0] == stamp else None
            if region is None:
                region = np.frombuffer(self._data, dtype=np.uint8, count=size, offset=start)
                weakref.finalize(region, _publish_release, self._words,
                                 _released_index(self.entries, self.rank, entry), stamp)
                self._holders[entry] = (stamp, weakref.ref(region))
        return region


def _publish_release(words, index, stamp):
    # runs in whichever thread frees the last array: one store into shared memory
    words[index] = stamp


class PayloadReader:
    """A rank's decoder of shared batches of queue ``name``/``dp_id``: maps each pool once
    (the two most recent stay mapped) and each batch's own segment per batch.

    ``decode`` may run in several threads at once (the socket's receiver, the ring's
    prefetch thread, the event loop), also for one batch: its decodes share the region's
    release (``_PoolView.region``)."""

    _KEEP_POOLS = 2

    def __init__(self, name: str, dp_id: int, tp_size: int, tp_rank: int):
        self.prefix = payload_prefix(name, dp_id)
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self._pools = collections.OrderedDict()  # name -> _PoolView
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
        or closed). Blocks only on system calls; the first batch of a pool maps it
        (~30 ms per 256 MiB here, once).
        """
        actual = codec.payload_checksum([body, ref])
        if actual != check:
            raise ProtocolError(
                f"payload checksum mismatch: expected {check:#018x} (sent with the batch), "
                f"computed {actual:#018x} over the body and shared-memory reference "
                f"received: the batch was corrupted between the engine's encode and this "
                f"decode")
        r = unpack_ref(ref)
        if r.stamp:
            data = self._pool(r.name).region(r.start, r.size, r.stamp)
        else:
            data = map_payload(r.name, r.size, self.prefix).view
        if r.data_hash:
            found = xxhash.xxh3_64(data).intdigest() or 1
            if found != r.data_hash:
                raise ProtocolError(f"shared batch {r.name}: its {r.size} bytes hash to "
                                    f"{found:#018x}, the engine wrote {r.data_hash:#018x}")
        return codec.decode_payload([body, r.offsets, data], None)

    def _pool(self, name):
        # under a lock: the socket's receiver, the ring's prefetch thread and the event loop
        # may decode at once, and each pool must be mapped once (its release bookkeeping)
        with self._pools_lock:
            pool = self._pools.get(name)
            if pool is None:
                pool = _PoolView.open(name, self.prefix, self.tp_size, self.tp_rank)
                self._pools[name] = pool
                while len(self._pools) > self._KEEP_POOLS:  # views keep an evicted one mapped
                    self._pools.popitem(last=False)
            return pool


# -- leftovers -----------------------------------------------------------------------------


def pool_locked(path: str) -> bool:
    """True while a live engine holds the ``flock`` of the pool file ``path`` (it takes it
    when it creates the pool, for the pool's life): alive on this node, in any pid
    namespace. False for a leftover, for a segment of a batch's own (no lock) and for a
    file that is gone or not ours to open. Takes a shared lock for a moment to ask;
    never blocks."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False  # free (closing the descriptor drops our shared lock)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _owned_by_the_dead(path: str) -> bool:
    """True if shared-memory file ``path`` is this uid's and no live process holds its
    ownership lock: the pool's ``flock``, or the owner lock of a ``shm.Segment`` (a ring).
    Never blocks; False for anything it cannot open."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # gone, or not ours to open
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            return False  # not ours to judge, nor to remove
        if owner_lock_held(fd):
            return False  # a live engine's ring
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live engine's pool
        return True
    finally:
        os.close(fd)


def reclaim_stale(name: str, dp_id: int) -> list:
    """Unlink the shared batches and pools of queue ``name``/``dp_id`` left by engines that
    are gone. Call it only while holding the queue's node-local endpoint exclusively
    (``TaskQueue`` calls it once its ack board is created): then no other engine of this
    queue lives, and any such name is a killed engine's, whatever pid it carries (pids
    are reused, and differ between pid namespaces). A pool whose ownership lock is held
    anyway is left alone, as are names of other uids. Returns the names removed."""
    pattern, sems = _name_re(name, dp_id), _sem_re(name, dp_id)
    removed = []
    try:
        entries = os.listdir(_SHM_DIR)
    except OSError:
        return removed
    for entry in entries:
        if pattern.fullmatch(entry) is not None:
            if _owned_by_the_dead(f"{_SHM_DIR}/{entry}") and unlink_segment("/" + entry):
                removed.append("/" + entry)
    for entry in entries:  # a ring's semaphores, once its segment is known gone or stale
        if sems.fullmatch(entry) is None:
            continue
        ring = entry[len("sem."):].rsplit(".w", 1)[0]
        if os.path.exists(f"{_SHM_DIR}/{ring}") and not _owned_by_the_dead(f"{_SHM_DIR}/{ring}"):
            continue  # its ring lives
        try:
            if os.lstat(f"{_SHM_DIR}/{entry}").st_uid != os.geteuid():
                continue  # not ours to judge, nor to remove
            posix_ipc.unlink_semaphore("/" + entry[len("sem."):])
            removed.append(entry)
        except (OSError, posix_ipc.ExistentialError):
            pass
    if removed:
        log.warning("reclaimed %d shared batch(es) and pool(s) of %s dp_id=%d left by exited "
                    "engine(s): %s", len(removed), name, dp_id, ", ".join(removed[:8]))
    return removed
