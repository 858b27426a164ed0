"""The engine's put path in one call: ``BatchEncoder.encode(tasks)`` pickles a batch,
decides whether its arrays travel inline (one data frame per rank) or through node-local
shared memory (``payload_shm``), copies them once, and returns what the engine enqueues
and sends: the payload frames, their checksum and the shared memory the batch holds.

The engine only enqueues and sends. It tells the encoder what becomes of each batch
(``keep`` once it has a sequence number, ``discard`` if it was never enqueued,
``release`` once every rank consumed it, ``drop_all`` when a worker group is retired)
so that shared memory is freed exactly when no rank can need it any more.

Lock invariant: ``_kept`` (seq -> shared memory of a batch the engine retains) is
guarded by the engine's own mutex: ``keep``, ``release`` and ``drop_all`` are called
under it; ``encode`` and ``discard`` touch no shared state and run in any thread.
"""

import itertools
import weakref

from . import codec, envs, payload_shm
from .errors import EndpointInUseError
from .shm import unlink_segment

__all__ = ["BatchEncoder", "EncodedBatch"]


class EncodedBatch:
    """One encoded batch: ``frames`` (what follows the DATA header), ``checksum`` (the
    header's check) and ``shared`` (the ``payload_shm.SharedPayload`` holding its arrays,
    or None when they travel in ``frames``)."""

    __slots__ = ("frames", "checksum", "shared")

    def __init__(self, frames, checksum, shared):
        self.frames, self.checksum, self.shared = frames, checksum, shared


class BatchEncoder:
    """Encodes the batches of one queue (``name``/``dp_id``).

    ``node_local``: the queue's ranks are reached over ``ipc://`` and may map this
    node's shared memory (a ``tcp://`` queue always sends arrays inline); the threshold
    is ``FD_SYNC_SHM_PAYLOAD_MIN_KB``, read here. ``max_message_bytes``: the largest
    message the workers accept.
    """

    def __init__(self, name: str, dp_id: int, tp_size: int, *, node_local: bool,
                 max_message_bytes: int):
        self.name, self.dp_id, self.tp_size = name, dp_id, tp_size
        self._max_message_bytes = max_message_bytes
        # None: never through shared memory
        self._shm_min_bytes = envs.shm_payload_min_bytes() if node_local else None
        self._numbers = itertools.count(1)
        self._kept = {}  # seq -> SharedPayload (under the engine's mutex)
        # every shared name not yet unlinked; the finalizer must not reference self
        self.names = set()
        self._finalizer = weakref.finalize(self, _unlink_all, self.names)

    def reclaim_stale(self) -> list:
        """Remove the shared batches a killed engine of this queue left. Call it once the
        queue's node-local endpoint is exclusively this engine's."""
        return payload_shm.reclaim_stale(self.name, self.dp_id)

    # -- the put path --------------------------------------------------------------------

    def encode(self, tasks) -> EncodedBatch:
        """Pickle ``tasks`` and copy its arrays exactly once: into one data frame, or into
        shared memory for a node-local batch whose arrays take at least the threshold.
        Any thread, no lock; blocks for the copy only.

        Raises ``TypeError`` if ``tasks`` cannot be pickled and ``ValueError`` if the
        message would exceed the workers' limit (or a codec bound); nothing is kept then.
        """
        parts = codec.encode_parts(tasks)
        threshold = self._shm_min_bytes
        if threshold is not None and parts.buffers and parts.data_size >= threshold:
            return self._encode_shared(parts)
        frames = parts.frames()
        self._check_message_size(frames)
        return EncodedBatch(frames, codec.payload_checksum(frames), None)

    def _encode_shared(self, parts):
        # The message carries [body, reference]; the checksum covers what the worker
        # decodes (body, offsets, the shared bytes), exactly as for the socket path.
        name = payload_shm.payload_name(self.name, self.dp_id, next(self._numbers))
        ref = payload_shm.pack_ref(name, parts.data_size, parts.offsets)
        frames = [parts.body, ref]
        self._check_message_size(frames)
        try:
            shared = payload_shm.SharedPayload.create(name, parts.data_size)
        except FileExistsError:
            raise EndpointInUseError(
                f"TaskQueue {self.name} dp_id={self.dp_id}: shared batch {name} exists: "
                f"another TaskQueue of this name lives in this process; close it "
                f"first") from None
        self.names.add(name)
        try:
            for (start, _), raw in zip(parts.layout, parts.buffers):
                shared.write(start, raw)
            shared.seal()
            # from the caller's buffers (cache-warm), not read back from the segment
            check = parts.checksum()
        except BaseException:
            self.names.discard(name)
            shared.release()
            raise
        return EncodedBatch(frames, check, shared)

    def _check_message_size(self, frames):
        size = sum(len(f) for f in frames)
        if size > self._max_message_bytes:
            raise ValueError(f"TaskQueue {self.name}: the batch encodes to {size} bytes, above "
                             f"the {self._max_message_bytes}-byte limit workers accept "
                             f"(FD_SYNC_MAX_MESSAGE_MB, set it on the engine and the workers)")

    # -- what becomes of a batch -----------------------------------------------------------

    def keep(self, seq: int, batch: EncodedBatch) -> None:
        """The engine enqueued ``batch`` as ``seq`` (under its mutex)."""
        if batch.shared is not None:
            self._kept[seq] = batch.shared

    def discard(self, batch: EncodedBatch) -> None:
        """``batch`` was never enqueued (put timed out, queue closed): nobody will ever map
        its shared memory. Any thread."""
        if batch.shared is not None:
            self._unlink(batch.shared)

    def release(self, seq: int) -> None:
        """Every rank consumed ``seq`` (under the engine's mutex, or once its I/O thread has
        stopped). Ranks that still view its arrays keep valid memory."""
        shared = self._kept.pop(seq, None)
        if shared is not None:
            self._unlink(shared)

    def drop_all(self) -> dict:
        """The worker group was retired (under the engine's mutex): every kept batch is
        handed back, ``{seq: shared}``, for ``decode_retained`` and then ``forget``."""
        dropped, self._kept = self._kept, {}
        return dropped

    def forget(self, dropped: dict) -> None:
        """Free what ``drop_all`` handed back (the decoded ``LostBatch`` arrays keep their
        pages; the retired group's ranks that had not mapped a batch are told it is
        lost)."""
        for shared in dropped.values():
            self._unlink(shared)

    @staticmethod
    def decode_retained(frames, shared):
        """A retained batch decoded again (for ``LostBatch``); its arrays are read-only
        and, for a shared batch (``shared``: its SharedPayload), views of the engine's
        mapping, which they keep alive."""
        if shared is None:
            return codec.decode_payload(frames)
        _, _, offsets = payload_shm.unpack_ref(frames[1])
        return codec.decode_payload([frames[0], offsets, shared.map()])

    def close(self) -> None:
        """Unlink every shared batch still kept (the queue closed; its I/O thread has
        stopped)."""
        for seq in list(self._kept):
            self.release(seq)

    def _unlink(self, shared):
        self.names.discard(shared.name)
        shared.release()


def _unlink_all(names):
    for name in list(names):  # shared batches still retained when the process exits
        unlink_segment(name)
