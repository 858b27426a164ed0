"""Coordination of the TP ranks of one group on one node: shared-memory watermarks,
generation-indexed step decisions, an adaptive spin-then-block barrier, and rank 0's
blocking wait for work (``wait_received``).

Layout of the group's segment (int64 slots; each rank's block is one 64-byte cache line
so that a rank writing its own watermarks never invalidates another rank's line)::

    header      MAGIC, VERSION, TP_SIZE, OWNER_PID, READY, INCARNATION
    rank r      RECEIVED  highest seq the rank holds locally (contiguous from 1)
                CONSUMED  highest seq the rank has taken
                ARRIVED   the barrier generation the rank last arrived at
                SLEEPING  the generation the rank is blocked on in a semaphore, else 0
                PID
                FAULT     non-zero once the rank stopped at an engine-side error (its code),
                          so that a peer waiting for it raises the same error, not "exited"
                WAITING   rank 0 only: the seq it is blocked waiting for every rank to hold
                          (``wait_received``), else 0; a receiver that completes it posts
                          rank 0's semaphore
                ARRIVED_AT  CLOCK_MONOTONIC ns of the rank's last barrier arrival (written
                          before ARRIVED): how late a partner was, exactly, even for a rank
                          that was asleep when it came
    decisions   a ring of DECISION_RING entries (GEN, FROM, TO), written by rank 0 only
    engines     one slot per rank: the engine instance that welcomed it (0: none yet),
                written before its first RECEIVED; rank 0 latches a decision only when
                every rank's engine is its own (``engine_split``): seqs are an engine's,
                and a group whose ranks were welcomed by different engines (a restart
                that raced with the group's start, or ranks given different endpoints)
                would take different batches under the same seqs

The step protocol (the invariant: every rank takes the same batches at the same step):
  * rank 0's ``exist_tasks()`` reads every rank's RECEIVED; if the minimum is past what
    the group has taken, it writes the decision "take (FROM, TO]" into the ring entry of
    the *next* barrier generation, then arrives at that barrier.
  * when rank 0 holds a batch that a peer does not hold yet, its check first waits for
    that peer to hold it, or to arrive at the barrier without it (``wait_peers``): the
    peer is usually receiving it at that moment, and rank 0 would wait for it at the
    barrier anyway. Deciding before that wait cost the batch a whole step.
  * after the barrier of generation G, every rank reads the entry tagged G. An entry
    tagged otherwise means "no decision this step". Indexing by generation is what makes
    a fast rank 0, already deciding for G+1, unable to change what a slow rank takes at G;
    the barrier bounds the skew to one generation, so a ring of 8 is plenty.

Memory ordering: rank 0 writes the decision before its ARRIVED slot, and readers read
ARRIVED before the decision; x86-64 keeps store->store and load->load order, so a rank
that saw the arrival sees the decision. The only store->load (Dekker) patterns, "I sleep"
vs "you arrived" and "I wait for seq N" vs "I received N", have a bounded fallback
(semaphore waits time out and re-check), so a theoretically lost wake-up costs at most
one fallback interval, never a hang.

The barrier knows the loop's state. Spinning releases ranks that arrive together in
about a µs but burns the CPU for as long as the partner is late; blocking costs no CPU
but ~30 µs of wake-up. Which one pays depends on what the loop does between barriers, so
the barrier asks the loop's recent history, not the queue:

  * is the loop busy? The share of the wall time since this rank last asked that its
    thread wanted a CPU: ran on one (``time.thread_time_ns``, ~0.5 µs), or, when that
    share is between 0.1 and 0.5, also waited in the run queue for one (a thread preempted
    on a loaded machine is still busy; one that sleeps is not: its ``/proc/.../schedstat``,
    ~0.8 µs more). A decode loop computes between barriers (near 1); an idle loop sleeps
    (FastDeploy's 1 ms loop: near 0.01, one short call per millisecond). Busy
    means at least ``_BUSY_SHARE``. Whether a batch is in flight says nothing about it: a
    decode loop runs for many steps without a new batch. It is asked only on the waiting
    path, after a first 2 µs of spinning (ranks that arrive together never pay it), at
    most once per ``_BUSY_SPAN_NS`` while busy and once per ``_REASK_NS`` (10 ms) while
    idle (each question is a tax on an idle iteration; a loop that becomes busy is
    recognised within 10 ms).
  * how late were the partners? Each rank remembers how late they were at its last two
    barriers (from their ARRIVED_AT, exact even when it slept; 0 when it came last).

A busy loop spins the full window, then blocks: a barrier that blocks wakes its rank tens
of µs after the last arrival, and in a busy loop that skew is carried into the next
barrier, where it costs again (blocking at once after late partners, tried first, made a
late rank's next wait about twice as long). While it waits it also lets the worker
receive what its prefetch thread has not (``on_wait``). An idle loop spins only
``_CHEAP_SPIN_US`` (less CPU than a sleep and a wake-up), and only when the partners came
within that at both of the last two barriers; otherwise it blocks at once, without
spinning or asking: there the skew meets a 1 ms sleep, not a waiting partner.

The creator (rank 0) owns the names: it creates the segment and one POSIX semaphore per
rank, unlinks them at close, and reclaims leftovers of a crashed run on start. Who is alive
is proven by locks, not pids (``shm``): rank 0 holds the segment's owner lock, and every
rank holds the lock of its own rank byte (``rank_lock``) for its life, so a reused pid or a
rank in another pid namespace is never taken for alive or dead by mistake.

Lives of one process. A process may close its client and build a new one (a server that
recovers in-process). The new object must never inherit the old one's generation counters
or decisions: a rank re-attached to its old segment at generation 0 would pass barriers
alone (its peers' arrival marks are ahead) and replay old decisions. So a process never
joins the same group incarnation twice (``_JOINED``): a new rank object waits for rank 0 to
create a new incarnation. A rank that closes marks its slot ``FAULT_LEFT``, so a peer
waiting for it raises at once instead of waiting for its timeout.

A step stays all-or-none when a rank stops. A rank that learns of a failure while it waits
in a barrier it has already arrived at does not leave (a peer arriving later would pass
and take the step alone): it publishes its fault and keeps waiting, until either every rank
arrived (the step completes on every rank; the failure is raised by the next step call) or
a rank that has not arrived published a fault (it will never arrive: nobody passes, and
this rank raises). Only ``close()`` from another thread makes a waiter leave at once.

Signals. Every semaphore wait here goes through ``shm.sem_wait``: a signal that a
handler takes (a Python handler, ``faulthandler.register``, a profiler's) resumes the wait
with the time that remains, and what a Python handler raises (``SystemExit`` from
``install_signal_cleanup``, ``KeyboardInterrupt``) propagates from the wait, at most 0.1 s
late.

Closing from another thread. ``close()`` may run while another thread waits in
``barrier()`` or ``wait_received()``: it marks the group closed, posts the semaphores, and
frees them only once every waiter has left (they raise ``ClosedError``); a waiter that does
not leave within the bound keeps them (leaked, never freed under it). The mapping is never
unmapped under a reader: it is unmapped when the object is garbage.
"""

