"""The engine's put path in one call: ``BatchEncoder.encode(tasks)`` pickles a batch,
decides where its bytes go and copies them once: into a slot of the worker group's ring
(``shm.batch_ring``: every rank of the node reads it), the arrays of a large one into
node-local shared memory (``kept_batches.LargeBatches``), else one data frame per rank (the socket).
It returns what the engine enqueues and sends.

What becomes of each batch afterwards (enqueued, discarded, released by every rank,
dropped with its worker group) is ``kept_batches.KeptBatches``'s (``encoder.kept``), which
owns the ring and every kept slot or region; ``encode`` takes a slot under its ``lock``
(the copy runs outside it) and a pool region or segment from its ``LargeBatches``.
"""

import logging

from .. import envs
from ..shm import payload, room
from ..shm.pool import PoolTruncated
from ..wire import codec
from .kept_batches import KeptBatches, RingPlace

__all__ = ["BatchEncoder", "EncodedBatch"]


class EncodedBatch:
    """One encoded batch: ``frames`` (what follows the DATA header; None for a batch only
    the ring holds), ``checksum`` (the header's check), ``shared`` (the
    ``PoolRegion`` or ``payload.SharedPayload`` holding its arrays, or
    None when they travel in ``frames`` or the ring) and ``ring`` (its ``RingPlace``, or
    None when it travels over the socket)."""

    __slots__ = ("frames", "checksum", "shared", "ring")

    def __init__(self, frames, checksum, shared, ring=None):
        self.frames, self.checksum, self.shared, self.ring = frames, checksum, shared, ring


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

    ``kept`` (``engine.kept_batches.KeptBatches``) owns what the batches are written into
    and everything after the write (enqueue, discard, retirement, ``close()``, ``stats()``):
    its owner calls it directly; this class only encodes.
    """

    def __init__(self, name: str, dp_id: int, tp_size: int, *, node_local: bool,
                 max_message_bytes: int, encrypted_limit=None, window: int = 8):
        self.name, self.dp_id, self.tp_size = name, dp_id, tp_size
        self._max_message_bytes = max_message_bytes
        # (bytes, why) for a CURVE-encrypted endpoint: see TaskQueue; None otherwise
        self._encrypted_limit = encrypted_limit
        # None: never through shared memory
        self._shm_min_bytes = envs.shm_payload_min_bytes() if node_local else None
        self._hash_shared = envs.shm_checksum()
        # the ring, every kept slot and region, and their lock (module docstring)
        self.kept = KeptBatches(name, dp_id, tp_size, node_local=node_local, window=window,
                                min_bytes=self._shm_min_bytes)
        self._lock = self.kept.lock  # taken around a slot's allocation only
        self._large = self.kept.large
        self.counters = self.kept.counters

    # -- the put path --------------------------------------------------------------------

    def encode(self, tasks) -> EncodedBatch:
        """Pickle ``tasks`` and copy its arrays exactly once: into one data frame, or, for
        a node-local batch whose arrays take at least the threshold, into shared memory
        (the pool; else a segment of its own; else, when ``/dev/shm`` has no room, the
        data frame after all). Any thread. Blocks for the copy, and, at the first shared
        batch of a worker group, while the pool is created (every page of it reserved and
        mapped in: a time proportional to ``FD_SYNC_SHM_POOL_MB``; only this call waits
        for it: see the module docstring).

        Raises ``TypeError`` if ``tasks`` cannot be pickled and ``ValueError`` if the
        message would exceed the workers' limit (or a codec bound); nothing is held then.
        The size is checked before anything is copied, and pickling stops at the limit:
        refusing a 2 GiB batch costs no more memory than the limit's worth of pickle.
        A failure to use shared memory is never raised: it is logged (at most once a
        minute per kind) and the batch goes over the socket.
        """
        parts = codec.encode_parts(tasks, max_body_bytes=self._max_message_bytes)
        threshold = self._shm_min_bytes
        ring = self.kept.ring
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
        ring = self.kept.ring
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
        self.kept.note(key, level, msg, *args)

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
