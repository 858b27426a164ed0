"""The FastDeploy drop-in (``fastdeploy_sync.fastdeploy.EngineWorkerQueue``) under FastDeploy's
own engine and worker loops, with real processes, sockets and shared memory.

FastDeploy's queue tests (tests/inter_communicator/test_engine_worker_queue.py) ported:
  * test_put_get_tasks_and_clear_data   -> test_put_get_num_tasks_and_clear (engine and
    worker on separate instances: here one instance is either side, see the module docstring)
  * test_queue_exist_tasks_and_ports    -> test_ports_and_server_only_port (tcp, port 0)
  * test_single_node_signal_updates     -> test_exist_tasks_is_derived (intended difference:
    set_exist_tasks(True) does not create a batch)
  * test_connect_retry_failure          -> test_fail_fast_without_server
  * to_tensor / to_numpy, cache info, RDMA connect, finished requests, disaggregation,
    barriers, lock: tests/integration/test_fastdeploy_channels.py.
"""

import os
import threading
import time

import pytest

from conftest import SPAWN
from fastdeploy_sync.errors import GroupLostError
from fastdeploy_sync.fastdeploy import EngineWorkerQueue
from fd_workers import (
    STOP,
    batch,
    ep_dp_engine_process,
    fd_engine_loop,
    fd_engine_process,
    fd_worker_loop,
)
from workers import wait_until

RESULT_TIMEOUT_S = 60


def _collect(results, n):
    out = {}
    for _ in range(n):
        kind, dp_id, rank, payload = results.get(timeout=RESULT_TIMEOUT_S)
        assert kind == "ok", f"dp {dp_id} rank {rank} failed:\n{payload}"
        out[(dp_id, rank)] = payload
    return out


def _run_group(name, procs, results, tp, dp, n, *, sync=False, max_inflight=1, clear_after=None,
               wait_exist=True, pause=None, max_step_ms=2.0, clear_at=None):
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=tp,
                               local_data_parallel_size=dp, name=name, max_inflight=max_inflight)
    try:
        port = server.get_server_port()
        address = ("0.0.0.0", port)
        keep = []  # the parent must hold every barrier until the children attached it
        for d in range(dp):
            barrier, signal = SPAWN.Barrier(tp), SPAWN.Value("i", 0)
            keep.append((barrier, signal))
            for r in range(tp):
                procs(fd_worker_loop, address, tp, r, d, barrier, signal, results, sync=sync,
                      name=name, seed=d * 10 + r, pause=pause, max_step_ms=max_step_ms,
                      clear_at=clear_at)
        clients = [EngineWorkerQueue(address=address, is_server=False, num_client=tp,
                                     client_id=0, local_data_parallel_id=d, name=name)
                   for d in range(dp)]
        assert all(c.role == "engine" for c in clients)
        errors = []

        def engine(c, d):
            try:
                fd_engine_loop(c, d, n, clear_after=clear_after, wait_exist=wait_exist)
            except BaseException as exc:  # reported below, with the workers' view
                errors.append(exc)

        threads = [threading.Thread(target=engine, args=(c, d)) for d, c in enumerate(clients)]
        for t in threads:
            t.start()
        out = _collect(results, tp * dp)
        for t in threads:
            t.join(timeout=30)
        assert not errors, errors
        return out
    finally:
        server.cleanup()


def _check_consistent(out, tp, dp, n, cleared=0):
    for d in range(dp):
        ranks = [out[(d, r)] for r in range(tp)]
        ref = ranks[0]["calls"]
        for r in range(1, tp):
            # identical batches at identical steps and calls on every rank
            assert [(s, c, ids) for s, c, ids, _ in ranks[r]["calls"]] == \
                   [(s, c, ids) for s, c, ids, _ in ref], f"dp {d}: rank {r} differs from rank 0"
        # exactly one all_client_read per get_tasks call, hence per batch
        for i in range(len(ref)):
            assert sum(rk["calls"][i][3] for rk in ranks) == 1, f"dp {d} call {ref[i][1]}"
        taken = [x for _, _, ids, _ in ref for x in ids]
        assert taken[-1] == STOP and taken.count(STOP) == 1
        # only this DP group's batches, each once, in order; with a clear, the cleared
        # ones never show up and every rank dropped the same number
        ks = [x[1] for x in taken[:-1]]
        assert all(x[0] == d for x in taken[:-1]), f"dp {d} took another group's batch"
        assert ks == sorted(set(ks)), ks
        assert len(ks) == n - cleared, (ks, cleared)
        assert {rk["cleared"] for rk in ranks} == {cleared}