import logging
import os
import secrets
import threading
import time
import weakref

import posix_ipc

from . import envs
from .errors import BarrierTimeoutError, ClosedError, GroupInUseError, GroupLostError
from .shm import (OWNER_LOCK, Segment, SegmentInUse, create_fresh_semaphore, create_reclaiming,
                  open_semaphore, sem_wait, unlink_semaphore)

__all__ = ["ShmTPGroup", "SoloGroup", "group_shm_name", "rank_lock", "remove_if_stale",
           "FAULT_LEFT"]

log = logging.getLogger(__name__)


MAGIC = 0x46445359_4E430002  # "FDSYNC", layout 2 (engines area)
VERSION = 2
H_MAGIC, H_VERSION, H_TP_SIZE, H_OWNER_PID, H_READY, H_INCARNATION = range(6)
RANK_BASE = 8
RANK_STRIDE = 8  # 64 bytes: one cache line per rank
R_RECEIVED, R_CONSUMED, R_ARRIVED, R_SLEEPING, R_PID, R_FAULT, R_WAITING, R_ARRIVED_AT = range(8)
DECISION_RING = 8
D_GEN, D_FROM, D_TO = range(3)
D_STRIDE = 4
# FAULT of a rank that closed its client (other codes are the worker's, all > 0 and < 64).
FAULT_LEFT = 64
# How long close() lets a waiter in another thread leave before keeping (leaking) the
# semaphores instead of freeing them under it.
_CLOSE_WAIT_S = 1.0

# (segment name, incarnation, rank) of every group this process has served: a new object
# never joins one of them again (see the module docstring). Guarded by _JOINED_LOCK.
_JOINED = set()
_JOINED_LOCK = threading.Lock()


def rank_lock(rank: int) -> int:
    """The byte of the group's segment whose lock rank ``rank`` holds while it lives."""
    return OWNER_LOCK + 1 + rank

# A blocked waiter re-checks this soon even without a post: the fallback for a lost
# wake-up (see module docstring). Each re-check that finds nothing doubles the interval up
# to _IDLE_FALLBACK_WAIT_S, so that a rank idle for seconds wakes ~10 times a second, not
# 100; a dead peer is still noticed within ~0.2 s.
_FALLBACK_WAIT_S = 0.01
_IDLE_FALLBACK_WAIT_S = 0.1
# wait_peers re-checks this often without a post (a lost wake-up costs at most this)
_PEER_FALLBACK_WAIT_S = 0.0005
_ATTACH_POLL_S = 0.01
# An idle loop's barrier spins this many µs at most, and only when its partners came within
# that (a sleep and a wake-up cost the waiter more CPU), so that ranks arriving together
# are released in a µs, not ~30 µs.
_CHEAP_SPIN_US = 8.0
# Every wait first spins this long before asking whether the loop is busy (which costs a
# syscall, ~0.5 µs): partners arriving together never pay for the question.
_FIRST_SPIN_S = 2e-6
# The loop is busy when its thread was on a CPU at least this share of the time since the
# last question; spans shorter than _BUSY_SPAN_NS keep the last answer (a tight loop).
_BUSY_SHARE = 0.5
_BUSY_SPAN_NS = 200_000
# Below this share the thread slept (an idle 1 ms loop's is near 0.01): the run-queue wait,
# which only a loaded machine makes large, is not worth reading.
_SLEPT_SHARE = 0.1
# An idle loop asks whether it is still idle at most this often (and one whose partners
# came later than the cheap spin blocks at once, without spinning, until then), so that a
# loop that became busy is recognised within this long.
_REASK_NS = 10_000_000


