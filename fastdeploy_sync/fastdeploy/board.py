"""The group board: what a TP group's ranks decide together that FastDeploy decides by a lock
(who is the last reader of a ``get_tasks()`` call, the ``read_finish_flag``, whether a read
came before the step it was meant for, what a worker's ``clear_data()`` drops).

Three kinds, one interface (``WorkerSide`` uses them):
  * ``GroupBoard``: the ranks share a node; node-local shared memory and a semaphore lock.
  * ``PaddleBoard``: the ranks span nodes; the step's paddle collective decides, nothing
    is shared.
  * ``SoloBoard``: TP=1.

Decisions are indexed by the ``get_tasks()`` call number j (FastDeploy's own barrier orders
rank 0's check before every rank's j-th call; see ``WorkerSide``). A ring slot per call in
flight holds ``(j, readers so far, for_gen, first, last, drop)``: ``for_gen`` is the barrier
generation of the queue's own ``worker_process_tp_barrier`` the call is meant for (0: the
loop does not use that barrier), ``(first, last]`` the seqs rank 0 latched, ``drop`` how many
of them a worker's ``clear_data()`` removed, fixed when the first rank reads the call.
"""

import weakref

from .. import names
from ..errors import ProtocolError, TaskSyncError
from ..shm.header import SegmentHeader
from ..shm.segment import (
    SegmentInUse,
    SegmentNotReady,
    attach_when_ready,
    create_reclaiming,
    unlink_segment,
)
from ..shm.semaphores import create_fresh_semaphore, open_semaphore, sem_wait, unlink_semaphore

__all__ = ["GroupBoard", "PaddleBoard", "SoloBoard", "EARLY"]

# last_reader()'s answer to a read that came before the barrier generation its call is for
EARLY = None

# word OWNER_PID (1) holds rank 0's pid (shm.segment)
_B_READY, _B_FLAG, _B_NEXT_CALL, _B_SEALED, _B_CLEAR = 2, 3, 4, 5, 6
# rank 0 saw the engine's CLOSE having taken everything: the call and barrier generation
# from which every rank raises (see WorkerSide.check)
_B_CLOSED_CALL, _B_CLOSED_GEN = 7, 8
_B_RING = 8  # calls in flight at once: the caller's barrier bounds the skew to one
_B_SLOT = 6  # call, readers, for_gen, first, last, drop
_B_RING_BASE = 9
_HEADER = SegmentHeader(0x46445359_4E43465A, _B_READY)  # "FDSYNCFZ": this layout
_B_CALLS_BASE = _B_RING_BASE + _B_SLOT * _B_RING  # then one word per rank: its calls
_LOCK_TIMEOUT_S = 5.0
_ATTACH_POLL_S = 0.01


