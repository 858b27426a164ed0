"""The pool of reused shared memory for large batches (one per worker group), both sides:
the engine's ``PayloadPool`` writes it, each rank's ``PoolView`` reads it.

Why a pool: writing a large batch into fresh tmpfs pages costs a page fault per page;
the pool's pages are reserved and mapped in once, when it is created, and reused by
every batch after (``docs/large-batches.md`` has the costs). Regions are handed
out in ring order and a region is written again only once *every* rank has released it:
each batch's arrays keep one small object per rank alive (a numpy view of the region),
whose finalizer stores the batch's stamp in that rank's row of the pool's header when
the last array is freed (``PoolView``, the ranks' side; ``shm.payload.PayloadReader``
decodes through it). A rank that holds arrays for
long holds its region: the ring cannot pass it, and batches take a segment of their own
or the socket meanwhile. A pool is never reused across worker groups: when a group is
retired its pool is retired with it.

The pool is a ``SealedSegment`` (``shm.sealed``): its memory a memfd sealed against
shrinking, so the arrays a rank keeps can never be cut from under it by a truncation
(a SIGBUS for whoever touches them), behind an anchor in ``/dev/shm`` created exclusively,
mode 0600, its owner lock held for the engine's life, so ``cleanup`` and the next engine
judge a leftover as every other segment.
"""

import collections
import mmap
import os
from typing import Callable, TypeVar

import numpy as np

from ..errors import GroupLostError, ProtocolError
from .header import SegmentHeader
from .order import load_acquire, store_release
from .ownership import on_fork
from .release import Holders, all_released
from .sealed import SealedSegment, open_sealed
from .segment import map_shared

T = TypeVar("T")

__all__ = ["PayloadPool", "PoolRegion", "PoolView", "PoolTruncated", "POOL_ENTRIES", "MAGIC", "VERSION",
           "FILLED", "HEADER_FIELDS", "MAX_ENTRIES", "MAX_TP", "header_bytes",
           "released_index"]


# Header, int64 words: magic, owner pid (OWNER_PID: for people), layout version, tp_size,
# entries, data offset, data size, ready (written last); then `entries` FILLED words (FILLED[e]:
# the stamp of the last batch the engine wrote into a region of entry e = stamp %
# entries); then one RELEASED row of `entries` words per rank (RELEASED[r][e]: the stamp
# of the last batch of entry e whose arrays rank r freed). Rows are 8 * entries bytes
# apart, so ranks never share a cache line. The data starts at the next page.
MAGIC = int.from_bytes(b"FDSYPOOL", "little")
VERSION = 2
_H_VERSION, _H_TP, _H_ENTRIES, _H_DATA_OFFSET, _H_DATA_SIZE, _H_READY = 2, 3, 4, 5, 6, 7
_HEADER = SegmentHeader(MAGIC, _H_READY, VERSION, _H_VERSION)
FILLED = 8  # the first FILLED word
HEADER_FIELDS = 8  # the words before FILLED
POOL_ENTRIES = 256  # batches a pool holds at most at once
MAX_ENTRIES = 1 << 16
MAX_TP = 1 << 12
_ALIGN = 64  # regions start on cache lines (and codec aligns buffers inside them)


