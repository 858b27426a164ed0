"""Worker-process bodies for the tests (module-level so that spawn can import them).

Each reports to a multiprocessing queue as ``(tag, rank, payload)``; an exception is
reported as ``("error", rank, repr)`` rather than lost in a child's stderr
(``report_errors``). What the scripts use too is ``fastdeploy_sync.testing.processes``'s,
imported here for the tests that take it from this module.
"""

import logging
import os
import random
import socket
import time

from fastdeploy_sync import TaskClient, TaskQueue
from fastdeploy_sync.testing.processes import (  # noqa: F401
    check_consistency,
    collect,
    consistency_rank,
    engine_cause,
    make_batch,
    put_with_pauses,
    report_errors,
    take_checked,
)


@report_errors
def take_n_rank(out, rank, name, tp, n_batches, async_prefetch=None, endpoint=None,
                deadline_s=60.0, leave=None):
    """sync_step() until n batches are taken; report the batches (as given) in order.
    With ``leave`` (an Event), close only once it is set (at most 60 s): a rank that closes
    says BYE, and the engine then retires the group at once, perhaps before it learned
    what its peers took (a test that reads the engine's view of a live group waits)."""
    got = []
    deadline = time.monotonic() + deadline_s
    with TaskClient(name, tp, rank, async_prefetch=async_prefetch, endpoint=endpoint) as client:
        out.put(("ready", rank, os.getpid()))
        while len(got) < n_batches:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: took {len(got)}/{n_batches} batches")
            tasks = client.sync_step(timeout=30)
            got.extend(tasks)
            if not tasks:
                time.sleep(0.0005)
        out.put(("taken", rank, got))
        if leave is not None:
            leave.wait(60)


@report_errors
def failing_prefetch_rank(out, rank, name, tp, async_prefetch, leave=None):
    """Steps until the client raised twice an error of its own; report the exception types
    and how often it logged. With ``leave`` (an Event), close only once it is set: a rank that closes early
    makes its peer's barrier raise "rank N closed its client" before the peer's own
    failure can arrive."""
    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record)

    logging.getLogger("fastdeploy_sync").addHandler(Collect(level=logging.ERROR))
    deadline = time.monotonic() + 30
    with TaskClient(name, tp, rank, async_prefetch=async_prefetch) as client:
        out.put(("ready", rank, os.getpid()))
        raised = []
        # two of its own (a peer's failure may be raised first: see the test)
        while (sum(e[0] != "BarrierTimeoutError" for e in raised) < 2 and len(raised) < 10
               and time.monotonic() < deadline):
            try:
                client.sync_step(timeout=10)
            except Exception as exc:
                raised.append((type(exc).__name__, type(exc.__cause__).__name__
                               if exc.__cause__ else None, str(exc),
                               exc.__cause__ is not None
                               and exc.__cause__.__traceback__ is not None))
            time.sleep(0.001)
        out.put(("raised", rank, (raised, len(records))))
        if leave is not None:
            leave.wait(30)


@report_errors
def idle_rank(out, rank, name, tp, seconds, leave=None):
    """Build a client, stay idle, report the prefetch thread's and process's CPU seconds.
    With ``leave`` (an Event), close only once it is set: a rank that closes first says
    BYE, and the engine then retires the group (its peers' threads stop)."""
    with TaskClient(name, tp, rank, async_prefetch=True) as client:
        time.sleep(0.3)  # let start-up settle
        t0, p0, w0 = client.prefetch_cpu_seconds(), time.process_time(), time.monotonic()
        time.sleep(seconds)
        t1 = client.prefetch_cpu_seconds()
        assert t1 is not None, f"the prefetch thread stopped: {client._faults.error!r}"
        out.put(("cpu", rank, (t1 - t0, time.process_time() - p0, time.monotonic() - w0)))
        if leave is not None:
            leave.wait(30)


