"""The engine's put path in one call: ``BatchEncoder.encode(tasks)`` pickles a batch,
decides where its bytes go and copies them once: into a slot of the worker group's ring
(``shm.batch_ring``: every rank of the node reads it), the arrays of a large one into
node-local shared memory (``large_batches``), else one data frame per rank (the socket).
It returns what the engine enqueues and sends.

The engine only enqueues and sends. It tells the encoder what becomes of each batch
(``enqueue`` once it has a sequence number, ``discard`` if it was never enqueued,
``release`` once every rank consumed it, ``drop_all``/``forget`` when a worker group is
retired, ``close``) so that shared memory is reused or freed exactly when no rank can
need it any more (a pool region or ring slot also waits for every rank's arrays to be
freed: ``shm.release``).

Lock invariant: ``_lock`` guards the ring (the current group's writer and its slots),
``_kept_ring`` (seq -> ring place of a batch the engine retains) and ``counters``;
``large_batches`` guards its own. ``encode`` holds a lock only to take a slot or region;
the copy runs outside it. The engine calls ``enqueue``, ``release`` and ``drop_all`` under
its own mutex, which is always taken before these locks, never after.
"""

import collections
import functools
import logging
import os
import threading
import weakref
from typing import Optional

import numpy as np

from .. import envs
from ..errors import EndpointInUseError, ProtocolError
from ..logs import RateLimitedLog
from ..shm import batch_ring, payload, room
from ..shm.pool import PoolRegion, PoolTruncated
from ..shm.segment import unlink_segment
from ..shm.semaphores import unlink_semaphore
from ..wire import codec
from .large_batches import LargeBatches

__all__ = ["BatchEncoder", "EncodedBatch"]

log = logging.getLogger(__name__)

# The ring's slots take at most this much of /dev/shm per worker group.
_RING_MAX_BYTES = 64 << 20


class EncodedBatch:
    """One encoded batch: ``frames`` (what follows the DATA header; None for a batch only
    the ring holds), ``checksum`` (the header's check), ``shared`` (the
    ``PoolRegion`` or ``payload.SharedPayload`` holding its arrays, or
    None when they travel in ``frames`` or the ring) and ``ring`` (its ``RingPlace``, or
    None when it travels over the socket)."""

    __slots__ = ("frames", "checksum", "shared", "ring")

    def __init__(self, frames, checksum, shared, ring=None):
        self.frames, self.checksum, self.shared, self.ring = frames, checksum, shared, ring


class RingPlace:
    """Where a batch sits in a worker group's ring: the ring, the slot, and what its
    descriptor will say (kind, lengths, check, the arrays' hash)."""

    __slots__ = ("ring", "slot", "kind", "lengths", "check", "data_hash")

    def __init__(self, ring, slot, kind, lengths, check, data_hash):
        self.ring, self.slot, self.kind, self.lengths = ring, slot, kind, lengths
        self.check, self.data_hash = check, data_hash

    def frames(self) -> list:
        """Copies of the frames the slot holds (the ring need not stay mapped for them)."""
        return self.ring.frames(self.slot, self.kind, self.lengths)


class Dropped:
    """What a retired group's batch held: its ``shared`` memory (or None) and, for a batch
    the ring held, copies of its ``frames`` (or the ``ProtocolError`` that says why they
    could not be read)."""

    __slots__ = ("shared", "frames")

    def __init__(self, shared, frames):
        self.shared, self.frames = shared, frames


