"""close() from another thread (a shutdown or signal-handling thread, as servers have) while
the event loop is inside a step call: the call raises ClosedError within a bound, nothing is
freed under it, and the process lives on (it was killed by SIGSEGV: the group's semaphores
were closed under a waiter)."""

import pytest

from fastdeploy_sync import TaskQueue
from workers import close_from_thread_rank, collect, idle_peer_rank

CALLS = ["barrier", "wait_for_tasks", "sync_step", "exist_tasks", "get_tasks"]


@pytest.mark.parametrize("async_prefetch", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("call", CALLS)
def test_close_from_another_thread_during_a_step_call(name, procs, results, doomed, call,
                                                      async_prefetch):
    with TaskQueue(name, 2):
        peer = procs(idle_peer_rank, doomed, 1, name, 2, 60)
        rank0 = procs(close_from_thread_rank, results, 0, name, 2, call, async_prefetch)
        try:
            try:
                kind, message, raised_after_s, close_s, calls = collect(results, "closed", 1,
                                                                        timeout=30)[0]
            except AssertionError:
                rank0.join(timeout=5)
                if rank0.exitcode not in (None, 0):
                    raise AssertionError(f"rank 0's process died (exit code {rank0.exitcode}: "
                                         f"a negative code is the signal)") from None
                raise
        finally:
            rank0.join(timeout=20)
            peer.kill()
            peer.join(timeout=10)
    assert rank0.exitcode == 0, f"rank 0's process died: exit code {rank0.exitcode}"
    assert kind == "ClosedError", (kind, message)
    assert "closed" in message
    assert raised_after_s is not None and raised_after_s < 5.0, raised_after_s
    assert close_s < 5.0 and calls >= 1
