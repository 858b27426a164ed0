"""Liveness and restarts, with real processes: every process learns that its peer is gone
within a bounded time, in the library's terms, and a restarted worker group just works.

Heartbeats are shortened (0.2 s interval, 1 s timeout) so that the tests stay short; no
test asserts a duration tighter than its collect timeout (timings live in
scripts/benchmarks/liveness_times.py).
"""

import os
import signal
import socket
import time

import pytest

from fastdeploy_sync import Heartbeat, TaskQueue
from workers import (
    FAST_HEARTBEAT,
    collect,
    construct_rank,
    late_stepper_rank,
    serve_engine,
    step_until_error_rank,
    wait_until,
)

HB = Heartbeat(*FAST_HEARTBEAT)
MODES = pytest.mark.parametrize("async_prefetch", [True, False], ids=["async", "sync"])


pytestmark = pytest.mark.usefixtures("loopback_tcp")


@pytest.fixture
def killed_engine_names(name):
    """A SIGKILLed engine leaves its socket file and ack board: after the test, the next
    engine of the name reclaims them (and removes them on close)."""
    yield name
    TaskQueue(name, 1).close()


def _free_tcp_endpoint():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _check_same_prefix(raised, n):
    """Every rank took the same batches, in order, and the first ``n`` at least."""
    taken = [raised[r]["taken"] for r in sorted(raised)]
    assert all(t == taken[0] for t in taken), f"ranks took different batches: {taken}"
    assert taken[0][:n] == list(range(n)) and taken[0] == list(range(len(taken[0])))


@MODES
def test_a_killed_engine_is_reported_gone_on_every_rank(name, killed_engine_names, procs, results, doomed,
                                                        async_prefetch):
    n = 5
    engine = procs(serve_engine, doomed, 0, name, 2, n)
    collect(doomed, "served", 1, timeout=30)
    for rank in range(2):
        procs(step_until_error_rank, results, rank, name, 2, async_prefetch, report_after=n)
    collect(results, "took_n", 2)
    os.kill(engine.pid, signal.SIGKILL)
    raised = collect(results, "raised", 2, timeout=30)
    for rank in range(2):
        assert raised[rank]["cause"] == "EngineGoneError", raised[rank]
        # the rank that noticed first says why; a peer waiting for it says who noticed
        assert ("connection to the engine" in raised[rank]["message"]
                and "was lost" in raised[rank]["message"]
                or "stopped at EngineGoneError" in raised[rank]["message"]), raised[rank]
        assert raised[rank]["message"].startswith(f"rank {rank} ")
        if async_prefetch:
            assert raised[rank]["type"] == "PrefetchError"
    _check_same_prefix(raised, n)
    engine.join(timeout=10)


def test_a_stopped_engine_is_reported_gone(name, killed_engine_names, procs, results, doomed):
    """SIGSTOP for longer than the heartbeat timeout: to its workers it is gone."""
    engine = procs(serve_engine, doomed, 0, name, 2, 3)
    collect(doomed, "served", 1, timeout=30)
    for rank in range(2):
        procs(step_until_error_rank, results, rank, name, 2, True, report_after=3)
    collect(results, "took_n", 2)
    os.kill(engine.pid, signal.SIGSTOP)
    try:
        raised = collect(results, "raised", 2, timeout=30)
    finally:
        os.kill(engine.pid, signal.SIGKILL)
    assert [raised[r]["cause"] for r in range(2)] == ["EngineGoneError"] * 2
    _check_same_prefix(raised, 3)
    engine.join(timeout=10)


@MODES
def test_close_lets_every_rank_take_everything_then_reports_closed(name, procs, results,
                                                                   async_prefetch):
    n = 20
    queue = TaskQueue(name, 2, heartbeat=HB)
    try:
        for rank in range(2):
            procs(step_until_error_rank, results, rank, name, 2, async_prefetch)
        for i in range(n):
            queue.put_tasks(i, timeout=30)
    finally:
        unconsumed = queue.close(timeout=30)
    assert unconsumed == []
    # every rank answered the CLOSE before the engine closed its socket without a linger
    assert queue.stats()["close_answered"] == 2
    raised = collect(results, "raised", 2, timeout=30)
    for rank in range(2):
        assert raised[rank]["type"] == raised[rank]["cause"] == "EngineClosedError", raised[rank]
        assert raised[rank]["taken"] == list(range(n))