class GroupBoard:
    """Node-local shared memory of one TP group.

    ``all_client_read`` must be True on exactly one rank per ``get_tasks()`` call (the last
    reader): that needs an atomic read-modify-write, which plain stores and loads cannot
    give (two ranks finishing together would both see "everyone is done"). A POSIX
    semaphore used as a mutex guards the ring of per-call slots; uncontended it costs two
    futex operations without a system call. A rank that dies holding it makes the
    others raise ``TimeoutError`` after 5 s instead of hanging.

    Lock invariant: a call's slot, ``SEALED`` and ``CLEAR`` change only under the lock; a
    decision (TaskClient's latch and the slot's ``for_gen``, ``first``, ``last``) is written
    only while no rank has begun reading its call (``SEALED`` < j), and its ``drop`` is
    fixed by the read that seals it, so every reader of call j sees the same one.

    Rank 0 creates the segment and semaphore (reclaiming a crashed run's leftovers) and
    unlinks them at close; other ranks attach to the one a live rank 0 holds (its owner
    lock, not a pid, says so), waiting up to ``timeout`` seconds.
    """

    def __init__(self, name, dp_id, tp_size, tp_rank, timeout):
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.shm_name = names.dropin_board(name, dp_id)
        self.sem_name = names.dropin_board_lock(name, dp_id)
        self._owner = tp_rank == 0
        self._size = (_B_CALLS_BASE + tp_size) * 8
        self._seg = self._create() if self._owner else self._attach(timeout)
        try:
            self._sem = open_semaphore(self.sem_name)
        except BaseException:
            self._seg.close()
            raise
        self._view = self._seg.view
        self._finalizer = weakref.finalize(self, _release_board, self._seg, self._sem,
                                           self._owner, self.shm_name, self.sem_name)

    def _create(self):
        try:
            seg = create_reclaiming(self.shm_name, self._size)
        except SegmentInUse as exc:
            raise TaskSyncError(f"{exc}: another rank 0 of this address and DP group is "
                                f"running") from None
        create_fresh_semaphore(self.sem_name, initial_value=1).close()
        _HEADER.publish(seg.view, {})
        return seg

    def _attach(self, timeout):
        try:
            return attach_when_ready(self.shm_name, self._usable, timeout, _ATTACH_POLL_S)
        except SegmentNotReady:
            raise TimeoutError(f"rank {self.tp_rank}: {self.shm_name} not created by rank 0 "
                               f"within {timeout:.1f} s: is rank 0 of this DP group running "
                               f"(with the same fastdeploy_sync version)?") from None

    def _usable(self, seg):
        # a board whose rank 0 is gone (killed with its group) is a leftover that the new
        # rank 0 is about to replace: wait for that one
        if seg.size == self._size and _HEADER.ready(seg.view) and seg.owner_alive():
            return None
        return "not ready"

    def _lock(self):
        """Take the board's semaphore, waiting at most 5 s in all (``sem_wait``: a
        handled signal neither ends nor stretches the wait)."""
        if not sem_wait(self._sem, _LOCK_TIMEOUT_S):
            raise TimeoutError(f"rank {self.tp_rank}: {self.sem_name} held for "
                               f"{_LOCK_TIMEOUT_S:g} s: a rank died inside get_tasks(); "
                               f"restart the worker group")

    def latch_unless_read(self, call, for_gen, decide):
        """Rank 0: run ``decide()`` (which latches decision ``call`` in the TaskClient and
        returns ``(count, first, last)``, or None when nothing is latched) unless some rank
        has already begun reading decision ``call``; record ``for_gen`` and the seqs in the
        call's slot. Returns ``decide()``'s result, or False when refused.

        A decision, once any rank may have read it, never changes: rank 0 may check for
        tasks again after the caller's barrier (FastDeploy logs ``num_tasks()`` there),
        and re-latching then would let a slow rank read a larger decision than a fast
        one. Readers seal the call under the same lock (``last_reader``) before they read,
        so either the latch is seen by every reader or it does not happen."""
        self._lock()
        try:
            v = self._view
            if v[_B_SEALED] >= call:
                return False
            result = decide()
            if result:
                s = _B_RING_BASE + _B_SLOT * (call % _B_RING)
                v[s] = call
                v[s + 1] = 0
                v[s + 2] = for_gen
                v[s + 3] = result[1]
                v[s + 4] = result[2]
                v[s + 5] = -1 if v[_B_CLEAR] else 0  # -1: the first read fixes it
            return result
        finally:
            self._sem.release()

    def last_reader(self, call, barriers):
        """A rank's ``call``-th ``get_tasks()``, made after this rank passed ``barriers``
        generations of the queue's barrier: ``EARLY`` when the call's decision is meant for
        a later generation (the read came before the step it is for: the caller takes
        nothing and changes nothing), else ``(last, drop)``: count this rank's read (which
        seals the call, see ``latch_unless_read``), ``last`` True on exactly one rank per
        call, the last to count it; ``drop``: how many of the call's batches to drop (a
        worker's ``clear_data()`` bound, fixed by the first read). Blocks only on a peer
        inside the same few stores.

        Also checks the caller's contract: when a rank makes call j, rank 0's last check
        announced a call >= j, and every other rank has made call j-1 or j. A rank that
        calls more often than its peers raises ``ProtocolError`` on its next call, instead
        of the group drifting a call apart (and later hanging in the caller's barrier). A
        rank that calls less often is caught only when the call counts show it (a peer
        raises)."""
        s = _B_RING_BASE + _B_SLOT * (call % _B_RING)
        self._lock()
        try:
            v = self._view
            if barriers and v[s] == call and v[s + 2] > barriers:
                return EARLY
            v[_B_CALLS_BASE + self.tp_rank] = call
            calls = v[_B_CALLS_BASE:_B_CALLS_BASE + self.tp_size].tolist()
            if call > v[_B_NEXT_CALL] and v[_B_NEXT_CALL] == 0:
                # rank 0 never checked as a TP rank: most likely its client's role was
                # undecided (its exist_tasks() read False) and it joined in get_tasks()
                raise ProtocolError(
                    f"TP rank {self.tp_rank} of {self.shm_name}: get_tasks() call {call}, but "
                    f"rank 0 has never checked for tasks as a TP rank (the ranks have made "
                    f"{calls} calls). If rank 0 is an EngineWorkerQueue built without "
                    f"role='worker', its role was undecided and its exist_tasks() read False "
                    f"(rank 0 says so): build it with role='worker' or set "
                    f"FD_SYNC_QUEUE_ROLE=worker. Otherwise TP rank 0 must call "
                    f"exist_tasks() or num_tasks() every step, before the TP barrier")
            if call > v[_B_NEXT_CALL]:
                raise ProtocolError(
                    f"TP rank {self.tp_rank} of {self.shm_name}: get_tasks() call {call}, but "
                    f"rank 0 has not checked for tasks for it (its last exist_tasks() or "
                    f"num_tasks() was for call {v[_B_NEXT_CALL]}; the ranks have made {calls} "
                    f"calls). Fix the worker loop: TP rank 0 must call exist_tasks() or "
                    f"num_tasks() (on this queue) every step, before the TP barrier, and set "
                    f"the signal the other ranks read from that result only")
            if max(calls) > call or min(calls) < call - 1:
                raise ProtocolError(
                    f"TP rank {self.tp_rank} of {self.shm_name}: get_tasks() call {call} while "
                    f"the ranks have made {calls} calls: every rank must call get_tasks() at "
                    f"the same steps. Fix the worker loop: every rank calls it iff the signal "
                    f"TP rank 0 set before the TP barrier is set, at most once per step")
            if v[_B_SEALED] < call:
                v[_B_SEALED] = call
            if v[s] != call:  # nothing was latched for this call
                v[s] = call
                v[s + 1] = v[s + 2] = v[s + 5] = 0
            elif v[s + 5] < 0:  # the first read: fix what a worker's clear_data() drops
                v[s + 5] = max(0, min(v[_B_CLEAR], v[s + 4]) - v[s + 3])
            readers = v[s + 1] + 1
            v[s + 1] = readers
            return readers == self.tp_size, v[s + 5]
        finally:
            self._sem.release()

    def request_clear(self, upto):
        """A worker's ``clear_data()``: from the next call nobody has read on, batches with
        seq <= ``upto`` are dropped by every rank (``CLEAR`` only grows)."""
        self._lock()
        try:
            v = self._view
            if v[_B_CLEAR] < upto:
                v[_B_CLEAR] = upto
            unread = v[_B_SEALED] + 1  # the one call rank 0 may have latched and nobody read
            s = _B_RING_BASE + _B_SLOT * (unread % _B_RING)
            if v[s] == unread:
                v[s + 5] = -1
        finally:
            self._sem.release()

    def announce(self, next_call):
        """Rank 0, in its check: the call number its next ``get_tasks()`` will have, i.e.
        the highest any rank may make this step (one store)."""
        self._view[_B_NEXT_CALL] = next_call

    def get_flag(self):
        return self._view[_B_FLAG]

    def set_flag(self, value):
        self._view[_B_FLAG] = value

    def set_closed(self, call, for_gen):
        """Rank 0, in its check before the step's barrier: the engine closed the queue;
        every rank raises from its ``call``-th ``get_tasks()`` (or the ``read_finish_flag``
        read before it) made after ``for_gen`` passes of the queue's barrier. Written
        before the step's barrier; under the board's lock, so that a reader that sees the
        call word and then takes the lock sees both words (``closed``)."""
        self._lock()
        try:
            v = self._view
            v[_B_CLOSED_GEN] = for_gen
            v[_B_CLOSED_CALL] = call
        finally:
            self._sem.release()

    def closed(self, call, barriers):
        """Whether a rank about to make its ``call``-th ``get_tasks()``, having passed
        ``barriers`` generations of the queue's barrier, must raise ``EngineClosedError``
        (see ``set_closed``; a read that comes before the step it is for, as in
        ``last_reader``, does not)."""
        v = self._view
        if not v[_B_CLOSED_CALL]:
            return False  # one read per call until the engine closes
        self._lock()  # acquire: see set_closed
        try:
            at, gen = v[_B_CLOSED_CALL], v[_B_CLOSED_GEN]
        finally:
            self._sem.release()
        return call >= at and not (barriers and barriers < gen)

    def close(self):
        self._view = None
        self._finalizer()


