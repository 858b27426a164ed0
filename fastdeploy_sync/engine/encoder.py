"""The engine's put path in one call: ``BatchEncoder.encode(tasks)`` pickles a batch,
decides whether its arrays travel inline (one data frame per rank) or through node-local
shared memory (``payload_shm``: the queue's pool, a segment of the batch's own, or, when
neither has room, the socket after all), copies them once, and returns what the engine
enqueues and sends: the payload frames, their checksum and the shared memory the batch
holds.

The engine only enqueues and sends. It tells the encoder what becomes of each batch
(``keep`` once it has a sequence number, ``discard`` if it was never enqueued,
``release`` once every rank consumed it, ``drop_all``/``forget`` when a worker group is
retired, ``close``) so that shared memory is reused or freed exactly when no rank can
need it any more (the pool also waits for every rank's arrays to be freed: see
``payload_shm``).

Lock invariant: ``_lock`` guards the pools, ``_kept`` (seq -> the shared memory of a
batch the engine retains) and ``counters``. ``encode`` holds it only to take a region;
the copy runs outside it, and so does the pool's creation (once per worker group, by the
put that needs it first: releases, stats and other puts never wait for it; a put that
finds the pool being created takes a segment of its own). The engine
calls ``keep``, ``release`` and ``drop_all`` under its own mutex, which is always taken
before this lock, never after.
"""

import collections
import itertools
import logging
import os
import threading
import time
import weakref

import numpy as np

from .. import envs, names
from ..errors import EndpointInUseError, ProtocolError
from ..logs import RateLimitedLog
from ..shm import batch_ring, payload, room
from ..shm.pool import PayloadPool, PoolRegion, PoolTruncated
from ..shm.segment import unlink_segment
from ..shm.semaphores import unlink_semaphore
from ..wire import codec

__all__ = ["BatchEncoder", "EncodedBatch"]

log = logging.getLogger(__name__)