def test_close_reports_what_was_not_consumed(name):
    with TaskQueue(name, 2, heartbeat=HB) as queue:
        for i in range(3):
            queue.put_tasks(i, timeout=1)
        assert queue.close(timeout=0.2) == [1, 2, 3]  # no worker ever connected


def test_the_engine_reports_a_killed_rank_disconnected(name, procs, results, doomed):
    queue = TaskQueue(name, 2, heartbeat=HB, max_inflight=2)
    try:
        victim = procs(step_until_error_rank, doomed, 0, name, 2, True)
        procs(step_until_error_rank, results, 1, name, 2, True)
        collect(doomed, "ready", 1)
        assert wait_until(lambda: [r["state"] for r in queue.ranks()] == ["connected"] * 2)
        os.kill(victim.pid, signal.SIGKILL)
        assert wait_until(lambda: queue.ranks()[0]["state"] == "disconnected", timeout=15)
        state = queue.ranks()
        assert state[0]["reason"] in ("its connection closed", "group retired"), state
        # the survivor is told its group is gone (not left to time out)
        raised = collect(results, "raised", 1, timeout=30)
        assert raised[1]["cause"] in ("GroupLostError", "BarrierTimeoutError"), raised[1]
        event = queue.group_events.get(timeout=15)
        # rank 0's death, or rank 1 leaving because of it (its barrier saw rank 0 exit
        # within ~0.1 s and its close() said BYE before the engine's reconnect grace for
        # rank 0 ran out)
        assert "rank 0" in event.reason or "rank 1 closed its client" in event.reason, event
        for i in range(2):
            queue.put_tasks(i, timeout=1)
        with pytest.raises(TimeoutError, match="rank 0 .*retired .*waiting for a new worker group"):
            queue.put_tasks(99, timeout=0.2)
    finally:
        queue.close(timeout=0)


def test_a_restarted_engine_serves_a_fresh_group_and_refuses_the_old(name, killed_engine_names, procs, results,
                                                                     doomed):
    """An engine restarted on the same tcp port while the old workers still live: their
    queued ACKs and HELLOs are recognised as another engine's and ignored, the old workers
    are told their engine is gone, and a fresh group takes every new batch."""
    endpoint = _free_tcp_endpoint()
    old_engine = procs(serve_engine, doomed, 0, name, 2, 4, endpoint)
    collect(doomed, "served", 1, timeout=30)
    for rank in range(2):
        procs(step_until_error_rank, results, rank, name, 2, True, endpoint, report_after=4)
    collect(results, "took_n", 2)
    os.kill(old_engine.pid, signal.SIGKILL)
    old_engine.join(timeout=10)
    with TaskQueue(name, 2, endpoint=endpoint, heartbeat=HB) as queue:
        old = collect(results, "raised", 2, timeout=30)
        assert [old[r]["cause"] for r in range(2)] == ["EngineGoneError"] * 2
        n = 6
        for rank in range(2):
            procs(step_until_error_rank, results, rank, name, 2, True, endpoint, report_after=n)
        for i in range(100, 100 + n):
            queue.put_tasks(i, timeout=30)
        fresh = collect(results, "took_n", 2, timeout=30)
        assert fresh[0] == fresh[1] == list(range(100, 100 + n))
        assert wait_until(lambda: queue.stats()["consumed"] == [n, n])  # tcp ACKs in flight
        # the old workers took nothing of the new engine, and none of their ACKs counted
        assert all(b < 100 for r in range(2) for b in old[r]["taken"])
        assert queue.close(timeout=10) == []
    collect(results, "raised", 2, timeout=30)  # the fresh group: EngineClosedError


def test_a_whole_group_restart_under_a_live_engine(name, procs, results, doomed):
    queue = TaskQueue(name, 2, heartbeat=HB)
    try:
        first = [procs(step_until_error_rank, doomed, rank, name, 2, True, report_after=3)
                 for rank in range(2)]
        for i in range(3):
            queue.put_tasks(i, timeout=30)
        collect(doomed, "took_n", 2)
        for p in first:
            os.kill(p.pid, signal.SIGKILL)
        queue.put_tasks(3, timeout=30)  # put while the group is dead: never finished
        queue.put_tasks(4, timeout=30)
        event = queue.group_events.get(timeout=15)
        assert [b.seq for b in event.unfinished] == [4, 5]
        assert [b.tasks for b in event.unfinished] == [3, 4]
        assert all(b.taken_by == () for b in event.unfinished)
        start = time.monotonic()
        for rank in range(2):
            procs(step_until_error_rank, results, rank, name, 2, True, report_after=3)
        for i in range(10, 13):
            queue.put_tasks(i, timeout=30)
        fresh = collect(results, "took_n", 2, timeout=30)
        print(f"new group took its first batches {time.monotonic() - start:.2f} s after start")
        assert fresh[0] == fresh[1] == [10, 11, 12]
    finally:
        assert queue.close(timeout=10) == []
    collect(results, "raised", 2, timeout=30)


