"""Rebuilding a client in-process: a new ``TaskClient`` object never inherits an old
incarnation's generation counters or decisions, so the core invariant (every rank takes the
same batches at the same step) holds across repeated engine restarts while workers build
their clients again at random points."""

import os
import random
import signal
import time

import pytest

from conftest import SPAWN
from workers import check_lives, collect, rebuild_storm_rank, storm_engine


@pytest.mark.parametrize("async_prefetch", [True, False], ids=["async", "sync"])
@pytest.mark.slow
def test_rebuild_storm_keeps_every_rank_identical(name, procs, results, async_prefetch):
    """20 engine lives (half killed at a random moment, half closed), two worker processes
    that rebuild their clients after every error and at random points."""
    lives, tp, seed = 20, 2, 15
    rng = random.Random(seed)
    seconds = 40.0
    for rank in range(tp):
        procs(rebuild_storm_rank, results, rank, name, tp, seconds, seed, async_prefetch)
    for life in range(lives):
        up = SPAWN.Queue()  # one per life: a killed engine may hold its queue's lock
        engine = procs(storm_engine, up, life, name, tp, 10_000, seed, 1.2)
        collect(up, "engine_up", 1, timeout=30)
        if rng.random() < 0.5:
            time.sleep(0.2 + rng.random())
            os.kill(engine.pid, signal.SIGKILL)
        engine.join(timeout=30)
        up.close()
    reports = collect(results, "lives", tp, timeout=seconds + 60)
    lives_by_rank = {rank: report[0] for rank, report in reports.items()}
    errors = {rank: report[1] for rank, report in reports.items()}
    taken = sum(len(ids) for steps in lives_by_rank[0].values() for _, ids in steps)
    assert taken > 0, f"nothing was taken: {errors}"
    problems = check_lives(lives_by_rank)
    assert not problems, "\n".join(problems[:10]) + f"\nerrors: {errors}"
    protocol = [(rank, e) for rank, err in errors.items() for e in err if "ProtocolError" in e]
    assert not protocol, protocol


@pytest.mark.usefixtures("loopback_tcp")
@pytest.mark.parametrize("async_prefetch", [True, False], ids=["async", "sync"])
def test_a_group_split_across_engine_instances_takes_nothing(name, procs, results,
                                                             async_prefetch):
    """The ranks of one group welcomed by two different engines (a restart racing with the
    group's start, seen in the storm above: rank 0 bound to the old engine and rank 1 to
    the new one took different batches under the same seqs; here, deterministically, two
    live engines): seqs are an engine's, so rank 0 must not latch, and every rank stops."""
    from fastdeploy_sync import TaskQueue
    from workers import step_until_error_rank

    with TaskQueue(name, 2, endpoint="tcp://127.0.0.1:0") as first, \
            TaskQueue(name, 2, dp_id=1, endpoint="tcp://127.0.0.1:0") as second:
        for rank, engine in enumerate((first, second)):
            procs(step_until_error_rank, results, rank, name, 2, async_prefetch,
                  engine.endpoint, report_after=1)
        collect(results, "ready", 2)
        first.put_tasks("from the first engine", timeout=10)
        second.put_tasks("from the second engine", timeout=10)
        raised = collect(results, "raised", 2, timeout=30)
    for rank in range(2):
        assert raised[rank]["taken"] == [], raised
        assert raised[rank]["cause"] == "EngineGoneError", raised[rank]
    assert "welcomed by different engine instances" in raised[0]["message"], raised[0]