def header_bytes(tp_size: int, entries: int) -> int:
    """The size of a pool's header (its data starts there, on a page)."""
    words = FILLED + entries * (tp_size + 1)
    return -(-words * 8 // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY


def released_index(entries: int, rank: int, entry: int) -> int:
    """The word where rank ``rank`` publishes its release of entry ``entry``."""
    return FILLED + entries * (rank + 1) + entry


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

    Not thread-safe: ``engine.kept_batches.LargeBatches`` serialises every call under its
    lock, except ``write`` and ``view`` of a region it handed out (regions are disjoint)."""

    def __init__(self, segment, tp_size, entries, data_size, header):
        self.name, self.tp_size, self.entries, self.data_size = (segment.name, tp_size, entries,
                                                                 data_size)
        self._seg = segment
        self._words = segment.view[:header // 8]
        self._data = segment.view.cast("B")[header:header + data_size]
        self._live = collections.deque()  # regions in ring order, oldest first
        self._stamps = 0
        self.retired = False  # no more regions: its group was retired or the queue closed
        self.closed = False
        on_fork(self)  # a forked child never unlinks the parent's pool

    @classmethod
    def create(cls, name: str, tp_size: int, data_size: int,
               entries: int = POOL_ENTRIES) -> "PayloadPool":
        """Create pool ``name`` with ``data_size`` bytes of data for ``tp_size`` ranks: a
        ``SealedSegment`` (anchor exclusive, mode 0600, owner-locked for this process's
        life; memory sealed against shrinking), every page reserved and mapped in (the
        one-time cost of the page faults, paid here rather than by a put:
        docs/large-batches.md). ``FileExistsError`` if the name exists, ``OSError`` (no
        room) with the name removed again."""
        if data_size <= 0 or data_size % _ALIGN:
            raise ValueError(f"pool {name}: data size {data_size}, expected a positive "
                             f"multiple of {_ALIGN}")
        header = header_bytes(tp_size, entries)
        seg = SealedSegment.create(name, header + data_size)  # every page reserved
        try:
            seg.populate(write=True)
        except BaseException:
            seg.unlink_if_mine()
            seg.close()
            raise
        pool = cls(seg, tp_size, entries, data_size, header)
        words = pool._words
        _HEADER.publish(words, {_H_TP: tp_size, _H_ENTRIES: entries, _H_DATA_OFFSET: header,
                                _H_DATA_SIZE: data_size})
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
                first = released_index(self.entries, 0, region.stamp % self.entries)
                if not all_released(words, first, self.entries, self.tp_size, region.stamp):
                    return
            elif region.state != _DISCARDED:
                return
            live.popleft()

    def write(self, region, parts) -> None:
        """Copy ``parts`` into ``region``."""
        base = region.start
        parts.write_data(self._data[base:base + region.size])
        # release: a rank that sees the stamp sees the bytes (it also learns of the batch
        # only through a later publication: the ring's SEQ, or the socket)
        store_release(self._words, FILLED + region.stamp % self.entries, region.stamp)

    def view(self, region) -> memoryview:
        """A read-only view of ``region``'s bytes (a closed pool's mapping stays)."""
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
        """Unlink the name and drop the ownership lock. Idempotent. The mapping stays
        while something still refers to this pool: a region still being written by a put
        that is about to fail, or being decoded again for a ``LostBatch`` (whose arrays
        are copies), must find it mapped; the memory returns to the system with the last
        of them, at once when there is none.

        The pool forgets its regions here: each region refers to its pool, so a pool
        that kept its own would be freed (its mapping, pre-faulted, and the descriptor
        mmap keeps) only by a garbage collection."""
        if self.closed:
            return
        self.closed = self.retired = True
        self._live.clear()
        self._seg.unlink_if_mine()
        self._seg.release_locks()

    def after_fork_in_child(self):
        """In a forked child: the pool is the parent's; the child never writes into it nor
        unlinks it (its segment dropped the inherited lock descriptor itself)."""
        self.closed = self.retired = True


# -- the ranks' side ------------------------------------------------------------------


def open_reference(name: str, prefix: str, what: str, opener: Callable[[str], T]) -> T:
    """``opener(name)`` once ``name`` passed the checks every rank makes before it maps
    a reference an engine sent (this queue's ``prefix``, no path); ``what`` names the
    object in messages ("shared batch", "shared batch pool"). ``ProtocolError`` for a
    name outside the queue's and for what ``opener`` raises as ``PermissionError`` (not
    ours, or not reachable); ``GroupLostError`` for ``FileNotFoundError`` (gone: the group
    was retired). Blocks as long as ``opener`` does."""
    if not name.startswith(prefix) or "/" in name[1:]:
        raise ProtocolError(f"shared-memory reference to {name!r}, outside this queue's "
                            f"batches ({prefix}*)")
    try:
        return opener(name)
    except FileNotFoundError:
        raise GroupLostError(
            f"{what} {name} is gone before this rank mapped it: the engine retired "
            f"this worker group or closed the queue; restart the group") from None
    except PermissionError as exc:
        raise ProtocolError(f"{what} {name}: not mapped: {exc}") from exc


def _open_sealed_pool(name: str, prefix: str) -> int:
    """The checked descriptor of pool ``name``'s sealed memory (``open_reference``, then
    ``shm.sealed.open_sealed``: through ``/proc`` or over the engine's socket)."""
    return open_reference(name, prefix, "shared batch pool",
                          lambda n: open_sealed(n, os.O_RDWR))