def test_a_new_group_waits_for_the_old_one_to_go(name, procs, results, doomed):
    """The new group asks while the old one's sockets are still up (SIGSTOPped, not
    killed): it is held back, not refused, and accepted once the old one is silent."""
    queue = TaskQueue(name, 2, heartbeat=HB)
    try:
        first = [procs(step_until_error_rank, doomed, rank, name, 2, True, report_after=1)
                 for rank in range(2)]
        queue.put_tasks(0, timeout=30)
        collect(doomed, "took_n", 2)
        for p in first:
            os.kill(p.pid, signal.SIGSTOP)
        try:
            # the new rank 0 must create a new segment: remove the stopped group's name as
            # an operator's rm would (the library itself never takes a live owner's name,
            # and a stopped process is alive)
            import posix_ipc

            from fastdeploy_sync import names
            posix_ipc.unlink_shared_memory(names.group_segment(name, 0))
            for rank in range(2):
                procs(step_until_error_rank, results, rank, name, 2, True, report_after=2)
            queue.put_tasks(1, timeout=30)
            queue.put_tasks(2, timeout=30)
            event = queue.group_events.get(timeout=15)
            # SIGSTOP: the engine's ZMTP heartbeats drop the stopped ranks' connections
            assert "is gone" in event.reason or "replaced" in event.reason, event.reason
            queue.put_tasks(3, timeout=30)
            queue.put_tasks(4, timeout=30)
            fresh = collect(results, "took_n", 2, timeout=30)
            assert fresh[0] == fresh[1] and fresh[0][-2:] == [3, 4]
        finally:
            for p in first:
                os.kill(p.pid, signal.SIGKILL)
    finally:
        queue.close(timeout=10)
    collect(results, "raised", 2, timeout=30)


def test_a_single_restarted_rank_is_refused_on_every_rank(name, procs, results, doomed):
    """Rank 1 is killed and restarted alone while rank 0 of its group lives on: the new rank
    1 is refused at construction and rank 0 raises, both saying to restart the whole group.
    Rank 0 stays in its group until the checks are done: a restarted rank that arrives once
    rank 0 has gone waits for a new rank 0 instead (FD_SYNC_ATTACH_TIMEOUT), which under
    load (a slow spawn) made this test wait 30 s for nothing."""
    from conftest import SPAWN

    leave = SPAWN.Event()
    queue = TaskQueue(name, 2, heartbeat=HB)
    try:
        procs(step_until_error_rank, results, 0, name, 2, True, report_after=2,
              retry_barrier_timeouts=True, leave=leave)
        victim = procs(step_until_error_rank, doomed, 1, name, 2, True, report_after=2)
        for i in range(2):
            queue.put_tasks(i, timeout=30)
        collect(doomed, "took_n", 1)
        collect(results, "took_n", 1)
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=10)
        # the survivor, rank 0, learns first (the engine retires the group), then the
        # restarted rank 1 arrives: the order a slow restart (or a loaded machine) gives
        raised = collect(results, "raised", 1, timeout=30)[0]
        assert raised["cause"] == "GroupLostError", raised
        assert "restart the whole group" in raised["message"]
        procs(construct_rank, results, 1, name, 2)  # the restarted rank 1
        restarted = collect(results, "constructed", 1, timeout=30)[1]
        assert restarted[0] == "GroupLostError", restarted
        assert "restart the whole group" in restarted[1]
        event = queue.group_events.get(timeout=15)
        assert "rank 1" in event.reason
    finally:
        leave.set()
        queue.close(timeout=0)