@report_errors
def profiled_rank(out, rank, name, tp, n_batches, deadline_s=60.0):
    """A client built with no profile argument (FD_SYNC_PROFILE decides): steps until it has
    taken n batches, then reports the step count and the profiler's summary (None if off)."""
    steps = taken = 0
    deadline = time.monotonic() + deadline_s
    with TaskClient(name, tp, rank) as client:
        out.put(("ready", rank, os.getpid()))
        while taken < n_batches:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: took {taken}/{n_batches} batches")
            taken += len(client.sync_step(timeout=30))
            steps += 1
            time.sleep(0.0005)
        profiler = client.profiler
        out.put(("profiled", rank, (steps, None if profiler is None else profiler.summary())))


@report_errors
def hold_group_rank(out, rank, name, tp, seconds, leave=None):
    """Join the group, say so, then stay until killed or ``seconds`` pass (with ``leave``,
    an Event: until it is set, at most ``seconds``)."""
    with TaskClient(name, tp, rank):
        out.put(("ready", rank, os.getpid()))
        if leave is None:
            time.sleep(seconds)
        else:
            leave.wait(seconds)


@report_errors
def barrier_once_rank(out, rank, name, tp, delay_s, timeout):
    with TaskClient(name, tp, rank) as client:
        out.put(("ready", rank, os.getpid()))
        time.sleep(delay_s)
        client.barrier(timeout=timeout)
        out.put(("passed", rank, None))


@report_errors
def peer_receiving_rank(out, rank, name, async_prefetch, holding, hold_s, peer_wait_s):
    """TP=2. Rank 1 holds the GIL for ``hold_s`` (``holding.value`` set to 1 first: a raw
    shared int, because a multiprocessing Event's waiter is released only once the setter
    runs Python again, i.e. after the hold), so a batch put
    meanwhile reaches it only when it steps again: its receiver publishes it just before
    the barrier. Rank 0 checks as soon as it holds the batch itself. Both report what the
    check said, how long it took, and what the step took. ``peer_wait_s``: the bound of
    rank 0's wait for a receiving peer, raised so that the test does not race it."""
    import fastdeploy_sync.worker.client as worker_module
    from engine_peers import hold_gil

    worker_module._PEER_WAIT_S = peer_wait_s
    with TaskClient(name, 2, rank, async_prefetch=async_prefetch) as client:
        client.barrier(timeout=30)
        found = elapsed = None
        if rank == 1:  # says nothing through ``out`` first: its feeder thread needs the GIL
            hold_gil(0.001)  # its imports and set-up release the GIL: done before the hold
            # its prefetch thread back in its poll (not stopped half-way through a loop by
            # the hold, where it would not see the batch come)
            time.sleep(0.1)
            holding.value = 1
            hold_gil(hold_s)
        else:
            out.put(("ready", rank, None))
            wait_until(lambda: client.num_tasks() != 0, timeout=30, interval=0.001,
                       what="rank 0: its own receiver to have the batch")
            t0 = time.monotonic()
            found = client.exist_tasks()
            elapsed = time.monotonic() - t0
        client.barrier(timeout=30)
        tasks, _ = client.get_tasks()
        out.put(("took", rank, (found, elapsed, tasks)))


def _explode():
    raise RuntimeError("this request cannot be rebuilt on the worker")


class Exploding:
    """Pickles fine on the engine, fails to unpickle on the worker."""

    def __reduce__(self):
        return _explode, ()


@report_errors
def scripted_rank(out, rank, name, tp, steps, skip_get_on=(), deadline_s=30.0):
    """Run ``steps`` barrier steps; skip get_tasks() on the given step indices. Report
    what was taken per step, or the first exception (type name and message)."""
    taken = []
    with TaskClient(name, tp, rank) as client:
        out.put(("ready", rank, os.getpid()))
        deadline = time.monotonic() + deadline_s
        try:
            for step in range(steps):
                if rank == 0:
                    wait_until(client.exist_tasks, timeout=max(0.0, deadline - time.monotonic()),
                               interval=0.001, what=f"step {step}: tasks to arrive")
                client.barrier(timeout=10)
                if step not in skip_get_on:
                    taken.append(client.get_tasks()[0])
        except Exception as exc:
            out.put(("raised", rank, (type(exc).__name__, str(exc), taken)))
            return
        out.put(("raised", rank, (None, "", taken)))


