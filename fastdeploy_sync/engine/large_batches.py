"""Where a node-local engine keeps large batches' arrays: the worker group's pool, else a
segment of the batch's own, else nowhere (the batch takes the socket).

The pool (``shm.pool.PayloadPool``) is created by the first put that needs one, outside
the lock (its pages are reserved and faulted in: releases, stats and other puts must not
wait for that; a put that finds the pool being created takes a segment of its own), and
is retired with its worker group: ranks of the old group may still view it, so it is
unlinked only once no batch of the next group sits in it. A segment of its own
(``shm.payload.SharedPayload``) is unlinked once every rank consumed its batch.

Lock invariant: ``_lock`` guards the pools (current, being created, retired), ``_kept``
(seq -> the shared memory of a batch the engine retains) and the names registered for
the finalizer. The engine's mutex is always taken before it, never after.
"""

import itertools
import logging
import threading
import time

from .. import names
from ..errors import EndpointInUseError
from ..shm import payload, room
from ..shm.pool import PayloadPool, PoolRegion

__all__ = ["LargeBatches"]

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
