"""FastDeploy's worker loop shapes, task path only, written from reading
``fastdeploy/worker/worker_process.py`` of PaddlePaddle/FastDeploy (no FastDeploy code here).

Shapes (``shape=``), each as ``event_loop_normal`` runs it:

* ``develop`` (commit 0009064e): TP rank 0 checks ``exist_tasks()``, sets the signal (one
  node) or ``read_finish_flag.set(1)`` (``nnode > 1``); the TP barrier; every rank whose
  signal or ``read_finish_flag.get() == 1`` is set calls ``get_tasks()``; the reader with
  ``read_finish`` resets the signal (one node) or the flag (``nnode > 1``). A taken
  ``ControlRequest`` runs, then the TP barrier. Then the idle branch (no running request:
  TP barrier, sleep 1 ms) or the model step (its TP collective).
* ``v2x`` (commit 58c5a816 and the 2.x branches): the same, rank 0 checks
  ``num_tasks() > 0``, and the reader with ``read_finish`` resets both the signal and the flag.
* ``v20`` (the 2.0-era file with ``self.nnode = 1`` hard-coded): a TP barrier at the top of
  every iteration, rank 0 checks ``num_tasks() > 0``, the TP barrier, the read, then the
  model step on every iteration (no idle branch).
* ``overlap`` (develop, 2026, the overlap scheduler, on by default on GPU): as ``develop``,
  but the TP barrier is the queue's own ``worker_process_tp_barrier.wait()``, there is no
  idle branch and an idle step is a no-op: each idle iteration has a single sync point
  (check, the queue's barrier, read the signal, nothing). A busy step runs the model's
  collective (``barrier``). Develop's ``nnode = (tp + 8) // 8``: at TP=8 on one node rank 0
  sets ``read_finish_flag`` instead of the signal (pass ``multi_node=True``).
* ``index`` (the loop docs/index.md teaches, written on the drop-in): TP rank 0 calls
  ``exist_tasks()``, the caller's TP barrier, every rank calls ``get_tasks()`` every step,
  then the model step's collective when a rank has running requests.

``read_flag=False``: the loop reads only the node-local signal, never
``read_finish_flag.get()`` (a loop that calls nothing of the queue but rank 0's check and
``get_tasks()`` once the signal is set; with ``shape="overlap"`` the queue's barrier is then
its only other call).

``nnode > 1`` (``multi_node=True``): rank 0 sets ``read_finish_flag`` instead of the
node-local signal, as FastDeploy does when the TP group spans nodes.

The TP barrier is the caller's: ``barrier`` (``wait(timeout)``), a multiprocessing barrier
on one node or ``paddle.distributed.barrier()`` across nodes. ``signal`` stands for
FastDeploy's node-local ``exist_task_signal`` (a ``.value`` holder).

A "model step" (a rank has running requests: it took a batch within the last
``busy_steps`` steps) sleeps ``step_ms`` (GIL released) or spins it (``gil_step=True``,
pure Python), then passes the barrier as its TP collective.
"""

import os
import time

STOP = "stop"


class ControlRequest:
    """A picklable stand-in for FastDeploy's ``ControlRequest`` (it travels as
    ``([ControlRequest], bsz)`` through the same queue as requests)."""

    def __init__(self, request_id, method, args=None):
        self.request_id, self.method, self.args = request_id, method, args or {}

    def __repr__(self):
        return f"ControlRequest({self.request_id!r}, {self.method!r})"


class LocalFlag:
    """FastDeploy's node-local ``exist_task_signal`` when no other process needs it."""

    def __init__(self):
        self.value = 0


