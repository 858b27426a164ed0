"""Coordination of the TP ranks of one group on one node: shared-memory watermarks,
generation-indexed step decisions, an adaptive spin-then-block barrier, and rank 0's
blocking waits for work (``wait_received``, ``wait_peers``).

The segment's layout is ``layout``'s; its creation, joining and freeing are
``group_segment``'s; how long a wait spins is ``spin``'s; what a waiter knows of its peers
is ``peers``'.

The step protocol (the invariant: every rank takes the same batches at the same step):
  * rank 0's ``exist_tasks()`` reads every rank's RECEIVED; if the minimum is past what
    the group has taken, it writes the decision "take (FROM, TO]" into the ring entry of
    the *next* barrier generation, then arrives at that barrier.
  * when rank 0 holds a batch that a peer does not hold yet, its check first waits for
    that peer to hold it, or to arrive at the barrier without it (``wait_peers``): the
    peer is usually receiving it at that moment, and rank 0 would wait for it at the
    barrier anyway; deciding before that wait would cost the batch a whole step.
  * after the barrier of generation G, every rank reads the entry tagged G. An entry
    tagged otherwise means "no decision this step". Indexing by generation is what makes
    a fast rank 0, already deciding for G+1, unable to change what a slow rank takes at G;
    the barrier bounds the skew to one generation, so a ring of 8 is plenty.

Memory ordering (``shm.order``; docs/design.md): every arrival is a release store
(everything a rank wrote before the barrier, rank 0's decision among it, is visible to
whoever sees the arrival), and a rank that has seen every arrival fences once before it
leaves the barrier (an acquire: it then reads the decision and whatever its peers wrote
before arriving). RECEIVED is a release store read with an acquire (``min_received``):
a rank's engine slot, written before it, is then visible to rank 0's latch; ENGINE,
FAULT and READY are release stores too. CONSUMED publishes nothing but its value (a
batch's memory is handed back by a release store of its own, ``shm.release``): a plain
store, off the take's path. The architecture's own order is never relied on. The only
store->load (Dekker) patterns, "I sleep" vs "you arrived" and "I wait for seq N" vs "I
received N", have a bounded fallback (semaphore waits time out and re-check), so a
theoretically lost wake-up costs at most one fallback interval, never a hang; the
announcements in them ("I sleep", "I wait for N") publish nothing else, so they stay plain
stores.

The barrier knows the loop's state (``spin``): it spins while the loop is busy and the
partners came together, and blocks on its semaphore (no CPU) otherwise. While a busy
loop's rank waits it also lets the worker receive what its prefetch thread has not
(``WaitHooks.on_wait``).

A step stays all-or-none when a rank stops. A rank that learns of a failure while it waits
in a barrier it has already arrived at does not leave (a peer arriving later would pass
and take the step alone): it publishes its fault and keeps waiting, until either every rank
arrived (the step completes on every rank; the failure is raised by the next step call) or
a rank that has not arrived published a fault (it will never arrive: nobody passes, and
this rank raises). Only ``close()`` from another thread makes a waiter leave at once. A
rank that closes marks its slot ``FAULT_LEFT``, so a peer waiting for it raises at once
instead of waiting for its timeout.

Signals. Every semaphore wait here goes through ``shm.semaphores.sem_wait``: a signal that
a handler takes (a Python handler, ``faulthandler.register``, a profiler's) resumes the
wait with the time that remains, and what a Python handler raises (``SystemExit`` from
``install_signal_cleanup``, ``KeyboardInterrupt``) propagates from the wait, at most one
signal slice late.
"""

import time
from typing import Optional

from .. import envs
from ..errors import BarrierTimeoutError, ClosedError
from ..shm.order import fence, store_release
from ..shm.semaphores import sem_wait
from .group_segment import GroupSegment
from .layout import (
    D_FROM,
    D_GEN,
    D_STRIDE,
    D_TO,
    DECISION_RING,
    FAULT_LEFT,
    R_ARRIVED,
    R_ARRIVED_AT,
    R_CONSUMED,
    R_FAULT,
    R_RECEIVED,
    R_SLEEPING,
    R_WAITING,
    RANK_BASE,
    RANK_STRIDE,
)
from .peers import PeerWatch
from .protocol import NO_HOOKS
from .spin import FIRST_SPIN_S, SpinPolicy