@pytest.mark.parametrize("tp,dp,sync", [(1, 1, False), (2, 1, False), (4, 1, False),
                                        (2, 1, True), (2, 2, False), (1, 2, True)])
def test_fastdeploy_loops_step_consistency(name, procs, results, tp, dp, sync):
    """Engine = server + client(client_id=0) with FastDeploy's wait-then-put loop; workers run
    event_loop_normal's task path with their own barrier; random step times."""
    n = 25
    out = _run_group(name, procs, results, tp, dp, n, sync=sync)
    _check_consistent(out, tp, dp, n)


def test_pipelined_window(name, procs, results):
    """max_inflight=4 and an engine that puts back to back: several batches per take, still
    identical on every rank."""
    n = 40
    out = _run_group(name, procs, results, 2, 1, n, max_inflight=4, wait_exist=False)
    _check_consistent(out, 2, 1, n)
    assert any(len(ids) > 1 for _, _, ids, _ in out[(0, 0)]["calls"]), "never took 2 at once"


def test_clear_data_with_batches_in_flight(name, procs, results):
    """Workers stall at step 0 while the engine puts 3 batches, clears, puts 3 more: every
    rank drops the same 3 (held in every rank's slot, some possibly already latched),
    none of them is ever returned, everything put after the clear is taken."""
    n = 6
    out = _run_group(name, procs, results, 2, 1, n, max_inflight=4, wait_exist=False,
                     clear_after=2, pause=(0, 0.5))
    _check_consistent(out, 2, 1, n, cleared=3)
    taken = [x for _, _, ids, _ in out[(0, 0)]["calls"] for x in ids]
    assert taken == [(0, 3), (0, 4), (0, 5), STOP]


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_worker_clear_data_drops_the_same_batches_on_every_rank(name, procs, results, sync):
    """FastDeploy's weight update: every rank calls clear_data() at the same step, after the
    barrier, while batches are pending. Every rank drops the same batches (what they held),
    none of them is returned, and what the engine puts after is delivered. Before: a
    worker's clear_data() dropped nothing."""
    n = 6
    out = _run_group(name, procs, results, 2, 1, n, sync=sync, max_inflight=4,
                     wait_exist=False, pause=(1, 0.5), clear_at=1)
    cleared = {out[(0, r)]["cleared"] for r in range(2)}
    assert len(cleared) == 1 and min(cleared) >= 1, cleared
    dropped = cleared.pop()
    ref = out[(0, 0)]["calls"]
    assert [(s, c, ids) for s, c, ids, _ in out[(0, 1)]["calls"]] == \
        [(s, c, ids) for s, c, ids, _ in ref]
    taken = [x for _, _, ids, _ in ref for x in ids]
    assert taken == [(0, k) for k in range(dropped, n)] + [STOP], (dropped, taken)


@pytest.mark.serial
def test_rank_calling_get_tasks_more_often_raises(name, procs, results):
    """The caller's contract broken on purpose: rank 1 calls get_tasks() once more at step
    3. A rank raises ProtocolError within a few steps instead of the group drifting a call
    apart."""
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=2, name=name)
    try:
        address = ("0.0.0.0", server.get_server_port())
        barrier, signal = SPAWN.Barrier(2), SPAWN.Value("i", 0)
        for r in range(2):
            procs(fd_worker_loop, address, 2, r, 0, barrier, signal, results, name=name,
                  extra_call=(1, 3), deadline_s=60.0)
        engine = EngineWorkerQueue(address=address, client_id=0, num_client=2, name=name)
        try:  # the workers stop taking once rank 1 raised: the engine's puts time out, or
            # the engine learns first that the group is lost (a rank's client said BYE).
            # Bounds a loaded machine's start-up meets: with 2 s, the engine gave up before
            # the workers had connected, and their 2 s barrier broke before step 3 (now
            # the default, 20 s: the rank left behind by the one that raised waits that long).
            fd_engine_loop(engine, 0, 10, put_timeout=30.0)
        except (TimeoutError, GroupLostError):
            pass
        got = {}
        for _ in range(2):
            kind, _, rank, payload = results.get(timeout=RESULT_TIMEOUT_S)
            got[rank] = (kind, payload)
        # the rank ahead, or a peer, finds the call counts apart (whichever calls second
        # on a step where the ahead rank is not the slowest)
        errors = [p for kind, p in got.values() if kind == "error" and "ProtocolError" in p]
        assert errors, got
        # the message names the loop rule that was broken and how to fix it (the extra
        # call is either past what rank 0 checked for, or ahead of a peer's calls)
        assert "Fix the worker loop" in errors[0]
        assert ("rank 0 has not checked for tasks" in errors[0]
                or "call get_tasks() at the same steps" in errors[0]), errors[0]
    finally:
        server.cleanup()


