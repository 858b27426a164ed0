"""The layout of a TP group's shared-memory segment, and a read-only look at a live one.

Int64 slots; each rank's block is one 64-byte cache line, so that a rank writing its own
watermarks never invalidates another rank's line::

    header      MAGIC, OWNER_PID (shm.segment's word 1), VERSION, TP_SIZE, READY, INCARNATION
    rank r      RECEIVED  highest seq the rank holds locally (contiguous from 1)
                CONSUMED  highest seq the rank has taken
                ARRIVED   the barrier generation the rank last arrived at
                SLEEPING  the generation the rank is blocked on in a semaphore, else 0
                PID
                FAULT     non-zero once the rank stopped at an error (its code), so that a
                          peer waiting for it raises the same kind of error, not "exited"
                WAITING   rank 0 only: the seq it is blocked waiting for every rank to hold
                          (``wait_received``; negated: ``wait_peers``), else 0; a receiver
                          that completes it posts rank 0's semaphore
                ARRIVED_AT  CLOCK_MONOTONIC ns of the rank's last barrier arrival (written
                          before ARRIVED): how late a partner was, exactly, even for a rank
                          that was asleep when it came
    decisions   a ring of DECISION_RING entries (GEN, FROM, TO), written by rank 0 only
    engines     one slot per rank: the engine instance that welcomed it (0: none yet),
                written before its first RECEIVED

Liveness is by locks (``shm.ownership``): rank 0 holds the segment's owner lock, and every
rank holds the lock of its own rank byte (``rank_lock``) for its life.
"""

import secrets

from .. import names
from ..shm.header import SegmentHeader
from ..shm.ownership import OWNER_LOCK
from ..shm.segment import OWNER_PID, Segment

__all__ = ["MAGIC", "VERSION", "HEADER", "H_MAGIC", "H_OWNER_PID", "H_VERSION", "H_TP_SIZE", "H_READY",
           "H_INCARNATION", "RANK_BASE", "RANK_STRIDE", "R_RECEIVED", "R_CONSUMED",
           "R_ARRIVED", "R_SLEEPING", "R_PID", "R_FAULT", "R_WAITING", "R_ARRIVED_AT",
           "DECISION_RING", "D_GEN", "D_FROM", "D_TO", "D_STRIDE", "FAULT_LEFT", "MAX_TP",
           "segment_bytes", "rank_lock", "new_incarnation", "RankState", "GroupState",
           "read_group"]

MAGIC = 0x46445359_4E430003  # "FDSYNC", layout 3 (the owner pid at shm.segment.OWNER_PID)
VERSION = 3
H_MAGIC, H_OWNER_PID, H_VERSION, H_TP_SIZE, H_READY, H_INCARNATION = 0, OWNER_PID, 2, 3, 4, 5
HEADER = SegmentHeader(MAGIC, H_READY, VERSION, H_VERSION)
RANK_BASE = 8
RANK_STRIDE = 8  # 64 bytes: one cache line per rank
R_RECEIVED, R_CONSUMED, R_ARRIVED, R_SLEEPING, R_PID, R_FAULT, R_WAITING, R_ARRIVED_AT = range(8)
DECISION_RING = 8
D_GEN, D_FROM, D_TO = range(3)
D_STRIDE = 4
# FAULT of a rank that closed its client (other codes are the worker's, all > 0 and < 64).
FAULT_LEFT = 64
# The largest tp_size a reader believes a segment's header about.
MAX_TP = 4096


def segment_bytes(tp_size: int) -> int:
    """The size of the segment of a group of ``tp_size`` ranks."""
    return (RANK_BASE + tp_size * RANK_STRIDE + DECISION_RING * D_STRIDE + tp_size) * 8


def rank_lock(rank: int) -> int:
    """The byte of the group's segment whose lock rank ``rank`` holds while it lives."""
    return OWNER_LOCK + 1 + rank


def new_incarnation() -> int:
    """A fresh group incarnation id: random, non-zero, 63 bits. Rank 0 picks it when the
    group is created and every rank of the group reports it to the engine, which tells a
    restarted group from the one it replaces by it."""
    return secrets.randbits(63) | 1


class RankState:
    """One rank as a live segment shows it (``read_group``)."""

    __slots__ = ("rank", "pid", "alive", "received", "consumed", "arrived", "sleeping")

    def __init__(self, rank, pid, alive, received, consumed, arrived, sleeping):
        self.rank, self.pid, self.alive = rank, pid, alive
        self.received, self.consumed, self.arrived, self.sleeping = (received, consumed,
                                                                     arrived, sleeping)


class GroupState:
    """A TP group's segment as read at one moment: ``shm_name``, ``tp_size``, ``owner_pid``
    (as its rank 0 recorded it), ``owner_alive`` (by its owner lock) and ``ranks``."""

    __slots__ = ("shm_name", "tp_size", "owner_pid", "owner_alive", "ranks")

    def __init__(self, shm_name, tp_size, owner_pid, owner_alive, ranks):
        self.shm_name, self.tp_size, self.owner_pid = shm_name, tp_size, owner_pid
        self.owner_alive, self.ranks = owner_alive, ranks


def read_group(name: str, dp_id: int):
    """The state of queue ``name``/``dp_id``'s node-local TP group, read without joining
    it (safe next to a running group: reads only, takes no lock). Returns a ``GroupState``;
    ``FileNotFoundError`` if there is no segment, ``PermissionError`` if another user owns
    it, ``ValueError`` (saying why) for one that is not a ready group of this layout.
    Alive means holding the owner's or the rank's lock, never a pid. Never blocks."""
    shm_name = names.group_segment(name, dp_id)
    seg = Segment.attach(shm_name)
    try:
        v = seg.view
        if seg.size < RANK_BASE * 8 or not HEADER.ready(v):
            raise ValueError(f"{shm_name}: not a ready fastdeploy_sync group")
        tp = v[H_TP_SIZE]
        if not 0 < tp <= MAX_TP or seg.size < (RANK_BASE + tp * RANK_STRIDE) * 8:
            raise ValueError(f"{shm_name}: not a fastdeploy_sync group of this layout "
                             f"(tp_size {tp} in {seg.size} bytes)")
        ranks = []
        for r in range(tp):
            b = RANK_BASE + r * RANK_STRIDE
            ranks.append(RankState(r, v[b + R_PID], seg.lock_held(rank_lock(r)),
                                   v[b + R_RECEIVED], v[b + R_CONSUMED], v[b + R_ARRIVED],
                                   v[b + R_SLEEPING]))
        return GroupState(shm_name, tp, v[H_OWNER_PID], seg.owner_alive(), ranks)
    finally:
        seg.close()