__all__ = ["ShmTPGroup", "FAULT_LEFT"]

# How long close() lets a waiter in another thread leave before keeping (leaking) the
# semaphores instead of freeing them under it.
_CLOSE_WAIT_S = 1.0
# A blocked waiter re-checks this soon even without a post: the fallback for a lost
# wake-up (see module docstring). Each re-check that finds nothing doubles the interval up
# to _IDLE_FALLBACK_WAIT_S, so that a rank idle for seconds wakes ~10 times a second, not
# 100; a dead peer is still noticed within ~0.2 s.
_FALLBACK_WAIT_S = 0.01
_IDLE_FALLBACK_WAIT_S = 0.1
# A blocked barrier wait with a service to run wakes this often to run it.
_SERVICE_WAIT_S = 0.0005
# wait_peers re-checks this often without a post (a lost wake-up costs at most this)
_PEER_FALLBACK_WAIT_S = 0.0005
# How often a blocked barrier wait looks for peers that exited without a post.
_LIVENESS_CHECK_S = 0.1


def _all_at_least(view, slots, value: int) -> bool:
    """True if every word of ``view`` at ``slots`` is at least ``value`` (each rank's
    watermark or arrival has reached it). A plain loop: it runs in every barrier."""
    for s in slots:
        if view[s] < value:
            return False
    return True