def _worker_thread(address, name, **kw):
    """A TP=1 worker in this process (role="worker": this process also holds the server)."""
    return EngineWorkerQueue(address=address, is_server=False, num_client=1, client_id=0,
                             name=name, role="worker", connect_timeout=10, **kw)


def test_put_get_num_tasks_and_clear(name):
    """FastDeploy's test_put_get_tasks_and_clear_data, with the engine's client and the
    worker as two instances."""
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=1, name=name)
    try:
        address = ("0.0.0.0", server.get_server_port())
        engine = EngineWorkerQueue(address=address, is_server=False, num_client=1, client_id=0,
                                   name=name)
        worker = _worker_thread(address, name)
        try:
            assert engine.connected_client_counter.get() == 1
            tasks = ["task-A"]
            engine.put_tasks(tasks)
            assert engine.num_tasks() == 1
            wait_until(worker.exist_tasks, interval=0.002, what="worker.exist_tasks()")
            fetched, all_read = worker.get_tasks()
            assert all_read and fetched == [tasks]
            wait_until(lambda: engine.num_tasks() == 0, interval=0.002, what="engine.num_tasks() == 0")
            assert not engine.exist_tasks()
            # put, clear: FastDeploy's engine reads an empty queue at once and may put again,
            # and its exist_tasks() stays True until the workers drained what was cleared;
            # the worker never gets the cleared batch
            engine.put_tasks(tasks)
            engine.clear_data()
            assert engine.num_tasks() == 0 and engine.exist_tasks()
            engine.clear_data()  # nothing put since: adds nothing
            engine.put_tasks(["task-C"], timeout=1)  # no wait for the workers
            assert engine.num_tasks() == 1 and engine.exist_tasks()
            wait_until(lambda: worker.num_tasks() == 3, interval=0.002,
                       what="worker.num_tasks() == 3")  # the batch, the marker, task-C
            assert worker.exist_tasks()
            fetched, all_read = worker.get_tasks()
            assert fetched == [["task-C"]] and all_read and worker.cleared == 1
            wait_until(lambda: engine.num_tasks() == 0, interval=0.002, what="engine.num_tasks() == 0")
            assert not engine.exist_tasks()  # drained
            # cleared, then drained by the workers alone: the flag falls with the drain
            engine.put_tasks(["task-E"])
            engine.clear_data()
            assert engine.num_tasks() == 0 and engine.exist_tasks()
            wait_until(lambda: worker.num_tasks() == 2, interval=0.002,
                       what="worker.num_tasks() == 2")  # the batch and the marker
            assert worker.exist_tasks()
            assert worker.get_tasks() == ([], True) and worker.cleared == 2
            wait_until(lambda: not engine.exist_tasks(), interval=0.002, what="not engine.exist_tasks()")
            engine.clear_data()  # nothing pending: a no-op
            assert engine.num_tasks() == 0
            # worker-side clear_data empties what the worker holds, as FastDeploy's
            engine.put_tasks(["task-B"])
            wait_until(worker.exist_tasks, interval=0.002, what="worker.exist_tasks()")
            worker.clear_data()
            assert worker.get_tasks() == ([], True) and worker.cleared == 3
            engine.put_tasks(["task-D"], timeout=5)
            wait_until(worker.exist_tasks, interval=0.002, what="worker.exist_tasks()")
            assert worker.get_tasks() == ([["task-D"]], True)
        finally:
            worker.cleanup()
    finally:
        server.cleanup()