# After a pool could not be created (no room, or an error), batches take the other paths
# for this long before the encoder tries again.
_POOL_RETRY_S = 60.0
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
    rank; off by default, see ``payload_shm``).
    ``max_message_bytes``: the largest message the workers accept. ``window``: the
    queue's ``max_inflight`` (sizes the ring).

    ``counters`` (for ``TaskQueue.stats()``): ``shm_pool_batches``,
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
        self._ring = None  # the current group's ring (batch_ring.RingWriter)
        self._kept_ring = {}  # seq -> RingPlace of a batch the engine retains
        # None: never through shared memory
        self._shm_min_bytes = envs.shm_payload_min_bytes() if node_local else None
        self._pool_bytes = envs.shm_pool_bytes() if node_local else 0
        self._hash_shared = envs.shm_checksum()
        self._lock = threading.Lock()
        self._pool = None  # the current group's pool, created at its first shared batch
        self._creating_pool = False  # a put is creating it (outside _lock)
        self._retired = []  # retired pools a batch of the next group may still sit in
        self._pool_retry_at = 0.0  # no pool until then (the last attempt failed)
        self._numbers = itertools.count(1)  # names of pools and segments
        self._kept = {}  # seq -> PoolRegion or SharedPayload
        self._closed = False
        self._log = RateLimitedLog(log, interval=60.0)
        self.counters = collections.Counter()
        # every shared name (and ring semaphore) not yet unlinked; the finalizer must not
        # reference self
        self.names = set()
        self._sem_names = set()
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
        target = self._place(parts.data_size)
        if target is None:
            return None
        try:
            data_hash = parts.data_hash() if self._hash_shared else 0
            try:
                target.write_payload(parts)
            except PoolTruncated as exc:  # tampered with: never SIGBUS, go on
                self._discard(target)
                self._retire_damaged(target.pool, exc)
                return None
            ref = payload.pack_ref(target.name, parts.data_size, parts.offsets,
                                       stamp=target.stamp, start=target.start,
                                       data_hash=data_hash)
            frames = [parts.body, ref]
            self._check_message_size(frames)
            check = codec.payload_checksum(frames)
        except BaseException:
            self._discard(target)
            raise
        return EncodedBatch(frames, check, target)

    def _place(self, size):
        """Room for ``size`` bytes: a pool region, a segment of its own, or None."""
        with self._lock:
            if self._closed:
                return None  # the put fails with ClosedError anyway
            pool = self._pool
            plan = self._plan_pool() if pool is None else None
            number = next(self._numbers)
        if plan is not None:
            pool = self._create_pool(*plan)  # this put only: nothing else waits for it
        if pool is not None:
            with self._lock:
                if pool is self._pool:  # not retired with its group meanwhile
                    region = pool.allocate(size)
                    if region is not None:
                        self.counters["shm_pool_batches"] += 1
                        return region
                    held = pool.stats()
                    why = (f"the pool ({pool.data_size >> 20} MiB) holds {held['regions']} "
                           f"batch(es) not yet consumed and freed by every rank "
                           f"({held['bytes_held'] >> 20} MiB)" if size <= pool.data_size else
                           f"the batch is larger than the pool ({pool.data_size >> 20} MiB, "
                           f"FD_SYNC_SHM_POOL_MB)")
                    self._note("pool-full", logging.INFO, "a %.1f MiB batch takes a "
                               "segment of its own: %s", size / room.MiB, why)
        if self._closed:  # since the check above (e.g. while this put created the pool)
            return None
        no_room = room.fresh_fits(size)
        if no_room is None:
            name = names.batch_segment(self.name, self.dp_id, number)
            try:
                shared = payload.SharedPayload.create(name, size)
            except FileExistsError:
                raise EndpointInUseError(
                    f"TaskQueue {self.name} dp_id={self.dp_id}: shared batch {name} exists: "
                    f"another TaskQueue of this name lives in this process; close it "
                    f"first") from None
            except OSError as exc:  # ENOSPC: someone else filled /dev/shm meanwhile
                no_room = f"creating {name} failed: {exc}"
            else:
                with self._lock:
                    self.names.add(name)
                    self.counters["shm_segment_batches"] += 1
                return shared
        with self._lock:
            self.counters["shm_socket_fallbacks"] += 1
            self._note("socket", logging.WARNING, "a %.1f MiB batch goes over the socket "
                       "(one copy per rank) instead of shared memory: %s",
                       size / room.MiB, no_room)
        return None

    def _retire_damaged(self, pool, exc):
        """A pool another process damaged: no batch goes into it any more (the next shared
        batch creates a new one; this one goes over the socket)."""
        with self._lock:
            if pool is self._pool:
                pool.abandon_kept()
                self._retired.append(pool)
                self._pool = None
            self._note("pool-damaged", logging.ERROR, "%s; a new pool replaces it", exc)

    def _plan_pool(self):
        """(name, size) of the pool this put should create, or None: pools are off, one is
        being created by another put (this batch takes a segment of its own meanwhile),
        or the last attempt failed less than ``_POOL_RETRY_S`` ago. Under ``_lock``."""
        if not self._pool_bytes or self._creating_pool:
            return None
        now = time.monotonic()
        if now < self._pool_retry_at:
            return None
        self._pool_retry_at = now + _POOL_RETRY_S
        size, why = room.pool_size(self._pool_bytes, max(self._shm_min_bytes, 1 << 20))
        if size == 0:
            self._note("pool-none", logging.WARNING, "no shared-memory pool (%s; "
                       "FD_SYNC_SHM_POOL_MB=%d): large batches take a segment of their own "
                       "or the socket", why, self._pool_bytes >> 20)
            return None
        if size < self._pool_bytes:
            self._note("pool-small", logging.WARNING, "shared-memory pool sized down to "
                       "%d MiB (FD_SYNC_SHM_POOL_MB=%d): %s", size >> 20, self._pool_bytes >> 20,
                       why)
        name = names.pool(self.name, self.dp_id, next(self._numbers))
        self._creating_pool = True
        self.names.add(name)  # from now on: the finalizer removes it if we die meanwhile
        return name, size

    def _create_pool(self, name, size):
        """Create the pool ``_plan_pool`` named, outside ``_lock`` (its pages are reserved
        and faulted in: 0.17 s for 256 MiB here, during which releases, stats and other
        puts must not wait), and make it the current pool; None if it could not be
        created or the queue closed meanwhile."""
        pool = error = None
        try:
            pool = PayloadPool.create(name, self.tp_size, size)
        except FileExistsError:
            error = EndpointInUseError(
                f"TaskQueue {self.name} dp_id={self.dp_id}: pool {name} exists: another "
                f"TaskQueue of this name lives in this process; close it first")
        except OSError as exc:
            error = exc
        with self._lock:
            self._creating_pool = False
            if pool is None:
                self.names.discard(name)
                if isinstance(error, EndpointInUseError):
                    raise error from None
                self._note("pool-failed", logging.WARNING, "could not create the "
                           "shared-memory pool %s (%d MiB): %s; retrying in %.0f s", name,
                           size >> 20, error, _POOL_RETRY_S)
                return None
            if self._closed or self._pool is not None:
                self._close_pool(pool)
                return None
            self._pool = pool
            self.counters["shm_pools_created"] += 1
            return pool

    def _note(self, key, level, msg, *args):
        self._log.log(key, level, "TaskQueue %s dp_id=%d: " + msg, self.name, self.dp_id, *args)

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
            shared = batch.shared
            if shared is not None:
                self._kept[seq] = shared
                if isinstance(shared, PoolRegion):
                    shared.pool.kept(shared)
            if place is not None:
                ring.kept(place.slot)
                self._kept_ring[seq] = place
                ring.publish(rel_seq, place.kind, place.slot, place.check, place.data_hash,
                             place.lengths)
                return None, batch.checksum
            if ring is not None:
                ring.publish(rel_seq, batch_ring.SOCKET)
        return batch.frames, batch.checksum


    def discard(self, batch: EncodedBatch) -> None:
        """``batch`` was never enqueued (put timed out, queue closed): no rank will ever map
        its shared memory. Any thread."""
        if batch.shared is not None:
            self._discard(batch.shared)
        if batch.ring is not None:
            with self._lock:
                batch.ring.ring.discard(batch.ring.slot)

    def _discard(self, shared):
        with self._lock:
            if isinstance(shared, PoolRegion):
                shared.pool.discarded(shared)
                self._close_idle_pools()
            else:
                self._unlink(shared)

    def release(self, seq: int) -> None:
        """Every rank consumed ``seq``. A segment of its own is unlinked (ranks that still
        view its arrays keep valid memory); a pool region is reused once every rank's
        arrays of it are freed too."""
        with self._lock:
            place = self._kept_ring.pop(seq, None)
            if place is not None:
                place.ring.consumed(place.slot)
            shared = self._kept.pop(seq, None)
            if shared is None:
                return
            if isinstance(shared, PoolRegion):
                shared.pool.consumed(shared)
                if shared.pool.retired:
                    self._close_idle_pools()
            else:
                self._unlink(shared)

    def drop_all(self, next_epoch: int) -> dict:
        """The worker group was retired: every kept batch is handed back, ``{seq:
        Dropped}``, for ``decode_retained`` and then ``forget``. The group's pool and ring
        are retired with it: ranks of the old group may still view them, so nothing of
        them is reused; the next group's first shared batch creates a new pool, and its
        ring (epoch ``next_epoch``) is created here, before any of its batches is put."""
        with self._lock:
            kept, self._kept = self._kept, {}
            places, self._kept_ring = self._kept_ring, {}
            ring, self._ring = self._ring, None
            if self._pool is not None:
                self._pool.abandon_kept()
                self._retired.append(self._pool)
                self._pool = None
                self._pool_retry_at = 0.0
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
        with self._lock:
            for entry in dropped.values():
                shared = entry.shared
                if shared is not None and not isinstance(shared, PoolRegion):
                    self._unlink(shared)
            self._close_idle_pools()

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
        with self._lock:
            self._closed = True
            for shared in self._kept.values():
                if not isinstance(shared, PoolRegion):
                    self._unlink(shared)
            self._kept.clear()
            pools = self._retired + ([self._pool] if self._pool is not None else [])
            self._pool, self._retired = None, []
            for pool in pools:
                self._close_pool(pool)
            ring, self._ring = self._ring, None
            self._kept_ring.clear()
        if ring is not None:
            self._close_ring(ring)

    def stats(self) -> dict:
        """``counters`` plus the current pool's ``shm_pool_bytes`` and
        ``shm_pool_held_bytes``."""
        with self._lock:
            out = dict(self.counters)
            if self._pool is not None:
                held = self._pool.stats()
                out.update(shm_pool_bytes=held["data_size"], shm_pool_held_bytes=held["bytes_held"])
            if self._ring is not None:
                out["shm_ring_slots_held"] = self._ring.held()
        return out

    # -- under _lock -----------------------------------------------------------------------

    def _close_idle_pools(self):
        """Unlink retired pools (and, after ``close``, any) no rank may still need to open:
        no batch in them is being written or waits to be consumed."""
        for pool in list(self._retired):
            if not pool.busy():
                self._retired.remove(pool)
                self._close_pool(pool)

    def _close_pool(self, pool):
        self.names.discard(pool.name)
        pool.close()

    def _unlink(self, shared):
        self.names.discard(shared.name)
        shared.release()


def _unlink_all(names, sem_names, owner_pid):
    if os.getpid() != owner_pid:
        return  # a forked child exiting: these are its parent's, still in use
    for name in list(names):  # shared batches, pools and rings left when the process exits
        unlink_segment(name)
    for name in list(sem_names):
        unlink_semaphore(name)
