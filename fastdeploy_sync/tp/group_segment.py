"""A TP group's shared memory and semaphores: made by rank 0, joined by the others, freed
only once no thread of this process waits on them.

The creator (rank 0) owns the names (``names.group_segment`` and one semaphore per rank):
it creates them (reclaiming a crashed run's leftovers), unlinks them at close. Who is
alive is proven by locks, not pids (``shm.ownership``): rank 0 holds the segment's owner
lock, and every rank holds the lock of its own rank byte (``layout.rank_lock``) for its
life, so a reused pid or a rank in another pid namespace is never taken for alive or dead
by mistake.

Lives of one process. A process may close its client and build a new one (a server that
recovers in-process). The new object must never inherit the old one's generation counters
or decisions: a rank re-attached to its old segment at generation 0 would pass barriers
alone (its peers' arrival marks are ahead) and replay old decisions. So a process never
joins the same group incarnation twice (``_JOINED``): a new rank object waits for rank 0
to create a new incarnation.

Closing from another thread. ``close()`` may run while another thread waits on a
semaphore of the group: the gate (``enter_blocking`` / ``leave_blocking``) counts such
threads; close marks the group closing, posts every semaphore, and frees them only once
every waiter has left. A waiter that does not leave within the bound keeps them (leaked,
never freed under it). The mapping is never unmapped under a reader: it is unmapped when
the object is garbage.
"""

import logging
import os
import threading
import weakref

import posix_ipc

from .. import names
from ..errors import ClosedError, GroupInUseError, GroupLostError
from ..shm.segment import (
    SegmentInUse,
    SegmentNotReady,
    attach_when_ready,
    create_reclaiming,
    reclaim_stale,
)
from ..shm.semaphores import create_fresh_semaphore, open_semaphore, unlink_semaphore
from .layout import (
    H_INCARNATION,
    H_MAGIC,
    H_OWNER_PID,
    H_TP_SIZE,
    HEADER,
    MAGIC,
    MAX_TP,
    R_PID,
    RANK_BASE,
    RANK_STRIDE,
    new_incarnation,
    rank_lock,
    segment_bytes,
)

__all__ = ["GroupSegment"]

log = logging.getLogger(__name__)

# (segment name, incarnation, rank) of every group this process has served: a new object
# never joins one of them again (see the module docstring). Guarded by _JOINED_LOCK.
_JOINED: set = set()
_JOINED_LOCK = threading.Lock()


def _group_semaphores(seg) -> list:
    """The semaphore names of the (leftover) group segment ``seg``, by the tp_size it
    records (none when it is not of this layout)."""
    v = seg.view
    tp = v[H_TP_SIZE] if seg.size >= RANK_BASE * 8 and v[H_MAGIC] == MAGIC else 0
    return [f"{seg.name}.w{r}" for r in range(max(0, min(tp, MAX_TP)))]


