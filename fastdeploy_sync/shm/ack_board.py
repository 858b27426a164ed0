"""The ack board: a node-local engine learns what each rank consumed from shared memory.

Why: an acknowledgement sent over ZeroMQ costs the worker's event loop a send, an eventfd
write to wake libzmq's I/O thread, and cold caches after a model step: most of the budget
of a take (docs/performance.md). When the engine is on the same node (an ``ipc://``
endpoint, by construction), the worker instead writes its consumed seq into this
engine-owned segment (one store), and the engine reads it when it needs room or a count.
``tcp://`` endpoints keep ZeroMQ ACK messages.

Layout (int64 slots): MAGIC, OWNER_PID, TP_SIZE, READY, ENGINE, then one cache line per rank
holding its CONSUMED seq, tagged with the epoch of the worker group that wrote it
(``epoch << EPOCH_SHIFT | seq``, one store, so it is never torn): a retired group's
straggler that still writes its slot cannot advance the next group's accounting. The
engine creates it before binding its socket (so a worker that received a batch can always
find it) and unlinks it at close; a crashed engine's leftover is reclaimed by the next
engine of the same name. A worker attaches it only while its creator holds its owner lock
(``shm.ownership``), and only the board of the engine instance that welcomed it (ENGINE): a
worker that reads a WELCOME late, after its engine died and the next engine of the name
made its board, must not write its acks there, where a group of the same epoch number
would count them (and the ring it names would be the other engine's).
"""


from typing import Any

from .. import names
from .header import SegmentHeader
from .segment import OWNER_PID, Segment, create_reclaiming, unlink_segment

__all__ = ["AckBoard", "EPOCH_SHIFT"]

EPOCH_SHIFT = 40  # seqs below 2**40 (a trillion batches), epochs below 2**23
_SEQ_MASK = (1 << EPOCH_SHIFT) - 1

MAGIC = 0x46445359_41434B01  # "FDSY" "ACK" layout 1
B_TP_SIZE, B_READY, B_ENGINE = 2, 3, 4  # word OWNER_PID (1): the engine's pid
_HEADER = SegmentHeader(MAGIC, B_READY)  # no VERSION word: MAGIC carries the layout
BASE = 8
STRIDE = 8  # one 64-byte cache line per rank


class AckBoard:
    """One handle on the board: the engine's (``create``) or a worker rank's (``attach``)."""

    def __init__(self, segment: Segment, tp_size: int, owner: bool):
        # both None once closed (a closed board is not used again: its owner dropped it)
        self._seg: Any = segment
        self._view: Any = segment.view
        self.tp_size = tp_size
        self._owner = owner
        self._slots = [BASE + r * STRIDE for r in range(tp_size)]

    @classmethod
    def create(cls, name: str, dp_id: int, tp_size: int, engine: int) -> "AckBoard":
        """Engine instance ``engine``: create the board, reclaiming a crashed engine's
        leftover. Raises ``FileExistsError`` if a live process owns a board of this name."""
        size = (BASE + tp_size * STRIDE) * 8
        seg = create_reclaiming(names.ack_board(name, dp_id), size)  # SegmentInUse: FileExistsError
        _HEADER.publish(seg.view, {B_TP_SIZE: tp_size, B_ENGINE: engine})
        return cls(seg, tp_size, owner=True)

    @classmethod
    def attach(cls, name: str, dp_id: int, tp_size: int, engine: int):
        """Worker: the board of live engine instance ``engine`` (the one that welcomed
        it), or None if there is none usable, or the board is another engine's (then the
        worker acknowledges over ZeroMQ instead, and reads no ring). Never blocks."""
        try:
            seg = Segment.attach(names.ack_board(name, dp_id))
        except FileNotFoundError:
            return None
        v = seg.view
        if (seg.size != (BASE + tp_size * STRIDE) * 8 or not _HEADER.ready(v)
                or v[B_TP_SIZE] != tp_size or v[B_ENGINE] != engine
                or not seg.owner_alive()):
            seg.close()
            return None
        return cls(seg, tp_size, owner=False)

    @property
    def name(self) -> str:
        return self._seg.name

    @property
    def owner_pid(self) -> int:
        """The engine's pid as it recorded it (in its own pid namespace): names its rings."""
        return self._view[OWNER_PID]

    def publish(self, rank: int, tagged_seq: int) -> None:
        """Worker: this rank has consumed every batch up to the seq in ``tagged_seq``
        (``epoch << EPOCH_SHIFT | seq``; the caller precomputes the tag)."""
        # A plain store: the word publishes nothing but itself (the engine reuses a batch's
        # memory only once the rank's release word, a release store, says so: shm.release)
        self._view[self._slots[rank]] = tagged_seq

    def read(self) -> list:
        """Engine: every rank's ``(epoch, consumed seq)``."""
        v = self._view
        return [(x >> EPOCH_SHIFT, x & _SEQ_MASK) for x in (v[s] for s in self._slots)]

    def close(self) -> None:
        """Unmap; the engine also unlinks the name. Idempotent."""
        if self._seg is None:
            return
        name = self._seg.name
        self._view = None
        self._seg.close()
        self._seg = None
        if self._owner:
            unlink_segment(name)
