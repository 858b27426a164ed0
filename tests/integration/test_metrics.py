"""fastdeploy_sync.metrics: a real TaskQueue and real worker processes, scraped through
prometheus_client exactly as a /metrics endpoint would (generate_latest)."""

import subprocess
import sys
import time

import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from conftest import SPAWN  # noqa: E402
from fastdeploy_sync import Heartbeat, TaskQueue  # noqa: E402
from fastdeploy_sync.metrics import register  # noqa: E402
from workers import (  # noqa: E402
    FAST_HEARTBEAT,
    collect,
    construct_and_exit,
    step_until_error_rank,
    take_n_rank,
    wait_until,
)


def scrape(registry):
    """{(sample name, frozenset of labels): value} from the text a scrape returns."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples, name, **labels):
    return samples[(name, frozenset({k: str(v) for k, v in labels.items()}.items()))]


def test_values_move_as_batches_are_put_and_consumed(name, procs, results):
    registry = CollectorRegistry()
    q = {"queue": name, "dp_id": 0}
    with TaskQueue(name, 2) as queue:
        register(registry, queue)
        s = scrape(registry)
        assert value(s, "fdsync_batches_put_total", **q) == 0
        assert value(s, "fdsync_rank_state", **q, rank=0, state="never connected") == 1
        # from before the first put: every delivery the histogram counts lies within
        started = time.monotonic()
        for i in range(3):
            queue.put_tasks(i, timeout=5)
        s = scrape(registry)
        assert value(s, "fdsync_batches_put_total", **q) == 3
        assert value(s, "fdsync_batches_in_flight", **q) == 3
        assert value(s, "fdsync_batches_delivered_total", **q) == 0
        assert value(s, "fdsync_rank_lag_batches", **q, rank=1) == 3
        assert value(s, "fdsync_delivery_seconds_count", **q) == 0

        # The ranks stay until the scrape: one that closed first (BYE) would retire the
        # group, perhaps before the engine learned what the other took, and a retirement
        # also resets "consumed" to the last seq (it passed the wait below without a single
        # delivery on a loaded machine).
        leave = SPAWN.Event()
        for rank in range(2):
            procs(take_n_rank, results, rank, name, 2, 5, leave=leave)
        collect(results, "ready", 2)
        for i in range(3, 5):
            queue.put_tasks(i, timeout=5)
        assert [sorted(t) for t in collect(results, "taken", 2).values()] == [list(range(5))] * 2
        assert wait_until(lambda: queue.stats()["consumed"] == [5, 5], 60)
        elapsed = time.monotonic() - started
        s = scrape(registry)
        assert queue.stats().get("groups_retired", 0) == 0, "retired before the scrape"
        leave.set()
    assert value(s, "fdsync_batches_put_total", **q) == 5
    assert value(s, "fdsync_batches_delivered_total", **q) == 5
    assert value(s, "fdsync_batches_in_flight", **q) == 0
    assert value(s, "fdsync_max_inflight", **q) == 8
    for rank in range(2):
        assert value(s, "fdsync_rank_consumed_seq", **q, rank=rank) == 5
        assert value(s, "fdsync_rank_lag_batches", **q, rank=rank) == 0
    assert value(s, "fdsync_groups_total", **q) == 1
    # the histogram: 5 deliveries, cumulative buckets, a plausible sum
    buckets = sorted(((float(dict(labels)["le"]), v) for (n, labels), v in s.items()
                      if n == "fdsync_delivery_seconds_bucket"), key=lambda b: b[0])
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and counts[-1] == 5 and buckets[-1][0] == float("inf")
    assert value(s, "fdsync_delivery_seconds_count", **q) == 5
    # the first three waited for the workers to start; none waited longer than the test
    # (before, the clock started after the first three puts and a scrape, and a loaded
    # machine's scrape took longer than the second each of them was allowed for that)
    assert 0 < value(s, "fdsync_delivery_seconds_sum", **q) <= 5 * elapsed


def test_rank_state_and_a_retired_group_with_its_reason(name, procs, results):
    registry = CollectorRegistry()
    q = {"queue": name, "dp_id": 0}
    with TaskQueue(name, 2, heartbeat=Heartbeat(*FAST_HEARTBEAT)) as queue:
        register(registry, queue)
        ranks = [procs(step_until_error_rank, results, r, name, 2) for r in range(2)]
        collect(results, "ready", 2)
        queue.put_tasks("one", timeout=5)
        assert wait_until(lambda: queue.stats()["consumed"] == [1, 1])
        s = scrape(registry)
        for rank in range(2):
            assert value(s, "fdsync_rank_state", **q, rank=rank, state="connected") == 1
            assert value(s, "fdsync_rank_state", **q, rank=rank, state="disconnected") == 0
            assert 0 <= value(s, "fdsync_rank_silent_seconds", **q, rank=rank) < 5
        ranks[1].kill()
        ranks[1].join(timeout=10)
        assert wait_until(lambda: queue.stats().get("groups_retired", 0) == 1, 15)
        collect(results, "raised", 1)  # rank 0 learns its group is gone
        s = scrape(registry)
    retired = {dict(labels)["reason"]: v for (n, labels), v in s.items()
               if n == "fdsync_groups_retired_total"}
    assert sum(retired.values()) == 1, retired
    # a known kind, not "other": a new retirement reason needs a kind in RETIREMENT_KINDS
    assert set(retired) <= {"gone", "hung", "rank_restarted", "replaced", "left"}, retired
    assert value(s, "fdsync_rank_state", **q, rank=1, state="connected") == 0


def test_rejected_peers_are_counted(name, procs, results):
    registry = CollectorRegistry()
    with TaskQueue(name, 2) as queue:
        register(registry, queue)
        procs(construct_and_exit, results, name)  # tp_size 1 against the engine's 2
        assert wait_until(lambda: queue.stats().get("rejected", 0) >= 1, 15)
        s = scrape(registry)
    assert value(s, "fdsync_rejected_peers_total", queue=name, dp_id=0) >= 1


def test_several_queues_and_a_broken_one(name):
    """One collector for two DP groups; a queue whose stats() raises is counted, and the
    others are still scraped."""

    class Broken:
        name, dp_id, max_inflight = "broken", 0, 1

        def stats(self):
            raise RuntimeError("I/O thread failed")

    registry = CollectorRegistry()
    with TaskQueue(name, 1, dp_id=0) as q0, TaskQueue(name, 1, dp_id=1) as q1:
        collector = register(registry, q0, Broken())
        collector.add(q1)
        q1.put_tasks("x", timeout=5)
        s = scrape(registry)
        assert value(s, "fdsync_batches_put_total", queue=name, dp_id=0) == 0
        assert value(s, "fdsync_batches_put_total", queue=name, dp_id=1) == 1
        assert value(s, "fdsync_scrape_errors_total") == 1
        collector.remove(q1)
        s = scrape(registry)
        assert ("fdsync_batches_put_total", frozenset({"queue": name, "dp_id": "1"}.items())) \
            not in s
        registry.unregister(collector)
        assert scrape(registry) == {}


def test_registering_twice_on_one_registry_is_refused(name):
    registry = CollectorRegistry()
    with TaskQueue(name, 1) as queue:
        register(registry, queue)
        with pytest.raises(ValueError):
            register(registry, queue)


def test_importing_fastdeploy_sync_does_not_import_prometheus_client():
    code = "import sys, fastdeploy_sync; print('prometheus_client' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_the_fastdeploy_drop_in_exports_its_queues(name):
    """FastDeploy's engine builds EngineWorkerQueue, not TaskQueue: its server hands out
    its per-DP-group queues so that FastDeploy's own /metrics registry can include them."""
    from fastdeploy_sync.fastdeploy import EngineWorkerQueue

    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=1,
                               local_data_parallel_size=2, name=name)
    try:
        assert [q.dp_id for q in server.task_queues] == [0, 1]
        engine = EngineWorkerQueue(address=server.address, client_id=0,
                                   local_data_parallel_id=1, name=name)
        assert engine.task_queues == server.task_queues
        registry = CollectorRegistry()
        register(registry, *server.task_queues)
        engine.put_tasks(["x"])
        s = scrape(registry)
        assert value(s, "fdsync_batches_put_total", queue=name, dp_id=1) == 1
        assert value(s, "fdsync_batches_put_total", queue=name, dp_id=0) == 0
    finally:
        server.cleanup()