@MODES
def test_a_worker_busy_before_its_first_step_stays_connected(name, procs, results,
                                                            async_prefetch):
    """Three heartbeat timeouts between building the client and the first step call (a
    model loading): the rank keeps pinging, so the engine neither marks it silent nor
    retires its group."""
    from conftest import SPAWN

    leave = SPAWN.Event()  # the ranks close (BYE: their group retires) after the checks
    with TaskQueue(name, 2, heartbeat=HB) as queue:
        for rank in range(2):
            procs(late_stepper_rank, results, rank, name, 2, async_prefetch, 3.0, 3,
                  leave=leave)
        try:
            collect(results, "ready", 2)
            for i in range(3):
                queue.put_tasks(i, timeout=30)
            taken = collect(results, "taken", 2, timeout=30)
            assert taken[0] == taken[1] == [0, 1, 2]
            assert queue.group_events.empty()
            assert queue.stats().get("groups_retired", 0) == 0
        finally:
            leave.set()


# -- busy is not dead (liveness.py's contract) -------------------------------------------


def test_an_engine_side_gil_hold_does_not_retire_a_healthy_group(name, procs, results,
                                                                 socket_delivery):
    """The engine's own thread holds the GIL for about three heartbeat timeouts (as when
    it pickles a huge batch): its I/O thread cannot run, the rank's pings queue up. The
    rank's connection stayed up, so the group is not retired, and the next batch reaches
    it (it was retired for silence once the I/O thread ran again)."""
    from engine_peers import hold_gil, raw_rank_process

    with TaskQueue(name, 1, heartbeat=HB) as queue:
        procs(raw_rank_process, results, 0, queue.endpoint, name, 1, None, 30.0)
        collect(results, "joined", 1)
        queue.put_tasks("before", timeout=5)
        assert collect(results, "received", 1)[0] == [1]
        hold_gil(3 * HB.timeout)
        queue.put_tasks("after", timeout=5)
        assert collect(results, "received", 1, timeout=30)[0] == [1, 2]
        assert queue.group_events.empty(), queue.group_events.get()
        assert queue.ranks()[0]["state"] == "connected"


def test_a_worker_holding_the_gil_is_not_retired(name, procs, results):
    """Rank 1's main thread holds the GIL for three heartbeat timeouts between two steps
    (its prefetch thread cannot ping): the group is not retired and both ranks take every
    batch (it was retired for silence)."""
    from engine_peers import gil_holding_rank

    n = 6
    with TaskQueue(name, 2, heartbeat=HB) as queue:
        for rank in range(2):
            hold = 3 * HB.timeout if rank == 1 else 0.0
            procs(gil_holding_rank, results, rank, name, 2, n, hold, 2, FAST_HEARTBEAT)
        collect(results, "ready", 2)
        for i in range(2):
            queue.put_tasks(i, timeout=30)
        collect(results, "holding", 1, timeout=30)
        for i in range(2, n):
            queue.put_tasks(i, timeout=60)
        held = collect(results, "held", 1, timeout=60)[1]
        assert held >= 2 * HB.timeout
        taken = collect(results, "taken", 2, timeout=60)
        assert taken[0] == taken[1] == list(range(n))
        # the ranks close their clients once they took everything: that BYE retires the
        # group with nothing unfinished; any other retirement is the failure
        lost = []
        while not queue.group_events.empty():
            lost.append(queue.group_events.get())
        assert all("closed its client (BYE)" in e.reason and not e.unfinished
                   for e in lost), lost


def test_a_hung_rank_is_retired_after_the_stall_timeout_and_not_before(name, socket_delivery):
    """A rank whose connection stays up but who says nothing: never retired for that
    alone within the heartbeat timeout (it was, as 'silent'), retired as hung once the
    stall timeout passes; with stall_timeout=0 never."""
    from engine_peers import RawRank

    quiet = Heartbeat(0.2, 1.0, stall_timeout=3.0)
    with TaskQueue(name, 1, heartbeat=quiet) as queue:
        rank = RawRank(queue.endpoint, name, 1, 0).join()  # and never pings
        start = time.monotonic()
        event = queue.group_events.get(timeout=30)
        waited = time.monotonic() - start
        assert "is hung" in event.reason and "stall timeout 3 s" in event.reason, event.reason
        assert waited >= 2.5, waited
        rank.close()
    with TaskQueue(name, 1, heartbeat=Heartbeat(0.2, 1.0, stall_timeout=0)) as queue:
        rank = RawRank(queue.endpoint, name, 1, 0).join()
        time.sleep(3 * 1.0)
        assert queue.group_events.empty()
        assert queue.ranks()[0]["state"] == "connected"
        rank.close()