def spin(ms):
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def run_loop(q, shape, tp_size, rank, barrier, signal, *, multi_node=False, until_stop=True,
             step_ms=0.0, gil_step=False, busy_steps=1, deadline_s=60.0, on_take=None,
             barrier_timeout=20.0, lag=None, stats=None, read_flag=True, on_step=None):
    """Run FastDeploy's loop of ``shape`` over the drop-in ``q`` until the STOP batch was
    taken (every rank takes it at the same step). Returns ``calls``: one
    ``(step, call, tasks)`` per ``get_tasks()`` call that returned batches (an ``overlap``
    rank whose read came before its peers' gets ``[]`` from a call the others do not
    make: such calls are not listed), and the number of steps.
    ``on_take(step, tasks)`` sees each call's tasks (for timing).
    ``lag=(rank, seconds)``: that rank sleeps this long right after the step's TP barrier,
    before it reads the signal, every step (a rank the OS descheduled there).
    ``stats``: a dict; ``stats["early"]`` counts the overlap reads answered ``[]``.
    ``on_step(step)`` is called at the top of every step."""
    if shape not in ("develop", "v2x", "v20", "overlap", "index"):
        raise ValueError(shape)
    calls = []
    step = 0
    ncall = 0
    busy = 0
    deadline = time.monotonic() + deadline_s
    stop = False

    def tp_barrier():
        if tp_size > 1:
            if shape == "overlap":
                q.worker_process_tp_barrier.wait(barrier_timeout)
            else:
                barrier.wait(barrier_timeout)

    while not stop:
        if on_step is not None:
            on_step(step)
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank} ({shape}): no STOP batch within {deadline_s} s "
                               f"(step {step}, {ncall} get_tasks() calls)")
        if shape == "v20":
            tp_barrier()  # "Synchronize before updating weights"
        if rank == 0:
            found = (q.exist_tasks() if shape in ("develop", "overlap", "index")
                     else q.num_tasks() > 0)
            if found and shape != "index":
                if multi_node:
                    q.read_finish_flag.set(1)
                else:
                    signal.value = 1
        tp_barrier()  # "Synchronize the signal for other workers"
        if lag is not None and lag[0] == rank:
            time.sleep(lag[1])
        if (shape == "index" or signal.value == 1
                or (read_flag and q.read_finish_flag.get() == 1)):
            tasks, read_finish = q.get_tasks()
            # overlap: a read that came before the peers' (the drop-in answers [] to it)
            # is no call of the group's; only calls that took batches are compared
            listed = shape not in ("overlap", "index") or bool(tasks)
            if listed:
                ncall += 1
            elif stats is not None and shape == "overlap":
                stats["early"] = stats.get("early", 0) + 1
            if read_finish and shape != "index":
                if shape in ("develop", "overlap"):
                    if multi_node:
                        q.read_finish_flag.set(0)
                    else:
                        signal.value = 0
                else:
                    signal.value = 0
                    q.read_finish_flag.set(0)
            if listed:
                if on_take is not None:
                    on_take(step, tasks)
                calls.append((step, ncall, tasks))
            control = [t for t in tasks if isinstance(t, tuple) and t[0]
                       and isinstance(t[0][0], ControlRequest)]
            if any(t == STOP for t in tasks):
                stop = until_stop
            if tasks:
                busy = busy_steps
            if shape in ("develop", "overlap") and control:
                for _ in control:  # run_control_method, then the TP barrier
                    tp_barrier()
        if shape in ("overlap", "index"):
            if busy:  # the model step and its collective; an idle step does nothing
                if step_ms:
                    spin(step_ms) if gil_step else time.sleep(step_ms / 1000)
                if tp_size > 1:
                    barrier.wait(barrier_timeout)
                busy -= 1
        elif shape != "v20" and busy == 0:
            tp_barrier()  # idle branch
            time.sleep(0.001)
        else:
            if step_ms:
                if gil_step:
                    spin(step_ms)
                else:
                    time.sleep(step_ms / 1000)
            if shape != "v20" or tp_size > 1:
                tp_barrier()  # the model step's TP collective
            busy = max(0, busy - 1)
        step += 1
    return calls, step


def wait_room(client, timeout=20.0):
    """FastDeploy's engine wait, ``while exist_tasks(): sleep(0.001)``, bounded:
    ``TimeoutError`` once the workers took nothing for ``timeout`` s (an error the engine
    side raises, such as ``GroupLostError``, goes through)."""
    deadline = time.monotonic() + timeout
    while client.exist_tasks():
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine: workers took nothing for {timeout} s")
        time.sleep(0.001)


