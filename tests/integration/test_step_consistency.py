"""The core invariant, with real processes: at every step every TP rank takes exactly the
same batches, in put order, none lost and none twice, in async and sync mode."""

import pytest

from fastdeploy_sync import TaskQueue
from workers import check_consistency, collect, consistency_rank, put_with_pauses


@pytest.mark.parametrize("async_prefetch", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_rank_takes_the_same_batches_at_the_same_step(name, procs, results, tp,
                                                            async_prefetch):
    n = 1500
    with TaskQueue(name, tp, max_inflight=8) as queue:
        for rank in range(tp):
            procs(consistency_rank, results, rank, name, tp, n, async_prefetch, seed=tp)
        put_with_pauses(queue, n, seed=tp)
        steps = collect(results, "steps", tp, timeout=120)
        assert queue.num_tasks() == 0
    check_consistency(steps, tp, n)


@pytest.mark.parametrize("async_prefetch", [True, False], ids=["async", "sync"])
def test_steps_that_check_but_do_not_take(name, procs, results, async_prefetch):
    """FastDeploy's loop sometimes calls exist_tasks() and then takes nothing that step:
    what a rank takes must depend only on its own barrier generation's decision."""
    tp, n = 2, 600
    with TaskQueue(name, tp, max_inflight=4) as queue:
        for rank in range(tp):
            procs(consistency_rank, results, rank, name, tp, n, async_prefetch, seed=7,
                  skip_every=3)
        put_with_pauses(queue, n, seed=7)
        steps = collect(results, "steps", tp, timeout=120)
    check_consistency(steps, tp, n)
    assert all(step % 3 != 2 for step, _ in steps[0]), "a skipped step took batches"


@pytest.mark.parametrize("max_inflight", [1, 64])
def test_inflight_bounds(name, procs, results, max_inflight):
    """max_inflight=1 is FastDeploy's one-batch-at-a-time; a large bound lets steps take many."""
    tp, n = 2, 300
    with TaskQueue(name, tp, max_inflight=max_inflight) as queue:
        for rank in range(tp):
            procs(consistency_rank, results, rank, name, tp, n, True, seed=3)
        put_with_pauses(queue, n, seed=3)
        steps = collect(results, "steps", tp, timeout=120)
    check_consistency(steps, tp, n)
    if max_inflight == 1:
        assert all(len(ids) == 1 for _, ids in steps[0])
