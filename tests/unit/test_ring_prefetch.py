"""The prefetch thread's pass over the ring (``RingPrefetch._predecode``) against a reader
whose decode fails, with and without the event loop having claimed the batch meanwhile."""

import collections
import threading

import pytest

from fastdeploy_sync.errors import ProtocolError
from fastdeploy_sync.shm import batch_ring
from fastdeploy_sync.worker.ring_prefetch import PUBLISHED, RingPrefetch
from fastdeploy_sync.worker.slot import LocalSlot


class _Reader:
    """Seqs 1..published are INLINE; decoding ``failing`` raises what a slot reused since
    raises, after ``claim`` (the event loop taking the batch while the thread decodes)."""

    def __init__(self, slot, published, failing, claim):
        self.words = collections.defaultdict(int, {PUBLISHED: published})
        self._slot, self._failing, self._claim = slot, failing, claim

    def kind(self, seq):
        return batch_ring.INLINE if seq <= self.words[PUBLISHED] else 0

    def decode(self, seq):
        if seq == self._failing:
            if self._claim:
                self._slot.claim(self._slot.taken, seq)  # the event loop took it meanwhile
            raise ProtocolError(f"ring r: the slot of seq {seq} holds stamp {seq + 10}, not "
                                f"{seq}: reused before this rank read it")
        return f"batch {seq}"


def _prefetch(slot):
    return RingPrefetch("n", 0, 2, 1, slot, None, threading.Event(), True,
                        collections.Counter(), lambda exc: None)


def test_a_batch_the_event_loop_took_while_the_thread_decoded_it_is_no_fault():
    """The prefetch thread chose seq 2, lost the GIL, and the event loop took 1-2; every rank
    consumed them and the engine reused 2's slot before this decode looked. Before: the
    thread stopped with the ProtocolError, and the rank raised it at its next step (the
    async rebuild storm, about 1 run in 10)."""
    slot = LocalSlot()
    reader = _Reader(slot, published=4, failing=2, claim=True)
    assert _prefetch(slot)._predecode(reader, 1) == 5
    assert slot.claim(2, 4) == {3: ("batch 3", False), 4: ("batch 4", False)}


def test_a_batch_that_fails_to_decode_before_the_event_loop_claimed_it_is_raised():
    slot = LocalSlot()
    reader = _Reader(slot, published=4, failing=2, claim=False)
    with pytest.raises(ProtocolError, match="reused before this rank read it"):
        _prefetch(slot)._predecode(reader, 1)