class ShmTPGroup:
    """One rank's handle on the node-local coordination of a TP group (``tp.protocol``).

    Construction: rank 0 creates the segment and semaphores (reclaiming a crashed run's
    leftovers, raising ``GroupInUseError`` if a live rank 0 of the same name exists).
    Other ranks block until rank 0 has published the segment, up to ``attach_timeout``
    seconds (``FD_SYNC_ATTACH_TIMEOUT``), then raise ``TimeoutError``.

    ``spin_us``: the longest ``barrier()`` spins before blocking (None:
    ``FD_SYNC_BARRIER_SPIN_US``); it spins that long only when it pays (``spin``), else
    blocks at once.

    Not thread-safe: use one instance from the event loop thread; only
    ``publish_received`` and ``wake`` may be called from the prefetch thread
    (``publish_received`` writes one slot and may post rank 0's semaphore), and ``close``
    from any thread.
    """

    spans_nodes = False

    def __init__(self, name: str, dp_id: int, tp_size: int, tp_rank: int,
                 attach_timeout: Optional[float] = None, spin_us: Optional[float] = None):
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.gen = 0  # barrier generations this rank has passed
        if attach_timeout is None:
            attach_timeout = envs.attach_timeout_s()
        seg = self._seg = GroupSegment(name, dp_id, tp_size, tp_rank, attach_timeout)
        self.shm_name = seg.shm_name
        self.incarnation = seg.incarnation
        self._view = seg.view
        self._sems = seg.sems
        self._peers = PeerWatch(seg, tp_size, tp_rank)
        self.peer_fault = self._peers.peer_fault
        self.rank_alive = seg.rank_alive
        self._spin = SpinPolicy((envs.barrier_spin_us() if spin_us is None else spin_us) * 1e-6)
        self._my = RANK_BASE + tp_rank * RANK_STRIDE
        ranks = [RANK_BASE + r * RANK_STRIDE for r in range(tp_size)]
        self._received_slots = [b + R_RECEIVED for b in ranks]
        self._consumed_slots = [b + R_CONSUMED for b in ranks]
        self._arrived_slots = [b + R_ARRIVED for b in ranks]
        self._received_arrived = [(b + R_RECEIVED, b + R_ARRIVED) for b in ranks[1:]]
        self._arrived_at_slots = [b + R_ARRIVED_AT for b in ranks]
        # The barrier's fast path reads only these (it is paid every step): the partners'
        # ARRIVED slots, and (slot, rank) of every rank's SLEEPING.
        self._partner_arrived = [s for r, s in enumerate(self._arrived_slots) if r != tp_rank]
        self._my_arrived, self._my_arrived_at = self._my + R_ARRIVED, self._my + R_ARRIVED_AT
        self._sleeping_slots = [(b + R_SLEEPING, r) for r, b in enumerate(ranks)]
        self._waiting_slot = RANK_BASE + R_WAITING  # rank 0's
        # How late (ns) the partners were at the last two barriers (0: this rank came last).
        self._late_prev = self._late_last = 0
        self._decision_base = RANK_BASE + tp_size * RANK_STRIDE
        self._engine_slots = [self._decision_base + DECISION_RING * D_STRIDE + r
                              for r in range(tp_size)]
        self._waiting_gen = 0  # the generation a barrier wait of this rank is for, else 0
        self._closed = False

    # -- watermarks ----------------------------------------------------------------------

    def publish_received(self, seq: int) -> None:
        """This rank holds every seq up to ``seq``. If rank 0 waits in ``wait_received``
        for a seq every rank now holds, post its semaphore (one read when it does not)."""
        v = self._view
        store_release(v, self._my + R_RECEIVED, seq)  # after ENGINE (publish_engine)
        # store RECEIVED, then load WAITING: the Dekker pair of wait_received and wait_peers
        # (bounded fallback); wait_peers announces its seq negated
        want = abs(v[self._waiting_slot])
        if want and want <= seq and self.min_received() >= want:
            self._seg.post(0)

    def min_received(self) -> int:
        """The lowest RECEIVED of the group, loaded with acquire: what every rank wrote
        before publishing it (its ENGINE) is visible after this returns."""
        v = self._view
        low = min([v[s] for s in self._received_slots])
        fence()
        return low

    def publish_consumed(self, seq: int) -> None:
        # a plain store: CONSUMED publishes nothing but itself (a batch's memory is handed
        # back by the rank's release word, a release store: shm.release)
        self._view[self._my + R_CONSUMED] = seq

    def all_consumed(self, seq: int) -> bool:
        return _all_at_least(self._view, self._consumed_slots, seq)

    # -- rank 0's waits ------------------------------------------------------------------

    def wait_received(self, seq: int, timeout: float, check=None) -> bool:
        """Rank 0: block until every rank holds ``seq`` (``min_received() >= seq``: True),
        or ``timeout`` seconds pass (False), or a peer rank has published a fault (False
        at once: the caller's next ``barrier()`` raises it).

        Blocks on rank 0's semaphore with the GIL released (no CPU); the receiver that
        completes ``seq`` posts it (``publish_received``), so the wake-up is one semaphore
        post. Without a post it re-checks after 10 ms, then 20, 40, 80 and every 100 ms
        (the bounded fallback of the module docstring; an idle wait costs ~nothing).
        ``check`` runs after every wake-up, posted or not (``wake()`` posts the same
        semaphore); whatever it raises ends the wait."""
        if self.tp_rank != 0:
            raise RuntimeError(f"rank {self.tp_rank} of {self.shm_name}: wait_received() is "
                               f"rank 0's (receivers post rank 0's semaphore only)")
        if self.min_received() >= seq:
            return True
        deadline = time.monotonic() + timeout
        sem = self._sems[0]
        seg = self._seg
        wait_s = _FALLBACK_WAIT_S
        seg.enter_blocking()
        try:
            self._view[self._waiting_slot] = seq
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
                if seg.closing:
                    raise seg.closed_error()
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
        came first, so it would latch nothing and the batch would wait a whole step more,
        although rank 0 then waits for that peer at the barrier anyway. Waiting here moves
        that wait in front of the decision: the step takes the batch, and rank 0 passes the
        barrier no later than it would have. A rank that arrived without ``seq`` ends the
        wait at once.

        Spins as the barrier would for this loop (busy: up to the window), then blocks on
        rank 0's semaphore (GIL released), posted by the receiver that completes ``seq`` and
        by the arrival of a rank that lacks it; without a post it re-checks every
        ``_PEER_FALLBACK_WAIT_S``. Raises nothing of its own (only what a signal handler
        raises during the wait); returns at once when the group is closing or a peer
        published a fault (the barrier then says why)."""
        gen = self.gen + 1
        if self._peers_settled(seq, gen):
            return self.min_received()
        start = time.perf_counter()
        late = max(self._late_prev, self._late_last)
        end = start + min(timeout, self._spin.budget_s(time.monotonic_ns(), late))
        while time.perf_counter() < end:
            if self._peers_settled(seq, gen):
                return self.min_received()
        deadline = start + timeout
        sem = self._sems[0]
        seg = self._seg
        try:
            seg.enter_blocking()
        except ClosedError:  # closing: the barrier says so
            return self.min_received()
        try:
            self._view[self._waiting_slot] = -seq
            while not seg.closing and self.peer_fault() is None:
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
        self._seg.leave_blocking()

    def _peers_settled(self, seq: int, gen: int) -> bool:
        """Every rank holds ``seq`` or has arrived at barrier generation ``gen``."""
        v = self._view
        for received, arrived in self._received_arrived:
            if v[received] < seq and v[arrived] < gen:
                return False
        return True

    # -- faults and engines --------------------------------------------------------------

    def publish_fault(self, code: int) -> None:
        """This rank stopped at an error ``code`` (see ``worker.faults``; the first code
        stays); peers blocked in the barrier or in ``wait_received`` wake and see it."""
        v = self._view
        if not v[self._my + R_FAULT]:
            store_release(v, self._my + R_FAULT, code)
        for r in range(self.tp_size):
            self._seg.post(r)

    def missing_fault(self):
        """During a barrier wait: ``(rank, code)`` of the first rank that has not arrived
        at the generation being waited for and published a fault (``peers``); outside a
        wait: ``peer_fault()``."""
        return self._peers.missing_fault(self._waiting_gen)

    def publish_engine(self, engine: int) -> None:
        """This rank was welcomed by engine instance ``engine`` (before it publishes any
        RECEIVED: a rank that holds a batch has its engine written)."""
        store_release(self._view, self._engine_slots[self.tp_rank], engine)

    def engine_split(self, engine: int):
        """Rank 0, before latching: ``[(rank, its engine), ...]`` for the ranks welcomed by
        another engine instance than ``engine`` (rank 0's), or None when every rank that
        was welcomed at all has ``engine``: seqs are an engine's, and ranks welcomed by
        different engines would take different batches under the same seqs."""
        v = self._view
        split = [(r, v[s]) for r, s in enumerate(self._engine_slots) if v[s] and v[s] != engine]
        return split or None

    def all_welcomed(self, engine: int) -> bool:
        """True once every rank was welcomed by engine instance ``engine`` (a rank
        publishes its engine after it attached the worker group's ring: rank 0 latches a
        batch it read from the ring only then)."""
        v = self._view
        return all(v[s] == engine for s in self._engine_slots)

    # -- decisions -----------------------------------------------------------------------

    def latch(self, gen: int, from_seq: int, to_seq: int) -> None:
        """Rank 0: the barrier of generation ``gen`` releases a step that takes (from, to].
        Plain stores: rank 0's arrival at ``gen`` (a release store) publishes them."""
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

    def wake(self) -> None:
        """Wake this rank's barrier wait or ``wait_received`` early (e.g. its prefetch
        thread just failed). Thread-safe; does nothing once the group is closed."""
        self._seg.post(self.tp_rank)

    def barrier(self, timeout: Optional[float] = None, hooks=NO_HOOKS) -> None:
        """Block until every rank of the group has called ``barrier()`` for this generation.

        Waits by spinning on shared memory (release at once when ranks arrive together),
        then blocking on this rank's semaphore (GIL released, no CPU; woken by the last
        rank's arrival). How long it spins depends on the loop's recent history
        (``spin``).

        ``timeout`` (seconds, None = forever): raises ``BarrierTimeoutError`` naming the
        ranks that did not arrive. It is raised early if one of them has exited. After a
        timeout, calling ``barrier()`` again resumes the same generation. ``hooks``: what
        this rank does while it waits (``protocol.WaitHooks``).

        Raises ``ClosedError`` if ``close()`` runs meanwhile (from another thread).
        """
        gen = self.gen + 1
        v = self._view
        arrived_at = time.monotonic_ns()
        v[self._my_arrived_at] = arrived_at  # before ARRIVED: whoever sees one sees both
        store_release(v, self._my_arrived, gen)  # and rank 0's decision for gen
        if v[self._waiting_slot] < 0:  # rank 0 waits for this rank in its check (wait_peers)
            self._seg.post(0)
        late = 0  # last to arrive: nobody was late
        for s in self._partner_arrived:
            if v[s] < gen:
                late = self._wait(gen, timeout, hooks, arrived_at)
                break
        self._late_prev, self._late_last = self._late_last, late
        fence()  # acquire: every rank arrived; what each wrote before arriving is visible
        for slot, r in self._sleeping_slots:  # wake the ranks asleep in this generation
            if v[slot] == gen:
                self._sems[r].release()
        self.gen = gen

    def last_arrival_ns(self) -> int:
        """CLOCK_MONOTONIC ns at which the last rank arrived at the barrier this rank last
        passed: the moment that barrier completed, the same on every rank. Valid until a
        partner arrives at the next generation (it then overwrites its time). Never
        blocks."""
        v = self._view
        return max(int(v[s]) for s in self._arrived_at_slots)

    def _all_arrived(self, gen: int) -> bool:
        return _all_at_least(self._view, self._arrived_slots, gen)

    def _partner_lateness(self, gen, arrived_at) -> int:
        """ns between this rank's arrival at ``gen`` and the last partner's."""
        v = self._view
        last = arrived_at
        for r, s in enumerate(self._arrived_at_slots):
            # a partner already at the next barrier has overwritten its time: skip it
            if v[self._arrived_slots[r]] == gen and v[s] > last:
                last = int(v[s])
        return last - arrived_at

    def _wait(self, gen, timeout, hooks, arrived_at) -> int:
        """Wait until every rank arrived at ``gen`` (see ``barrier``); returns how late the
        last partner was (ns). While spinning that is the time spun (within one poll: no
        slot is read for it); after blocking, read from the partners' slots."""
        start = now = time.perf_counter()
        late = max(self._late_prev, self._late_last)
        spin = self._spin
        if spin.may_spin(arrived_at, late):
            # spin briefly first (partners arriving with us are released without the
            # question), then ask how long. The partners' slots are read inline: a poll is
            # about twice as fast as through _all_arrived.
            v, partners = self._view, self._partner_arrived
            spin_end, asked = now + FIRST_SPIN_S, False
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
                budget = spin.budget_s(arrived_at, late)
                if budget >= spin.spin_s and hooks.on_wait is not None:
                    hooks.on_wait()  # a busy loop: use the wait (an idle one sleeps)
                    now = time.perf_counter()
                spin_end = start + budget
        # else an idle loop whose partners came late: block at once
        return self._block(gen, timeout, hooks, arrived_at, start, now)

    def _block(self, gen, timeout, hooks, arrived_at, start, now) -> int:
        """``_wait``'s blocking part: on this rank's semaphore, re-checking after every
        post and fallback interval; runs ``hooks.service`` and ``hooks.check``."""
        deadline = None if timeout is None else start + timeout
        sem = self._sems[self.tp_rank]
        service, check = hooks.service, hooks.check
        wait_s = _SERVICE_WAIT_S if service is not None else _FALLBACK_WAIT_S
        sleeping_slot = self._my + R_SLEEPING
        v = self._view
        seg = self._seg
        next_liveness = now
        seg.enter_blocking()
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
                if seg.closing:
                    raise seg.closed_error()
                if self._all_arrived(gen):
                    return self._partner_lateness(gen, arrived_at)
                if check is not None:
                    check()
                now = time.perf_counter()
                if posted or now >= next_liveness:  # a post may say a peer left or stopped
                    next_liveness = now + _LIVENESS_CHECK_S
                    self._peers.check_missing(gen)
                if deadline is not None and now >= deadline:
                    raise BarrierTimeoutError(
                        f"rank {self.tp_rank}: barrier generation {gen} timed out after "
                        f"{timeout:.3f}s; {self._peers.describe_missing(gen)}")
        finally:
            v[sleeping_slot] = 0
            self._waiting_gen = 0
            seg.leave_blocking()

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
            store_release(v, self._my + R_FAULT, FAULT_LEFT)
        left = self._seg.close(timeout)
        if left:
            self._spin.close()
        return left
