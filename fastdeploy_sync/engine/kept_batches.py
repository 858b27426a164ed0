"""What the engine keeps of each batch until every rank released it: the worker group's
ring (``shm.batch_ring``) and the slots its batches sit in (``KeptBatches``), and the
shared memory of large batches' arrays (``LargeBatches``): the worker group's pool, else a
segment of the batch's own, else nowhere (the batch takes the socket).

``engine.encoder.BatchEncoder`` writes each batch into what this module hands out; the
engine tells ``KeptBatches`` what becomes of it (``enqueue`` once it has a sequence
number, ``discard`` if it was never enqueued, ``release`` once every rank consumed it,
``drop_all``/``forget`` when a worker group is retired, ``close``) so that shared memory
is reused or freed exactly when no rank can need it any more (a pool region or ring slot
also waits for every rank's arrays to be freed: ``shm.release``).

Where a node-local engine keeps large batches' arrays: the worker group's pool, else a
segment of the batch's own, else nowhere (the batch takes the socket).

The pool (``shm.pool.PayloadPool``) is created by the first put that needs one, outside
the lock (its pages are reserved and faulted in: releases, stats and other puts must not
wait for that; a put that finds the pool being created takes a segment of its own), and
is retired with its worker group: ranks of the old group may still view it, so it is
unlinked only once no batch of the next group sits in it. A segment of its own
(``shm.payload.SharedPayload``) is unlinked once every rank consumed its batch.

Lock invariants: ``KeptBatches.lock`` guards the ring (the current group's writer and its
slots), ``KeptBatches._kept_ring`` (seq -> ring place of a batch the engine retains) and
``counters``; ``LargeBatches._lock`` guards the pools (current, being created, retired),
``_kept`` (seq -> the shared memory of a batch the engine retains) and the names
registered for the finalizer. The encoder holds ``KeptBatches.lock`` only to take a slot
(the copy runs outside it). The engine calls ``enqueue``, ``release`` and ``drop_all``
under its own mutex, which is always taken before these locks, never after.
"""

import collections
import functools
import itertools
import logging
import os
import threading
import time
import weakref
from typing import Optional

import numpy as np

from .. import envs, names
from ..errors import EndpointInUseError, ProtocolError
from ..logs import RateLimitedLog
from ..shm import batch_ring, payload, room
from ..shm.pool import PayloadPool, PoolRegion
from ..shm.segment import unlink_segment
from ..shm.semaphores import unlink_semaphore
from ..wire import codec

__all__ = ["KeptBatches", "LargeBatches", "RingPlace", "Dropped"]

log = logging.getLogger(__name__)

# The ring's slots take at most this much of /dev/shm per worker group.
_RING_MAX_BYTES = 64 << 20

# After a pool could not be created (no room, or an error), batches take the other paths
# for this long before another is tried.
POOL_RETRY_S = 60.0


