"""STATUS: what scraping the engine's status costs a live group, and what a hostile
endpoint can do to ``query_status``/``fastdeploy-sync status``. Real engine, ranks and
sockets; every wait is bounded."""

import time

from fastdeploy_sync import TaskClient, TaskQueue
from fastdeploy_sync.engine import query_status

from conftest import SPAWN
from workers import _report_errors, collect, wait_until


@_report_errors
def connected_rank(out, rank, name, tp, leave):
    """Join the group, say so, stay until ``leave`` is set (at most 60 s), then close."""
    with TaskClient(name, tp, rank):
        out.put(("ready", rank, None))
        leave.wait(60)


def test_scraping_the_status_does_not_make_the_engine_probe_its_ranks(name, procs, results):
    """Each scrape is a connection that comes and goes; a dropped connection used to make
    the engine probe (PONG) every rank, up to 20 times a second, waking their receiving
    threads. Only a rank's own connection dropping does that now: 30 scrapes in ~0.8 s
    cost the ranks no more probes than the heartbeat tick's (one per rank per second)."""
    leave = SPAWN.Event()
    with TaskQueue(name, 2) as queue:
        try:
            for rank in range(2):
                procs(connected_rank, results, rank, name, 2, leave)
            collect(results, "ready", 2)
            assert wait_until(lambda: all(r["state"] == "connected" for r in queue.ranks()), 10)
            before = queue.stats().get("probes", 0)
            start = time.monotonic()
            for _ in range(30):
                assert query_status(queue.endpoint, timeout=5)["tp_size"] == 2
                time.sleep(0.025)
            time.sleep(0.1)  # the last drop reported
            elapsed = time.monotonic() - start
            probes = queue.stats().get("probes", 0) - before
            assert probes <= 2 * (elapsed / queue.heartbeat.interval + 2), (probes, elapsed)
        finally:
            leave.set()
