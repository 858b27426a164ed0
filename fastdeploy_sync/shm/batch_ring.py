"""One write per node: a node-local engine's batches in a shared-memory ring every rank reads.

Why: over ``ipc://`` a batch reached a rank only once that rank's prefetch thread had run:
woken by the socket, it took the GIL, received its own copy and decoded it, and only then
could rank 0's check say "every rank holds it". A thread that needs the GIL loses to a
step that holds it (a pure-Python step: batches waited for the interpreter's switch
interval) and costs a step that releases it (the model's thread waited for the GIL the
prefetch thread held). Here the engine writes each batch once into shared memory, and
the ring itself says which batches every rank of the node can take: rank 0's check reads
one word, and a rank whose prefetch thread has not decoded a batch yet decodes it itself
when it takes it. No rank's progress waits for any Python thread of another process.

Shape (after vLLM's ``shm_broadcast.MessageQueue``): one writer (the engine), the TP
ranks of one worker group as readers.

* **Slots** hold the batches' bytes: ``slots`` fixed areas of ``slot_bytes``, each with a
  FILLED word (the stamp of the batch the engine last wrote there) and one RELEASED word
  per rank (the stamp of the last batch of that slot whose decoded arrays the rank freed:
  decoded arrays are zero-copy views of the slot). The engine reuses a slot only once
  every rank consumed its batch *and* released it, so an array a rank still holds stays
  valid and unchanged; a slot held that way is skipped, not waited for.
* **Descriptors** say what each sequence number is: ``descs`` entries indexed by
  ``seq % descs`` (the in-flight window bounds how many are live), each SEQ, KIND, SLOT,
  STAMP, CHECK, DATA_HASH and three lengths. KIND is ``INLINE`` (pickle body, offsets and
  arrays in the slot), ``SHARED`` (body and a ``shm.payload`` reference in the slot, the
  arrays in the large-batch pool or a segment of their own) or ``SOCKET`` (the batch did
  not fit: it travels over the socket, and a rank can take it once every rank
  received it).
* **PUBLISHED** is the highest sequence number whose descriptor is complete; descriptors
  are published in order.

Memory ordering (``shm.order``; docs/design.md): the engine writes a slot's bytes, its
FILLED word and the descriptor's fields, then the descriptor's SEQ and then PUBLISHED,
each a release store; a reader loads the descriptor's SEQ with acquire before it reads the
fields and bytes, so a reader that saw SEQ sees the rest, on any architecture. PUBLISHED is
read plainly, as a bound (a rank's idle step pays one read, no fence): a SEQ below it not
yet visible reads as "not published yet" and is taken at a later step.
A rank releases a slot with a release store after its last view is gone, and the engine
acquires after reading every rank's release before it writes the slot again.

Wake-ups: one POSIX semaphore per rank, posted by the engine after each publication
(only when its count is 0, so that a rank that never waits, such as one in sync mode,
never accumulates posts). A rank's prefetch thread blocks on it with the GIL released;
it only pre-decodes: nothing waits for it.

Integrity and trust, as for ``shm.payload``: the ring's name is an anchor created
exclusively, mode 0600, owner-locked for the engine's life (``shm.segment.Segment``); its
memory is a memfd sealed against shrinking (``shm.sealed``), so the arrays a rank keeps
after the take can never be cut from under it (a truncated ``/dev/shm`` file is a SIGBUS
for whoever touches the missing pages). A rank maps that memory only after checking the
anchor's owner uid and that the memfd it opened is the recorded one, its own uid's and
sealed, then the ring's magic, layout and epoch; CHECK (xxh3_64 of the body and
offsets or reference, ``codec.payload_checksum``) is verified before anything is
unpickled, and the lengths and slot are checked by arithmetic first. The array bytes are
hashed only with ``FD_SYNC_SHM_CHECKSUM=1`` (DATA_HASH), as the pool's.

Lifetime: one ring per worker group (its *epoch*, the ack board's tag), created by the
engine before the group's first batch, named by ``names.ring`` (its semaphores:
``names.ring_semaphore``), unlinked when the group is retired or the queue
closes. Mappings stay valid while arrays view them; the memory returns to the system
with the last view.
"""

import logging
import mmap
import os
import threading
import time

import numpy as np
import posix_ipc

