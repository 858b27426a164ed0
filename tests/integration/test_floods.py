"""Floods from inside the trust boundary (issue 15, item 3): a flood may slow the flooder,
never the group. Small floods, real processes and sockets; each checks that delivery goes
on (every batch reaches every rank, in order, the group is not retired) and that the
engine's memory stays bounded. No timing is asserted: scripts/tools/flood.py measures the
group's rate under each flood and the engine's peak memory with larger floods.
"""

import os
import signal
import time

from engine_peers import PeakRSS, producer_endpoint_flooder, put_and_die, worker_key_flooder
from fastdeploy_sync import TaskQueue
from fastdeploy_sync.wire.auth import create_keys
from workers import collect, make_batch, step_until_error_rank, take_n_rank, wait_until

# The engine's peak memory above where it stood before a flood (the batches in flight
# count too: 8 x 64 x 512 int64, ~4 MiB); the floods below without bounds grew it by
# hundreds of MiB to GiB.
MEMORY_BOUND_MIB = 64


def _paced_puts(queue, first, n, pause_s=0.02):
    for i in range(first, first + n):
        queue.put_tasks(i, timeout=60)
        time.sleep(pause_s)


def _run_group_under_flood(queue, procs, results, start_flooder, endpoint=None):
    """Two ranks that stay until the queue closes take batches put every 20 ms before,
    during and after a flood; returns (what each rank took, messages the flooder sent,
    the engine's peak RSS growth in MiB, stats)."""
    for rank in range(2):
        procs(step_until_error_rank, results, rank, name_of(queue), 2, True, endpoint,
              report_after=10, deadline_s=120.0)
    collect(results, "ready", 2)
    _paced_puts(queue, 0, 10)
    collect(results, "took_n", 2)
    peak = PeakRSS().start()
    flooder = start_flooder()
    collect(results, "flooded_started", 1)
    i = 10
    while flooder.is_alive():  # puts go on for as long as the flood
        _paced_puts(queue, i, 1)
        i += 1
    _paced_puts(queue, i, 10)
    n = i + 10
    sent = collect(results, "flooded", 1, timeout=60)[0]
    assert wait_until(lambda: queue.num_tasks() == 0, timeout=60), queue.stats()
    growth = peak.growth_mib()
    stats = queue.stats()
    assert queue.close(timeout=30) == []
    raised = collect(results, "raised", 2, timeout=60)
    taken = {rank: raised[rank]["taken"] for rank in range(2)}
    assert all(raised[r]["cause"] == "EngineClosedError" for r in range(2)), raised
    print(f"flood: {sent} messages, {n} batches; engine peak RSS +{growth:.1f} MiB; {stats}")
    return taken, n, growth, stats


def name_of(queue):
    return queue.name


def test_a_flood_on_the_producer_endpoint_neither_stops_the_group_nor_bloats_the_engine(
        name, procs, results):
    """A same-user process sends QUERY, STATUS and garbage to the producer endpoint as
    fast as it can and never reads a reply."""
    with TaskQueue(name, 2) as queue:
        taken, n, growth, stats = _run_group_under_flood(queue, procs, results, lambda: procs(
            producer_endpoint_flooder, results, 0, queue.producer_endpoint, 4.0))
    for rank in range(2):
        assert taken[rank] == list(range(n))
    assert stats.get("groups_retired", 0) == 0
    assert stats["garbage_frames"] > 0 and stats.get("status_requests", 0) > 0
    assert growth < MEMORY_BOUND_MIB, f"engine peak RSS grew by {growth:.0f} MiB"


def test_a_worker_key_holder_flooding_over_tcp_neither_stops_the_group_nor_bloats_the_engine(
        name, procs, results, tmp_path, monkeypatch):
    """A process holding the worker key sends stale PINGs and HELLOs of ever new groups as
    fast as it can over CURVE, never reading a reply (with a heartbeat timer on the
    engine's socket, libzmq aborted the engine when such a flooder hung up)."""
    keys = create_keys(tmp_path / "keys")["dir"]
    monkeypatch.setenv("FD_SYNC_KEYS_DIR", keys)
    with TaskQueue(name, 2, endpoint="tcp://127.0.0.1:0", keys_dir=keys) as queue:
        taken, n, growth, stats = _run_group_under_flood(
            queue, procs, results,
            lambda: procs(worker_key_flooder, results, 0, queue.endpoint, name, 2, keys, 4.0),
            endpoint=queue.endpoint)
    for rank in range(2):
        assert taken[rank] == list(range(n))
    assert stats.get("groups_retired", 0) == 0
    assert stats["stale"] > 0 and stats["rejected"] > 0
    assert growth < MEMORY_BOUND_MIB, f"engine peak RSS grew by {growth:.0f} MiB"


def test_producers_killed_while_their_big_puts_wait_leave_nothing_behind(
        name, procs, results, doomed):
    """Producers put 2 MiB batches into a full queue, without waiting for the replies,
    and are killed. Their batches are neither kept without bound nor delivered later."""
    producers, puts, mib = 6, 10, 2
    with TaskQueue(name, 2, max_inflight=2) as queue:
        queue.put_tasks(make_batch(0), timeout=5)
        queue.put_tasks(make_batch(1), timeout=5)  # full: no rank yet
        peak = PeakRSS().start()
        killed = [procs(put_and_die, doomed, i, queue.producer_endpoint, puts, mib)
                  for i in range(producers)]
        collect(doomed, "sent", producers, timeout=60)
        assert wait_until(lambda: queue.stats().get("puts_busy", 0) > 0, timeout=30)
        for p in killed:
            os.kill(p.pid, signal.SIGKILL)
        assert wait_until(lambda: not queue._io._producers.pending, timeout=30)
        growth = peak.growth_mib()
        n = 6
        for rank in range(2):
            procs(take_n_rank, results, rank, name, 2, n)
        for i in range(2, n):
            queue.put_tasks(make_batch(i), timeout=30)
        taken = collect(results, "taken", 2, timeout=60)
        assert wait_until(lambda: queue.num_tasks() == 0, timeout=30)
        stats = queue.stats()
    print(f"engine peak RSS +{growth:.1f} MiB; {stats}")
    for rank in range(2):
        assert [b for b, _ in taken[rank]] == list(range(n))  # none of the killed ones'
    assert stats.get("puts_remote", 0) == 0 and stats["last_seq"] == n
    assert stats.get("puts_dropped_gone", 0) > 0
    assert growth < MEMORY_BOUND_MIB, f"engine peak RSS grew by {growth:.0f} MiB"