def test_unix_socket_path_addresses(name):
    """FastDeploy's FD_ENGINE_TASK_QUEUE_WITH_SHM: engine and workers pass the path
    /dev/shm/fd_task_queue_<port>.sock instead of (host, port). It is node-local, names
    the same queue as ("0.0.0.0", port), and nothing is created at the path itself."""
    path = f"/dev/shm/{name}_task_queue.sock"  # no port in it: the queue is named by the file
    server = EngineWorkerQueue(address=path, is_server=True, num_client=1)
    try:
        assert server.address == path and server.is_single_node
        engine = EngineWorkerQueue(address=path, is_server=False, num_client=1, client_id=0)
        assert engine.role == "engine"
        worker = _worker_thread(path, None)
        try:
            engine.put_tasks(["via-path"])
            wait_until(worker.exist_tasks, interval=0.002, what="worker.exist_tasks()")
            assert worker.get_tasks() == ([["via-path"]], True)
            assert not os.path.exists(path)
        finally:
            worker.cleanup()
    finally:
        server.cleanup()
    # a port in the file name: the same queue as the (host, port) form
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=1, name=name)
    try:
        port = server.get_server_port()
        worker = _worker_thread(f"/dev/shm/fd_task_queue_{port}.sock", name)
        try:
            engine = EngineWorkerQueue(address=("0.0.0.0", port), client_id=0, name=name)
            engine.put_tasks(["via-port"])
            wait_until(worker.exist_tasks, interval=0.002, what="worker.exist_tasks()")
            assert worker.get_tasks() == ([["via-port"]], True)
        finally:
            worker.cleanup()
    finally:
        server.cleanup()
    with pytest.raises(ValueError, match="unix socket path"):
        EngineWorkerQueue(address=("0.0.0.0",), is_server=True)


def test_put_blocks_one_batch_at_a_time(name):
    """FastDeploy's put_tasks waits until every rank read the previous batch."""
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=1, name=name)
    try:
        engine = EngineWorkerQueue(address=("0.0.0.0", server.get_server_port()),
                                   is_server=False, num_client=1, client_id=0, name=name)
        engine.put_tasks(batch(0, 0))
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            engine.put_tasks(batch(0, 1), timeout=0.2)
        assert time.monotonic() - t0 >= 0.2
        assert engine.num_tasks() == 1
    finally:
        server.cleanup()


def test_ports_and_server_only_port(name, loopback_tcp):
    """FastDeploy's test_queue_exist_tasks_and_ports: a tcp server on port 0 reports its real
    port; a client asking for it gets RuntimeError. Two DP groups use port and port + 1."""
    server = EngineWorkerQueue(address=("127.0.0.1", 0), is_server=True, num_client=1,
                               local_data_parallel_size=2)
    try:
        port = server.get_server_port()
        assert port > 0 and server.address == ("127.0.0.1", port)
        assert [q.endpoint for q in server._queues] == [f"tcp://127.0.0.1:{port}",
                                                        f"tcp://127.0.0.1:{port + 1}"]
        # name=None: the worker derives the queue name from the port, as FastDeploy's do
        worker = _worker_thread(("127.0.0.1", port), None, local_data_parallel_id=1)
        try:
            with pytest.raises(RuntimeError):
                worker.get_server_port()
            assert not worker.exist_tasks()
            engine = EngineWorkerQueue(address=("127.0.0.1", port), client_id=0,
                                       local_data_parallel_id=1)
            with pytest.raises(RuntimeError):
                engine.get_server_port()
            engine.put_tasks(["dp1"])
            assert worker._name == server._name == f"fdq{port}"  # workers know the port only
            wait_until(worker.exist_tasks, interval=0.002, what="worker.exist_tasks()")
            assert worker.get_tasks() == ([["dp1"]], True)
            assert server.num_connected_clients() == 0  # the server's own group 0
            assert engine.num_connected_clients() == 1
        finally:
            worker.cleanup()
    finally:
        server.cleanup()


