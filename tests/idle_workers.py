"""Worker-process bodies for tests/integration/test_idle_wait.py (module-level so that spawn can import
them). Each reports ``(tag, rank, payload)`` to a multiprocessing queue; an exception is
reported as ``("error", rank, repr)`` (see ``fastdeploy_sync.testing.processes.report_errors``)."""

import os
import time

from fastdeploy_sync import TaskClient
from fastdeploy_sync.testing.processes import report_errors


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