def engine_loop(client, batches, *, put_timeout=20.0, wait_exist=True, on_put=None):
    """FastDeploy's engine loop: ``while exist_tasks(): sleep(0.001)``, then ``put_tasks``,
    for each of ``batches``, then STOP. ``on_put(k)`` is called just before put k."""
    for k, b in enumerate(batches):
        if wait_exist:
            wait_room(client, put_timeout)
        if on_put is not None:
            on_put(k)
        client.put_tasks(b, timeout=put_timeout)
    if wait_exist:
        wait_room(client, put_timeout)
    client.put_tasks(STOP, timeout=put_timeout)


def engine_loop_v0(client, batches, *, timeout=20.0, use_exist=False):
    """FastDeploy's V0 scheduler loop (``_insert_task_to_worker``, every stored version):
    ``if num_tasks() > 0`` (or ``exist_tasks()``): sleep 1 ms; ``if num_cache_infos() > 0``:
    sleep 1 ms; else put the next batch; then STOP. ``TimeoutError`` once nothing could be
    put for ``timeout`` s. Returns how many times each wait was taken."""
    waits = {"tasks": 0, "cache_infos": 0}
    pending = list(batches) + [STOP]
    deadline = time.monotonic() + timeout
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"V0 engine: nothing put for {timeout} s ({waits})")
        if (client.exist_tasks() if use_exist else client.num_tasks() > 0):
            waits["tasks"] += 1
            time.sleep(0.001)
            continue
        if client.num_cache_infos() > 0:
            waits["cache_infos"] += 1
            time.sleep(0.001)
            continue
        client.put_tasks(pending.pop(0), timeout=timeout)
        deadline = time.monotonic() + timeout
    return waits


def v0_engine_process(address, tp_size, dp_id, n, results, *, name=None, use_exist=False):
    """FastDeploy's V0 engine in a process of its own with a plain client (FastDeploy's
    arguments: ``client_id=0``, no role): reports ``("engine", dp_id, 0, waits)`` or an
    error."""
    import traceback

    try:
        from fastdeploy_sync.fastdeploy import EngineWorkerQueue

        q = EngineWorkerQueue(address=address, is_server=False, num_client=tp_size,
                              client_id=0, local_data_parallel_id=dp_id, name=name,
                              connect_timeout=10)
        try:
            waits = engine_loop_v0(q, batches(dp_id, n), use_exist=use_exist)
            waits["role"] = q.role
        finally:
            q.cleanup()
        results.put(("engine", dp_id, 0, waits))
    except BaseException:
        results.put(("error", dp_id, -1, traceback.format_exc()))


def sync_env(sync):
    os.environ["DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM"] = "1" if sync else "0"


def ids_of(tasks):
    """Batch ids of what a get_tasks() call returned: ``(dp_id, k)`` per request batch,
    ``("control", id)`` per ControlRequest, ``STOP``."""
    out = []
    for t in tasks:
        if t == STOP:
            out.append(STOP)
            continue
        reqs, _bsz = t
        if isinstance(reqs[0], ControlRequest):
            out.append(("control", reqs[0].request_id))
        else:
            out.append(tuple(reqs[0]["id"]))
    return out


def batches(dp_id, n, *, every_control=0, array_len=64):
    """n FastDeploy-shaped batches ``([request], real_bsz)`` with numpy token ids; with
    ``every_control=k`` every k-th is ``([ControlRequest], bsz)`` instead."""
    import numpy as np

    out = []
    for k in range(n):
        if every_control and k % every_control == every_control - 1:
            out.append(([ControlRequest(k, "update_weights", {"k": k})], k + 1))
        else:
            out.append(([{"id": (dp_id, k), "token_ids": np.arange(k, k + array_len,
                                                                    dtype=np.int64)}], k + 1))
    return out


