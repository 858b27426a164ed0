"""Worker-process bodies for tests/integration/test_idle_wait.py (module-level so that spawn can import
them). Each reports ``(tag, rank, payload)`` to a multiprocessing queue; an exception is
reported as ``("error", rank, repr)`` (see ``fastdeploy_sync.testing.processes.report_errors``)."""

import os
import random
import time

from fastdeploy_sync import TaskClient
from fastdeploy_sync.testing.processes import report_errors
from workers import take_checked


def _exception(exc):
    return type(exc).__name__, str(exc), time.monotonic()


@report_errors
def wait_phases_rank(out, rank, name, tp, async_prefetch, idle_timeout):
    """Three phases, in lockstep with the test:

    1. no batch exists: rank 0's ``wait_for_tasks(idle_timeout)`` must time out; one
       empty step; report ("timed_out", rank, (result, seconds waited)).
    2. the test puts one batch: rank 0's ``wait_for_tasks(20)`` must return True; one
       step takes it; report ("arrived", rank, (result, monotonic time it returned,
       tasks taken, (stats, every rank's received watermark) when the wait returned)).
    3. the test closes the engine: rank 0 blocks in ``wait_for_tasks(30)``, the others in
       ``barrier(30)``; report ("raised", rank, (type, message, monotonic time)).
    """
    with TaskClient(name, tp, rank, async_prefetch=async_prefetch) as client:
        out.put(("ready", rank, os.getpid()))
        if rank == 0:
            t0 = time.monotonic()
            result = client.wait_for_tasks(idle_timeout)
            waited = time.monotonic() - t0
        else:
            result = waited = None
        client.barrier(timeout=30)
        assert client.get_tasks()[0] == [], "a batch before the test put one"
        out.put(("timed_out", rank, (result, waited)))

        # 20 s < the others' barrier timeout: a failed wait reports its state, below
        result = client.wait_for_tasks(20) if rank == 0 else None
        returned = time.monotonic()
        state = client.stats()
        client.barrier(timeout=30)
        tasks, _ = client.get_tasks()
        out.put(("arrived", rank, (result, returned, tasks, state)))

        try:
            if rank == 0:
                result = client.wait_for_tasks(30)
                raise AssertionError(f"wait_for_tasks() returned {result} after the engine "
                                     f"closed; stats {client.stats()}, error "
                                     f"{client._faults.error!r}, close seq {client._watch.close_seq}, "
                                     f"peer fault {client._group.peer_fault()}")
            client.barrier(timeout=30)
            raise AssertionError("barrier() returned after the engine closed")
        except Exception as exc:
            if isinstance(exc, AssertionError):
                raise
            out.put(("raised", rank, _exception(exc)))


@report_errors
def alternating_rank(out, rank, name, tp, n_batches, async_prefetch, seed, max_step_ms=2.0,
                     deadline_s=90.0):
    """``workers.consistency_rank`` with rank 0 alternating, step by step, between the
    blocking ``wait_for_tasks()`` (random timeouts of 0-5 ms, some of which pass) and the
    flag check ``exist_tasks()``. Reports ("steps", rank, ([(step, [batch ids])], waits)),
    waits being rank 0's (returned True, returned False) counts, None on other ranks."""
    rng = random.Random(seed * 1000 + rank)
    steps = []
    taken = 0
    waits = [0, 0]
    deadline = time.monotonic() + deadline_s
    with TaskClient(name, tp, rank, async_prefetch=async_prefetch) as client:
        step = 0
        while taken < n_batches:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: took {taken}/{n_batches} batches")
            if rank == 0:
                if step % 2:
                    client.exist_tasks()
                else:
                    waits[not client.wait_for_tasks(rng.random() * 0.005)] += 1
            client.barrier(timeout=30)
            if rng.random() < 0.2:  # a slow rank: the others may be at the next check
                time.sleep(rng.random() * max_step_ms / 1000)
            ids = take_checked(client)
            if ids:
                steps.append((step, ids))
                taken += len(ids)
            time.sleep(rng.random() * max_step_ms / 1000)  # the model step
            step += 1
        out.put(("steps", rank, (steps, tuple(waits) if rank == 0 else None)))
