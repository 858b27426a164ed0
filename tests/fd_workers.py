"""Worker processes for tests/integration/test_fastdeploy_dropin.py: FastDeploy's ``event_loop_normal``
task path over the drop-in, with the test's own TP barrier and shared signal standing in
for FastDeploy's (``paddle.distributed.barrier`` and the ``exist_task_signal`` IPCSignal).

Every blocking call is bounded: the barrier by ``BARRIER_TIMEOUT_S``, the loop by
``deadline_s``. A worker reports ``("ok", dp_id, rank, calls)`` or ``("error", dp_id, rank,
text)`` on ``results``; ``calls`` is one ``(step, call, payload_ids, all_client_read)`` per
``get_tasks()``.
"""

import os
import pickle
import random
import time
import traceback

BARRIER_TIMEOUT_S = 20.0
STOP = "stop"


def batch(dp_id, k, with_array=True):
    """A FastDeploy-shaped batch ``(requests, real_bsz)``; ids are ``(dp_id, k)``."""
    import numpy as np

    req = {"id": (dp_id, k)}
    if with_array:
        req["token_ids"] = np.arange(k, k + 64, dtype=np.int64)
    return [req], k + 1


def ids_of(tasks):
    out = []
    for reqs, _bsz in tasks:
        for r in reqs:
            out.append(tuple(r["id"]) if isinstance(r["id"], (tuple, list)) else r["id"])
    return out


def fd_worker_loop(address, tp_size, rank, dp_id, barrier, signal, results, *, sync=False,
                   name=None, max_step_ms=2.0, seed=0, deadline_s=40.0, pause=None,
                   check_arrays=True, extra_call=None, barrier_timeout=BARRIER_TIMEOUT_S,
                   clear_at=None):
    """FastDeploy's loop, task path only. Stops after the step that took the STOP batch
    (every rank takes it at the same step, so every rank stops at the same step).
    ``pause=(step, seconds)``: every rank sleeps that long at that step (before the
    exist check), so batches pile up in flight. ``extra_call=(rank, step)``: that rank calls
    ``get_tasks()`` once more at that step (breaking the contract on purpose).
    ``clear_at=step``: every rank calls ``clear_data()`` at that step, after the barrier and
    before it reads the signal, as FastDeploy's weight-update branch does."""
    os.environ["DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM"] = "1" if sync else "0"
    try:
        from fastdeploy_sync.fastdeploy import EngineWorkerQueue

        q = EngineWorkerQueue(address=address, is_server=False, num_client=tp_size,
                              client_id=rank, local_data_parallel_id=dp_id, name=name)
    except BaseException:
        results.put(("error", dp_id, rank, traceback.format_exc()))
        return
    rng = random.Random(seed * 1000 + dp_id * 100 + rank)
    calls = []
    step = 0
    ncall = 0
    deadline = time.monotonic() + deadline_s
    try:
        stop = False
        while not stop:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank} dp {dp_id}: no STOP batch within {deadline_s} s "
                                   f"(step {step}, {ncall} get_tasks calls)")
            if pause is not None and step == pause[0]:
                time.sleep(pause[1])
            if rank == 0:
                if q.exist_tasks():
                    signal.value = 1
            if tp_size > 1:
                barrier.wait(barrier_timeout)
            if clear_at is not None and step == clear_at:
                q.clear_data()
            if signal.value == 1 or q.read_finish_flag.get() == 1:
                tasks, read_finish = q.get_tasks()
                ncall += 1
                if read_finish:
                    signal.value = 0
                ids = []
                for t in tasks:
                    if t == STOP:
                        stop = True
                        ids.append(STOP)
                    else:
                        if check_arrays:
                            reqs, bsz = t
                            tok = reqs[0]["token_ids"]
                            assert int(tok[0]) == reqs[0]["id"][1] and len(tok) == 64
                        ids.extend(ids_of([t]))
                calls.append((step, ncall, ids, bool(read_finish)))
            if extra_call is not None and extra_call == (rank, step):
                q.get_tasks()
            if max_step_ms:
                time.sleep(rng.uniform(0, max_step_ms) / 1000)
            # The model step's TP collective (or, idle, FastDeploy's second barrier): without
            # it rank 0 could set the next step's signal before a slow rank read this step's,
            # and the loop would race on its own signal (not the queue's).
            if tp_size > 1:
                barrier.wait(barrier_timeout)
            step += 1
        results.put(("ok", dp_id, rank, {"calls": calls, "cleared": q.cleared,
                                         "steps": step}))
    except BaseException:
        results.put(("error", dp_id, rank, traceback.format_exc()))
    finally:
        q.cleanup()


