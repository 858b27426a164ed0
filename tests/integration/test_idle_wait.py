"""Rank 0's blocking wait for work (``TaskClient.wait_for_tasks``), with real processes:
it times out, wakes when a batch arrives, raises at once when the engine closes, in async
and sync mode at TP 1/2/4; and step consistency holds when rank 0 alternates between it
and ``exist_tasks()``. No timing is asserted beyond "before the 20-30 s timeouts"."""

import time

import pytest

from fastdeploy_sync import TaskClient, TaskQueue
from idle_workers import wait_phases_rank
from workers import check_consistency, collect, consistency_rank, put_with_pauses

MODES = pytest.mark.parametrize("async_prefetch", [True, False], ids=["async", "sync"])


@MODES
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_wait_times_out_wakes_on_a_batch_and_raises_on_close(name, procs, results, tp,
                                                              async_prefetch):
    idle_timeout = 0.25
    queue = TaskQueue(name, tp)
    try:
        for rank in range(tp):
            procs(wait_phases_rank, results, rank, name, tp, async_prefetch, idle_timeout)
        collect(results, "ready", tp)

        timed_out = collect(results, "timed_out", tp)
        result, waited = timed_out[0]
        assert result is False
        assert waited >= idle_timeout - 0.01, f"returned after {waited:.3f}s, before its timeout"

        put_at = time.monotonic()
        queue.put_tasks("batch-1", timeout=10)
        try:
            arrived = collect(results, "arrived", tp, timeout=30)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the engine's view: {queue.stats()}") from None
        result, returned, _, state = arrived[0]
        assert result is True, (f"rank 0 timed out; its stats and the group's watermarks: "
                                f"{state}; the engine's view: {queue.stats()}")
        assert returned - put_at < 10, "woke by its 20 s timeout, not by the batch"
        assert all(report[2] == ["batch-1"] for report in arrived.values())
    finally:
        closed_at = time.monotonic()
        queue.close()
    raised = collect(results, "raised", tp, timeout=20)
    for rank, (kind, message, at) in raised.items():
        assert kind == "EngineClosedError", f"rank {rank}: {kind}: {message}"
        assert at - closed_at < 10, f"rank {rank} raised by its timeout, not at the close"


def test_wait_is_rank_0s(name):
    with TaskQueue(name, 1):
        with TaskClient(name, 1, 0) as client:
            assert client.wait_for_tasks(0) is False
    with pytest.raises(RuntimeError, match="rank 0"):
        TaskClient.wait_for_tasks(_Rank1(), 0.01)


class _Rank1:
    """Enough of a TaskClient for wait_for_tasks to refuse it before touching anything."""
    name, tp_rank = "x", 1


@pytest.mark.parametrize("tp,async_prefetch", [(2, True), (4, True), (2, False)],
                         ids=["tp2-async", "tp4-async", "tp2-sync"])
def test_consistency_when_rank0_alternates_wait_and_check(name, procs, results, tp,
                                                          async_prefetch):
    n = 400
    with TaskQueue(name, tp, max_inflight=8) as queue:
        for rank in range(tp):
            procs(consistency_rank, results, rank, name, tp, n, async_prefetch, seed=tp,
                  alternate_wait=True)
        put_with_pauses(queue, n, seed=tp)
        reports = collect(results, "steps", tp, timeout=120)
    check_consistency({rank: steps for rank, (steps, _) in reports.items()}, tp, n)
    waits = reports[0][1]
    assert waits[0] > 0, "no wait_for_tasks() returned True: the test did not exercise it"