class GroupSegment:
    """One rank's handle on the group's segment (``view``: int64 slots, see ``layout``) and
    semaphores (``sems``, one per rank), and the gate that keeps ``close()`` from freeing a
    semaphore a thread of this process waits on.

    Rank 0 creates them (raising ``GroupInUseError`` if a live rank 0 of the same name
    exists); other ranks block until rank 0 has published the segment, up to
    ``attach_timeout`` seconds, then raise ``TimeoutError``."""

    def __init__(self, name: str, dp_id: int, tp_size: int, tp_rank: int,
                 attach_timeout: float):
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.shm_name = names.group_segment(name, dp_id)
        self._sem_names = [names.group_semaphore(name, dp_id, r) for r in range(tp_size)]
        self._size = segment_bytes(tp_size)
        self.sems: list = []  # rank 0: created below; the others: when they attach
        if tp_rank == 0:
            self._seg = self._create()
            self.sems = [open_semaphore(n) for n in self._sem_names]
        else:
            self._seg = self._attach(attach_timeout)
        self.view = self._seg.view
        self.incarnation = self.view[H_INCARNATION]  # rank 0 wrote it before READY
        with _JOINED_LOCK:
            _JOINED.add((self.shm_name, self.incarnation, tp_rank))
        # Threads inside a semaphore wait of this group, and whether close() began; both
        # under _gate (taken only around blocking waits and posts from other threads).
        self._gate = threading.Condition(threading.Lock())
        self._blocked = 0
        self.closing = False
        # Process exit or garbage without close(): the names are still removed (rank 0), and
        # the mapping is unmapped once nothing can read it any more.
        self._res = _Resources(self._seg, self.sems, self.shm_name, self._sem_names)
        self._finalizer = weakref.finalize(self, self._res.release, tp_rank == 0)

    # -- creation / attachment ---------------------------------------------------------

    def _create(self):
        try:
            seg = create_reclaiming(self.shm_name, self._size, semaphores=_group_semaphores)
        except SegmentInUse as exc:
            raise GroupInUseError(
                f"TP group {self.shm_name} is owned by live process {exc.owner} (its rank 0; "
                f"the pid as that process sees it): two groups cannot share a name and dp_id"
                if exc.owner else
                f"{self.shm_name}: another rank 0 created this group concurrently") from None
        try:
            for sem_name in self._sem_names:
                create_fresh_semaphore(sem_name).close()
            seg.try_lock(rank_lock(0))  # our own new file: nobody else can hold it
            v = seg.view
            HEADER.publish(v, {H_TP_SIZE: self.tp_size, H_INCARNATION: new_incarnation(),
                               RANK_BASE + R_PID: os.getpid()})
        except BaseException:
            for sem_name in self._sem_names:
                unlink_semaphore(sem_name)
            seg.unlink_if_mine()
            seg.close()
            raise
        return seg

    def _attach(self, timeout: float):
        """Attach rank 0's live segment, claim this rank's slot, open the semaphores; retry
        until ``timeout`` while there is no usable segment (none yet, a stale one, or one
        whose incarnation this process already served)."""
        try:
            return attach_when_ready(self.shm_name, self._join, timeout)
        except SegmentNotReady as exc:
            raise TimeoutError(
                f"rank {self.tp_rank}: TP group {self.shm_name} not ready after {timeout:.1f}s "
                f"({exc.why}); is rank 0 of this group running, or did it fail already (its log "
                f"says)? (FD_SYNC_ATTACH_TIMEOUT)"
            ) from None

    def _join(self, seg):
        """``attach_when_ready``'s test: None once ``seg`` is usable, this rank's slot is
        claimed and the semaphores are open (``sems``); else why not."""
        why = self._usable(seg)
        if why is not None:
            return why
        self._claim_rank(seg)
        try:
            sems = [open_semaphore(n) for n in self._sem_names]
        except FileNotFoundError:  # semaphores gone: rank 0 is closing or replacing it
            return "rank 0 is replacing it"
        if not seg.is_current():
            for sem in sems:
                sem.close()
            return "rank 0 replaced it while this rank attached"
        self.sems = sems
        return None

    def _claim_rank(self, seg) -> None:
        """Take this rank's slot (its lock, then its pid). Refuse a second life in a live
        group: a slot held by a live process means two processes for one rank; a slot
        that names a process which has exited or closed means one rank restarted, and its
        peers' model state no longer matches a fresh one: the whole group must restart
        (a new rank 0 creates a new incarnation)."""
        v = seg.view
        slot = RANK_BASE + self.tp_rank * RANK_STRIDE
        if not seg.try_lock(rank_lock(self.tp_rank)):
            raise GroupInUseError(
                f"rank {self.tp_rank} of TP group {self.shm_name} is held by live process "
                f"{v[slot + R_PID]}: check tp_rank on each worker")
        held_by = v[slot + R_PID]
        if held_by:
            seg.unlock(rank_lock(self.tp_rank))
            raise GroupLostError(
                f"rank {self.tp_rank} of TP group {self.shm_name} already ran in process "
                f"{held_by}, which exited or closed its client, while rank 0 (pid "
                f"{v[H_OWNER_PID]}) lives on: one rank cannot rejoin a live group (its peers' "
                f"model state is gone too); restart the whole group")
        v[slot + R_PID] = os.getpid()
        with _JOINED_LOCK:
            _JOINED.add((self.shm_name, v[H_INCARNATION], self.tp_rank))

    def _usable(self, seg):
        """None if ``seg`` is a live, ready segment of our shape that this process has not
        served before, else why not."""
        if seg.size < RANK_BASE * 8:
            return "rank 0 is creating it"
        v = seg.view
        if not HEADER.ready(v):
            return "rank 0 is creating it"
        # Rank 0 holds both the owner lock and its rank lock for its life. A new rank 0
        # reclaiming a dead group's segment holds the owner lock alone, for a moment before
        # it removes the name: read that as stale too, or this rank would find its slot
        # naming the dead rank and refuse to "rejoin a live group".
        if not (seg.owner_alive() and seg.lock_held(rank_lock(0))):
            return (f"a stale segment of exited process {v[H_OWNER_PID]} waits for rank 0 to "
                    f"reclaim it")
        with _JOINED_LOCK:
            served = (self.shm_name, v[H_INCARNATION], self.tp_rank) in _JOINED
        if served:
            return (f"this process already served its incarnation {v[H_INCARNATION]:#x} as "
                    f"rank {self.tp_rank} (an earlier client, closed or not): waiting for rank 0 "
                    f"to create a new one")
        if v[H_TP_SIZE] != self.tp_size or seg.size != self._size:
            raise ValueError(f"rank {self.tp_rank} was built with tp_size={self.tp_size} but "
                             f"rank 0 of {self.shm_name} uses tp_size={v[H_TP_SIZE]}")
        return None

    # -- liveness ----------------------------------------------------------------------

    def rank_alive(self, rank: int) -> bool:
        """True while rank ``rank``'s process holds its rank lock (it attached and has not
        closed or exited). Never blocks."""
        return rank == self.tp_rank or self._seg.lock_held(rank_lock(rank))

    # -- the gate: semaphores and the threads waiting on them ---------------------------

    def post(self, rank: int) -> None:
        """Post rank ``rank``'s semaphore, unless close() has begun (it may be freeing
        them). Thread-safe."""
        with self._gate:
            if not self.closing:
                self.sems[rank].release()

    def enter_blocking(self) -> None:
        """A thread is about to wait on a semaphore: close() must not free it meanwhile.
        ``ClosedError`` once close() began."""
        with self._gate:
            if self.closing:
                raise self.closed_error()
            self._blocked += 1

    def leave_blocking(self) -> None:
        with self._gate:
            self._blocked -= 1
            if self.closing:
                self._gate.notify_all()

    def closed_error(self) -> ClosedError:
        return ClosedError(f"rank {self.tp_rank} of TP group {self.shm_name} was closed "
                           f"while this thread waited")

    def close(self, timeout: float) -> bool:
        """Post every semaphore (peers waiting for this rank see its slot, this process's
        own waiters leave and raise ``ClosedError``), wait up to ``timeout`` seconds for
        every waiter of this process to leave, then close the semaphores; rank 0 also
        removes the names (peers keep their mappings), and a rank whose rank 0 has gone
        removes its leftovers. True when everything was freed; False when a waiter stayed
        (the semaphores are kept until the object is garbage). Idempotent only through the
        caller (``ShmTPGroup.close``)."""
        with self._gate:
            for sem in self.sems:
                sem.release()
            self.closing = True
            left = self._gate.wait_for(lambda: self._blocked == 0, timeout)
        if not left:
            log.error("rank %d of TP group %s: a thread still waits in the group %.1f s after "
                      "close(); its semaphores are kept open until the object is garbage",
                      self.tp_rank, self.shm_name, timeout)
        # the finalizer stays: it unmaps (and closes kept semaphores) once this is garbage
        self._res.release(self.tp_rank == 0, close_sems=left, unmap=False)
        return left


class _Resources:
    """What a GroupSegment frees, for close() and for its finalizer (which must not hold
    the group itself)."""

    def __init__(self, seg, sems, shm_name, sem_names):
        self.seg, self.sems, self.shm_name, self.sem_names = seg, sems, shm_name, sem_names
        self.names_done = False
        self.pid = os.getpid()

    def release(self, owner: bool, close_sems: bool = True, unmap: bool = True) -> None:
        seg = self.seg
        if os.getpid() != self.pid:
            self.names_done = True  # a forked child: the names are its parent's group's
        if not self.names_done:
            self.names_done = True
            if owner:
                # the semaphores first: while the segment's name exists (and we hold its
                # owner lock) no new rank 0 can create semaphores of the same names
                for name in self.sem_names:
                    unlink_semaphore(name)
                seg.unlink_if_mine()
            else:
                reclaim_stale(self.shm_name, semaphores=_group_semaphores)  # if rank 0 is gone
            seg.release_locks()
        if close_sems:
            sems, self.sems = self.sems, []
            for sem in sems:
                try:
                    sem.close()
                except posix_ipc.ExistentialError:
                    pass
        if unmap:
            seg.close()