def fd_engine_loop(client, dp_id, n, *, with_array=True, clear_after=None, put_timeout=20.0,
                   wait_exist=True):
    """FastDeploy's engine: ``while exist_tasks(): sleep(0.001)`` then ``put_tasks``, n
    batches, then STOP. ``clear_after=k``: call ``clear_data()`` right after batch k.
    ``wait_exist=False``: put back to back (the server's ``max_inflight`` bounds it)."""
    deadline = time.monotonic() + put_timeout
    for k in range(n):
        while wait_exist and client.exist_tasks():
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine dp {dp_id}: workers took nothing for {put_timeout} s")
            time.sleep(0.001)
        client.put_tasks(batch(dp_id, k, with_array), timeout=put_timeout)
        if clear_after is not None and k == clear_after:
            client.clear_data()
    client.put_tasks(STOP, timeout=put_timeout)


def fd_engine_process(address, dp_id, n, results, *, name=None, use_env=False):
    """FastDeploy's per-DP-rank engine process: a client of the server another process
    owns (``role="engine"``, or ``FD_SYNC_QUEUE_ROLE=engine`` with ``use_env``), running
    the wait-then-put loop; reports ``("engine", dp_id, 0, None)`` or an error."""
    try:
        from fastdeploy_sync.fastdeploy import EngineWorkerQueue

        if use_env:
            os.environ["FD_SYNC_QUEUE_ROLE"] = "engine"
            kw = {}
        else:
            kw = {"role": "engine"}
        q = EngineWorkerQueue(address=address, is_server=False, num_client=2, client_id=0,
                              local_data_parallel_id=dp_id, name=name, connect_timeout=10, **kw)
        try:
            assert q.role == "engine", q.role
            fd_engine_loop(q, dp_id, n)
        finally:
            q.cleanup()
        results.put(("engine", dp_id, 0, None))
    except BaseException:
        results.put(("error", dp_id, -1, traceback.format_exc()))


def cache_messager(address, tp_size, rank, results, rounds, *, name=None, dp_id=0,
                   wait_s=30.0):
    """FastDeploy's cache messager of TP rank ``rank`` (``cache_manager/cache_messager.py``:
    ``EngineWorkerQueue(address, is_server=False, num_client=tp, client_id=rank)``), side
    channels only: for each of ``rounds`` rounds it polls ``get_cache_info()`` until the
    engine's infos arrive, passes ``cache_info_barrier`` with its peers, and reports
    ``put_finished_req([[request_id, "finished"]])``. Reports ``("ready", dp, rank, None)``
    once built, then ``("messager", dp, rank, {"infos": [...], "all_put": [...]})`` or
    ``("error", dp, rank, traceback)``. Every wait is bounded by ``wait_s``."""
    try:
        from fastdeploy_sync.fastdeploy import EngineWorkerQueue

        q = EngineWorkerQueue(address=address, is_server=False, num_client=tp_size,
                              client_id=rank, local_data_parallel_id=dp_id, name=name,
                              connect_timeout=10)
    except BaseException:
        results.put(("error", dp_id, rank, traceback.format_exc()))
        return
    results.put(("ready", dp_id, rank, None))
    try:
        infos, all_put = [], []
        for k in range(rounds):
            deadline = time.monotonic() + wait_s
            got = q.get_cache_info()
            while not got:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"messager {rank}: no cache info of round {k}")
                time.sleep(0.002)
                got = q.get_cache_info()
            infos.append(got)
            q.cache_info_barrier.wait(timeout=wait_s)
            all_put.append(q.put_finished_req([[f"req{k}", "finished"]], timeout=wait_s))
        results.put(("messager", dp_id, rank, {"infos": infos, "all_put": all_put,
                                               "role": q.role}))
    except BaseException:
        results.put(("error", dp_id, rank, traceback.format_exc()))
    finally:
        q.cleanup()