from .. import names
from ..errors import ProtocolError
from ..wire import codec
from .header import SegmentHeader
from .order import load_acquire, store_release
from .release import Holders, all_released
from .sealed import SealedSegment, read_sealed
from .semaphores import create_fresh_semaphore, open_semaphore, sem_wait

__all__ = ["RingWriter", "RingReader", "INLINE", "SHARED", "SOCKET", "PUBLISHED",
           "ring_geometry", "published_rings"]

log = logging.getLogger(__name__)

INLINE, SHARED, SOCKET = 1, 2, 3
_KINDS = (INLINE, SHARED, SOCKET)

_MAGIC = int.from_bytes(b"FDSYRING", "little")
_VERSION = 2
# Header words (word OWNER_PID, 1, holds the engine's pid).
(_H_VERSION, _H_TP, _H_SLOTS, _H_SLOT_BYTES, _H_DESCS, _H_EPOCH, _H_READY, _H_PUBLISHED,
 _H_DATA_OFFSET) = 2, 3, 4, 5, 6, 7, 8, 9, 10
_HEADER = SegmentHeader(_MAGIC, _H_READY, _VERSION, _H_VERSION)
# The index of PUBLISHED in ``RingReader.words``: a rank's step reads it directly (~40 ns;
# a method call would triple the cost of a check that finds nothing new).
PUBLISHED = _H_PUBLISHED
_HEADER_WORDS = 16  # two cache lines
# Descriptor words.
_D_SEQ, _D_KIND, _D_STAMP, _D_CHECK, _D_HASH, _D_L0, _D_L1, _D_L2 = range(8)
_D_WORDS = 8  # one cache line
_LINE_WORDS = 8
_MAX_TP = 1 << 12
_MAX_SLOTS = 1 << 14
_MAX_DESCS = 1 << 16
_SLOT_BYTES_MIN = 4096
# A semaphore wait that times out re-checks the ring this often at most: a post that was
# skipped because the count read non-zero can delay a pre-decode by no more than this.
_WAIT_SLICE_S = 1.0