def test_exist_tasks_is_derived(name):
    """FastDeploy's test_single_node_signal_updates: set_exist_tasks(True) creates no batch
    here (an intended difference: the flag follows the queue), and set_exist_tasks(False)
    with a batch pending clears the engine's flag until the next put, as FastDeploy's."""
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=1, name=name)
    try:
        assert not server.exist_tasks()
        server.set_exist_tasks(True)
        assert not server.exist_tasks()
        server.set_exist_tasks(False)
        server.put_tasks(["x"])
        assert server.exist_tasks() and server.exist_tasks_intra_signal.value[0] == 1
        server.set_exist_tasks(False)
        assert not server.exist_tasks() and server.exist_tasks_intra_signal.value[0] == 0
        assert server.num_tasks() == 1  # the batch is still there (clear_data() drops it)
        server.exist_tasks_intra_signal.value[0] = 1  # FastDeploy's IPCSignal spelling
        assert server.exist_tasks()
    finally:
        server.cleanup()


def test_fail_fast_without_server(name):
    """FastDeploy's _connect_with_retry: ConnectionError after a bounded wait."""
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="is_server=True"):
        EngineWorkerQueue(address=("0.0.0.0", 1), is_server=False, num_client=1, client_id=0,
                          name=name, connect_timeout=0.5)
    assert 0.5 <= time.monotonic() - t0 < 5


def test_engine_clients_in_other_processes(name, procs, results):
    """FastDeploy's per-DP-rank engine processes: the server lives in one process, each DP
    group's engine client in another (one says role="engine", the other sets
    FD_SYNC_QUEUE_ROLE=engine); every rank of both groups takes every batch once, in order,
    at the same step, with one all_client_read per call."""
    tp, dp, n = 2, 2, 20
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=tp,
                               local_data_parallel_size=dp, name=name)
    try:
        address = ("0.0.0.0", server.get_server_port())
        engine_results = SPAWN.Queue()
        keep = []
        for d in range(dp):
            barrier, signal = SPAWN.Barrier(tp), SPAWN.Value("i", 0)
            keep.append((barrier, signal))
            for r in range(tp):
                procs(fd_worker_loop, address, tp, r, d, barrier, signal, results, name=name,
                      seed=d * 10 + r)
            procs(fd_engine_process, address, d, n, engine_results, name=name, use_env=d == 1)
        for _ in range(dp):
            kind, d, _, payload = engine_results.get(timeout=RESULT_TIMEOUT_S)
            assert kind == "engine", f"engine process of dp {d} failed:\n{payload}"
        out = _collect(results, tp * dp)
        assert server._queues[0].stats().get("puts_remote") == n + 1
    finally:
        server.cleanup()
    _check_consistent(out, tp, dp, n)


def test_ep_dp_with_a_forked_dp_engine(name, procs, results):
    """EP + DP=2 on one node as FastDeploy runs it: the engine process builds the server of
    both DP groups, then forks the DP-1 engine, whose plain client_id=0 client must put
    through the parent's server (not act on the copy it inherited). Every batch of both
    groups is delivered. Before: the child's first put_tasks() never returned and DP group
    1 took 0 batches."""
    tp, dp, n = 1, 2, 15
    engine_results, done = SPAWN.Queue(), SPAWN.Event()
    procs(ep_dp_engine_process, n, engine_results, done, name=name, tp_size=tp, dp_size=dp)
    kind, _, _, port = engine_results.get(timeout=RESULT_TIMEOUT_S)
    assert kind == "port", port
    address = ("0.0.0.0", port)
    keep = []
    for d in range(dp):
        barrier, signal = SPAWN.Barrier(tp), SPAWN.Value("i", 0)
        keep.append((barrier, signal))
        procs(fd_worker_loop, address, tp, 0, d, barrier, signal, results, name=name,
              seed=d)
    try:
        engines = {}
        for _ in range(dp):
            kind, d, pid, payload = engine_results.get(timeout=RESULT_TIMEOUT_S)
            assert kind == "engine", f"engine of DP group {d}:\n{payload}"
            engines[d] = (pid, payload)
        assert engines[1][0] != engines[0][0] and engines[1][1] == "engine"  # the forked child
        out = _collect(results, tp * dp)
    finally:
        done.set()
    _check_consistent(out, tp, dp, n)


def test_engine_client_without_a_server_fails_fast(name):
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="no TaskQueue"):
        EngineWorkerQueue(address=("0.0.0.0", 1), client_id=0, name=name, role="engine",
                          connect_timeout=0.5)
    assert time.monotonic() - t0 < 10
