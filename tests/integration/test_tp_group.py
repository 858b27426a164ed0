"""The node-local TP group: shared-memory lifetime, stale-segment reclaim, barrier errors."""

import glob
import os
import signal

import pytest

from conftest import SPAWN
from fastdeploy_sync import BarrierTimeoutError, GroupInUseError
from fastdeploy_sync.names import group_segment as group_shm_name
from fastdeploy_sync.shm.ownership import OWNER_LOCK
from fastdeploy_sync.shm.segment import Segment
from fastdeploy_sync.tp.shm_group import ShmTPGroup
from workers import barrier_once_rank, collect, hold_group_rank


def _ours(name):
    return sorted(glob.glob(f"/dev/shm/*{name}*"))


def test_close_removes_every_name(name):
    rank0 = ShmTPGroup(name, 0, 2, 0)
    rank1 = ShmTPGroup(name, 0, 2, 1, attach_timeout=5)
    assert len(_ours(name)) == 3  # the segment and one semaphore per rank
    rank1.close()
    rank0.close()
    rank0.close()  # idempotent
    assert _ours(name) == []


def _crash_a_rank0(name, procs, doomed):
    """Leave behind what a killed rank 0 of a TP=2 group leaves: its segment and semaphores."""
    p = procs(hold_group_rank, doomed, 0, name, 2, 60)
    collect(doomed, "ready", 1)
    os.kill(p.pid, signal.SIGKILL)
    p.join(timeout=10)
    assert len(_ours(name)) == 3


def test_segment_of_a_killed_rank0_is_reclaimed(name, procs, doomed, caplog):
    _crash_a_rank0(name, procs, doomed)
    rank0 = ShmTPGroup(name, 0, 2, 0)  # a new run: reclaims instead of failing
    try:
        assert "reclaimed stale shared memory" in caplog.text
        assert rank0.min_received() == 0  # fresh state, not the dead run's
    finally:
        rank0.close()
    assert _ours(name) == []


def test_rank1_waits_while_a_stale_segment_awaits_its_rank0(name, procs, results, doomed):
    """Rank 1 starts first and finds a crashed run's segment: it must not attach to it."""
    _crash_a_rank0(name, procs, doomed)
    procs(barrier_once_rank, results, 1, name, 2, 0.0, 10)
    rank0 = ShmTPGroup(name, 0, 2, 0)
    try:
        collect(results, "ready", 1)
        rank0.barrier(timeout=10)
        collect(results, "passed", 1)
    finally:
        rank0.close()


def test_rank1_of_a_restarted_group_waits_while_rank0_reclaims_the_old_segment(
        name, procs, doomed):
    """A whole group was killed and restarts. The new rank 0 reclaims the old segment: it
    holds the old segment's owner lock for a moment before it removes the name. A new rank
    1 that looks at the old segment in that moment must read it as stale and wait for the
    new one, not refuse to "rejoin a live group" (its slot names the dead rank 1, and the
    owner lock is held, but by the reclaimer, not by a rank 0 of that group)."""
    group = [procs(hold_group_rank, doomed, rank, name, 2, 60) for rank in range(2)]
    collect(doomed, "ready", 2)
    for p in group:
        os.kill(p.pid, signal.SIGKILL)
    for p in group:  # reaped: every thread gone, so are its locks (a zombie leader is not)
        p.join(timeout=10)
        assert p.exitcode == -signal.SIGKILL
    reclaimer = Segment.attach(group_shm_name(name, 0))
    try:
        assert reclaimer.try_lock(OWNER_LOCK)  # what shm._reclaim holds while it unlinks
        with pytest.raises(TimeoutError, match="stale segment"):
            ShmTPGroup(name, 0, 2, 1, attach_timeout=0.3)
        assert reclaimer.unlink_if_mine()
    finally:
        reclaimer.close()
    rank0 = ShmTPGroup(name, 0, 2, 0)
    try:
        rank1 = ShmTPGroup(name, 0, 2, 1, attach_timeout=5)
        try:
            join = _in_thread(lambda: rank0.barrier(timeout=5))
            rank1.barrier(timeout=5)
            assert join() == ("ok", None)
        finally:
            rank1.close()
    finally:
        rank0.close()


def test_a_live_group_of_another_process_is_not_stolen(name, procs, results):
    leave = SPAWN.Event()  # the owner stays until the attempt was made
    procs(hold_group_rank, results, 0, name, 2, 120.0, leave)
    collect(results, "ready", 1)
    with pytest.raises(GroupInUseError, match="owned by live process"):
        ShmTPGroup(name, 0, 2, 0)
    leave.set()


def test_rank1_without_rank0_times_out_clearly(name):
    with pytest.raises(TimeoutError, match="is rank 0 of this group running"):
        ShmTPGroup(name, 0, 2, 1, attach_timeout=0.3)


