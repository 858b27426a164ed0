"""The core invariant, with real processes: at every step every TP rank takes exactly the
same batches, in put order, none lost and none twice, in async and sync mode."""

import random
import time

import pytest

from fastdeploy_sync import TaskQueue

from workers import collect, consistency_rank, make_batch


def _put_with_pauses(queue, n, seed):
    rng = random.Random(seed)
    for i in range(n):
        queue.put_tasks(make_batch(i), timeout=30)
        if rng.random() < 0.05:  # the engine is busy elsewhere now and then
            time.sleep(rng.random() * 0.01)


def _check(steps_by_rank, tp, n):
    reference = steps_by_rank[0]
    for rank in range(1, tp):
        assert steps_by_rank[rank] == reference, f"rank {rank} took different batches than rank 0"
    flat = [batch_id for _, ids in reference for batch_id in ids]
    assert flat == list(range(n)), "batches lost, duplicated or out of put order"


@pytest.mark.parametrize("async_prefetch", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_rank_takes_the_same_batches_at_the_same_step(name, procs, results, tp,
                                                            async_prefetch):
    n = 1500
    with TaskQueue(name, tp, max_inflight=8) as queue:
        for rank in range(tp):
            procs(consistency_rank, results, rank, name, tp, n, async_prefetch, seed=tp)
        _put_with_pauses(queue, n, seed=tp)
        steps = collect(results, "steps", tp, timeout=120)
        assert queue.num_tasks() == 0
    _check(steps, tp, n)


@pytest.mark.parametrize("async_prefetch", [True, False], ids=["async", "sync"])
def test_steps_that_check_but_do_not_take(name, procs, results, async_prefetch):
    """FastDeploy's loop sometimes calls exist_tasks() and then takes nothing that step:
    what a rank takes must depend only on its own barrier generation's decision."""
    tp, n = 2, 600
    with TaskQueue(name, tp, max_inflight=4) as queue:
        for rank in range(tp):
            procs(consistency_rank, results, rank, name, tp, n, async_prefetch, seed=7,
                  skip_every=3)
        _put_with_pauses(queue, n, seed=7)
        steps = collect(results, "steps", tp, timeout=120)
    _check(steps, tp, n)
    assert all(step % 3 != 2 for step, _ in steps[0]), "a skipped step took batches"


@pytest.mark.parametrize("max_inflight", [1, 64])
def test_inflight_bounds(name, procs, results, max_inflight):
    """max_inflight=1 is FastDeploy's one-batch-at-a-time; a large bound lets steps take many."""
    tp, n = 2, 300
    with TaskQueue(name, tp, max_inflight=max_inflight) as queue:
        for rank in range(tp):
            procs(consistency_rank, results, rank, name, tp, n, True, seed=3)
        _put_with_pauses(queue, n, seed=3)
        steps = collect(results, "steps", tp, timeout=120)
    _check(steps, tp, n)
    if max_inflight == 1:
        assert all(len(ids) == 1 for _, ids in steps[0])