def ep_dp_engine_process(n, results, done, *, name=None, tp_size=1, dp_size=2, wait_s=60.0):
    """FastDeploy's engine process under EP + DP on one node: it builds the server for every
    DP group, then forks the DP-1 engine (``start_data_parallel_service``) after the server
    was built; the child builds FastDeploy's plain client (``client_id=0``,
    ``local_data_parallel_id=1``) and runs the engine loop of group 1, the parent runs
    group 0's through its own client. Reports ``("port", -1, -1, port)`` once the server is
    up, ``("engine", dp, pid, None)`` per group (or ``("error", dp, -1, traceback)``), and
    keeps the server until ``done`` is set (at most ``wait_s``)."""
    try:
        from fastdeploy_sync.fastdeploy import EngineWorkerQueue
        from fastdeploy_sync.testing.processes import reap

        server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=tp_size,
                                   local_data_parallel_size=dp_size, name=name)
    except BaseException:
        results.put(("error", -1, -1, traceback.format_exc()))
        return
    try:
        address = ("0.0.0.0", server.get_server_port())
        results.put(("port", -1, -1, address[1]))
        # as multiprocessing's fork start method does, after the server was built; the child
        # reports through a pipe (a multiprocessing queue the parent used is not fork-safe)
        read_end, write_end = os.pipe()
        child = os.fork()
        if child == 0:
            try:
                os.close(read_end)
                report = _forked_dp_engine(address, tp_size, 1, n, name)
                os.write(write_end, pickle.dumps(report))
            finally:
                os._exit(0)
        os.close(write_end)
        try:
            client = EngineWorkerQueue(address=address, is_server=False, num_client=tp_size,
                                       client_id=0, local_data_parallel_id=0, name=name)
            fd_engine_loop(client, 0, n, put_timeout=wait_s / 2)
            results.put(("engine", 0, os.getpid(), None))
        except BaseException:
            results.put(("error", 0, -1, traceback.format_exc()))
        reap(child, wait_s)
        with os.fdopen(read_end, "rb") as pipe:
            data = pipe.read()
        results.put(pickle.loads(data) if data else ("error", 1, -1, "the forked engine died"))
        done.wait(wait_s)
    finally:
        server.cleanup()




def _forked_dp_engine(address, tp_size, dp_id, n, name):
    """The forked DP engine's loop; its report."""
    try:
        from fastdeploy_sync.fastdeploy import EngineWorkerQueue

        client = EngineWorkerQueue(address=address, is_server=False, num_client=tp_size,
                                   client_id=0, local_data_parallel_id=dp_id, name=name,
                                   connect_timeout=10)
        try:
            fd_engine_loop(client, dp_id, n, put_timeout=20.0)
            return ("engine", dp_id, os.getpid(), client.role)
        finally:
            client.cleanup()
    except BaseException:
        return ("error", dp_id, -1, traceback.format_exc())


def side_channel_probe(address, keys_dir, item, results, *, connect_timeout=5.0):
    """A client in a process of its own puts ``item`` on the disaggregated-task channel;
    reports ``("ok", 0, 0, None)`` or ``("error", 0, 0, "<type>: <message>")``."""
    try:
        from fastdeploy_sync.fastdeploy import EngineWorkerQueue

        q = EngineWorkerQueue(address=address, num_client=1, client_id=0, keys_dir=keys_dir,
                              connect_timeout=connect_timeout)
        try:
            q.put_disaggregated_tasks(item)
        finally:
            q.cleanup()
        results.put(("ok", 0, 0, None))
    except BaseException as exc:
        results.put(("error", 0, 0, f"{type(exc).__name__}: {exc}"))


def barrier_messager(address, tp_size, rank, results, *, name=None, late_s=0.0):
    """A cache messager of TP rank ``rank`` passing ``cache_info_barrier`` in four rounds:
    the first and the last two with a 60 s timeout, the second with none (so the
    ``FD_SYNC_SIDE_WAIT_S`` bound), arriving ``late_s`` seconds late to it. Reports
    ``("barrier", 0, rank, ["ok" | "broken", ...])`` (per round) or ``("error", ...)``."""
    import threading as _threading

    try:
        from fastdeploy_sync.fastdeploy import EngineWorkerQueue

        q = EngineWorkerQueue(address=address, is_server=False, num_client=tp_size,
                              client_id=rank, name=name, connect_timeout=10)
    except BaseException:
        results.put(("error", 0, rank, traceback.format_exc()))
        return
    try:
        outcomes = []
        for k, timeout in enumerate((60.0, None, 60.0, 60.0)):
            if k == 1:
                time.sleep(late_s)
            try:
                q.cache_info_barrier.wait(timeout=timeout)
                outcomes.append("ok")
            except _threading.BrokenBarrierError:
                outcomes.append("broken")
        results.put(("barrier", 0, rank, outcomes))
    except BaseException:
        results.put(("error", 0, rank, traceback.format_exc()))
    finally:
        q.cleanup()