class LargeBatches:
    """The shared memory of queue ``name``/``dp_id``'s large batches (module docstring).

    ``pool_bytes``: the pool's size (0: no pool); ``min_bytes``: the threshold of a shared
    batch (a pool smaller than it is none); ``names``: the set of shared names the
    encoder's finalizer removes if the process exits first; ``counters``: the queue's
    shared-memory counters; ``note(key, level, msg, *args)``: the encoder's rate-limited
    log."""

    def __init__(self, name, dp_id, tp_size, pool_bytes, min_bytes, names_set, counters, note):
        self.name, self.dp_id, self.tp_size = name, dp_id, tp_size
        self._pool_bytes, self._min_bytes = pool_bytes, min_bytes
        self._names, self._counters, self._note = names_set, counters, note
        self._lock = threading.Lock()
        self._pool = None  # the current group's pool, created at its first shared batch
        self._creating_pool = False  # a put is creating it (outside _lock)
        self._retired = []  # retired pools a batch of the next group may still sit in
        self._pool_retry_at = 0.0  # no pool until then (the last attempt failed)
        self._numbers = itertools.count(1)  # names of pools and segments
        self._kept = {}  # seq -> PoolRegion or SharedPayload
        self._closed = False

    # -- placing -------------------------------------------------------------------------

    def place(self, size):
        """Room for ``size`` bytes: a pool region, a segment of its own, or None (no room:
        logged, counted). Any thread; creating the pool blocks only this call."""
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
                        self._counters["shm_pool_batches"] += 1
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
                    self._names.add(name)
                    self._counters["shm_segment_batches"] += 1
                return shared
        with self._lock:
            self._counters["shm_socket_fallbacks"] += 1
            self._note("socket", logging.WARNING, "a %.1f MiB batch goes over the socket "
                       "(one copy per rank) instead of shared memory: %s",
                       size / room.MiB, no_room)
        return None

    def retire_damaged(self, pool, exc):
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
        or the last attempt failed less than ``POOL_RETRY_S`` ago. Under ``_lock``."""
        if not self._pool_bytes or self._creating_pool:
            return None
        now = time.monotonic()
        if now < self._pool_retry_at:
            return None
        self._pool_retry_at = now + POOL_RETRY_S
        size, why = room.pool_size(self._pool_bytes, max(self._min_bytes, 1 << 20))
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
        self._names.add(name)  # from now on: the finalizer removes it if we die meanwhile
        return name, size

    def _create_pool(self, name, size):
        """Create the pool ``_plan_pool`` named, outside ``_lock`` (module docstring), and
        make it the current pool; None if it could not be created or the queue closed
        meanwhile."""
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
                self._names.discard(name)
                if isinstance(error, EndpointInUseError):
                    raise error from None
                self._note("pool-failed", logging.WARNING, "could not create the "
                           "shared-memory pool %s (%d MiB): %s; retrying in %.0f s", name,
                           size >> 20, error, POOL_RETRY_S)
                return None
            if self._closed or self._pool is not None:
                self._close_pool(pool)
                return None
            self._pool = pool
            self._counters["shm_pools_created"] += 1
            return pool

    # -- what becomes of a batch ---------------------------------------------------------

    def kept(self, seq: int, shared) -> None:
        """The batch whose arrays ``shared`` holds was enqueued as ``seq``."""
        with self._lock:
            self._kept[seq] = shared
            if isinstance(shared, PoolRegion):
                shared.pool.kept(shared)

    def discard(self, shared) -> None:
        """``shared`` was never enqueued (put timed out, queue closed): no rank will ever
        map it. Any thread."""
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
            shared = self._kept.pop(seq, None)
            if shared is None:
                return
            if isinstance(shared, PoolRegion):
                shared.pool.consumed(shared)
                if shared.pool.retired:
                    self._close_idle_pools()
            else:
                self._unlink(shared)

    def drop_all(self) -> dict:
        """The worker group was retired: ``{seq: shared}`` of every kept batch, handed back
        (``forget`` frees them). The group's pool is retired with it: the next group's
        first shared batch creates a new one."""
        with self._lock:
            kept, self._kept = self._kept, {}
            if self._pool is not None:
                self._pool.abandon_kept()
                self._retired.append(self._pool)
                self._pool = None
                self._pool_retry_at = 0.0
        return kept

    def forget(self, shared_list) -> None:
        """Free what ``drop_all`` handed back (the decoded ``LostBatch`` arrays keep their
        pages; the retired group's ranks that had not mapped a batch are told it is
        lost)."""
        with self._lock:
            for shared in shared_list:
                if shared is not None and not isinstance(shared, PoolRegion):
                    self._unlink(shared)
            self._close_idle_pools()

    def close(self) -> None:
        """Unlink every shared name: kept batches' segments and every pool. Mappings stay
        valid while views of them live; a put still copying into a pool finishes into
        memory that is already unnamed."""
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

    def stats(self) -> dict:
        """The current pool's ``shm_pool_bytes`` and ``shm_pool_held_bytes`` (none without
        a pool)."""
        with self._lock:
            if self._pool is None:
                return {}
            held = self._pool.stats()
            return {"shm_pool_bytes": held["data_size"], "shm_pool_held_bytes": held["bytes_held"]}

    # -- under _lock -----------------------------------------------------------------------

    def _close_idle_pools(self):
        """Unlink retired pools (and, after ``close``, any) no rank may still need to open:
        no batch in them is being written or waits to be consumed."""
        for pool in list(self._retired):
            if not pool.busy():
                self._retired.remove(pool)
                self._close_pool(pool)

    def _close_pool(self, pool):
        self._names.discard(pool.name)
        pool.close()

    def _unlink(self, shared):
        self._names.discard(shared.name)
        shared.release()


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


class KeptBatches:
    """Everything queue ``name``/``dp_id`` (``tp_size`` ranks) keeps of its batches until
    every rank released them: the current worker group's ring (``ring``, None for none),
    the ring slots of enqueued batches, and the large batches' shared memory (``large``).

    ``node_local``: the ranks may map this node's shared memory (else no ring, no pool);
    ``window``: the queue's ``max_inflight`` (sizes the ring); ``min_bytes``: the
    threshold of a shared batch (None: never). ``lock`` guards the ring and ``counters``
    (module docstring); ``names``: every shared name not yet unlinked (the finalizer
    removes them if the process exits first).
    """

    def __init__(self, name: str, dp_id: int, tp_size: int, *, node_local: bool,
                 window: int, min_bytes):
        self.name, self.dp_id, self.tp_size = name, dp_id, tp_size
        # The ring (one per worker group, see batch_ring): its geometry, None for no ring
        slot_bytes = envs.shm_ring_slot_bytes() if node_local else 0
        self._ring_geometry = None
        if slot_bytes:
            slots = max(4, min(2 * window + 2, _RING_MAX_BYTES // slot_bytes))
            self._ring_geometry = (slots, slot_bytes, window + 2)
        self.ring: Optional[batch_ring.RingWriter] = None  # the current group's ring
        self._kept_ring: dict = {}  # seq -> RingPlace of a batch the engine retains
        self.lock = threading.Lock()
        self._closed = False
        # note(key, level, msg, *args): one line of the queue's shared-memory log, at most
        # once a minute per key (a partial, not a bound method: LargeBatches holds it, and
        # must not hold self, which the finalizer watches)
        self.note = functools.partial(_note, RateLimitedLog(log, interval=60.0), name, dp_id)
        self.counters: collections.Counter = collections.Counter()
        # every shared name (and ring semaphore) not yet unlinked; the finalizer must not
        # reference self
        self.names: set = set()
        self._sem_names: set = set()
        self.large = LargeBatches(name, dp_id, tp_size,
                                  envs.shm_pool_bytes() if node_local else 0,
                                  min_bytes, self.names, self.counters, self.note)
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
            self.note("ring-none", logging.WARNING, "no shared-memory ring for worker group "
                      "%d (%s): its batches travel over the socket", epoch, no_room)
        with self.lock:
            self.ring = ring
            if ring is not None:
                self.names.add(ring.name)
                self._sem_names.update(ring.sem_names)

    def _close_ring(self, ring):
        ring.close()
        with self.lock:
            self.names.discard(ring.name)
            self._sem_names.difference_update(ring.sem_names)

    def wake(self) -> None:
        """Wake the ranks' prefetch threads after a publication (``TaskQueue.put_tasks``,
        outside the engine's mutex). Never blocks."""
        ring = self.ring
        if ring is not None:
            ring.wake()

    def reclaim_stale(self) -> list:
        """Remove the shared batches and pools a killed engine of this queue left. Call it
        once the queue's node-local endpoint is exclusively this engine's."""
        return payload.reclaim_stale(self.name, self.dp_id)

    # -- what becomes of a batch -----------------------------------------------------------

    def enqueue(self, seq: int, rel_seq: int, batch):
        """The engine enqueued ``batch`` (an ``engine.encoder.EncodedBatch``) as ``seq``
        (``rel_seq`` in its worker group); called under the engine's mutex, in seq order.
        Publishes it in the group's ring (a batch that travels over the socket is
        published as such, so that the ranks know). Returns ``(frames, checksum)`` to
        retain: frames None for a batch the ranks read from the ring, else the socket
        message's payload."""
        with self.lock:
            ring, place = self.ring, batch.ring
            if place is not None and place.ring is not ring:
                # the group it was written for was retired meanwhile: over the socket
                if batch.frames is None:
                    batch.frames = place.frames()
                    batch.checksum = codec.payload_checksum(batch.frames)
                place.ring.discard(place.slot)
                batch.ring = place = None
            if batch.shared is not None:
                self.large.kept(seq, batch.shared)
            if place is not None:  # place.ring is ring: the current one
                place.ring.kept(place.slot)
                self._kept_ring[seq] = place
                place.ring.publish(rel_seq, place.kind, place.slot, place.check,
                                   place.data_hash, place.lengths)
                return None, batch.checksum
            if ring is not None:
                ring.publish(rel_seq, batch_ring.SOCKET)
        return batch.frames, batch.checksum

    def discard(self, batch) -> None:
        """``batch`` was never enqueued (put timed out, queue closed): no rank will ever map
        its shared memory. Any thread."""
        if batch.shared is not None:
            self.large.discard(batch.shared)
        if batch.ring is not None:
            with self.lock:
                batch.ring.ring.discard(batch.ring.slot)

    def release(self, seq: int) -> None:
        """Every rank consumed ``seq``. A segment of its own is unlinked (ranks that still
        view its arrays keep valid memory); a pool region is reused once every rank's
        arrays of it are freed too."""
        with self.lock:
            place = self._kept_ring.pop(seq, None)
            if place is not None:
                place.ring.consumed(place.slot)
        self.large.release(seq)

    def drop_all(self, next_epoch: int) -> dict:
        """The worker group was retired: every kept batch is handed back, ``{seq:
        Dropped}``, for ``decode_retained`` and then ``forget``. The group's pool and ring
        are retired with it: ranks of the old group may still view them, so nothing of
        them is reused; the next group's first shared batch creates a new pool, and its
        ring (epoch ``next_epoch``) is created here, before any of its batches is put."""
        with self.lock:
            places, self._kept_ring = self._kept_ring, {}
            ring, self.ring = self.ring, None
        kept = self.large.drop_all()
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
        self.large.forget([entry.shared for entry in dropped.values()])

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
        batches' segments, every pool and the ring. Mappings stay valid while views of
        them live; a put still copying into a pool finishes into memory that is already
        unnamed. Idempotent; never blocks beyond the unlinks."""
        self.large.close()
        with self.lock:
            self._closed = True
            ring, self.ring = self.ring, None
            self._kept_ring.clear()
        if ring is not None:
            self._close_ring(ring)

    def stats(self) -> dict:
        """``counters`` plus the current pool's ``shm_pool_bytes`` and
        ``shm_pool_held_bytes`` and the ring's ``shm_ring_slots_held``."""
        large = self.large.stats()
        with self.lock:
            out = dict(self.counters)
            out.update(large)
            if self.ring is not None:
                out["shm_ring_slots_held"] = self.ring.held()
        return out


def _unlink_all(names_set, sem_names, owner_pid):
    if os.getpid() != owner_pid:
        return  # a forked child exiting: these are its parent's, still in use
    for name in list(names_set):  # shared batches, pools and rings left when the process exits
        unlink_segment(name)
    for name in list(sem_names):
        unlink_semaphore(name)


def _note(rate_limited_log, name, dp_id, key, level, msg, *args):
    """One line of the queue's shared-memory log, at most once a minute per ``key``."""
    rate_limited_log.log(key, level, "TaskQueue %s dp_id=%d: " + msg, name, dp_id, *args)
