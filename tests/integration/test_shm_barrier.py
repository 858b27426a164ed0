"""``fastdeploy_sync.tp.ShmBarrier``: the node-local barrier alone, as the ``profile``
command's model collective and a user's own loops use it. Real processes."""

import gc
import glob
import os

import pytest

from fastdeploy_sync import BarrierTimeoutError, ForkedProcessError
from fastdeploy_sync.tp import ShmBarrier
from workers import collect, shm_barrier_rank


def test_ranks_pass_together_and_see_when_the_last_one_arrived(name, procs, results):
    """Both ranks pass every generation, and ``last_arrival_ns()`` is an instant within
    this rank's wait (not later: a partner may already stand at the next generation)."""
    import time

    rounds = 50
    procs(shm_barrier_rank, results, 1, name, 2, rounds)
    with ShmBarrier(name, 2, 0) as barrier:
        for _ in range(rounds):
            before = time.monotonic_ns()
            barrier.wait(timeout=30)
            assert before <= barrier.last_arrival_ns() <= time.monotonic_ns()
        assert len(collect(results, "passed", 1)[1]) == rounds
        barrier.wait(timeout=30)


def test_a_rank_that_never_comes_is_named_and_close_frees_every_name(name):
    gc.disable()  # the names go at close(), not when the object is collected
    try:
        barrier = ShmBarrier(name, 2, 0)
        assert glob.glob(f"/dev/shm/*{name}*")
        with pytest.raises(BarrierTimeoutError, match="rank 1"):
            barrier.wait(timeout=0.5)
        assert barrier.close() is True
        assert glob.glob(f"/dev/shm/*{name}*") == []
        assert barrier.close() is True  # idempotent
    finally:
        gc.enable()


def test_a_forked_child_cannot_use_its_parents_barrier(name):
    with ShmBarrier(name, 1, 0) as barrier:
        pid = os.fork()
        if pid == 0:  # the child: every call refused, close() touches nothing
            code = 1
            try:
                barrier.wait(timeout=1)
            except ForkedProcessError:
                code = 0 if barrier.close() is None else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        barrier.wait(timeout=5)  # still the parent's, still works (TP=1: passes at once)