def loop_worker(address, shape, tp_size, rank, dp_id, barrier, signal, results, *, sync=False,
                name=None, multi_node=False, deadline_s=60.0, step_ms=0.0, busy_steps=1,
                queue_kw=None, lag=None, barrier_timeout=20.0, read_flag=True):
    """A worker process running ``run_loop``; reports ``("ok", dp_id, rank, {"calls":
    [(step, call, ids)], "steps": n})`` or ``("error", dp_id, rank, traceback)``."""
    import traceback

    sync_env(sync)
    try:
        from fastdeploy_sync.fastdeploy import EngineWorkerQueue

        q = EngineWorkerQueue(address=address, is_server=False, num_client=tp_size,
                              client_id=rank, local_data_parallel_id=dp_id, name=name,
                              **(queue_kw or {}))
    except BaseException:
        results.put(("error", dp_id, rank, traceback.format_exc()))
        return
    stats = {}
    try:
        def check(step, tasks):
            for t in tasks:
                if t != STOP and not isinstance(t[0][0], ControlRequest):
                    tok = t[0][0]["token_ids"]
                    assert int(tok[0]) == t[0][0]["id"][1], "a batch's arrays do not match it"

        calls, steps = run_loop(q, shape, tp_size, rank, barrier, signal, multi_node=multi_node,
                                deadline_s=deadline_s, step_ms=step_ms, busy_steps=busy_steps,
                                on_take=check, lag=lag, barrier_timeout=barrier_timeout,
                                stats=stats, read_flag=read_flag)
        results.put(("ok", dp_id, rank, {"calls": [(s, c, ids_of(t)) for s, c, t in calls],
                                         "steps": steps, "early": stats.get("early", 0)}))
    except BaseException:
        results.put(("error", dp_id, rank, traceback.format_exc()))
    finally:
        q.cleanup()


def check_group(reports, tp_size, dp_id, expected_ids):
    """Every rank of DP group ``dp_id`` took identical batches at identical steps and calls;
    each expected id exactly once, in put order, then STOP."""
    ref = reports[0]["calls"]
    for r in range(1, tp_size):
        assert reports[r]["calls"] == ref, f"dp {dp_id}: rank {r} differs from rank 0"
    taken = [x for _, _, ids in ref for x in ids]
    assert taken == list(expected_ids) + [STOP], (dp_id, taken[:20], len(taken))


def idle_worker(address, tp_size, rank, barrier, signal, results, *, name=None, sync=False):
    """A develop-shape worker that runs until the engine closes or its group breaks;
    reports its pid first (``("pid", rank, pid)``), then what it took or raised."""
    import traceback

    sync_env(sync)
    results.put(("pid", rank, os.getpid()))
    try:
        from fastdeploy_sync.fastdeploy import EngineWorkerQueue

        q = EngineWorkerQueue(address=address, num_client=tp_size, client_id=rank, name=name)
        try:
            calls, _ = run_loop(q, "develop", tp_size, rank, barrier, signal, deadline_s=60,
                                barrier_timeout=10)
            results.put(("ok", rank, [ids_of(t) for _, _, t in calls]))
        finally:
            q.cleanup()
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))


def closing_worker(address, shape, tp_size, rank, barrier, signal, results, *, name=None,
                   read_flag=True, sync=False, queue_kw=None):
    """A worker running ``shape`` (FastDeploy's worker arguments, no role unless
    ``queue_kw`` says) until the server closes: reports ``("stepping", rank, None)`` after
    its 20th step, then ``("raised", rank, (type name, message, monotonic time))`` or
    ``("error", rank, traceback)``."""
    import traceback

    sync_env(sync)
    try:
        from fastdeploy_sync.fastdeploy import EngineWorkerQueue

        q = EngineWorkerQueue(address=address, num_client=tp_size, client_id=rank, name=name,
                              **(queue_kw or {}))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        return

    def on_step(step):
        if step == 20:
            results.put(("stepping", rank, None))

    try:
        run_loop(q, shape, tp_size, rank, barrier, signal, multi_node=False, deadline_s=60,
                 barrier_timeout=30, read_flag=read_flag, on_step=on_step)
        results.put(("error", rank, "the loop ended without an error"))
    except BaseException as exc:
        results.put(("raised", rank, (type(exc).__name__, str(exc), time.monotonic())))
    finally:
        q.cleanup()