class _RunQueueWait:
    """Nanoseconds the calling thread has waited on a run queue (runnable, but another
    thread had the CPU) since it started, from its ``/proc/.../schedstat``: one descriptor,
    kept open and re-read (~0.8 µs), reopened if another thread asks; 0 where schedstat is
    missing. (Its first field, the CPU time, lags by up to a scheduler tick: the CPU time
    comes from ``time.thread_time_ns``, which is exact.)"""

    def __init__(self):
        self._tid = None
        self._fd = -1

    def read(self) -> int:
        tid = threading.get_native_id()
        if tid != self._tid:
            self.close()
            self._tid = tid
            try:
                self._fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._fd = -1
        if self._fd >= 0:
            try:
                # "<ns on a CPU> <ns waiting on a run queue> <timeslices>"
                return int(os.pread(self._fd, 96, 0).split()[1])
            except (OSError, ValueError, IndexError):
                pass
        return 0

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def new_incarnation() -> int:
    """A fresh group incarnation id: random, non-zero, 63 bits. Rank 0 picks it when the
    group is created and every rank of the group reports it to the engine, which tells a
    restarted group from the one it replaces by it."""
    return secrets.randbits(63) | 1


def group_shm_name(name: str, dp_id: int) -> str:
    return f"/fdsync.{name}.dp{dp_id}"


def _layout_slots(tp_size: int) -> int:
    return RANK_BASE + tp_size * RANK_STRIDE + DECISION_RING * D_STRIDE + tp_size


def remove_if_stale(name: str, dp_id: int) -> bool:
    """Remove the group segment of (name, dp_id) and its semaphores if its rank 0 is gone
    (nobody holds the owner lock); True if removed. A live group is never touched. Never
    blocks. For cleaners (a crashed run's names are otherwise reclaimed by the next rank 0)."""
    shm_name = group_shm_name(name, dp_id)
    try:
        seg = Segment.attach(shm_name)
    except FileNotFoundError:
        return False
    try:
        return _reclaim_group(seg)
    finally:
        seg.close()


def _reclaim_group(seg: Segment) -> bool:
    """Unlink ``seg``'s semaphores and name if nobody holds its owner lock (taking it first,
    so that no new rank 0 can appear meanwhile). The tp_size is read from the segment."""
    if not seg.try_lock(OWNER_LOCK):
        return False
    try:
        v = seg.view
        tp_size = v[H_TP_SIZE] if seg.size >= RANK_BASE * 8 and v[H_MAGIC] == MAGIC else 0
        if seg.unlink_if_mine():  # the name first: no new rank 0 can reuse the sem names
            for r in range(max(0, min(tp_size, 4096))):
                unlink_semaphore(f"{seg.name}.w{r}")
            return True
        return False
    finally:
        seg.unlock(OWNER_LOCK)


class SoloGroup:
    """The degenerate group of TP=1: no shared memory, no barrier.

    FastDeploy does not call the barrier at TP=1, so the decision is not indexed by
    generation here: ``get_tasks()`` takes whatever the last ``exist_tasks()`` latched.
    ``wait_received`` blocks on a condition the receiving thread notifies.
    """

    tp_size = 1
    gen = 0

    def __init__(self):
        self.incarnation = new_incarnation()
        self._received = 0
        self._consumed = 0
        self._decision = None
        self._changed = threading.Condition(threading.Lock())
        self._wakes = 0  # wake() calls: a waiter returns to its caller's check on a change

    def publish_received(self, seq):
        with self._changed:
            self._received = seq
            self._changed.notify_all()

    def min_received(self):
        return self._received

    def peers_ahead(self, seq):
        return True  # no peers to compare with: the caller asks its socket

    def wait_received(self, seq, timeout, check=None):
        """Block until this rank holds ``seq`` (True) or ``timeout`` seconds pass (False).
        GIL released while blocked. ``check`` runs after every ``wake()``; whatever it
        raises ends the wait."""
        deadline = time.monotonic() + timeout
        while True:
            with self._changed:
                wakes = self._wakes
                while self._received < seq and self._wakes == wakes:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    self._changed.wait(remaining)
                if self._received >= seq:
                    return True
            if check is not None:
                check()

    def latch(self, gen, from_seq, to_seq):
        self._decision = (from_seq, to_seq)

    def publish_engine(self, engine):
        pass

    def all_welcomed(self, engine):
        return True

    def engine_split(self, engine):
        return None

    def decision(self, gen):
        return self._decision

    def publish_consumed(self, seq):
        self._consumed = seq

    def all_consumed(self, seq):
        return self._consumed >= seq

    def barrier(self, timeout=None, service=None, check=None, on_wait=None):
        pass

    def publish_fault(self, code):
        pass

    def peer_fault(self):
        return None

    def missing_fault(self):
        return None

    def wake(self):
        """Wake a ``wait_received`` in progress (e.g. the prefetch thread just failed)."""
        with self._changed:
            self._wakes += 1
            self._changed.notify_all()

    def close(self, timeout=None) -> bool:
        """Wake a ``wait_received`` of another thread (its check raises the client's
        ``ClosedError``). Nothing to free."""
        self.wake()
        return True