class BatchEncoder:
    """Encodes the batches of one queue (``name``/``dp_id``, ``tp_size`` ranks).

    ``node_local``: the queue's ranks are reached over ``ipc://`` and may map this node's
    shared memory (a ``tcp://`` queue always sends arrays inline). Read here:
    ``FD_SYNC_SHM_PAYLOAD_MIN_KB`` (batches whose arrays take at least this much go
    through shared memory), ``FD_SYNC_SHM_POOL_MB`` (the pool's size),
    ``FD_SYNC_SHM_CHECKSUM`` (whether the shared bytes are hashed and verified by every
    rank; off by default, see ``shm.payload``).
    ``max_message_bytes``: the largest message the workers accept. ``window``: the
    queue's ``max_inflight`` (sizes the ring).

    ``counters`` (for ``TaskQueue.stats()``): ``shm_ring_batches``, ``shm_pool_batches``,
    ``shm_segment_batches``, ``shm_socket_fallbacks`` (batches above the threshold that
    went over the socket: no room in shared memory), ``shm_pools_created``.
    """

    def __init__(self, name: str, dp_id: int, tp_size: int, *, node_local: bool,
                 max_message_bytes: int, encrypted_limit=None, window: int = 8):
        self.name, self.dp_id, self.tp_size = name, dp_id, tp_size
        self._max_message_bytes = max_message_bytes
        # (bytes, why) for a CURVE-encrypted endpoint: see TaskQueue; None otherwise
        self._encrypted_limit = encrypted_limit
        # The ring (one per worker group, see batch_ring): its geometry, None for no ring
        slot_bytes = envs.shm_ring_slot_bytes() if node_local else 0
        self._ring_geometry = None
        if slot_bytes:
            slots = max(4, min(2 * window + 2, _RING_MAX_BYTES // slot_bytes))
            self._ring_geometry = (slots, slot_bytes, window + 2)
        self._ring: Optional[batch_ring.RingWriter] = None  # the current group's ring
        self._kept_ring: dict = {}  # seq -> RingPlace of a batch the engine retains
        # None: never through shared memory
        self._shm_min_bytes = envs.shm_payload_min_bytes() if node_local else None
        self._hash_shared = envs.shm_checksum()
        self._lock = threading.Lock()
        self._closed = False
        self._log = RateLimitedLog(log, interval=60.0)
        self.counters: collections.Counter = collections.Counter()
        # every shared name (and ring semaphore) not yet unlinked; the finalizer must not
        # reference self
        self.names: set = set()
        self._sem_names: set = set()
        self._large = LargeBatches(name, dp_id, tp_size,
                                   envs.shm_pool_bytes() if node_local else 0,
                                   self._shm_min_bytes, self.names, self.counters,
                                   functools.partial(_note, self._log, name, dp_id))
        self._finalizer = weakref.finalize(self, _unlink_all, self.names, self._sem_names,
                                           os.getpid())

    def open_ring(self, epoch: int) -> None:
        """Create the ring of worker-group epoch ``epoch`` (``batch_ring``): the batches put
        from now on until the next ``drop_all`` are that group's. Nothing when the queue
        has no ring; when ``/dev/shm`` has no room for one (logged), that group's batches
        travel over the socket. Call it with the engine's mutex held, before any batch of
        the group is published."""
        if self._ring_geometry is None or self._closed:
            return
        slots, slot_bytes, descs = self._ring_geometry
        size = batch_ring.ring_geometry(self.tp_size, slots, slot_bytes, descs)[0]
        no_room = room.fresh_fits(size)
        ring = None
        if no_room is None:
            try:
                ring = batch_ring.RingWriter.create(self.name, self.dp_id, self.tp_size, epoch,
                                                    slots=slots, slot_bytes=slot_bytes,
                                                    descs=descs)
            except FileExistsError:
                raise EndpointInUseError(
                    f"TaskQueue {self.name} dp_id={self.dp_id}: ring {epoch} exists: another "
                    f"TaskQueue of this name lives in this process; close it first") from None
            except OSError as exc:
                no_room = f"creating it failed: {exc}"
        if ring is None:
            self._note("ring-none", logging.WARNING, "no shared-memory ring for worker group "
                       "%d (%s): its batches travel over the socket", epoch, no_room)
        with self._lock:
            self._ring = ring
            if ring is not None:
                self.names.add(ring.name)
                self._sem_names.update(ring.sem_names)

    def _close_ring(self, ring):
        ring.close()
        with self._lock:
            self.names.discard(ring.name)
            self._sem_names.difference_update(ring.sem_names)

    def wake(self) -> None:
        """Wake the ranks' prefetch threads after a publication (``TaskQueue.put_tasks``,
        outside the engine's mutex). Never blocks."""
        ring = self._ring
        if ring is not None:
            ring.wake()

    def reclaim_stale(self) -> list:
        """Remove the shared batches and pools a killed engine of this queue left. Call it
        once the queue's node-local endpoint is exclusively this engine's."""
        return payload.reclaim_stale(self.name, self.dp_id)

    # -- the put path --------------------------------------------------------------------

    def encode(self, tasks) -> EncodedBatch:
        """Pickle ``tasks`` and copy its arrays exactly once: into one data frame, or, for
        a node-local batch whose arrays take at least the threshold, into shared memory
        (the pool; else a segment of its own; else, when ``/dev/shm`` has no room, the
        data frame after all). Any thread. Blocks for the copy, and, at the first shared
        batch of a worker group, while the pool is created (0.17 s for 256 MiB here; only
        this call waits for it: see the module docstring).

        Raises ``TypeError`` if ``tasks`` cannot be pickled and ``ValueError`` if the
        message would exceed the workers' limit (or a codec bound); nothing is held then.
        The size is checked before anything is copied, and pickling stops at the limit:
        refusing a 2 GiB batch costs no more memory than the limit's worth of pickle.
        A failure to use shared memory is never raised: it is logged (at most once a
        minute per kind) and the batch goes over the socket.
        """
        parts = codec.encode_parts(tasks, max_body_bytes=self._max_message_bytes)
        threshold = self._shm_min_bytes
        ring = self._ring
        large = threshold is not None and parts.buffers and parts.data_size >= threshold
        size = len(parts.body) + len(parts.offsets) + parts.data_size
        if ring is not None and not large and ring.fits_inline(parts):
            self._check_size(size)  # the same limit whichever path the batch takes
            batch = self._encode_ring(ring, parts)
            if batch is not None:
                return batch
        if large:
            batch = self._encode_shared(parts)
            if batch is not None:
                if ring is not None:
                    self._place_message(ring, batch)
                return batch
        # before the copy into one data frame: refuse what no rank would accept
        self._check_size(size)
        self.check_encrypted_size(size)
        frames = parts.frames()
        return EncodedBatch(frames, codec.payload_checksum(frames), None)

    def _encode_ring(self, ring, parts):
        """``EncodedBatch`` written whole into a slot of ``ring``, or None (no free slot).
        The check covers the body and offsets; the arrays are hashed only with
        ``FD_SYNC_SHM_CHECKSUM=1``, as the pool's."""
        with self._lock:
            slot = ring.allocate()
        if slot is None:
            self._note("ring-full", logging.INFO, "every slot of the ring holds a batch not "
                       "yet consumed and freed by every rank: a batch travels over the socket")
            return None
        try:
            kind, lengths = ring.write_inline(slot, parts)
            frames = [parts.body, parts.offsets] if parts.buffers else [parts.body]
            check = codec.payload_checksum(frames)
            data_hash = parts.data_hash() if self._hash_shared else 0
        except BaseException:
            with self._lock:
                ring.discard(slot)
            raise
        with self._lock:
            self.counters["shm_ring_batches"] += 1
        return EncodedBatch(None, check, None, RingPlace(ring, slot, kind, lengths, check,
                                                         data_hash))

    def place_payload(self, frames, check) -> EncodedBatch:
        """A batch another process encoded (a producer's ``frames`` with the checksum
        ``check`` they were verified against) as an ``EncodedBatch``: copied into a slot of
        the ring when one is free and large enough, else as it is (over the socket). Any
        thread; the copy runs outside the lock."""
        batch = EncodedBatch(frames, check, None)
        ring = self._ring
        if ring is None or sum(len(f) for f in frames) > ring.slot_bytes:
            return batch
        with self._lock:
            slot = ring.allocate()
        if slot is None:
            return batch
        kind, lengths = ring.write_payload(slot, frames)
        ring_check = codec.payload_checksum(frames[:2])
        batch.ring = RingPlace(ring, slot, kind, lengths, ring_check, 0)
        return batch

    def _place_message(self, ring, batch):
        """A shared batch's ``[body, reference]`` into a slot of ``ring`` when one is free
        and large enough; else it travels over the socket as it is."""
        if sum(len(f) for f in batch.frames) > ring.slot_bytes:
            return
        with self._lock:
            slot = ring.allocate()
        if slot is None:
            return
        kind, lengths = ring.write_frames(slot, batch.frames)
        batch.ring = RingPlace(ring, slot, kind, lengths, batch.checksum, 0)

    def _encode_shared(self, parts):
        """``EncodedBatch`` with the arrays in shared memory, or None (no room: socket).
        The message carries [body, reference]; its checksum covers both, and the
        reference carries the hash of the shared bytes (0: not hashed)."""
        # the body travels over the socket either way: refuse what no path can carry
        self._check_message_size([parts.body, parts.offsets])
        target = self._large.place(parts.data_size)
        if target is None:
            return None
        try:
            data_hash = parts.data_hash() if self._hash_shared else 0
            try:
                target.write_payload(parts)
            except PoolTruncated as exc:  # tampered with: never SIGBUS, go on
                self._large.discard(target)
                self._large.retire_damaged(target.pool, exc)
                return None
            ref = payload.pack_ref(target.name, parts.data_size, parts.offsets,
                                       stamp=target.stamp, start=target.start,
                                       data_hash=data_hash)
            frames = [parts.body, ref]
            self._check_message_size(frames)
            check = codec.payload_checksum(frames)
        except BaseException:
            self._large.discard(target)
            raise
        return EncodedBatch(frames, check, target)

    def _note(self, key, level, msg, *args):
        _note(self._log, self.name, self.dp_id, key, level, msg, *args)

    def _check_message_size(self, frames):
        self._check_size(sum(len(f) for f in frames))

    def check_encrypted_size(self, size):
        """``ValueError`` (saying why and what to do) for a batch of ``size`` bytes that an
        encrypted endpoint's I/O thread would take too long to encrypt (see TaskQueue)."""
        if self._encrypted_limit is not None and size > self._encrypted_limit[0]:
            limit, why = self._encrypted_limit
            raise ValueError(f"TaskQueue {self.name}: a {size / room.MiB:.0f} MiB batch "
                             f"is refused on this CURVE-encrypted tcp endpoint, whose limit is "
                             f"{limit / room.MiB:.0f} MiB: {why}. Split the batch, put "
                             f"it over ipc (ranks on this node), or raise "
                             f"FD_SYNC_HEARTBEAT_TIMEOUT on the engine and the workers")

    def _check_size(self, size):
        if size > self._max_message_bytes:
            raise ValueError(f"TaskQueue {self.name}: the batch encodes to {size} bytes, above "
                             f"the {self._max_message_bytes}-byte limit workers accept "
                             f"(FD_SYNC_MAX_MESSAGE_MB, set it on the engine and the workers)")

    # -- what becomes of a batch -----------------------------------------------------------

    def enqueue(self, seq: int, rel_seq: int, batch: EncodedBatch):
        """The engine enqueued ``batch`` as ``seq`` (``rel_seq`` in its worker group);
        called under the engine's mutex, in seq order. Publishes it in the group's ring
        (a batch that travels over the socket is published as such, so that the ranks
        know). Returns ``(frames, checksum)`` to retain: frames None for a batch the ranks
        read from the ring, else the socket message's payload."""
        with self._lock:
            ring, place = self._ring, batch.ring
            if place is not None and place.ring is not ring:
                # the group it was written for was retired meanwhile: over the socket
                if batch.frames is None:
                    batch.frames = place.frames()
                    batch.checksum = codec.payload_checksum(batch.frames)
                place.ring.discard(place.slot)
                batch.ring = place = None
            if batch.shared is not None:
                self._large.kept(seq, batch.shared)
            if place is not None:  # place.ring is ring: the current one
                place.ring.kept(place.slot)
                self._kept_ring[seq] = place
                place.ring.publish(rel_seq, place.kind, place.slot, place.check,
                                   place.data_hash, place.lengths)
                return None, batch.checksum
            if ring is not None:
                ring.publish(rel_seq, batch_ring.SOCKET)
        return batch.frames, batch.checksum


    def discard(self, batch: EncodedBatch) -> None:
        """``batch`` was never enqueued (put timed out, queue closed): no rank will ever map
        its shared memory. Any thread."""
        if batch.shared is not None:
            self._large.discard(batch.shared)
        if batch.ring is not None:
            with self._lock:
                batch.ring.ring.discard(batch.ring.slot)

    def release(self, seq: int) -> None:
        """Every rank consumed ``seq``. A segment of its own is unlinked (ranks that still
        view its arrays keep valid memory); a pool region is reused once every rank's
        arrays of it are freed too."""
        with self._lock:
            place = self._kept_ring.pop(seq, None)
            if place is not None:
                place.ring.consumed(place.slot)
        self._large.release(seq)

    def drop_all(self, next_epoch: int) -> dict:
        """The worker group was retired: every kept batch is handed back, ``{seq:
        Dropped}``, for ``decode_retained`` and then ``forget``. The group's pool and ring
        are retired with it: ranks of the old group may still view them, so nothing of
        them is reused; the next group's first shared batch creates a new pool, and its
        ring (epoch ``next_epoch``) is created here, before any of its batches is put."""
        with self._lock:
            places, self._kept_ring = self._kept_ring, {}
            ring, self._ring = self._ring, None
        kept = self._large.drop_all()
        dropped = {seq: Dropped(shared, None) for seq, shared in kept.items()}
        for seq, place in places.items():
            try:
                frames = place.frames()
            except ProtocolError as exc:  # decode_retained raises it: a LostBatch says so
                frames = exc
            dropped.setdefault(seq, Dropped(None, None)).frames = frames
        if ring is not None:
            self._close_ring(ring)
        self.open_ring(next_epoch)
        return dropped

    def forget(self, dropped: dict) -> None:
        """Free what ``drop_all`` handed back (the decoded ``LostBatch`` arrays keep their
        pages; the retired group's ranks that had not mapped a batch are told it is
        lost)."""
        self._large.forget([entry.shared for entry in dropped.values()])

    @staticmethod
    def decode_retained(frames, dropped):
        """A retained batch decoded again (for ``LostBatch``) from its retained ``frames``
        or, for a batch the ring held, the copies in ``dropped`` (a ``Dropped``, or None);
        its arrays are read-only. A shared batch's bytes are copied out of shared memory
        first (numpy's copy, GIL released): views of the mapping would keep the retired
        group's whole pool (or the batch's segment, in ``/dev/shm``) alive for as long as
        the caller holds the event, where the copy holds the batch's own bytes only."""
        if dropped is not None and dropped.frames is not None:
            if isinstance(dropped.frames, BaseException):
                raise dropped.frames
            frames = dropped.frames
        shared = dropped.shared if dropped is not None else None
        if shared is None:
            return codec.decode_payload(frames)
        ref = payload.unpack_ref(frames[1])
        view = shared.view() if isinstance(shared, PoolRegion) else shared.map()
        data = np.frombuffer(view, dtype=np.uint8).copy()
        del view  # the mapping goes with the last view of it
        return codec.decode_payload([frames[0], ref.offsets, data])

    def close(self) -> None:
        """Unlink every shared name (the queue closed; its I/O thread has stopped): kept
        batches' segments and every pool. Mappings stay valid while views of them live;
        a put still copying into a pool finishes into memory that is already unnamed."""
        self._large.close()
        with self._lock:
            self._closed = True
            ring, self._ring = self._ring, None
            self._kept_ring.clear()
        if ring is not None:
            self._close_ring(ring)

    def stats(self) -> dict:
        """``counters`` plus the current pool's ``shm_pool_bytes`` and
        ``shm_pool_held_bytes``."""
        large = self._large.stats()
        with self._lock:
            out = dict(self.counters)
            out.update(large)
            if self._ring is not None:
                out["shm_ring_slots_held"] = self._ring.held()
        return out


def _unlink_all(names, sem_names, owner_pid):
    if os.getpid() != owner_pid:
        return  # a forked child exiting: these are its parent's, still in use
    for name in list(names):  # shared batches, pools and rings left when the process exits
        unlink_segment(name)
    for name in list(sem_names):
        unlink_semaphore(name)


def _note(rate_limited_log, name, dp_id, key, level, msg, *args):
    """One line of the encoder's log, at most once a minute per ``key``."""
    rate_limited_log.log(key, level, "TaskQueue %s dp_id=%d: " + msg, name, dp_id, *args)