def test_bye_retires_the_group_at_once_and_close_returns_at_once(name, socket_delivery):
    """Both ranks close cleanly (BYE, then their sockets) with a batch in flight: the
    engine retires the group at once (handing the batch back) and close(timeout=5)
    returns at once (it waited out the timeout, the group looking connected)."""
    from engine_peers import RawRank
    from fastdeploy_sync.wire.codec import DATA

    queue = TaskQueue(name, 2, heartbeat=Heartbeat(1.0, 3.0))
    try:
        ranks = [RawRank(queue.endpoint, name, 2, r) for r in range(2)]
        ranks[1].group = ranks[0].group
        for rank in ranks:
            rank.join()
        seq = queue.put_tasks("in flight", timeout=5)
        for rank in ranks:
            rank.expect(DATA)
        for rank in ranks:
            rank.bye(taken=0)
            rank.close()
        event = queue.group_events.get(timeout=5)
        assert "closed its client (BYE)" in event.reason, event.reason
        assert [b.seq for b in event.unfinished] == [seq]
        start = time.monotonic()
        assert queue.close(timeout=5) == []
        assert time.monotonic() - start < 1.0
    finally:
        queue.close(timeout=0)


@pytest.mark.slow
def test_a_stopped_rank_is_found_gone_by_the_zmtp_heartbeats(name, procs, results, doomed):
    """SIGSTOP: the process cannot answer anything, its connection stays open; the
    engine's ZMTP heartbeats drop it and the group is retired. (Rank 1 is stopped: rank
    0 owns the group's shared memory and removes it when it stops.)"""
    queue = TaskQueue(name, 2, heartbeat=HB)
    try:
        procs(step_until_error_rank, results, 0, name, 2, True, report_after=1)
        stopped = procs(step_until_error_rank, doomed, 1, name, 2, True, report_after=1)
        queue.put_tasks(0, timeout=30)
        collect(results, "took_n", 1)
        collect(doomed, "took_n", 1)
        os.kill(stopped.pid, signal.SIGSTOP)
        try:
            event = queue.group_events.get(timeout=30)
            assert "rank 1 is gone" in event.reason, event.reason
            raised = collect(results, "raised", 1, timeout=30)[0]
            assert raised["cause"] in ("GroupLostError", "BarrierTimeoutError"), raised
        finally:
            os.kill(stopped.pid, signal.SIGKILL)
    finally:
        queue.close(timeout=0)


def test_a_batch_slower_to_cross_than_the_timeout_reaches_its_rank(name, loopback_tcp):
    """A 48 MiB batch to a rank behind a relay that passes the engine's bytes on at 12 MiB/s
    takes longer than the heartbeat timeout to cross: the engine's ZMTP heartbeats (its
    PINGs leave after the batch; the rank's answers come on the idle direction) and its
    liveness rules leave the rank its place, and the batch arrives whole."""
    import numpy as np

    from engine_peers import RawRank, SlowRelay
    from fastdeploy_sync.wire.codec import DATA, decode_payload

    slow = Heartbeat(0.5, 2.0)
    with TaskQueue(name, 1, endpoint="tcp://127.0.0.1:0", heartbeat=slow) as queue:
        relay = SlowRelay(queue.endpoint, 12 << 20)
        rank = RawRank(relay.endpoint, name, 1, 0)
        try:
            rank.join()
            time.sleep(1.5)  # the engine's ZMTP PINGs have reached the rank
            batch = np.arange(48 << 17, dtype=np.int64)  # 48 MiB
            start = time.monotonic()
            queue.put_tasks(batch, timeout=5)
            got = None
            next_ping = 0.0
            while got is None and time.monotonic() - start < 60:
                if time.monotonic() >= next_ping:
                    rank.ping()
                    next_ping = time.monotonic() + 0.2
                reply = rank.recv(0.05)
                if reply is not None and reply[0].kind == DATA:
                    got = reply
            took = time.monotonic() - start
            assert got is not None, "the batch never arrived"
            assert took > slow.timeout, f"crossed in {took:.1f} s: not slower than the timeout"
            np.testing.assert_array_equal(decode_payload(got[1]), batch)
            assert queue.group_events.empty()
        finally:
            rank.close()
            relay.close()