class PoolView:
    """A rank's mapping of one pool's sealed memory (``shm.sealed``: it cannot shrink under
    the arrays that view it): the data read-only (populated once), the header read-write
    (its release row)."""

    __slots__ = ("name", "entries", "data_size", "rank", "_words", "_data", "_holders",
                 "__weakref__")

    def __init__(self, name, entries, data_size, rank, words, data):
        self.name, self.entries, self.data_size, self.rank = name, entries, data_size, rank
        self._words, self._data = words, data
        self._holders = Holders(words)

    @classmethod
    def open(cls, name: str, prefix: str, tp_size: int, rank: int) -> "PoolView":
        """Map pool ``name`` for rank ``rank`` of a ``tp_size`` group, after checking its
        name (``prefix``), owner, header and size. ``ProtocolError`` for a failed check,
        ``GroupLostError`` when it is gone. Blocks only on system calls (the data's pages
        are mapped in here, once per pool)."""
        fd = _open_sealed_pool(name, prefix)
        try:
            st = os.fstat(fd)
            raw = os.pread(fd, HEADER_FIELDS * 8, 0)
            if len(raw) != HEADER_FIELDS * 8:
                raise ProtocolError(f"pool {name} holds {st.st_size} bytes, less than its header")
            words = memoryview(raw).cast("q")  # pread: the kernel's copy orders it
            if not _HEADER.ready(words):
                raise ProtocolError(f"pool {name}: not a ready pool of this layout "
                                    f"({_HEADER.describe(words)})")
            tp, entries = words[_H_TP], words[_H_ENTRIES]
            data_offset, data_size = words[_H_DATA_OFFSET], words[_H_DATA_SIZE]
            if tp != tp_size or not 0 < entries <= MAX_ENTRIES or not 0 < tp <= MAX_TP:
                raise ProtocolError(f"pool {name} is laid out for tp_size {tp} and {entries} "
                                    f"entries; this rank's group has tp_size {tp_size}")
            if (data_offset != header_bytes(tp, entries) or data_size <= 0
                    or data_offset + data_size != st.st_size):
                raise ProtocolError(f"pool {name}: header says data at {data_offset}, "
                                    f"{data_size} bytes; the segment holds {st.st_size}")
            header = map_shared(fd, data_offset)
            data = map_shared(fd, data_size, offset=data_offset, writable=False, populate=True)
        finally:
            os.close(fd)  # the mappings hold the memory
        return cls(name, entries, data_size, rank, memoryview(header).cast("q"), data)

    def region(self, start: int, size: int, stamp: int):
        """The batch ``stamp``'s bytes as a read-only numpy array of ``size`` bytes, after
        checking by arithmetic that they lie in the pool and that the engine recorded this
        stamp as the region's last fill. When the array and every view derived from it
        (the decoded arrays) are freed, this rank's release of ``stamp`` is published."""
        if not 0 <= start <= self.data_size - size or stamp <= 0:
            raise ProtocolError(f"pool {self.name}: region of {size} bytes at {start} "
                                f"(stamp {stamp}) outside its {self.data_size} bytes")
        entry = stamp % self.entries
        filled = load_acquire(self._words, FILLED + entry)  # then the bytes
        if filled != stamp:
            raise ProtocolError(f"pool {self.name}: the region of batch stamp {stamp} holds "
                                f"stamp {filled}: reused before this rank read it")
        return self._holders.holder(
            entry, stamp, lambda: np.frombuffer(self._data, dtype=np.uint8, count=size,
                                                offset=start),
            released_index(self.entries, self.rank, entry))


class PoolTruncated(ProtocolError):
    """A pool's memory is shorter than its layout. Pools are sealed against shrinking
    (``shm.sealed``), so nothing raises it any more; kept for callers that catch it."""
