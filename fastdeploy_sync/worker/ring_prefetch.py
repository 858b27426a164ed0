"""The worker group's batch ring on one rank: attached at the engine's WELCOME, decoded ahead
by a prefetch thread that nothing waits for (``shm.batch_ring``).

When ``put_tasks()`` returns, every rank of the node can take the batch: the ring itself
says so, and a rank whose prefetch thread has not decoded a batch yet decodes it itself
when it takes it (``TaskClient``'s take). So the thread only saves the event loop a decode:
it blocks on this rank's semaphore with the GIL released and, after each post, decodes
what was published ahead of the event loop, one batch per hold of the GIL; what it
decodes after the event loop claimed a batch is dropped (``LocalSlot.hold``).
"""

import threading
import time
from typing import Optional

from ..errors import ProtocolError
from ..shm import batch_ring

__all__ = ["RingPrefetch", "RING_KINDS", "PUBLISHED"]

# Kinds of ring batches a rank reads from the ring itself (the rest travel over the socket).
RING_KINDS = (batch_ring.INLINE, batch_ring.SHARED)
# ``words[PUBLISHED]`` is the ring's ``published()``, read without a method call.
PUBLISHED = batch_ring.PUBLISHED
# The prefetch thread re-checks the ring this often without a post (a safety net: errors
# and close() wake it at once).
_RING_WAIT_S = 1.0


class RingPrefetch:
    """One rank's ring (``reader``: a ``batch_ring.RingReader``, None until the engine
    welcomed this rank, and for good when the engine had no room for one: every batch then
    comes over the socket) and, in async mode, its prefetch thread (``thread``). ``words``
    (None with ``reader``) is the ring's int64 words, read-only: ``words[PUBLISHED]`` is
    what was published, one read where a step finds nothing new.

    ``woke`` is set after every wake-up of the thread (each post, a failure, close):
    ``wait_for_tasks`` in async mode waits on it."""

    def __init__(self, name, dp_id, tp_size, tp_rank, slot, payload_reader, closing,
                 async_prefetch: bool, counters, fail):
        self._name, self._dp_id, self._tp_size, self._rank = name, dp_id, tp_size, tp_rank
        self._slot = slot
        self._payload_reader = payload_reader
        self._closing = closing
        self._async = async_prefetch
        self._counters = counters
        self._fail = fail  # called with what stopped the thread
        self.reader: Optional[batch_ring.RingReader] = None
        self.words = None
        self.thread: Optional[threading.Thread] = None
        self.woke = threading.Event()

    def attach(self, epoch: int, engine_pid: int) -> None:
        """At the first WELCOME of a node-local engine (receiver): attach the ring of worker
        group ``epoch`` that engine ``engine_pid`` created and, in async mode, start the
        prefetch thread. No ring: counted (``no_ring``), batches come over the socket."""
        try:
            reader = batch_ring.RingReader.attach(self._name, self._dp_id, self._tp_size,
                                                  self._rank, epoch, engine_pid,
                                                  self._payload_reader)
        except FileNotFoundError:
            self._counters["no_ring"] += 1
            return
        self.reader = reader
        self.words = reader.words  # last: from here on the event loop reads the ring
        if self._async and not self._closing.is_set():
            self.thread = threading.Thread(target=self._main, daemon=True,
                                           name=f"fdsync-ring-{self._name}-r{self._rank}")
            self.thread.start()

    def published(self) -> int:
        """The last seq the engine published in the ring (the ring's ``published()``: one
        read of its words, no call into the reader: the step checks it when nothing is new),
        or -1 while no ring is attached (every batch then comes over the socket). Never
        blocks, never raises; any thread."""
        words = self.words
        return -1 if words is None else words[PUBLISHED]

    def covers(self, first: int, end: int) -> bool:
        """True if every seq in [first, end) was taken already or is in the ring: only the
        batches that did not fit the ring travel over the socket, so a gap there is no
        loss."""
        reader, taken = self.reader, self._slot.taken
        return reader is not None and all(s <= taken or reader.kind(s) in RING_KINDS
                                          for s in range(first, end))

    def _main(self):
        """The prefetch thread: blocks on this rank's semaphore, then decodes (``_predecode``)
        and sets ``woke``. A batch that does not decode stops it, as a receiver's failure
        does: the next step call raises it."""
        reader = self.reader
        next_seq = 1
        try:
            while not self._closing.is_set():
                reader.wait(_RING_WAIT_S)
                if self._closing.is_set():
                    return
                next_seq = self._predecode(reader, next_seq)
                if not self.woke.is_set():
                    self.woke.set()  # also for what it does not decode (socket batches)
        except BaseException as exc:  # never silent: raised on the event loop
            self._fail(exc)

    def _predecode(self, reader, next_seq) -> int:
        """Decode every published ring batch from ``next_seq`` on that the event loop has
        not claimed yet into the slot; returns the next seq to look at. Raises what a
        decode raises, except a ``ProtocolError`` for a batch the event loop claimed while
        this thread was decoding it (this thread lost the GIL after choosing the seq: the
        event loop took the batch, every rank consumed it, and the engine reused its slot
        before this decode looked)."""
        slot = self._slot
        words = reader.words
        while not self._closing.is_set():
            seq = max(next_seq, slot.taking + 1)
            if seq > words[PUBLISHED]:
                return seq
            kind = reader.kind(seq)
            if kind == 0:
                return seq  # its descriptor is being reused: taken meanwhile
            next_seq = seq + 1
            if kind not in RING_KINDS:
                continue  # travels over the socket: the receiver's
            try:
                tasks = reader.decode(seq)
            except ProtocolError:
                if slot.taking >= seq:
                    # the event loop claimed it meanwhile (and read it itself): its slot was
                    # reused since, which is no fault of the batch it took
                    continue
                raise
            if slot.hold(seq, tasks, kind == batch_ring.SHARED):
                self._counters["predecoded"] += 1
            del tasks
            self.woke.set()
            if words[PUBLISHED] > seq:
                time.sleep(0)  # the GIL goes back to the step before the next batch
        return next_seq

    def stop(self) -> None:
        """Wake the prefetch thread (and a sync-mode ``wait_for_tasks`` of another thread)
        so that it sees the client closing. Thread-safe."""
        self.woke.set()
        if self.reader is not None:
            self.reader.post()

    def close(self) -> None:
        """Close the ring and let go of the shared memory this rank reads: the batches
        held but not taken (the slot's), the ring, the pools (the payload reader's).
        Nothing of the client holds their mappings (or the descriptors mmap keeps with
        them) from here on: each is unmapped now, or with the last array that views it, or
        when a step call of another thread that still reads it returns; never later
        because the client's objects wait for a garbage collection. Only once no thread
        receives or decodes any more. ``reader`` and ``words`` are None afterwards."""
        self._slot.drop_held()
        reader = self.reader
        self.words = None  # first: a step call finding ``words`` set may read ``reader``
        self.reader = None
        if reader is not None:
            reader.close()
        if self._payload_reader is not None:
            self._payload_reader.close()
