"""Taking a step's batches on one rank: from the local slot, else decoded from the ring."""

from ..errors import ProtocolError
from ..shm import batch_ring
from .ring_prefetch import RING_KINDS

__all__ = ["Taker"]


class Taker:
    """``take(from_seq, to_seq)``: the event loop's half of ``get_tasks()`` (event loop
    only). Collaborators: ``slot`` (what background threads decoded), ``ring`` (the ring,
    for what they did not), ``faults``, ``group`` (publishes what was consumed), ``acks``
    (tells the engine), ``counters``."""

    def __init__(self, tp_rank, slot, ring, faults, group, acks, counters):
        self._rank = tp_rank
        self._slot, self._ring, self._faults = slot, ring, faults
        self._group, self._acks, self._counters = group, acks, counters

    def take(self, from_seq: int, to_seq: int) -> list:
        """The batches (from_seq, to_seq], in seq order; this rank's ``taken`` becomes
        ``to_seq``, published to the group and acknowledged to the engine (never blocks).
        ``ProtocolError`` if this rank has not taken exactly ``from_seq`` (its history
        disagrees with rank 0's decision) or holds a batch of the range nowhere; a batch
        that does not decode is latched as a receiver's failure would be and raised."""
        slot = self._slot
        if from_seq != slot.taken:
            raise ProtocolError(
                f"rank {self._rank} has taken up to seq {slot.taken} but the group's step "
                f"takes ({from_seq}, {to_seq}]: get_tasks() must be called on every rank of a "
                f"step or on none")
        seqs = range(from_seq + 1, to_seq + 1)
        items = slot.claim(from_seq, to_seq)  # no background thread adds these from now on
        ring = self._ring.reader
        if len(items) < len(seqs):
            for s in seqs:
                if s in items:
                    continue
                kind = ring.kind(s) if ring is not None else 0
                if kind not in RING_KINDS:
                    where = ring.describe(s) if ring is not None else "no ring attached"
                    raise ProtocolError(f"rank {self._rank} holds {len(items)} of the "
                                        f"{len(seqs)} batch(es) the step takes ({from_seq}, "
                                        f"{to_seq}]: seq {s} is missing ({where})")
                # not decoded ahead (the prefetch thread had not got the GIL, or sync mode)
                try:
                    items[s] = (ring.decode(s), kind == batch_ring.SHARED)
                except Exception as exc:
                    # as a receiver's failure: latched, so every later step call raises it
                    self._faults.latch(exc)
                    self._faults.raise_error()
                    raise  # raise_error returns only for an engine CLOSE: not this error
                self._counters["decoded_by_loop"] += 1
        tasks = []
        for s in seqs:
            batch, shared = items[s]
            tasks.append(batch)
            if shared:  # a large batch read through the pool, for stats()
                self._counters["shared_batches"] += 1
        slot.taken = to_seq
        self._group.publish_consumed(to_seq)
        self._acks.acknowledge(to_seq)
        return tasks