def _release_board(seg, sem, owner, shm_name, sem_name):
    try:
        sem.close()
    except Exception:  # already closed
        pass
    seg.close()
    if owner:
        unlink_segment(shm_name)
        unlink_semaphore(sem_name)


class PaddleBoard:
    """A TP group across nodes: nothing is shared but the collective in
    ``read_finish_flag.get()``, which decides each step for every rank (see
    ``WorkerSide.flag_get``). ``all_client_read`` is True on exactly one rank per call, TP
    rank ``tp_size - 1``: all FastDeploy's loop does with it is reset the flag, which here
    is derived afresh at every ``get()`` (knowing the last reader would cost a second
    collective per step). A worker's ``clear_data()`` drops nothing here (the ranks could
    only agree on it through another collective)."""

    def __init__(self, tp_size, tp_rank):
        self._last = tp_rank == tp_size - 1

    def last_reader(self, call, barriers):
        return self._last, 0

    def latch_unless_read(self, call, for_gen, decide):
        return decide()  # the next collective decides: no reader can see a change

    def request_clear(self, upto):
        return False

    def announce(self, next_call):
        pass

    def set_flag(self, value):
        pass

    def set_closed(self, call, for_gen):
        pass  # every rank raises in the step's collective (the client's own error)

    def closed(self, call, barriers):
        return False

    def close(self):
        pass


class SoloBoard:
    """TP=1: the only reader is always the last, and never early."""

    def __init__(self):
        self._flag = 0
        self._clear = 0
        self._latched = (0, 0, 0)  # (call, first, last) of the last latch
        self._closed = False

    def last_reader(self, call, barriers):
        latched_call, first, last = self._latched
        drop = max(0, min(self._clear, last) - first) if latched_call == call else 0
        return True, drop

    def latch_unless_read(self, call, for_gen, decide):
        result = decide()
        if result:
            self._latched = (call, result[1], result[2])
        return result

    def request_clear(self, upto):
        self._clear = max(self._clear, upto)

    def announce(self, next_call):
        pass

    def get_flag(self):
        return self._flag

    def set_flag(self, value):
        self._flag = value

    def set_closed(self, call, for_gen):
        self._closed = True

    def closed(self, call, barriers):
        return self._closed

    def close(self):
        pass