class ShmTPGroup:
    """One rank's handle on the node-local coordination of a TP group.

    Construction: rank 0 creates the segment and semaphores (reclaiming a crashed run's
    leftovers, raising ``GroupInUseError`` if a live rank 0 of the same name exists).
    Other ranks block until rank 0 has published the segment, up to ``attach_timeout``
    seconds (``FD_SYNC_ATTACH_TIMEOUT``), then raise ``TimeoutError``.

    ``spin_us``: the longest ``barrier()`` spins before blocking (None:
    ``FD_SYNC_BARRIER_SPIN_US``); it spins that long only when it pays (see the module
    docstring), else blocks at once.

    Not thread-safe: use one instance from the event loop thread; only
    ``publish_received`` and ``wake`` may be called from the prefetch thread
    (``publish_received`` writes one slot and may post rank 0's semaphore).
    """

    def __init__(self, name: str, dp_id: int, tp_size: int, tp_rank: int,
                 attach_timeout: float = None, spin_us: float = None):
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.gen = 0  # barrier generations this rank has passed
        self.shm_name = group_shm_name(name, dp_id)
        self._sem_names = [f"{self.shm_name}.w{r}" for r in range(tp_size)]
        self._spin_s = (envs.barrier_spin_us() if spin_us is None else spin_us) * 1e-6
        self._size = _layout_slots(tp_size) * 8
        if attach_timeout is None:
            attach_timeout = envs.attach_timeout_s()
        if tp_rank == 0:
            self._seg = self._create()
            self._sems = [open_semaphore(n) for n in self._sem_names]
        else:
            self._seg, self._sems = self._attach(attach_timeout)
        v = self._view = self._seg.view
        # Same on every rank: rank 0 wrote it before READY.
        self.incarnation = v[H_INCARNATION]
        self._my = RANK_BASE + tp_rank * RANK_STRIDE
        self._ranks = [RANK_BASE + r * RANK_STRIDE for r in range(tp_size)]
        self._received_slots = [b + R_RECEIVED for b in self._ranks]
        self._consumed_slots = [b + R_CONSUMED for b in self._ranks]
        self._arrived_slots = [b + R_ARRIVED for b in self._ranks]
        self._received_arrived = [(b + R_RECEIVED, b + R_ARRIVED) for b in self._ranks[1:]]
        self._arrived_at_slots = [b + R_ARRIVED_AT for b in self._ranks]
        # The barrier's fast path reads only these (every µs there is paid every step):
        # the partners' ARRIVED slots, and (slot, rank) of every rank's SLEEPING.
        self._partner_arrived = [s for r, s in enumerate(self._arrived_slots) if r != tp_rank]
        self._my_arrived, self._my_arrived_at = self._my + R_ARRIVED, self._my + R_ARRIVED_AT
        self._sleeping_slots = [(b + R_SLEEPING, r) for r, b in enumerate(self._ranks)]
        self._waiting_slot = RANK_BASE + R_WAITING  # rank 0's
        # How late (ns) the partners were at the last two barriers (0: this rank came last).
        self._late_prev = self._late_last = 0
        # Whether the loop is busy (see the module docstring): the last answer, and the
        # thread CPU and monotonic clocks when it was given.
        self._busy = False
        self._runq = _RunQueueWait()
        self._cpu_at = time.thread_time_ns()
        self._runq_at = self._runq.read()
        self._wall_at = time.monotonic_ns()
        self._spin_ns = int(self._spin_s * 1e9)
        self._cheap_ns = int(min(_CHEAP_SPIN_US * 1e3, self._spin_ns))
        self._decision_base = RANK_BASE + tp_size * RANK_STRIDE
        self._engine_slots = [self._decision_base + DECISION_RING * D_STRIDE + r
                              for r in range(tp_size)]
        self._waiting_gen = 0  # the generation a barrier wait of this rank is for, else 0
        self._closed = False
        # Threads inside a semaphore wait of this object, and whether close() began; both
        # under _gate (taken only around blocking waits and semaphore posts from other
        # threads, never on the spinning path).
        self._gate = threading.Condition(threading.Lock())
        self._blocked = 0
        self._closing = False
        with _JOINED_LOCK:
            _JOINED.add((self.shm_name, self.incarnation, tp_rank))
        # Process exit or garbage without close(): the names are still removed (rank 0), and
        # the mapping is unmapped once nothing can read it any more.
        self._res = _Resources(self._seg, self._sems, self.shm_name, self._sem_names)
        self._finalizer = weakref.finalize(self, self._res.release, tp_rank == 0)

    # -- creation / attachment ---------------------------------------------------------

    def _create(self) -> Segment:
        try:
            seg = create_reclaiming(self.shm_name, self._size, H_OWNER_PID)
        except SegmentInUse as exc:
            raise GroupInUseError(
                f"TP group {self.shm_name} is owned by live process {exc.owner} (its rank 0; "
                f"the pid as that process sees it): two groups cannot share a name and dp_id"
                if exc.owner else
                f"{self.shm_name}: another rank 0 created this group concurrently") from None
        try:
            for sem_name in self._sem_names:
                create_fresh_semaphore(sem_name)
            seg.try_lock(rank_lock(0))  # our own new file: nobody else can hold it
            v = seg.view
            v[H_MAGIC], v[H_VERSION], v[H_TP_SIZE] = MAGIC, VERSION, self.tp_size
            v[H_OWNER_PID] = os.getpid()
            v[H_INCARNATION] = new_incarnation()
            v[RANK_BASE + R_PID] = os.getpid()
            v[H_READY] = 1  # last: an attacher that sees READY sees everything above
        except BaseException:
            for sem_name in self._sem_names:
                unlink_semaphore(sem_name)
            seg.unlink_if_mine()
            seg.close()
            raise
        return seg

    @staticmethod
    def _header_bytes():
        return RANK_BASE * 8

    def _attach(self, timeout: float):
        """Attach rank 0's live segment, claim this rank's slot, open the semaphores; retry
        until ``timeout`` while there is no usable segment (none yet, a stale one, or one
        whose incarnation this process already served)."""
        deadline = time.monotonic() + timeout
        why = "it does not exist yet"
        while True:
            try:
                seg = Segment.attach(self.shm_name)
            except FileNotFoundError:
                seg = None
            if seg is not None:
                try:
                    why = self._usable(seg)
                    if why is None:
                        self._claim_rank(seg)
                        sems = [open_semaphore(n) for n in self._sem_names]
                        if self._still_named(seg):
                            return seg, sems
                        why = "rank 0 replaced it while this rank attached"
                        for sem in sems:
                            sem.close()
                except FileNotFoundError:  # semaphores gone: rank 0 is closing or replacing it
                    why = "rank 0 is replacing it"
                except BaseException:
                    seg.close()
                    raise
                seg.close()
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"rank {self.tp_rank}: TP group {self.shm_name} not ready after {timeout:.1f}s "
                    f"({why}); is rank 0 of this group running? (FD_SYNC_ATTACH_TIMEOUT)")
            time.sleep(_ATTACH_POLL_S)

    def _still_named(self, seg: Segment) -> bool:
        try:
            st = os.stat(f"/dev/shm{self.shm_name}")
        except FileNotFoundError:
            return False
        mine = os.fstat(seg._fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def _claim_rank(self, seg: Segment) -> None:
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

    def _usable(self, seg: Segment):
        """None if ``seg`` is a live, ready segment of our shape that this process has not
        served before, else why not."""
        if seg.size < self._header_bytes():
            return "rank 0 is creating it"
        v = seg.view
        if v[H_READY] != 1 or v[H_MAGIC] != MAGIC:
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

    # -- watermarks ----------------------------------------------------------------------

    def publish_received(self, seq: int) -> None:
        """This rank holds every seq up to ``seq``. If rank 0 waits in ``wait_received``
        for a seq every rank now holds, post its semaphore (one read when it does not)."""
        v = self._view
        v[self._my + R_RECEIVED] = seq
        # store RECEIVED, then load WAITING: the Dekker pair of wait_received and wait_peers
        # (bounded fallback); wait_peers announces its seq negated
        want = abs(v[self._waiting_slot])
        if want and want <= seq and self.min_received() >= want:
            self._post(0)

    def min_received(self) -> int:
        v = self._view
        return min([v[s] for s in self._received_slots])

    def peers_ahead(self, seq: int) -> bool:
        """True if another rank holds more than ``seq`` (this rank's own receipt lags: its
        receiver has not handled a batch that reached the node). ``tp_size`` reads."""
        v = self._view
        for s in self._received_slots:
            if v[s] > seq:
                return True
        return False

    def wait_received(self, seq: int, timeout: float, check=None) -> bool:
        """Rank 0: block until every rank holds ``seq`` (``min_received() >= seq``: True),
        or ``timeout`` seconds pass (False), or a peer rank has published a fault (False
        at once: the caller's next ``barrier()`` raises it).

        Blocks on rank 0's semaphore with the GIL released (no CPU); the receiver that
        completes ``seq`` posts it (``publish_received``), so the wake-up is one semaphore
        post (~30 µs). Without a post it re-checks after 10 ms, then 20, 40, 80 and every
        100 ms (the bounded fallback of the module docstring; an idle wait costs ~nothing).
        ``check`` runs after every wake-up, posted or not (``wake()`` posts the same
        semaphore); whatever it raises ends the wait."""
        if self.tp_rank != 0:
            raise RuntimeError(f"rank {self.tp_rank} of {self.shm_name}: wait_received() is "
                               f"rank 0's (receivers post rank 0's semaphore only)")
        if self.min_received() >= seq:
            return True
        deadline = time.monotonic() + timeout
        sem = self._sems[0]
        v = self._view
        wait_s = _FALLBACK_WAIT_S
        self._enter_blocking()
        try:
            v[self._waiting_slot] = seq
            while True:
                if self.min_received() >= seq:  # after announcing: see module docstring
                    return True
                if self.peer_fault() is not None:
                    return False
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                if not sem_wait(sem, min(remaining, wait_s)):
                    wait_s = min(wait_s * 2, _IDLE_FALLBACK_WAIT_S)  # idle: re-check less often
                if self._closing:
                    raise self._closed_error()
                if check is not None:
                    check()
        finally:
            self._end_rank0_wait(sem)

    def wait_peers(self, seq: int, timeout: float) -> int:
        """Rank 0, in its check before the barrier of generation ``gen + 1``, when it holds
        up to ``seq`` and a peer does not yet: wait until every rank holds ``seq``, or every
        rank that lacks it has arrived at that barrier, or ``timeout`` seconds pass; return
        ``min_received()``.

        Why: a peer that lacks a batch rank 0 holds is usually receiving it right now (its
        prefetch thread, or its event loop before it arrives: a step that holds the GIL
        lets the peer's thread run only when that step blocks). Rank 0's check is quick and
        came first, so it latched nothing and the batch waited a whole step more, although
        rank 0 then waited for that peer at the barrier anyway. Waiting for the peer here
        moves that wait in front of the decision: the step takes the batch, and rank 0
        passes the barrier no later than it would have (the peer arrives when it has
        arrived). A rank that arrived without ``seq`` ends the wait at once.

        Spins as the barrier would for this loop (busy: up to the window), then blocks on
        rank 0's semaphore (GIL released), posted by the receiver that completes ``seq`` and
        by the arrival of a rank that lacks it; without a post it re-checks every 0.5 ms.
        Raises nothing of its own (only what a signal handler raises during the wait:
        ``shm.sem_wait``); returns at once when the group is closing or a peer published a
        fault (the barrier then says why)."""
        gen = self.gen + 1
        if self._peers_settled(seq, gen):
            return self.min_received()
        start = time.perf_counter()
        end = start + min(timeout, self._spin_budget_s(time.monotonic_ns()))
        while time.perf_counter() < end:
            if self._peers_settled(seq, gen):
                return self.min_received()
        deadline = start + timeout
        sem = self._sems[0]
        v = self._view
        try:
            self._enter_blocking()
        except ClosedError:
            return self.min_received()
        try:
            v[self._waiting_slot] = -seq
            while not self._closing and self.peer_fault() is None:
                if self._peers_settled(seq, gen):  # after announcing: see module docstring
                    break
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                sem_wait(sem, min(remaining, _PEER_FALLBACK_WAIT_S))
        finally:
            self._end_rank0_wait(sem)
        return self.min_received()

    def _end_rank0_wait(self, sem) -> None:
        """End a ``wait_received`` or ``wait_peers``: withdraw the WAITING announcement and
        drop every post it drew. Several receivers (and arrivals) may have posted for the
        same wait: leave no stale count behind for the next wait or barrier (a stale post
        only costs a re-check)."""
        self._view[self._waiting_slot] = 0
        while sem_wait(sem, 0):
            pass
        self._leave_blocking()

    def _peers_settled(self, seq: int, gen: int) -> bool:
        """Every rank holds ``seq`` or has arrived at barrier generation ``gen``."""
        v = self._view
        for received, arrived in self._received_arrived:
            if v[received] < seq and v[arrived] < gen:
                return False
        return True

    def publish_consumed(self, seq: int) -> None:
        self._view[self._my + R_CONSUMED] = seq

    def all_consumed(self, seq: int) -> bool:
        v = self._view
        for s in self._consumed_slots:
            if v[s] < seq:
                return False
        return True

    def publish_fault(self, code: int) -> None:
        """This rank stopped at an error ``code`` (see ``worker``; the first code stays);
        peers blocked in the barrier or in ``wait_received`` wake and see it."""
        v = self._view
        if not v[self._my + R_FAULT]:
            v[self._my + R_FAULT] = code
        for r in range(self.tp_size):
            self._post(r)

    def peer_fault(self):
        """``(rank, code)`` of the first other rank that published a fault, or None."""
        v = self._view
        for r, base in enumerate(self._ranks):
            if r != self.tp_rank and v[base + R_FAULT]:
                return r, v[base + R_FAULT]
        return None

    def missing_fault(self):
        """During a barrier wait: ``(rank, code)`` of the first rank that has not arrived
        at the generation being waited for and published a fault, i.e. will never arrive
        (a faulted rank arrives nowhere again); else None. Outside a wait: ``peer_fault()``."""
        gen = self._waiting_gen
        if not gen:
            return self.peer_fault()
        v = self._view
        for r, base in enumerate(self._ranks):
            if r != self.tp_rank and v[base + R_FAULT] and v[base + R_ARRIVED] < gen:
                return r, v[base + R_FAULT]
        return None

    def received(self):
        """Every rank's RECEIVED, for error messages and stats."""
        return [self._view[s] for s in self._received_slots]

    # -- decisions -----------------------------------------------------------------------

    def publish_engine(self, engine: int) -> None:
        """This rank was welcomed by engine instance ``engine`` (before it publishes any
        RECEIVED: a rank that holds a batch has its engine written)."""
        self._view[self._engine_slots[self.tp_rank]] = engine

    def engine_split(self, engine: int):
        """Rank 0, before latching: ``[(rank, its engine), ...]`` for the ranks welcomed by
        another engine instance than ``engine`` (rank 0's), or None when every rank that
        was welcomed at all has ``engine``. Reads ``tp_size`` slots."""
        v = self._view
        split = [(r, v[s]) for r, s in enumerate(self._engine_slots) if v[s] and v[s] != engine]
        return split or None

    def all_welcomed(self, engine: int) -> bool:
        """True once every rank was welcomed by engine instance ``engine`` (a rank
        publishes its engine after it attached the worker group's ring: rank 0 latches a
        batch it read from the ring only then). Reads ``tp_size`` slots."""
        v = self._view
        return all(v[s] == engine for s in self._engine_slots)

    def latch(self, gen: int, from_seq: int, to_seq: int) -> None:
        """Rank 0: the barrier of generation ``gen`` releases a step that takes (from, to]."""
        base = self._decision_base + (gen % DECISION_RING) * D_STRIDE
        v = self._view
        v[base + D_FROM] = from_seq
        v[base + D_TO] = to_seq
        v[base + D_GEN] = gen

    def decision(self, gen: int):
        """(from, to) latched for generation ``gen``, or None if rank 0 latched nothing."""
        base = self._decision_base + (gen % DECISION_RING) * D_STRIDE
        v = self._view
        if v[base + D_GEN] != gen:
            return None
        return v[base + D_FROM], v[base + D_TO]

    # -- barrier -------------------------------------------------------------------------

    def _all_arrived(self, gen: int) -> bool:
        v = self._view
        for s in self._arrived_slots:
            if v[s] < gen:
                return False
        return True

    def wake(self) -> None:
        """Wake this rank's barrier wait or ``wait_received`` early (e.g. its prefetch
        thread just failed). Thread-safe; does nothing once the group is closed."""
        self._post(self.tp_rank)

    def _post(self, rank: int) -> None:
        """Post rank ``rank``'s semaphore, unless close() has begun (it may be freeing
        them). Thread-safe."""
        with self._gate:
            if not self._closing:
                self._sems[rank].release()

    def _enter_blocking(self) -> None:
        """A thread is about to wait on a semaphore: close() must not free it meanwhile."""
        with self._gate:
            if self._closing:
                raise self._closed_error()
            self._blocked += 1

    def _leave_blocking(self) -> None:
        with self._gate:
            self._blocked -= 1
            if self._closing:
                self._gate.notify_all()

    def _closed_error(self) -> ClosedError:
        return ClosedError(f"rank {self.tp_rank} of TP group {self.shm_name} was closed "
                           f"while this thread waited")

    def barrier(self, timeout: float = None, service=None, check=None, on_wait=None) -> None:
        """Block until every rank of the group has called ``barrier()`` for this generation.

        Waits by spinning on shared memory (sub-µs release when ranks arrive together),
        then blocking on this rank's semaphore (GIL released, no CPU; ~30 µs wake-up when
        the last rank arrives). How long it spins depends on the loop's recent history:
        up to ``spin_us`` while the loop is busy and the partners came within that at the
        last two barriers; ``_CHEAP_SPIN_US`` at most while it is idle; not at all after
        partners came later (see the module docstring).

        ``timeout`` (seconds, None = forever): raises ``BarrierTimeoutError`` naming the
        ranks that did not arrive. It is raised early if one of them has exited. After a
        timeout, calling ``barrier()`` again resumes the same generation.

        ``service``: a callable run while blocked, at least every 0.5 ms (sync mode uses it
        to keep receiving from the engine while it waits).

        ``on_wait``: a callable run once when this rank has to wait (its partners did not
        arrive within the first 2 µs), before it spins on: work the waiting time can absorb
        (async mode receives what its prefetch thread has not). It must not raise.

        ``check``: a callable run after every wake-up while blocked; whatever it raises ends
        the wait. The caller must not make it raise for a failure of its own once it has
        arrived (see the module docstring: publish a fault and keep waiting); the worker
        raises ``ClosedError`` and the failures of ranks that will never arrive
        (``missing_fault``) this way.

        Raises ``ClosedError`` if ``close()`` runs meanwhile (from another thread).
        """
        gen = self.gen + 1
        v = self._view
        arrived_at = time.monotonic_ns()
        v[self._my_arrived_at] = arrived_at  # before ARRIVED: whoever sees one sees both
        v[self._my_arrived] = gen
        if v[self._waiting_slot] < 0:  # rank 0 waits for this rank in its check (wait_peers)
            self._post(0)
        late = 0  # last to arrive: nobody was late
        for s in self._partner_arrived:
            if v[s] < gen:
                late = self._wait(gen, timeout, service, check, arrived_at, on_wait)
                break
        self._late_prev, self._late_last = self._late_last, late
        for slot, r in self._sleeping_slots:  # wake the ranks asleep in this generation
            if v[slot] == gen:
                self._sems[r].release()
        self.gen = gen

    def _spin_budget_s(self, now_ns: int) -> float:
        """How long to spin before blocking (see the module docstring): the window while
        the loop is busy; up to ``_CHEAP_SPIN_US`` while it is idle, if the partners came
        within that at both of the last two barriers; else 0."""
        if self._loop_busy(now_ns):
            return self._spin_s
        return self._cheap_ns * 1e-9 if max(self._late_prev, self._late_last) <= self._cheap_ns \
            else 0.0

    def _loop_busy(self, now_ns: int) -> bool:
        """Did this rank's thread want a CPU at least ``_BUSY_SHARE`` of the time since the
        last answer? A busy loop asks at most once per ``_BUSY_SPAN_NS`` (it is waiting
        anyway), an idle one once per ``_REASK_NS``; in between the last answer stands."""
        span = now_ns - self._wall_at
        if span < (_BUSY_SPAN_NS if self._busy else _REASK_NS):
            return self._busy
        cpu = time.thread_time_ns()
        wanted = cpu - self._cpu_at
        if _SLEPT_SHARE * span <= wanted < _BUSY_SHARE * span:
            # short of CPU: on a loaded machine it may have been preempted, which is busy
            # (the run-queue clock is read only here: after a span that did not read it,
            # its delta would cover more than this span, so this span counts CPU alone)
            runq = self._runq.read()
            if self._runq_at is not None:
                wanted += runq - self._runq_at
            self._runq_at = runq
        else:
            self._runq_at = None
        self._busy = wanted >= _BUSY_SHARE * span
        self._cpu_at, self._wall_at = cpu, now_ns
        return self._busy

    def last_arrival_ns(self) -> int:
        """CLOCK_MONOTONIC ns at which the last rank arrived at the barrier this rank last
        passed: the moment that barrier completed, the same on every rank. Valid until a
        partner arrives at the next generation (it then overwrites its time). Never
        blocks."""
        v = self._view
        return max(int(v[s]) for s in self._arrived_at_slots)

    def _partner_lateness(self, gen, arrived_at) -> int:
        """ns between this rank's arrival at ``gen`` and the last partner's."""
        v = self._view
        last = arrived_at
        for r, s in enumerate(self._arrived_at_slots):
            # a partner already at the next barrier has overwritten its time: skip it
            if v[self._arrived_slots[r]] == gen and v[s] > last:
                last = int(v[s])
        return last - arrived_at

    def _wait(self, gen, timeout, service, check, arrived_at, on_wait=None) -> int:
        """Wait until every rank arrived at ``gen`` (see ``barrier``); returns how late the
        last partner was (ns). While spinning that is the time spun (within one poll,
        ~0.2 µs: no slot is read for it); after blocking, read from the partners' slots."""
        start = now = time.perf_counter()
        if (self._busy or max(self._late_prev, self._late_last) <= self._cheap_ns
                or arrived_at - self._wall_at >= _REASK_NS):
            # it may spin: spin briefly first (partners arriving with us are released
            # without the question), then ask how long. The partners' slots are read
            # inline: a poll is ~2x shorter than through _all_arrived.
            v, partners = self._view, self._partner_arrived
            spin_end, asked = now + _FIRST_SPIN_S, False
            while True:
                while now < spin_end:
                    for s in partners:
                        if v[s] < gen:
                            break
                    else:
                        return int((now - start) * 1e9)
                    now = time.perf_counter()
                if asked:
                    break
                asked = True
                budget = self._spin_budget_s(arrived_at)
                if budget >= self._spin_s and on_wait is not None:
                    on_wait()  # a busy loop: use the wait (an idle one sleeps: nothing starves)
                    now = time.perf_counter()
                spin_end = start + budget
        # else an idle loop whose partners came late: block at once (what spinning or
        # asking would cost it is a tax on every idle iteration)
        deadline = None if timeout is None else start + timeout
        sem = self._sems[self.tp_rank]
        wait_s = 0.0005 if service is not None else _FALLBACK_WAIT_S
        sleeping_slot = self._my + R_SLEEPING
        v = self._view
        next_liveness = now
        self._enter_blocking()
        self._waiting_gen = gen
        try:
            while True:
                v[sleeping_slot] = gen
                if self._all_arrived(gen):  # re-check after announcing: see module docstring
                    return self._partner_lateness(gen, arrived_at)
                if service is not None:
                    service()
                posted = sem_wait(sem, wait_s if deadline is None
                                  else max(0.0, min(wait_s, deadline - time.perf_counter())))
                if not posted and service is None:  # a long wait: re-check less often
                    wait_s = min(wait_s * 2, _IDLE_FALLBACK_WAIT_S)
                if self._closing:
                    raise self._closed_error()
                if self._all_arrived(gen):
                    return self._partner_lateness(gen, arrived_at)
                if check is not None:
                    check()
                now = time.perf_counter()
                if posted or now >= next_liveness:  # a post may say a peer left or stopped
                    next_liveness = now + 0.1
                    self._check_peers(gen)
                if deadline is not None and now >= deadline:
                    raise BarrierTimeoutError(
                        f"rank {self.tp_rank}: barrier generation {gen} timed out after "
                        f"{timeout:.3f}s; {self._describe_missing(gen)}")
        finally:
            v[sleeping_slot] = 0
            self._waiting_gen = 0
            self._leave_blocking()

    def _missing(self, gen):
        v = self._view
        return [(r, v[b + R_PID]) for r, b in enumerate(self._ranks) if v[b + R_ARRIVED] < gen]

    def rank_alive(self, rank: int) -> bool:
        """True while rank ``rank``'s process holds its rank lock (it attached and has not
        closed or exited). Never blocks."""
        return rank == self.tp_rank or self._seg.lock_held(rank_lock(rank))

    def _describe_missing(self, gen):
        parts = []
        v = self._view
        for r, pid in self._missing(gen):
            if pid == 0:
                parts.append(f"rank {r} (never attached)")
            elif v[self._ranks[r] + R_FAULT] == FAULT_LEFT:
                parts.append(f"rank {r} (pid {pid}, closed its client)")
            else:
                parts.append(f"rank {r} (pid {pid}, {'alive' if self.rank_alive(r) else 'exited'})")
        return "waiting for " + ", ".join(parts)

    def _check_peers(self, gen):
        """Raise ``BarrierTimeoutError`` if a rank that has not arrived closed its client or
        exited: it never will. A rank that published a fault first is the caller's
        ``check`` to judge (it knows what the fault means: e.g. an engine CLOSE that this
        rank's own CLOSE, still on its way, will confirm), not an exit."""
        v = self._view
        gone = []
        for r, pid in self._missing(gen):
            fault = v[self._ranks[r] + R_FAULT]
            if fault == FAULT_LEFT:
                gone.append(f"rank {r} (pid {pid}) closed its client")
            elif not fault and pid and not self.rank_alive(r):
                gone.append(f"rank {r} (pid {pid}) exited")
        if gone:
            raise BarrierTimeoutError(
                f"rank {self.tp_rank}: barrier generation {gen} cannot complete: "
                + ", ".join(gone))

    # -- lifetime ------------------------------------------------------------------------

    def close(self, timeout: float = _CLOSE_WAIT_S) -> bool:
        """Leave the group: mark this rank's slot ``FAULT_LEFT`` (peers waiting for it raise
        at once), wake and wait for any thread of this process blocked in ``barrier()`` or
        ``wait_received()`` on this object (they raise ``ClosedError``), then close the
        semaphores; rank 0 also removes the names (peers keep their mappings), and a rank
        whose rank 0 has gone removes its leftovers. Idempotent; may be called from any
        thread.

        Blocks at most ``timeout`` seconds for such waiters; if one has not left by then,
        the semaphores are kept open (leaked until the object is garbage) rather than freed
        under it, and False is returned. The mapping stays until the object is garbage, so
        a concurrent reader never touches unmapped memory. True when everything was freed."""
        if self._closed:
            return True
        self._closed = True
        v = self._view
        if not v[self._my + R_FAULT]:
            v[self._my + R_FAULT] = FAULT_LEFT
        with self._gate:
            for sem in self._sems:  # peers waiting for us see LEFT; our own waiters leave
                sem.release()
            self._closing = True
            left = self._gate.wait_for(lambda: self._blocked == 0, timeout)
        if not left:
            log.error("rank %d of TP group %s: a thread still waits in the group %.1f s after "
                      "close(); its semaphores are kept open until the object is garbage",
                      self.tp_rank, self.shm_name, timeout)
        # the finalizer stays: it unmaps (and closes kept semaphores) once this is garbage
        self._res.release(self.tp_rank == 0, close_sems=left, unmap=False)
        if left:
            self._runq.close()
        return left


class _Resources:
    """What a ShmTPGroup frees, for close() and for its finalizer (which must not hold the
    group itself)."""

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
                _reclaim_group(seg)  # only if rank 0 is gone
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