def ring_geometry(tp_size: int, slots: int, slot_bytes: int, descs: int):
    """``(total bytes, data offset)`` of a ring: the header, descriptors, FILLED words and
    RELEASED rows, rounded up to a page, then the slots."""
    row = -(-slots // _LINE_WORDS) * _LINE_WORDS
    words = _HEADER_WORDS + descs * _D_WORDS + row * (1 + tp_size)
    offset = -(-words * 8 // mmap.PAGESIZE) * mmap.PAGESIZE
    return offset + slots * slot_bytes, offset


class _Layout:
    """Word indices of one ring's parts (shared by the writer and the readers)."""

    __slots__ = ("tp", "slots", "slot_bytes", "descs", "row", "filled", "released",
                 "data_offset", "size")

    def __init__(self, tp_size, slots, slot_bytes, descs):
        self.tp, self.slots, self.slot_bytes, self.descs = tp_size, slots, slot_bytes, descs
        self.row = -(-slots // _LINE_WORDS) * _LINE_WORDS
        self.filled = _HEADER_WORDS + descs * _D_WORDS
        self.released = self.filled + self.row
        self.size, self.data_offset = ring_geometry(tp_size, slots, slot_bytes, descs)

    def desc(self, seq: int) -> int:
        return _HEADER_WORDS + (seq % self.descs) * _D_WORDS

    def release_word(self, rank: int, slot: int) -> int:
        return self.released + rank * self.row + slot


# slot states (engine side)
_FREE, _WRITTEN, _KEPT, _CONSUMED = range(4)


class RingWriter:
    """The engine's end of one worker group's ring.

    Not thread-safe by itself: the caller (``engine.kept_batches.KeptBatches.lock``) serialises
    ``allocate``, ``kept``, ``discard``, ``consumed`` and ``close`` under its lock;
    ``write_*`` of a slot it handed out runs outside it (slots are disjoint), and
    ``publish`` runs under the engine's mutex, in sequence order."""

    def __init__(self, segment, layout, epoch, name, sems):
        self._seg = segment
        self._layout = layout
        self.epoch, self.name = epoch, name
        self._words = segment.view
        self._uwords = segment.view.cast("B").cast("Q")
        self._data = segment.view.cast("B")[layout.data_offset:]
        self._sems = sems
        self.sem_names = [names.ring_semaphore(name, rank) for rank in range(len(sems))]
        self._state = [_FREE] * layout.slots
        self._stamp = [0] * layout.slots
        self._stamps = 0
        self._cursor = 0
        self.closed = False

    @classmethod
    def create(cls, name: str, dp_id: int, tp_size: int, epoch: int, *, slots: int,
               slot_bytes: int, descs: int) -> "RingWriter":
        """Create the ring of ``epoch``: a sealed memfd behind an anchor created
        exclusively, mode 0600, owner-locked for this process's life (``shm.sealed``), every
        page reserved (``posix_fallocate``: no room is an ``OSError`` here, never a SIGBUS
        later) and mapped in, and one semaphore per rank.
        ``FileExistsError`` if the name exists (another live engine of this name in this
        process); ``OSError`` with nothing left behind otherwise."""
        if not 0 < tp_size <= _MAX_TP or not 0 < slots <= _MAX_SLOTS:
            raise ValueError(f"ring for tp_size {tp_size} with {slots} slots")
        if not 0 < descs <= _MAX_DESCS or slot_bytes < _SLOT_BYTES_MIN or slot_bytes % 64:
            raise ValueError(f"ring with {descs} descriptors of {slot_bytes}-byte slots")
        layout = _Layout(tp_size, slots, slot_bytes, descs)
        shm_name = names.ring(name, dp_id, epoch)
        seg = SealedSegment.create(shm_name, layout.size)  # every page reserved
        sems = []
        try:
            seg.populate(write=True)  # the engine's copy into a slot never faults
            for rank in range(tp_size):  # a killed engine's leftover (same pid) is replaced
                sems.append(create_fresh_semaphore(names.ring_semaphore(shm_name, rank)))
        except BaseException:
            for sem in sems:
                sem.unlink()
                sem.close()
            seg.unlink_if_mine()
            seg.close()
            raise
        _HEADER.publish(seg.view, {_H_TP: tp_size, _H_SLOTS: slots, _H_SLOT_BYTES: slot_bytes,
                                   _H_DESCS: descs, _H_EPOCH: epoch,
                                   _H_DATA_OFFSET: layout.data_offset})
        return cls(seg, layout, epoch, shm_name, sems)

    @property
    def slot_bytes(self) -> int:
        return self._layout.slot_bytes

    # -- slots (under the encoder's lock) ----------------------------------------------

    def allocate(self):
        """A free slot's index, or None when every slot holds a batch not yet consumed and
        released by every rank (the batch then takes another path). Never blocks."""
        if self.closed:
            return None
        lay, words = self._layout, self._words
        for step in range(lay.slots):
            slot = (self._cursor + step) % lay.slots
            state = self._state[slot]
            if state == _CONSUMED and all_released(words, lay.released + slot, lay.row,
                                                   lay.tp, self._stamp[slot]):
                state = self._state[slot] = _FREE
            if state == _FREE:
                self._state[slot] = _WRITTEN
                self._cursor = slot + 1
                return slot
        return None

    def kept(self, slot: int) -> None:
        """The batch in ``slot`` was enqueued."""
        self._state[slot] = _KEPT

    def discard(self, slot: int) -> None:
        """The batch in ``slot`` was never enqueued: no rank will read it."""
        self._state[slot] = _FREE

    def consumed(self, slot: int) -> None:
        """Every rank consumed the batch in ``slot``: reusable once every rank released it."""
        if self._state[slot] == _KEPT:
            self._state[slot] = _CONSUMED

    def held(self) -> int:
        """Slots not free now (written, in flight, or viewed by a rank)."""
        return sum(state != _FREE for state in self._state)

    # -- bytes (outside the lock: slots are disjoint) ----------------------------------

    def write_inline(self, slot: int, parts) -> tuple:
        """Copy an encoded batch (``codec.EncodedPayload``) into ``slot`` as arrays, then
        offsets, then body (arrays first: the slot starts on a page, the codec aligns them
        to 64 bytes inside). Returns the descriptor's ``(kind, lengths)``. ``ValueError``
        if it does not fit (the caller checks ``fits_inline`` first)."""
        body, offsets, size = parts.body, parts.offsets, parts.data_size
        base = slot * self._layout.slot_bytes
        end = size + len(offsets) + len(body)
        if end > self._layout.slot_bytes:
            raise ValueError(f"{end}-byte batch for a {self._layout.slot_bytes}-byte slot")
        data = self._data
        if size:
            parts.write_data(data[base:base + size])
        data[base + size:base + size + len(offsets)] = offsets
        data[base + size + len(offsets):base + end] = body
        return INLINE, (len(body), len(offsets), size)

    def write_payload(self, slot: int, frames) -> tuple:
        """Copy an encoded payload's frames (``[body]`` or ``[body, offsets, data]``, as a
        producer sends them) into ``slot`` in ``write_inline``'s layout; ``(kind,
        lengths)``. ``ValueError`` if they do not fit."""
        views = [memoryview(f).cast("B") for f in frames]
        body = views[0]
        offsets, data = (views[1], views[2]) if len(views) == 3 else (body[:0], body[:0])
        size = data.nbytes
        end = size + offsets.nbytes + body.nbytes
        if end > self._layout.slot_bytes:
            raise ValueError(f"{end}-byte batch for a {self._layout.slot_bytes}-byte slot")
        base = slot * self._layout.slot_bytes
        dest = self._data
        dest[base:base + size] = data
        dest[base + size:base + size + offsets.nbytes] = offsets
        dest[base + size + offsets.nbytes:base + end] = body
        return INLINE, (body.nbytes, offsets.nbytes, size)

    def write_frames(self, slot: int, frames) -> tuple:
        """Copy a shared batch's ``[body, reference]`` into ``slot``; ``(kind, lengths)``."""
        body, ref = (memoryview(f).cast("B") for f in frames)
        base = slot * self._layout.slot_bytes
        if body.nbytes + ref.nbytes > self._layout.slot_bytes:
            raise ValueError(f"{body.nbytes + ref.nbytes}-byte message for a "
                             f"{self._layout.slot_bytes}-byte slot")
        data = self._data
        data[base:base + ref.nbytes] = ref
        data[base + ref.nbytes:base + ref.nbytes + body.nbytes] = body
        return SHARED, (body.nbytes, ref.nbytes, 0)

    def fits_inline(self, parts) -> bool:
        return parts.data_size + len(parts.offsets) + len(parts.body) <= self._layout.slot_bytes

    def frames(self, slot: int, kind: int, lengths) -> list:
        """Copies of the frames a slot holds (``[body, offsets, data]``, ``[body]`` or
        ``[body, reference]``): for decoding a batch again on the engine without keeping
        the ring mapped."""
        base = slot * self._layout.slot_bytes
        data = self._data
        l0, l1, l2 = lengths
        if kind == SHARED:
            return [bytes(data[base + l1:base + l1 + l0]), bytes(data[base:base + l1])]
        if not l1:
            return [bytes(data[base + l2:base + l2 + l0])]
        return [bytes(data[base + l2 + l1:base + l2 + l1 + l0]),
                bytes(data[base + l2:base + l2 + l1]), bytes(data[base:base + l2])]

    # -- publication (under the engine's mutex, in seq order) ---------------------------

    def publish(self, seq: int, kind: int, slot: int = 0, check: int = 0, data_hash: int = 0,
                lengths=(0, 0, 0)) -> None:
        """Make group-relative ``seq`` visible to every rank: its descriptor, then
        PUBLISHED. ``kind`` SOCKET needs no slot: the ranks learn it travels over the
        socket. Never blocks."""
        lay, w = self._layout, self._words
        if kind != SOCKET:
            self._stamps += 1
            stamp = self._stamp[slot] = self._stamps
            w[lay.filled + slot] = stamp
        else:
            stamp = 0
        d = lay.desc(seq)
        w[d + _D_KIND] = kind | slot << 8
        w[d + _D_STAMP] = stamp
        self._uwords[d + _D_CHECK] = check
        self._uwords[d + _D_HASH] = data_hash
        w[d + _D_L0], w[d + _D_L1], w[d + _D_L2] = lengths
        # release: a reader that sees SEQ sees the fields, FILLED and the slot's bytes;
        # one that sees PUBLISHED sees SEQ
        store_release(w, d + _D_SEQ, seq)
        store_release(w, _H_PUBLISHED, seq)

    def published(self) -> int:
        return self._words[_H_PUBLISHED]

    def wake(self) -> None:
        """Post every rank's semaphore whose count is 0 (a rank that never waits gathers
        no posts). Never blocks. Any thread."""
        for sem in self._sems:
            try:
                if sem.value == 0:
                    sem.release()
            except posix_ipc.ExistentialError:
                return  # closed meanwhile

    def close(self) -> None:
        """Unlink the ring and its semaphores and drop the ownership lock. Idempotent.
        The mapping stays until this object and every view of it are garbage."""
        if self.closed:
            return
        self.closed = True
        for sem in self._sems:
            try:
                sem.unlink()
            except posix_ipc.ExistentialError:
                pass
            sem.close()
        self._sems = []
        self._seg.unlink_if_mine()
        self._seg.release_locks()


# RingReader.close waits this long for a thread inside wait() to leave.
_CLOSE_WAIT_S = 5.0


class RingReader:
    """A rank's end of one worker group's ring: reads descriptors, decodes batches from
    the slots (arrays zero-copy, read-only), publishes releases, waits for posts.

    ``decode`` of one seq must run in one thread at a time, and at most once per seq in
    this process (two decodes would publish two releases for one slot): the worker's
    prefetch thread and event loop agree on who decodes each seq (``worker.slot``)."""

    def __init__(self, segment, layout, rank, sem, shared_reader):
        self._seg = segment
        self._layout = layout
        self.rank = rank
        self.name = segment.name
        self._words = segment.view
        # the ring's int64 words, read-only by contract: ``words[PUBLISHED]`` is ``published()``
        self.words = segment.view
        self._uwords = segment.view.cast("B").cast("Q")
        self._data = segment.view.cast("B")[layout.data_offset:].toreadonly()
        self._sem = sem
        self._shared = shared_reader  # shm.payload.PayloadReader, for SHARED batches
        self._holders = Holders(self._words)
        self.closed = False
        # Threads inside wait(): close() frees the semaphore only once none is (a thread
        # woken from sem_timedwait still touches the semaphore's memory on its way out).
        self._waiting = 0
        self._wait_lock = threading.Lock()

    @classmethod
    def attach(cls, name: str, dp_id: int, tp_size: int, rank: int, epoch: int, pid: int,
               shared_reader) -> "RingReader":
        """Attach the ring of ``epoch`` that engine ``pid`` (its pid as written on the ack
        board) created. ``FileNotFoundError`` if there is none (the engine could not make
        one: batches then travel over the socket); ``ProtocolError`` for one that is not a
        ready ring of this layout, group and size, among them ``shm.sealed.SealedUnreachable``
        for one whose sealed memory this process can neither open through ``/proc`` nor
        receive over the engine's socket; ``PermissionError`` for another user's. Never
        blocks, but for the engine's socket when the engine is in another pid namespace
        (at most ``shm.memfd_server.FETCH_TIMEOUT_S``, 3 s)."""
        shm_name = names.ring(name, dp_id, epoch, pid)
        seg = SealedSegment.attach(shm_name)  # what it maps can never shrink
        try:
            w = seg.view
            if seg.size < _HEADER_WORDS * 8:
                raise ProtocolError(f"ring {shm_name} holds {seg.size} bytes, less than a header")
            if not _HEADER.ready(w):
                raise ProtocolError(f"ring {shm_name}: not a ready ring of layout {_VERSION} "
                                    f"({_HEADER.describe(w)})")
            tp, slots, slot_bytes, descs = w[_H_TP], w[_H_SLOTS], w[_H_SLOT_BYTES], w[_H_DESCS]
            if (tp != tp_size or w[_H_EPOCH] != epoch or not 0 < slots <= _MAX_SLOTS
                    or not 0 < descs <= _MAX_DESCS or slot_bytes < _SLOT_BYTES_MIN
                    or slot_bytes % 64):
                raise ProtocolError(f"ring {shm_name} is laid out for tp_size {tp}, epoch "
                                    f"{w[_H_EPOCH]}; this rank's group has tp_size {tp_size}, "
                                    f"epoch {epoch}")
            layout = _Layout(tp, slots, slot_bytes, descs)
            if layout.size != seg.size or layout.data_offset != w[_H_DATA_OFFSET]:
                raise ProtocolError(f"ring {shm_name} holds {seg.size} bytes, its header "
                                    f"says {layout.size}")
            sem = open_semaphore(names.ring_semaphore(shm_name, rank))
        except BaseException:
            seg.close()
            raise
        seg.populate(write=False)  # nor does a decode's read
        return cls(seg, layout, rank, sem, shared_reader)

    def published(self) -> int:
        """The highest seq published (each subject to ``kind``). One shared-memory read."""
        return self._words[_H_PUBLISHED]

    def kind(self, seq: int) -> int:
        """``INLINE``/``SHARED``/``SOCKET`` for a published ``seq``, 0 if its descriptor
        holds another seq (not published yet, or already reused)."""
        d = self._layout.desc(seq)
        words = self._words
        if load_acquire(words, d + _D_SEQ) != seq:
            return 0
        return words[d + _D_KIND] & 0xFF

    def describe(self, seq: int) -> str:
        """What this rank's ring says of ``seq``, for an error message: the ring, what it
        published, and what ``seq``'s descriptor holds."""
        d = self._layout.desc(seq)
        w = self._words
        return (f"ring {self.name} published up to {w[_H_PUBLISHED]}; the descriptor of seq "
                f"{seq} holds seq {w[d + _D_SEQ]}, kind {w[d + _D_KIND] & 0xFF}")

    def ready_upto(self, taken: int, socket_min) -> int:
        """The highest seq s >= ``taken`` such that every seq in (taken, s] is published and
        can be taken by every rank now: read from the ring, or, for a SOCKET batch, held
        by every rank (``socket_min()``: the lowest seq every rank received over the
        socket; called only when a SOCKET batch is met). Shared-memory reads only."""
        top = self._words[_H_PUBLISHED]  # a bound only: kind() acquires each SEQ
        seq = taken
        floor = None
        while seq < top:
            kind = self.kind(seq + 1)
            if kind == 0:
                break  # being overwritten: a reader of another life
            if kind == SOCKET:
                if floor is None:
                    floor = socket_min()
                if seq + 1 > floor:
                    break
            seq += 1
        return seq

    def decode(self, seq: int):
        """The batch of ``seq`` (published, INLINE or SHARED, not yet released by this
        rank), decoded: its arrays are read-only views of the slot (INLINE) or of the pool
        (SHARED), and this rank's release of the slot is published when the last of them
        is freed (at once when it has none).

        Checks, each before anything later is read or unpickled: the descriptor names
        this seq and a slot of this ring; the lengths fit the slot; the slot still holds
        the batch's stamp; the checksum over the body and offsets (or reference); the
        array bytes' hash when the engine wrote one. ``ProtocolError`` names what failed;
        ``GroupLostError`` when a SHARED batch's memory is gone (the group was retired)."""
        lay, words = self._layout, self._words
        d = lay.desc(seq)
        if load_acquire(words, d + _D_SEQ) != seq:  # then the fields, FILLED, the bytes
            raise ProtocolError(f"ring {self.name}: seq {seq} is not published (descriptor "
                                f"holds seq {words[d + _D_SEQ]})")
        kind_word, stamp = words[d + _D_KIND], words[d + _D_STAMP]
        kind, slot = kind_word & 0xFF, kind_word >> 8
        check, data_hash = self._uwords[d + _D_CHECK], self._uwords[d + _D_HASH]
        l0, l1, l2 = words[d + _D_L0], words[d + _D_L1], words[d + _D_L2]
        if kind not in (INLINE, SHARED) or not 0 <= slot < lay.slots or stamp <= 0:
            raise ProtocolError(f"ring {self.name}: seq {seq} has kind {kind}, slot {slot}, "
                                f"stamp {stamp}")
        if min(l0, l1, l2) < 0 or l0 + l1 + l2 > lay.slot_bytes or l0 == 0:
            raise ProtocolError(f"ring {self.name}: seq {seq} lengths ({l0}, {l1}, {l2}) do "
                                f"not fit a {lay.slot_bytes}-byte slot")
        holder = self._holder(slot, stamp, l0 + l1 + l2)
        filled = words[lay.filled + slot]
        if filled != stamp:
            raise ProtocolError(f"ring {self.name}: the slot of seq {seq} holds stamp {filled}, "
                                f"not {stamp}: reused before this rank read it")
        view = memoryview(holder)
        if kind == SHARED:
            ref, body = view[:l1], view[l1:l1 + l0]
            return self._shared.decode(body, ref, check)
        if l1:
            data, offsets, body = view[:l2], view[l2:l2 + l1], view[l2 + l1:]
            frames = [body, offsets, data]
        else:
            frames = [view[l2:l2 + l0]]
        what = f"ring {self.name}: seq {seq}"
        codec.verify_checksum(frames[:2], check, what)
        if len(frames) == 3:
            codec.verify_data_hash(frames[2], data_hash, what)
        return codec.decode_payload(frames, None)

    def _holder(self, slot, stamp, size):
        """The array every view of ``slot``'s batch ``stamp`` derives from (``shm.release``:
        this rank's release of the slot is published when the last of them is freed)."""
        lay = self._layout
        return self._holders.holder(
            slot, stamp, lambda: np.frombuffer(self._data, dtype=np.uint8, count=size,
                                               offset=slot * lay.slot_bytes),
            lay.release_word(self.rank, slot))

    def wait(self, timeout: float) -> bool:
        """Block until the engine posts this rank (True) or ``timeout`` seconds pass
        (False), with the GIL released; a handled signal neither ends nor stretches it
        (``shm.semaphores.sem_wait``). A semaphore closed under the wait (``close()`` of
        this client) reads as a timeout."""
        with self._wait_lock:
            if self.closed:
                return False
            self._waiting += 1
        try:
            return sem_wait(self._sem, timeout)
        except posix_ipc.ExistentialError:
            return False
        finally:
            with self._wait_lock:
                self._waiting -= 1

    def post(self) -> None:
        """Wake this rank's own waiter (``close()`` from another thread)."""
        try:
            self._sem.release()
        except posix_ipc.ExistentialError:
            pass

    def close(self) -> None:
        """Close the semaphore and drop the lock descriptor. The mapping stays while arrays
        view it (it is unmapped when the last of them is garbage). Idempotent; any thread.

        A thread inside ``wait()`` (another thread's ``wait_for_tasks()``) is woken first,
        and the semaphore is closed only once it has left (closing it under the wait is a
        SIGSEGV): blocks until then, at most ``_CLOSE_WAIT_S``; a waiter that has not left
        by then keeps the semaphore open until the process exits (logged)."""
        with self._wait_lock:
            if self.closed:
                return
            self.closed = True
        deadline = time.monotonic() + _CLOSE_WAIT_S
        while True:
            with self._wait_lock:
                waiting = self._waiting
            if not waiting or time.monotonic() >= deadline:
                break
            self.post()
            time.sleep(0.001)
        if waiting:
            log.error("ring %s: a thread is still inside wait() after %.0f s; its semaphore "
                      "stays open until this process exits", self.name, _CLOSE_WAIT_S)
        else:
            try:
                self._sem.close()
            except posix_ipc.ExistentialError:
                pass
        self._seg.release_locks()


def published_rings(name: str, dp_id: int) -> list:
    """``[(shm name, epoch, published seq)]`` of every ring of queue ``name``/``dp_id`` in
    ``/dev/shm`` owned by this uid (for ``fastdeploy-sync status``). Reads the headers
    only, read-only; skips what it cannot read (among them the rings of an engine in
    another pid namespace that it cannot reach over the engine's socket either:
    ``shm.sealed``). Never blocks, but up to ``shm.memfd_server.FETCH_TIMEOUT_S`` per ring
    of an engine in another pid namespace."""
    found: list = []
    try:
        entries = sorted(os.listdir(names.SHM_DIR))
    except OSError:
        return found
    for entry in entries:
        parsed = names.parse_shm_entry(entry)
        if parsed is None or parsed.kind != "ring" or (parsed.name, parsed.dp_id) != (name, dp_id):
            continue
        raw = read_sealed("/" + entry, _HEADER_WORDS * 8)  # checked: ours, sealed
        if raw is None or len(raw) < _HEADER_WORDS * 8:
            continue
        words = memoryview(raw).cast("q")
        if _HEADER.ready(words):
            found.append(("/" + entry, words[_H_EPOCH], words[_H_PUBLISHED]))
    return found
