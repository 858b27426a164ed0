"""What one rank holds and has taken: the lock-guarded local slot between the threads that
receive or decode batches and the event loop that takes them."""

import threading

__all__ = ["LocalSlot"]


class LocalSlot:
    """The batches a rank holds, by sequence number, until its event loop takes them.

    Lock invariant: ``held`` maps seq -> (decoded tasks, whether they were read through the
    large-batch pool) for seqs above ``taking`` that a background thread decoded ahead of
    the event loop (socket batches; ring batches the prefetch thread pre-decoded); ``taking``
    (written by the event loop, under the lock)
    only grows, and nothing at or below it is added. ``received`` (the highest seq received
    over the socket, every earlier one that travelled over the socket received too) only
    grows and is written, with ``held``, under the lock by the socket's receiver.

    ``taken`` (the highest seq this rank has taken) belongs to the event loop alone: read
    anywhere, written only by ``claim``'s caller once the batches are taken.
    """

    __slots__ = ("_lock", "_held", "taking", "received", "taken")

    def __init__(self):
        self._lock = threading.Lock()
        self._held = {}
        self.taking = 0
        self.received = 0
        self.taken = 0

    def receive(self, seq: int, tasks) -> None:
        """The socket's receiver decoded ``seq`` (the next one it was owed): hold it unless
        the event loop already took it, and advance ``received``."""
        with self._lock:
            if seq > self.taking:
                self._held[seq] = (tasks, False)  # a shared batch was counted by the decode
            self.received = seq

    def hold(self, seq: int, tasks, shared: bool) -> bool:
        """A thread decoded ``seq`` ahead of the event loop (``shared``: through the
        large-batch pool): hold it, unless the event loop claimed it meanwhile (False: it
        decodes the batch itself and this copy is dropped)."""
        with self._lock:
            if seq > self.taking:
                self._held[seq] = (tasks, shared)
                return True
            return False

    def claim(self, from_seq: int, to_seq: int) -> dict:
        """The event loop takes (from_seq, to_seq]: from now on no thread adds those seqs;
        returns ``{seq: (tasks, shared)}`` of the ones held (the rest are the caller's to decode)."""
        with self._lock:
            self.taking = to_seq
            held = self._held
            return {s: held.pop(s) for s in range(from_seq + 1, to_seq + 1) if s in held}

    def drop_held(self) -> None:
        """Forget the batches held but not taken (at close, once no thread adds any): their
        arrays may view shared memory, which then is unmapped with them."""
        with self._lock:
            self._held = {}

    def snapshot(self):
        """``(received, held count)`` read together (for ``stats()``)."""
        with self._lock:
            return self.received, len(self._held)