@report_errors
def hold_engine(out, rank, name, tp, seconds):
    """An engine that puts one batch, says so, then stays until killed."""
    with TaskQueue(name, tp) as queue:
        queue.put_tasks("x", timeout=5)
        out.put(("ready", rank, os.getpid()))
        time.sleep(seconds)


@report_errors
def paddle_consistency_rank(out, rank, endpoints, *args, **kwargs):
    """consistency_rank with the TP ranks coordinated by paddle.distributed (gloo, CPU)."""
    os.environ.update(PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM=str(len(endpoints)),
                      PADDLE_TRAINER_ENDPOINTS=",".join(endpoints),
                      PADDLE_CURRENT_ENDPOINT=endpoints[rank], PADDLE_DISTRI_BACKEND="gloo")
    import paddle
    import paddle.distributed as dist

    paddle.set_device("cpu")
    dist.init_parallel_env()
    consistency_rank.__wrapped__(out, rank, *args, coordinator="paddle", **kwargs)


def wait_until(predicate, timeout=10.0, what=None, seen=None, interval=0.005):
    """Poll ``predicate`` every ``interval`` seconds for up to ``timeout`` seconds.

    Returns the predicate's first truthy value (or its last value at the deadline). With
    ``what`` (what is awaited, in words) a deadline reached raises AssertionError naming
    it, the timeout and what was seen: ``seen()`` when given (called once, at the
    failure), otherwise the predicate's last value. Blocks at most ``timeout`` seconds
    plus one predicate call."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    value = predicate()
    if value or what is None:
        return value
    raise AssertionError(f"{what}: not reached within {timeout} s; seen: "
                         f"{seen() if seen is not None else value!r}")


# -- liveness and restarts --------------------------------------------------------------

FAST_HEARTBEAT = (0.2, 1.0)  # interval, timeout (s): liveness tests stay short


@report_errors
def step_until_error_rank(out, rank, name, tp, async_prefetch=True, endpoint=None,
                          report_after=0, deadline_s=60.0, heartbeat=FAST_HEARTBEAT,
                          retry_barrier_timeouts=False, leave=None):
    """sync_step() until a step call raises a TaskSyncError; report ("took_n", rank, ids)
    once ``report_after`` batches are taken, then ("raised", rank, {...}) with the type of
    the exception, of its engine-side cause, the message, the monotonic time and every
    batch taken. With ``retry_barrier_timeouts``, BarrierTimeoutError is retried (as a
    loop that does not know better would) until something else is raised. With ``leave``
    (an Event), the client stays open after reporting until it is set (at most 60 s)."""
    from fastdeploy_sync import BarrierTimeoutError, Heartbeat, TaskSyncError

    taken = []
    barrier_retries = 0
    deadline = time.monotonic() + deadline_s
    with TaskClient(name, tp, rank, async_prefetch=async_prefetch, endpoint=endpoint,
                    heartbeat=Heartbeat(*heartbeat)) as client:
        out.put(("ready", rank, (os.getpid(), client.worker_id, client.incarnation)))
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: nothing raised within {deadline_s}s "
                                   f"(took {len(taken)})")
            try:
                tasks = client.sync_step(timeout=10)
            except TaskSyncError as exc:
                if retry_barrier_timeouts and isinstance(exc, BarrierTimeoutError):
                    barrier_retries += 1
                    time.sleep(0.01)
                    continue
                cause = engine_cause(exc)
                out.put(("raised", rank, dict(type=type(exc).__name__,
                                              cause=type(cause).__name__, message=str(cause),
                                              at=time.monotonic(), taken=taken,
                                              barrier_retries=barrier_retries)))
                if leave is not None:
                    leave.wait(60)
                return
            if tasks:
                before = len(taken)
                taken.extend(tasks)
                if before < report_after <= len(taken):
                    out.put(("took_n", rank, list(taken)))
            time.sleep(0.001)


@report_errors
def serve_engine(out, rank, name, tp, n, endpoint=None, heartbeat=FAST_HEARTBEAT,
                 seconds=60.0):
    """An engine process: put batches 0..n-1, report ("served", 0, (pid, endpoint)), then
    stay until killed or ``seconds`` pass."""
    from fastdeploy_sync import Heartbeat

    with TaskQueue(name, tp, endpoint=endpoint, heartbeat=Heartbeat(*heartbeat)) as queue:
        for i in range(n):
            queue.put_tasks(i, timeout=30)
        out.put(("served", rank, (os.getpid(), queue.endpoint)))
        time.sleep(seconds)


@report_errors
@report_errors
def construct_rank(out, rank, name, tp, heartbeat=FAST_HEARTBEAT):
    """Build a TaskClient and report whether that raised (type, message) or worked."""
    from fastdeploy_sync import Heartbeat, TaskSyncError

    try:
        client = TaskClient(name, tp, rank, heartbeat=Heartbeat(*heartbeat))
    except TaskSyncError as exc:
        out.put(("constructed", rank, (type(exc).__name__, str(exc))))
        return
    client.close()
    out.put(("constructed", rank, (None, "")))


def construct_and_exit(out, name):
    """A worker built with the wrong tp_size (1, against the engine's 2): connects, says
    HELLO, and is gone before the engine's refusal can reach it."""
    client = TaskClient(name, 1, 0)
    time.sleep(0.05)
    client.close()


@report_errors
def late_stepper_rank(out, rank, name, tp, async_prefetch, idle_s, n, heartbeat=FAST_HEARTBEAT,
                      leave=None):
    """Build the client, make no step call for ``idle_s`` (a model loading), then take
    ``n`` batches and report them. With ``leave`` (an Event), close only once it is set (a
    rank that closes says BYE, and the engine retires its group)."""
    from fastdeploy_sync import Heartbeat

    with TaskClient(name, tp, rank, async_prefetch=async_prefetch,
                    heartbeat=Heartbeat(*heartbeat)) as client:
        out.put(("ready", rank, None))
        time.sleep(idle_s)
        got = []
        deadline = time.monotonic() + 30
        while len(got) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: took {len(got)}/{n}")
            got.extend(client.sync_step(timeout=10))
            time.sleep(0.001)
        out.put(("taken", rank, got))
        if leave is not None:
            leave.wait(30)


# -- rebuilds: a worker process that builds its client again ------------------------------

@report_errors
def storm_engine(out, life, name, tp, n, seed, seconds, heartbeat=FAST_HEARTBEAT):
    """One life of a restarting engine: put batches ``((life, i), tokens)`` at a random
    pace for ``seconds``, then close (unless the test kills it first). Batches no group
    takes within 0.3 s are skipped (put order within a life stays increasing)."""
    import numpy as np

    from fastdeploy_sync import Heartbeat

    rng = random.Random(seed * 7919 + life)
    end = time.monotonic() + seconds
    with TaskQueue(name, tp, max_inflight=4, heartbeat=Heartbeat(*heartbeat)) as queue:
        out.put(("engine_up", life, os.getpid()))
        i = 0
        while time.monotonic() < end and i < n:
            try:
                queue.put_tasks(((life, i), np.arange(i, i + 64, dtype=np.int64)), timeout=0.3)
            except TimeoutError:
                pass  # no group takes right now (it is being rebuilt): skip this one
            i += 1
            time.sleep(rng.random() * 0.002)
        queue.close(timeout=1)


@report_errors
def rebuild_storm_rank(out, rank, name, tp, seconds, seed, async_prefetch=True,
                       rebuild_p=0.002, cleanup_s=0.1, heartbeat=FAST_HEARTBEAT):
    """A worker process that, for ``seconds``, steps a FastDeploy-shaped loop and builds
    its ``TaskClient`` again after every error and at random points (``rebuild_p`` per
    step), as a server that recovers in-process does: it first spends up to ``cleanup_s``
    (random) on its own clean-up, then closes the old client and builds a new one.

    Reports ("lives", rank, (lives, errors)): ``lives`` maps each group incarnation this
    rank served to every step it passed, ``[(step, [batch id, ...]), ...]``, where ``step``
    counts the barriers that client object passed (an empty list: nothing taken);
    ``errors`` counts what was raised, by type (the engine-side cause for PrefetchError)."""
    import collections

    from fastdeploy_sync import Heartbeat, TaskSyncError

    os.environ["FD_SYNC_ATTACH_TIMEOUT"] = "3"
    rng = random.Random(seed * 1000 + rank)
    lives = collections.defaultdict(list)
    errors = collections.Counter()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            client = TaskClient(name, tp, rank, async_prefetch=async_prefetch,
                                heartbeat=Heartbeat(*heartbeat))
        except (TaskSyncError, TimeoutError) as exc:
            errors["construct:" + type(exc).__name__] += 1
            time.sleep(rng.random() * 0.05)
            continue
        steps = lives[client.incarnation]
        step = 0
        try:
            while time.monotonic() < deadline:
                if rank == 0:
                    client.exist_tasks()
                client.barrier(timeout=5)
                step += 1
                steps.append((step, [batch_id for batch_id, _ in client.get_tasks()[0]]))
                time.sleep(rng.random() * 0.002)  # the model step
                if rng.random() < rebuild_p:
                    errors["rebuilt on purpose"] += 1
                    break
        except TaskSyncError as exc:
            cause = engine_cause(exc)
            errors[type(cause).__name__] += 1
            if type(cause).__name__ == "ProtocolError":  # never expected: keep its words
                errors[f"ProtocolError: {cause}"[:400]] += 1
        time.sleep(rng.random() * cleanup_s)  # the server's own clean-up, old client still open
        client.close()
    out.put(("lives", rank, (dict(lives), dict(errors))))


def check_lives(lives_by_rank):
    """The invariant across rebuilds: for every group incarnation, every rank passed the
    same barriers and took the same batches at each (a rank that passed barriers in an
    incarnation its peers had left, or twice from step 1, passed them alone), in put order
    within each engine life, none twice."""
    ranks = sorted(lives_by_rank)
    incarnations = set()
    for rank in ranks:
        incarnations.update(lives_by_rank[rank])
    problems = []
    for inc in sorted(incarnations):
        per_rank = [lives_by_rank[r].get(inc, []) for r in ranks]
        if any(steps != per_rank[0] for steps in per_rank):
            problems.append(f"group {inc:#x}: " + "; ".join(
                f"rank {r} passed {len(s)} barriers, took {sum(len(i) for _, i in s)} "
                f"batches, last steps {[x for x in s if x[1]][-2:]}"
                for r, s in zip(ranks, per_rank)))
        flat = [batch_id for _, ids in per_rank[0] for batch_id in ids]
        if flat != sorted(flat) or len(set(flat)) != len(flat):
            problems.append(f"group {inc:#x}: batches out of put order or twice: {flat[:20]}")
    return problems


# -- close() from another thread ------------------------------------------------------------

@report_errors
def close_from_thread_rank(out, rank, name, tp, call, async_prefetch, blocked_s=0.3):
    """Rank 0 with its event loop in a thread calling ``call`` ("barrier", "wait_for_tasks",
    "sync_step": blocking while the peer never steps; "exist_tasks", "get_tasks": in a
    tight loop) while the main thread calls ``close()``, as a shutdown or signal-handling
    thread does. Reports ("closed", rank, (exception type, message, seconds from close()
    to the call raising, seconds close() took, calls made))."""
    import threading

    from fastdeploy_sync import Heartbeat

    client = TaskClient(name, tp, rank, async_prefetch=async_prefetch,
                        heartbeat=Heartbeat(0.2, 30))
    out.put(("ready", rank, os.getpid()))
    raised = []
    calls = [0]
    closing = [None]

    def loop():
        try:
            while True:
                calls[0] += 1
                if call == "barrier":
                    client.barrier(timeout=30)
                elif call == "wait_for_tasks":
                    client.wait_for_tasks(30)
                elif call == "sync_step":
                    client.sync_step(timeout=30)
                elif call == "exist_tasks":
                    client.exist_tasks()
                elif call == "get_tasks":
                    client.get_tasks()
                else:
                    raise ValueError(call)
        except BaseException as exc:
            raised.append((type(exc).__name__, str(exc), time.monotonic() - closing[0]
                           if closing[0] else None))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    time.sleep(blocked_s)  # the call is blocked (or spinning) by now
    assert not raised, f"the call raised before close(): {raised}"
    closing[0] = time.monotonic()
    client.close()
    close_s = time.monotonic() - closing[0]
    thread.join(10)
    assert not thread.is_alive(), f"{call} still runs 10 s after close()"
    out.put(("closed", rank, (*raised[0], close_s, calls[0])))


@report_errors
def idle_peer_rank(out, rank, name, tp, seconds):
    """A peer that joins the group and never steps (so rank 0's barrier blocks)."""
    from fastdeploy_sync import Heartbeat

    with TaskClient(name, tp, rank, heartbeat=Heartbeat(0.2, 30)):
        out.put(("ready", rank, os.getpid()))
        time.sleep(seconds)


@report_errors
def gil_hold_rank(out, rank, name, tp, async_prefetch, hold_s, heartbeat, n_after=2):
    """Take one batch, then hold the GIL for ``hold_s`` seconds in one C call (as a long
    numpy or compile step does: no Python thread of this process runs meanwhile), then take
    ``n_after`` more. Reports ("took_first", rank, ids) and ("after_hold", rank, (seconds
    held, every batch taken))."""
    import ctypes

    from fastdeploy_sync import Heartbeat

    hold = ctypes.PyDLL(None).usleep  # PyDLL: the call keeps the GIL
    hold.argtypes = [ctypes.c_uint]
    got = []
    deadline = time.monotonic() + 30
    with TaskClient(name, tp, rank, async_prefetch=async_prefetch,
                    heartbeat=Heartbeat(*heartbeat)) as client:
        out.put(("ready", rank, os.getpid()))
        while not got:
            assert time.monotonic() < deadline, "the first batch never came"
            got.extend(client.sync_step(timeout=10))
            time.sleep(0.001)
        out.put(("took_first", rank, list(got)))
        t0 = time.monotonic()
        hold(int(hold_s * 1e6))
        held = time.monotonic() - t0
        while len(got) < 1 + n_after:
            assert time.monotonic() < deadline, f"took {got} by the deadline"
            got.extend(client.sync_step(timeout=10))
            time.sleep(0.001)
        out.put(("after_hold", rank, (held, got)))


def free_ports(n):
    """``n`` distinct free tcp ports on 127.0.0.1, drawn below the kernel's ephemeral range:
    a port from that range (what binding port 0 gives) can become another test's outgoing
    connection's source port between this pick and the caller's bind ("Address already in
    use" in a parallel run). Another process may still bind one first."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    low, high = 20000, max(20000 + 4 * n + 1000, min(ephemeral_low, 32768))
    rng = random.SystemRandom()
    ports = []
    while len(ports) < n:
        port = rng.randrange(low, high)
        if port in ports:
            continue
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue  # taken now
        finally:
            s.close()
        ports.append(port)
    return ports


@report_errors
def shm_barrier_rank(out, rank, name, size, rounds):
    """A ``ShmBarrier`` rank: passes it ``rounds`` times, reports each pass's
    ``last_arrival_ns()`` as ("passed", rank, [ns, ...])."""
    from fastdeploy_sync.tp import ShmBarrier

    with ShmBarrier(name, size, rank) as barrier:
        passed = []
        for _ in range(rounds):
            barrier.wait(timeout=30)
            passed.append(barrier.last_arrival_ns())
        out.put(("passed", rank, passed))
        barrier.wait(timeout=30)  # every rank reported before any closes
