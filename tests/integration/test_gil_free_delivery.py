"""A batch that reached the node is taken at the first step boundary after ``put_tasks()``
returned, whatever the step does with the GIL.

Every rank's step is pure Python under ``sys.setswitchinterval(1.0)``: a background thread
of a rank then practically never gets the GIL while the step runs, so anything that needs a
rank's thread to run before rank 0 may latch a batch shows as a batch taken a step late.
The property is exact (no timing in the assertion): the engine writes the batch into the
node's ring before ``put_tasks()`` returns, and rank 0's check reads the ring, so a check
that began after the return sees it. Timestamps are CLOCK_MONOTONIC, shared by every
process of the machine.
"""

import random
import sys
import time

import numpy as np
import pytest

from fastdeploy_sync import TaskClient, TaskQueue
from fastdeploy_sync.testing.processes import report_errors
from workers import collect, wait_until

STEP_MS = 3.0


def _spin(ms):
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


@report_errors
def gil_holding_rank(out, rank, name, tp, n, async_prefetch):
    """Rank 0 records, per step, when its check began and the ids the step took; every
    rank checks that it took the same ids."""
    sys.setswitchinterval(1.0)
    steps = []
    taken = 0
    deadline = time.monotonic() + 90
    with TaskClient(name, tp, rank, async_prefetch=async_prefetch) as client:
        def welcomed():  # sync mode: num_tasks() receives
            if client.stats()["engine"] is not None:
                return True
            client.num_tasks()
            return False

        wait_until(welcomed, timeout=deadline - time.monotonic(), interval=0.001,
                   what=f"rank {rank}: the engine's welcome")
        client.barrier(timeout=30)
        if rank == 0:  # every rank has attached the ring and published its engine: from now
            # on a put is the node's at once (the peers wait in the barrier, GIL released,
            # while their receiving threads finish handling the WELCOME)
            while not client._group.all_welcomed(client._watch.engine):
                assert time.monotonic() < deadline, "a peer never attached the ring"
                time.sleep(0.001)
        client.barrier(timeout=30)
        out.put(("ready", rank, None))
        while taken < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: took {taken}/{n}")
            began = time.monotonic_ns()
            if rank == 0:
                client.exist_tasks()
            client.barrier(timeout=30)
            tasks, _ = client.get_tasks()
            ids = [int(t["id"]) for t in tasks]
            steps.append((began, ids))
            taken += len(ids)
            _spin(STEP_MS)  # the model step: holds the GIL the whole time
        out.put(("steps", rank, steps))
        out.put(("stats", rank, client.stats()))


@pytest.mark.parametrize("async_prefetch", [True, False], ids=["async", "sync"])
def test_every_batch_is_taken_at_the_first_step_after_put_returned(name, procs, results,
                                                                  async_prefetch):
    tp, n = 2, 40
    rng = random.Random(5)
    returned = {}
    with TaskQueue(name, tp, max_inflight=4) as queue:
        for rank in range(tp):
            procs(gil_holding_rank, results, rank, name, tp, n, async_prefetch)
        collect(results, "ready", tp, timeout=60)
        for i in range(n):
            time.sleep(0.002 + rng.random() * 0.008)  # lands anywhere in a step
            batch = {"id": i, "ids": np.arange(64 * 512, dtype=np.int64) + i}
            queue.put_tasks(batch, timeout=30)
            returned[i] = time.monotonic_ns()
        steps = collect(results, "steps", tp, timeout=120)
        stats = collect(results, "stats", tp, timeout=30)
    assert steps[0] and [ids for _, ids in steps[0]] == [ids for _, ids in steps[1]]
    assert [i for _, ids in steps[0] for i in ids] == list(range(n))
    took = {i: k for k, (_, ids) in enumerate(steps[0]) for i in ids}
    late = []
    for i, at in returned.items():
        # (a step that began before ``at`` may have taken it: the batch was published
        # before put_tasks() returned, and ``at`` is read after the return)
        first = next((k for k, (began, _) in enumerate(steps[0]) if began > at), len(steps[0]))
        if took[i] > first:
            late.append((i, took[i] - first))
    assert not late, f"batches taken after the first step that began after their put " \
                     f"returned (id, steps late): {late}"
    # the property did not depend on a rank's thread: the event loop decoded them itself
    assert all(s.get("ring") for s in stats.values()), stats
