"""FastDeploy's worker loop shapes (testing/fd_loops.py: develop's exist_tasks(), 2.x's
num_tasks() > 0, 2.0's barrier at the top) over the drop-in, one node, async and sync, TP
and DP sizes of the compatibility table, with FastDeploy's engine loop (wait while
exist_tasks(), then put). Every rank must take identical batches at identical steps, each
batch once, in order."""

import threading

import pytest

from conftest import SPAWN
from fastdeploy_sync.fastdeploy import EngineWorkerQueue
from fastdeploy_sync.testing.fd_loops import (
    ControlRequest,
    batches,
    check_group,
    engine_loop,
    ids_of,
    loop_worker,
    v0_engine_process,
)

RESULT_TIMEOUT_S = 90


def run_shape(name, procs, results, shape, tp, dp, n, *, sync=False, every_control=0,
              step_ms=0.0, busy_steps=1, max_inflight=None):
    kw = {} if max_inflight is None else {"max_inflight": max_inflight}
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=tp,
                               local_data_parallel_size=dp, name=name, **kw)
    try:
        address = ("0.0.0.0", server.get_server_port())
        keep = []  # the parent holds every barrier until the children attached it
        for d in range(dp):
            barrier, signal = SPAWN.Barrier(tp), SPAWN.Value("i", 0)
            keep.append((barrier, signal))
            for r in range(tp):
                procs(loop_worker, address, shape, tp, r, d, barrier, signal, results,
                      sync=sync, name=name, step_ms=step_ms, busy_steps=busy_steps)
        put = {d: batches(d, n, every_control=every_control) for d in range(dp)}
        errors = []

        def engine(d):
            client = EngineWorkerQueue(address=address, num_client=tp, client_id=0,
                                       local_data_parallel_id=d, name=name)
            try:
                engine_loop(client, put[d], put_timeout=30)
            except BaseException as exc:  # reported below, with the workers' view
                errors.append(exc)

        threads = [threading.Thread(target=engine, args=(d,)) for d in range(dp)]
        for t in threads:
            t.start()
        reports = {}
        for _ in range(tp * dp):
            kind, d, r, payload = results.get(timeout=RESULT_TIMEOUT_S)
            assert kind == "ok", f"{shape}: dp {d} rank {r} failed:\n{payload}"
            reports[(d, r)] = payload
        for t in threads:
            t.join(timeout=30)
        assert not errors, errors
    finally:
        server.cleanup()
    for d in range(dp):
        check_group({r: reports[(d, r)] for r in range(tp)}, tp, d, ids_of(put[d]))
    return reports


CELLS = [(tp, dp) for tp, dp in [(1, 2), (2, 1), (2, 2), (4, 1)]]


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
@pytest.mark.parametrize("tp,dp", CELLS, ids=[f"tp{t}-dp{d}" for t, d in CELLS])
@pytest.mark.parametrize("shape", ["develop", "v2x", "v20"])
def test_loop_shape_one_node(name, procs, results, shape, tp, dp, sync):
    """Before the fix, v2x and v20 (rank 0 checks num_tasks() > 0) raised ProtocolError on
    the first get_tasks() at TP > 1."""
    run_shape(name, procs, results, shape, tp, dp, 30, sync=sync)


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
@pytest.mark.parametrize("shape", ["develop", "v2x"])
def test_loop_shape_tp8(name, procs, results, shape, sync):
    run_shape(name, procs, results, shape, 8, 1, 8, sync=sync)


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_sync_fallback_idle_loop_tp2_dp2(name, procs, results, sync):
    """This library's sync fallback (DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM=1) under FastDeploy's
    idle loop (the idle branch's barrier and 1 ms sleep, no collective), one batch at a
    time, 50 batches per DP group; the same run in async mode."""
    run_shape(name, procs, results, "develop", 2, 2, 50, sync=sync)


@pytest.mark.parametrize("shape", ["develop", "v2x"])
def test_control_requests_travel_like_batches(name, procs, results, shape):
    """FastDeploy puts ControlRequest objects through the task queue as ([request], bsz):
    every rank takes each one at the same step as its peers, in put order among batches."""
    reports = run_shape(name, procs, results, shape, 2, 1, 12, every_control=3)
    ids = [x for _, _, got in reports[(0, 0)]["calls"] for x in got]
    assert [x for x in ids if x[0] == "control"] == [("control", 2), ("control", 5),
                                                     ("control", 8), ("control", 11)]
    assert ControlRequest(1, "x").method == "x"


@pytest.mark.parametrize("use_exist", [False, True], ids=["num_tasks", "exist_tasks"])
def test_v0_scheduler_engine_loop(name, procs, results, use_exist):
    """FastDeploy's V0 scheduler (forced on every platform but CUDA/XPU/MACA and whenever
    ENABLE_V1_KVCACHE_SCHEDULER=0) asks num_cache_infos() before every put. Its engine, in
    a process of its own with FastDeploy's plain client_id=0 client, puts and the TP=2
    group takes every batch. Before: num_cache_infos() raised AttributeError and nothing
    was put."""
    tp, n = 2, 15
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=tp,
                               name=name)
    try:
        address = ("0.0.0.0", server.get_server_port())
        barrier, signal = SPAWN.Barrier(tp), SPAWN.Value("i", 0)
        for r in range(tp):
            procs(loop_worker, address, "develop", tp, r, 0, barrier, signal, results,
                  name=name)
        engine_results = SPAWN.Queue()
        procs(v0_engine_process, address, tp, 0, n, engine_results, name=name,
              use_exist=use_exist)
        kind, _, _, waits = engine_results.get(timeout=RESULT_TIMEOUT_S)
        assert kind == "engine", waits
        assert waits["role"] == "engine" and waits["tasks"] > 0, waits
        reports = {}
        for _ in range(tp):
            kind, _, r, payload = results.get(timeout=RESULT_TIMEOUT_S)
            assert kind == "ok", f"rank {r}:\n{payload}"
            reports[r] = payload
    finally:
        server.cleanup()
    check_group(reports, tp, 0, ids_of(batches(0, n)))