def test_tp_size_mismatch_is_refused(name):
    rank0 = ShmTPGroup(name, 0, 2, 0)
    try:
        with pytest.raises(ValueError, match="tp_size=4 but rank 0 .* uses tp_size=2"):
            ShmTPGroup(name, 0, 4, 1, attach_timeout=5)
    finally:
        rank0.close()


def test_barrier_timeout_names_the_missing_rank(name):
    rank0 = ShmTPGroup(name, 0, 2, 0)
    try:
        with pytest.raises(BarrierTimeoutError, match=r"rank 1 \(never attached\)"):
            rank0.barrier(timeout=0.2)
    finally:
        rank0.close()


def test_barrier_reports_a_peer_that_exited(name, procs, doomed):
    rank0 = ShmTPGroup(name, 0, 2, 0)
    try:
        p = procs(hold_group_rank, doomed, 1, name, 2, 60)
        collect(doomed, "ready", 1)
        os.kill(p.pid, signal.SIGKILL)
        with pytest.raises(BarrierTimeoutError, match=rf"rank 1 \(pid {p.pid}\) exited"):
            rank0.barrier(timeout=30)  # raised as soon as the exit is seen, not after 30 s
    finally:
        rank0.close()


@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_barrier_releases_a_late_rank(name, procs, results, delay):
    """Together (spin path) and 50 ms late (semaphore path)."""
    rank0 = ShmTPGroup(name, 0, 2, 0)
    try:
        procs(barrier_once_rank, results, 1, name, 2, delay, 10)
        collect(results, "ready", 1)
        rank0.barrier(timeout=10)
        collect(results, "passed", 1)
        assert rank0.gen == 1
    finally:
        rank0.close()


def _in_thread(fn):
    """Run ``fn`` in a thread; returns a function that joins it (10 s) and returns what fn
    returned or raised, as ("ok", value) or ("raised", exception)."""
    import threading

    box = []

    def run():
        try:
            box.append(("ok", fn()))
        except BaseException as exc:  # handed to the test
            box.append(("raised", exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def join():
        t.join(10)
        assert box, "the thread did not finish within 10 s"
        return box[0]
    return join


def test_a_rebuilt_rank_never_rejoins_the_incarnation_it_served(name):
    """A process closes its rank-1 object and builds a new one while rank 0 (still the
    old incarnation, ahead by three barriers) lives: the new object must not attach the
    old segment at generation 0 (it would pass barriers alone and replay old decisions).
    The peer learns at once that rank 1 left."""
    rank0 = ShmTPGroup(name, 0, 2, 0)
    old = ShmTPGroup(name, 0, 2, 1, attach_timeout=5)
    try:
        for _ in range(3):
            join = _in_thread(lambda: rank0.barrier(timeout=5))
            old.barrier(timeout=5)
            assert join() == ("ok", None)
        rank0.latch(4, 0, 1)  # a decision a replaying rank would take
        waiting = _in_thread(lambda: rank0.barrier(timeout=30))
        old.close()
        with pytest.raises(TimeoutError, match="already served its incarnation"):
            ShmTPGroup(name, 0, 2, 1, attach_timeout=0.3)
        kind, exc = waiting()
        assert kind == "raised" and isinstance(exc, BarrierTimeoutError), exc
        assert "rank 1 (pid" in str(exc) and "closed its client" in str(exc)
    finally:
        old.close()
        rank0.close()
    # the whole group rebuilt: a new incarnation, joined from generation 0
    rank0 = ShmTPGroup(name, 0, 2, 0)
    try:
        new = ShmTPGroup(name, 0, 2, 1, attach_timeout=5)
        try:
            assert new.incarnation == rank0.incarnation != old.incarnation
            join = _in_thread(lambda: rank0.barrier(timeout=5))
            new.barrier(timeout=5)
            assert join() == ("ok", None) and new.gen == rank0.gen == 1
            assert new.decision(1) is None
        finally:
            new.close()
    finally:
        rank0.close()


def test_every_rank_reads_the_same_last_arrival(name):
    """``last_arrival_ns()``: the moment a barrier completed, the same on every rank (the
    profile's model collective releases its ranks at one instant after it)."""
    import threading
    import time

    rank0 = ShmTPGroup(name, 0, 2, 0)
    rank1 = ShmTPGroup(name, 0, 2, 1, attach_timeout=5)
    try:
        late = threading.Thread(target=lambda: (time.sleep(0.05), rank1.barrier(5)))
        t0 = time.monotonic_ns()
        late.start()
        rank0.barrier(5)
        late.join(5)
        assert rank0.last_arrival_ns() == rank1.last_arrival_ns()
        assert rank0.last_arrival_ns() >= t0 + 40_000_000  # rank 1's, ~50 ms after rank 0's
    finally:
        rank1.close()
        rank0.close()
