#!/usr/bin/env python3
"""Micro-benchmark of the worker's critical-path calls: this library (async and sync mode)
side by side with FastDeploy's EngineWorkerQueue as reproduced by
fastdeploy_sync/profiling/fd_baseline.py (its docstring names the FastDeploy commit and
counts the round trips), in the same run.

    python scripts/benchmarks/bench_sync.py [--iters 5000]

Section 6 measures the StepProfiler's own cost per step (FD_SYNC_PROFILE=1). Section 8
measures delivery (put -> every rank took the batch) in a busy TP=2 loop whose 2 ms step
holds the GIL (pure Python) or releases it (sleep), async and sync alternately; section 9
what the barrier's busy-loop question and the event loop's look at its sockets cost;
section 10 a loop whose step holds the GIL, split by whether a batch had woken the prefetch
thread when the step began (the event loop then receives it itself, and the thread's poll
result stays set until it gets the GIL), then the same loop in sync mode.
``--metrics-hz HZ`` registers a fastdeploy_sync.metrics collector on every engine queue of
sections 1-3 and scrapes it HZ times a second from a thread of the engine's process (a
Prometheus server scrapes every 15 s or so: a high rate magnifies the cost).

Every figure is a per-call p50/p99 over real processes (a second rank, an engine, a
manager server). Absolute times drift ~30 % between runs on a shared 2-core machine;
compare the ratios printed in the same run. Nothing here asserts a timing.

White-box benchmark: to split a step's time into its parts it wraps and reads the
library's private members (a client's ring, receiver, connection, watch and group, the
engine's outbox, a ShmTPGroup's words), which users never reach and which may change with
any commit. scripts/tools/layout_check.py allows it (``WHITE_BOX``) and no other script.
"""

import argparse
import contextlib
import multiprocessing as mp
import os
import random
import sys
import threading
import time
import uuid

import numpy as np

from fastdeploy_sync import TaskClient, TaskQueue
from fastdeploy_sync.profiling.fd_baseline import FDManagerQueue
from fastdeploy_sync.wire import codec

SPAWN = mp.get_context("spawn")
ns = time.perf_counter_ns


def pct(samples_ns, q):
    return float(np.percentile(np.asarray(samples_ns, dtype=np.float64), q)) / 1000.0


def timed_calls(fn, iters, warmup=200):
    for _ in range(warmup):
        fn()
    out = np.empty(iters, dtype=np.int64)
    for i in range(iters):
        t0 = ns()
        fn()
        out[i] = ns() - t0
    return out


def timer_overhead(iters=20000):
    return pct(timed_calls(lambda: None, iters), 50)


@contextlib.contextmanager
def scraped(queue):
    """With BENCH_METRICS_HZ set (by --metrics-hz, inherited by the engine processes): a
    metrics collector on ``queue``, scraped that often by a thread until the block ends."""
    hz = float(os.environ.get("BENCH_METRICS_HZ") or 0)
    if hz <= 0:
        yield
        return
    from prometheus_client import CollectorRegistry, generate_latest

    from fastdeploy_sync.metrics import register

    registry = CollectorRegistry()
    register(registry, queue)
    stop = threading.Event()

    def scrape():
        while not stop.wait(1.0 / hz):
            generate_latest(registry)

    thread = threading.Thread(target=scrape, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


# -- helper processes (module level so that spawn can import them) ---------------------------

def hold_rank(name, tp, rank, async_prefetch, ready, stop):
    with TaskClient(name, tp, rank, async_prefetch=async_prefetch):
        ready.set()
        stop.wait(120)


def barrier_rank(name, rank, async_prefetch, iters, late_ms, out, warmup=0):
    """Rank 1 of the barrier benchmark: ``warmup`` barriers first (rank 0 does as many),
    then ``iters``, optionally arriving 0..late_ms late; records the moment of each
    arrival (CLOCK_MONOTONIC is shared across processes)."""
    rng = random.Random(rank)
    arrivals = np.empty(iters, dtype=np.int64)
    with TaskClient(name, 2, rank, async_prefetch=async_prefetch) as client:
        client.barrier(timeout=60)  # both ready
        for _ in range(warmup):
            client.barrier(timeout=60)
        for i in range(iters):
            if late_ms:
                target = ns() + int(rng.random() * late_ms * 1e6)
                time.sleep(max(0.0, (target - ns()) / 1e9 - 0.0002))
                while ns() < target:  # exact arrival time, without a sleeping waiter's jitter
                    pass
            arrivals[i] = ns()
            client.barrier(timeout=60)
    out.put(arrivals)


def gloo_rank(rank, endpoints, name, iters, out):
    """TP=2 over paddle.distributed (gloo, CPU): the plain gloo barrier, then this
    library's paddle coordinator (one all-reduce per step). Rank 0 reports its samples."""
    os.environ.update(PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM="2",
                      PADDLE_TRAINER_ENDPOINTS=",".join(endpoints),
                      PADDLE_CURRENT_ENDPOINT=endpoints[rank], PADDLE_DISTRI_BACKEND="gloo",
                      GLOG_minloglevel="2")
    import warnings

    warnings.filterwarnings("ignore")
    import paddle
    import paddle.distributed as dist

    paddle.set_device("cpu")
    dist.init_parallel_env()
    gloo = timed_calls(dist.barrier, iters, 50)
    with TaskClient(name, 2, rank, coordinator="paddle") as c:
        coordinated = timed_calls(lambda: c.barrier(), iters, 50)
    if rank == 0:
        out.put((gloo, coordinated))


def bench_gloo(iters):
    """None if paddle is not installed."""
    import importlib.util
    import socket

    if importlib.util.find_spec("paddle") is None:
        return None
    socks = [socket.socket() for _ in range(2)]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
    endpoints = [f"127.0.0.1:{sock.getsockname()[1]}" for sock in socks]
    for sock in socks:
        sock.close()
    name = "bg" + uuid.uuid4().hex[:8]
    out = SPAWN.Queue()
    with TaskQueue(name, 2):
        procs = [SPAWN.Process(target=gloo_rank, args=(r, endpoints, name, iters, out))
                 for r in range(2)]
        for p in procs:
            p.start()
        gloo, coordinated = out.get(timeout=300)
        for p in procs:
            p.join(30)
    return {"gloo": gloo, "paddle coordinator": coordinated}


def manager_barrier_rank(address, iters):
    with FDManagerQueue(address=address, tp_size=2, tp_rank=1) as q:
        for _ in range(iters + 1):
            q.barrier(timeout=60)


def _gil_holding_step(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:  # a pure-Python model step: the GIL never released
        pass


def busy_delivery_rank(name, rank, step, async_prefetch, n, out):
    """A busy TP=2 loop (rank 0 checks, barrier, every rank takes, then a 2 ms step that
    holds the GIL, "python", or releases it, "sleep"); records when each batch was taken."""
    taken_at = {}
    with TaskClient(name, 2, rank, async_prefetch=async_prefetch) as client:
        client.barrier(timeout=60)
        out.put(("ready", rank, None))
        deadline = time.monotonic() + 120
        while len(taken_at) < n and time.monotonic() < deadline:
            if rank == 0:
                client.exist_tasks()
            client.barrier(timeout=60)
            for batch_id, _ in client.get_tasks()[0]:
                taken_at[batch_id] = time.monotonic_ns()
            if step == "python":
                _gil_holding_step(0.002)
            else:
                time.sleep(0.002)
        stats = client.stats()  # the socket's batches it received, the ring's it decoded
        by_loop = stats.get("received_by_loop", 0) + stats.get("decoded_by_loop", 0)
    out.put(("taken", rank, (taken_at, by_loop)))


# -- sections --------------------------------------------------------------------------------

def bench_exist(iters):
    """rank-0 exist_tasks() with nothing pending, TP=2 (rank 1 in another process)."""
    rows = {}
    for mode, async_prefetch in (("async", True), ("sync", False)):
        name = "bx" + uuid.uuid4().hex[:8]
        ready, stop = SPAWN.Event(), SPAWN.Event()
        with TaskQueue(name, 2) as queue, scraped(queue):
            p = SPAWN.Process(target=hold_rank, args=(name, 2, 1, async_prefetch, ready, stop))
            p.start()
            try:
                with TaskClient(name, 2, 0, async_prefetch=async_prefetch) as client:
                    ready.wait(60)
                    rows[mode] = timed_calls(client.exist_tasks, iters)
            finally:
                stop.set()
                p.join(10)
    with FDManagerQueue(is_server=True, tp_size=2) as server, \
            FDManagerQueue(address=server.address, tp_size=2, tp_rank=0) as q:
        rows["fd-manager exist_tasks()"] = timed_calls(q.exist_tasks, iters)
        # What every rank of FastDeploy's loop evaluates after the barrier on a step without
        # a batch: the shared-memory group flag, then the manager's read-finish flag.
        rows["fd-manager idle check"] = timed_calls(
            lambda: q.exist_task_signal() or q.get_read_finish_flag(), max(iters // 10, 200), 50)
        rows["fd-manager num_tasks()"] = timed_calls(q.num_tasks, max(iters // 10, 200), 50)
    return rows


def make_requests(n=64, tokens=512, as_list=False):
    reqs = []
    for i in range(n):
        ids = np.arange(i, i + tokens, dtype=np.int64)
        reqs.append({"request_id": f"req-{i}", "prompt_token_ids": ids.tolist() if as_list else ids,
                     "max_tokens": 128, "temperature": 0.8})
    return reqs, n


def engine_on_demand(name, conn):
    """The engine in its own process (as in a real server): puts one batch per request."""
    batch = make_requests()
    with TaskQueue(name, 1, max_inflight=4) as queue, scraped(queue):
        conn.send(True)
        while conn.recv():
            conn.send(queue.put_tasks(batch, timeout=10))
        conn.send(queue.stats())


def bench_take(iters):
    """A step that takes a ready batch of 64 requests x 512 token ids, TP=1.
    async: exist_tasks() + get_tasks() (the thread has already received and decoded).
    sync: exist_tasks() + get_tasks(), receiving and decoding on the event loop.
    fd-manager: FastDeploy's step with a batch at TP=1: exist_tasks() and set the group
    flag (shared memory), test it, get_tasks() (one batch in the list, copied through the
    proxy; the one rank is the last reader, 11 round trips), clear the flag."""
    rows = {}
    batch = make_requests()
    for mode, async_prefetch in (("async", True), ("sync", False)):
        name = "bt" + uuid.uuid4().hex[:8]
        samples = []
        here, there = SPAWN.Pipe()
        engine = SPAWN.Process(target=engine_on_demand, args=(name, there), daemon=True)
        engine.start()
        here.recv()
        with TaskClient(name, 1, 0, async_prefetch=async_prefetch) as client:
            # the engine's WELCOME arrives on the data socket first: read it before timing,
            # so that below "something arrived" means the batch
            deadline = time.monotonic() + 10
            while not client._watch.bound and time.monotonic() < deadline:
                client.num_tasks()
                time.sleep(0.001)
            for i in range(iters + 20):
                here.send(True)
                here.recv()
                deadline = time.monotonic() + 10
                if async_prefetch:  # wait outside the timed region until it is decoded
                    while client.stats()["held"] < 1 and time.monotonic() < deadline:
                        time.sleep(0.0001)
                elif client._ring.reader is not None:  # in the ring, not decoded
                    while client.ready_count() < 1 and time.monotonic() < deadline:
                        time.sleep(0.0001)
                elif not client._conn.data.poll(10000):  # arrived in the socket, not yet received
                    raise TimeoutError("batch did not arrive")
                time.sleep(0.001)  # let the previous step's acknowledgement settle
                t0 = ns()
                client.exist_tasks()
                tasks, _ = client.get_tasks()
                dt = ns() - t0
                if len(tasks) != 1 or len(tasks[0][0]) != 64:
                    from fastdeploy_sync.engine.queue import query_status
                    from fastdeploy_sync.wire.endpoints import default_endpoint
                    raise RuntimeError(
                        f"{mode} step {i}: took {len(tasks)} batch(es); worker "
                        f"{client.stats()}, error {client._faults.error!r}; engine "
                        f"{query_status(default_endpoint(name, 0))}")
                del tasks  # freeing the batch is the model runner's business, not timed
                if i >= 20:
                    samples.append(dt)
            here.send(False)
            here.recv()
        engine.join(10)
        rows[mode] = np.asarray(samples)
    with FDManagerQueue(is_server=True, tp_size=1) as server, \
            FDManagerQueue(address=server.address, tp_size=1, tp_rank=0) as q:
        samples = []
        for _ in range(max(iters // 10, 100)):
            server.put_tasks(batch, timeout=10)
            t0 = ns()
            if q.exist_tasks():
                q.set_exist_task_signal(True)
            if q.exist_task_signal() or q.get_read_finish_flag():
                tasks, last = q.get_tasks()
                if last:
                    q.set_exist_task_signal(False)
            samples.append(ns() - t0)
            assert len(tasks) == 1
            del tasks
        rows["fd-manager"] = np.asarray(samples)
    return rows


# Section 3's loop does nothing but barriers. The barrier judges a loop busy from the
# share of the time its thread ran since it last asked, and asks an idle-looking loop
# again only after 10 ms (tp_group._REASK_NS); the processes start idle, so the first
# ~10 ms of barriers run the idle loop's policy (spin 8 us, then block). These barriers
# first, ~20-40 ms, so that the timed ones measure the busy loop's steady state.
BUSY_WARMUP = 40_000


def bench_barrier_together(iters):
    rows = {}
    for mode, async_prefetch in (("async", True), ("sync", False)):
        name = "bb" + uuid.uuid4().hex[:8]
        out = SPAWN.Queue()
        with TaskQueue(name, 2) as queue, scraped(queue):
            with TaskClient(name, 2, 0, async_prefetch=async_prefetch) as client:
                p = SPAWN.Process(target=barrier_rank,
                                  args=(name, 1, async_prefetch, iters, 0, out, BUSY_WARMUP))
                p.start()
                client.barrier(timeout=60)
                samples = timed_calls(lambda: client.barrier(timeout=60), iters,
                                      warmup=BUSY_WARMUP)
                out.get(timeout=60)
                p.join(10)
        rows[mode] = samples
    with FDManagerQueue(is_server=True, tp_size=2) as server, \
            FDManagerQueue(address=server.address, tp_size=2, tp_rank=0) as q:
        m = max(iters // 5, 200)
        p = SPAWN.Process(target=manager_barrier_rank, args=(server.address, m))
        p.start()
        q.barrier(timeout=60)
        samples = timed_calls(lambda: q.barrier(timeout=60), m, warmup=0)
        p.join(30)
        rows["fd-manager"] = samples
    return rows


def bench_barrier_late(iters, late_ms=3.0):
    """Rank 1 arrives 0..late_ms late; release latency = rank 0's return - rank 1's arrival.
    Also rank 0's CPU time while it waits, as % of one core."""
    rows = {}
    variants = (("spin 50us, then block (default)", "50"), ("spin only", "1e9"),
                ("block at once", "0"))
    for label, spin in variants:
        os.environ["FD_SYNC_BARRIER_SPIN_US"] = spin
        name = "bl" + uuid.uuid4().hex[:8]
        out = SPAWN.Queue()
        with TaskQueue(name, 2):
            with TaskClient(name, 2, 0) as client:
                p = SPAWN.Process(target=barrier_rank, args=(name, 1, True, iters, late_ms, out))
                p.start()
                client.barrier(timeout=60)
                returns = np.empty(iters, dtype=np.int64)
                cpu0, wall0 = time.thread_time(), time.perf_counter()
                for i in range(iters):
                    client.barrier(timeout=60)
                    returns[i] = ns()
                cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
                arrivals = out.get(timeout=60)
                p.join(10)
        rows[label] = (returns - arrivals, 100.0 * cpu / wall)
    os.environ.pop("FD_SYNC_BARRIER_SPIN_US", None)
    return rows


def bench_decode(iters=300):
    rows = {}
    for label, as_list in (("numpy token ids (zero-copy frames)", False),
                           ("Python list token ids (pickled)", True)):
        frames = codec.encode_payload(make_requests(as_list=as_list))
        rows[label] = (timed_calls(lambda frames=frames: codec.decode_payload(frames), iters, 20),
                       len(frames))
    return rows


def bench_busy_delivery(n, rounds=2):
    """Put -> every rank took it (CLOCK_MONOTONIC, shared by the processes), TP=2, puts of
    64 x 512 int64 token ids 5-15 ms apart, for each step kind and mode, modes alternating
    (``rounds`` times). Returns {(step, mode): [per-batch ms, ...]} and the share of
    batches the event loop received itself (async)."""
    batch = make_requests()
    rows, by_loop = {}, {}
    for _ in range(rounds):
        for step in ("python", "sleep"):
            for mode, async_prefetch in (("async", True), ("sync", False)):
                name = "bd" + uuid.uuid4().hex[:8]
                out = SPAWN.Queue()
                with TaskQueue(name, 2) as queue:
                    ps = [SPAWN.Process(target=busy_delivery_rank,
                                        args=(name, r, step, async_prefetch, n, out))
                          for r in range(2)]
                    for p in ps:
                        p.start()
                    for _ in range(2):
                        out.get(timeout=60)
                    rng = random.Random(1)
                    put_at = {}
                    for i in range(n):
                        time.sleep(0.005 + rng.random() * 0.01)
                        put_at[i] = time.monotonic_ns()
                        queue.put_tasks((i, batch), timeout=30)
                    got = {}
                    for _ in range(2):
                        _, rank, report = out.get(timeout=180)
                        got[rank] = report
                    for p in ps:
                        p.join(30)
                ms = [(max(got[r][0][i] for r in range(2)) - put_at[i]) / 1e6 for i in range(n)]
                rows.setdefault((step, mode), []).extend(ms)
                if async_prefetch:
                    by_loop.setdefault(step, []).append(
                        max(got[r][1] for r in range(2)) / n)
    return rows, by_loop


def bench_questions(iters=20000):
    """What the barrier's busy-loop question and the event loop's look at its sockets cost
    (per call, ns, the best of 5 blocks)."""
    import select
    import threading

    import zmq

    from fastdeploy_sync.tp.layout import R_ARRIVED, RANK_BASE, RANK_STRIDE
    from fastdeploy_sync.tp.shm_group import ShmTPGroup
    from fastdeploy_sync.tp.spin import _RunQueueWait

    runq = _RunQueueWait()
    # rank 0 of a TP=2 group whose rank 1 is always already there: barrier()'s own work,
    # without a partner to wait for or another core's cache line to fetch
    group = ShmTPGroup("bq" + uuid.uuid4().hex[:8], 0, 2, 0)
    group._view[RANK_BASE + RANK_STRIDE + R_ARRIVED] = 1 << 62
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect("tcp://127.0.0.1:9")  # never connects: an idle socket's descriptor
    poller = select.poll()
    poller.register(sock.getsockopt(zmq.FD), select.POLLIN)
    lock = threading.Lock()

    def lock_pair():
        if lock.acquire(False):
            lock.release()

    candidates = (("time.perf_counter_ns()", time.perf_counter_ns),
                  ("time.monotonic_ns()", time.monotonic_ns),
                  ("time.thread_time_ns() (CPU time of the thread)", time.thread_time_ns),
                  ("schedstat run-queue wait (pread, kept open)", runq.read),
                  ("zmq socket getsockopt(EVENTS)", lambda: sock.getsockopt(zmq.EVENTS)),
                  ("poll(0) of the socket's descriptor", lambda: poller.poll(0)),
                  ("lock acquire(False) + release", lock_pair),
                  ("ShmTPGroup.barrier(), the partner already arrived", group.barrier))
    rows = {}
    try:
        for label, fn in candidates:
            best = float("inf")
            for _ in range(5):
                t0 = ns()
                for _ in range(iters):
                    fn()
                best = min(best, (ns() - t0) / iters)
            rows[label] = best
    finally:
        group.close()
        runq.close()
        ctx.destroy(linger=0)
    return rows


def bench_profiler_overhead(blocks=200, steps=2000):
    """exist_tasks + barrier + get_tasks at TP=1 with nothing pending, on a client without
    and one with the StepProfiler, in alternating blocks; per block, the mean step time.
    Returns (plain block means, profiled block means), ns per step."""
    plain_means, profiled_means = [], []
    names = ["bp" + uuid.uuid4().hex[:8] for _ in range(2)]
    with TaskQueue(names[0], 1), TaskQueue(names[1], 1), \
            TaskClient(names[0], 1, 0) as plain, \
            TaskClient(names[1], 1, 0, profile=True) as profiled:
        def block(client):
            exist_tasks, barrier, get_tasks = client.exist_tasks, client.barrier, client.get_tasks
            t0 = ns()
            for _ in range(steps):
                exist_tasks()
                barrier()
                get_tasks()
            return (ns() - t0) / steps

        for _ in range(blocks):
            plain_means.append(block(plain))
            profiled_means.append(block(profiled))
    return np.asarray(plain_means), np.asarray(profiled_means)


def take_batches(client, rank, n):
    """Take ``n`` batches, then return: rank 0 blocks in ``wait_for_tasks()``, every rank
    in the barrier (the idle ranks of section 7, ``put_floor.py`` and ``ring_parts.py``)."""
    taken = 0
    while taken < n:
        if rank == 0:
            client.wait_for_tasks(1.0)
        client.barrier(timeout=60)
        tasks, _ = client.get_tasks()
        taken += len(tasks)
        del tasks


def delivery_rank(name, tp, rank, n, out):
    """Take ``n`` batches (rank 0 blocks in wait_for_tasks, the others in the barrier) and
    report, per seq, when this rank began to decode it and when it held it decoded
    (CLOCK_MONOTONIC, shared by the processes): over the socket, when its receiver got the
    frames and when it published that it holds the batch; through the ring, when the first
    decode of the seq (the prefetch thread's, or the event loop's if it came first) began
    and ended. Also the async threads' CPU per batch and this rank's decode time."""
    received, published = {}, {}
    with TaskClient(name, tp, rank, async_prefetch=True) as client:
        group = client._group
        publish, on_data = group.publish_received, client._receiver._on_data

        def timed_publish(seq):
            published[seq] = ns()
            publish(seq)

        def timed_on_data(header, frames):
            received[header.seq] = ns()
            on_data(header, frames)

        group.publish_received, client._receiver._on_data = timed_publish, timed_on_data
        client.barrier(timeout=60)  # every rank is up
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # welcomed, and the ring attached if there is one
            stats = client.stats()
            if stats["engine"] and (stats.get("ring") or stats.get("no_ring")
                                    or "ring" not in stats):  # (a version without rings)
                break
            time.sleep(0.001)
        ring = client._ring.reader
        decode_times = []
        if ring is not None:
            decode = ring.decode

            def timed_decode(seq):
                t0 = ns()
                tasks = decode(seq)
                t1 = ns()
                decode_times.append(t1 - t0)
                received.setdefault(seq, t0)
                published.setdefault(seq, t1)
                return tasks

            ring.decode = timed_decode
        out.put(("ready", rank, None))
        cpu0 = client.prefetch_cpu_seconds()
        take_batches(client, rank, n)
        cpu1 = client.prefetch_cpu_seconds()  # None: the threads have stopped already
        cpu = (cpu1 - cpu0) / n * 1e9 if cpu0 is not None and cpu1 is not None else np.nan
    out.put(("times", rank, (received, published, cpu, decode_times)))


def timed_sends(queue):
    """{seq: when the engine's first DATA message for it left} (either thread's send),
    recorded by wrapping the queue's one sending method."""
    first = {}
    outbox = queue._io._outbox
    send = outbox.send

    def timed(link, frames):
        ok = send(link, frames)
        header = codec.unpack_header(frames[0])
        if ok and header.kind == codec.DATA and header.seq not in first:
            first[header.seq] = ns()
        return ok

    outbox.send = timed
    return first


DELIVERY_MODES = (("socket (FD_SYNC_SHM_RING_KB=off)", {"FD_SYNC_SHM_RING_KB": "off"}),
                  ("pool (ring off, FD_SYNC_SHM_PAYLOAD_MIN_KB=64)",
                   {"FD_SYNC_SHM_RING_KB": "off", "FD_SYNC_SHM_PAYLOAD_MIN_KB": "64"}),
                  ("ring (the default)", {}))


def bench_delivery(n, tp=2, modes=DELIVERY_MODES):
    """Put -> every rank holds a 64 x 512 batch, through each of ``modes`` (the socket,
    the shared-memory pool, the ring), puts alternating between their queues (2-5 ms
    apart, the ranks idle in between). Per row: {"held", "put", "send", "transport",
    "decode", "cpu", "decode_calls"}, us ("send": the call to the first DATA message
    leaving the engine)."""
    batch = make_requests()
    queues, procs, outs = {}, [], {}
    try:
        for label, env in modes:
            os.environ.update(env)  # read by TaskQueue()
            name = "bd" + uuid.uuid4().hex[:8]
            queues[label] = TaskQueue(name, tp, max_inflight=4)
            outs[label] = SPAWN.Queue()
            for rank in range(tp):
                p = SPAWN.Process(target=delivery_rank, args=(name, tp, rank, n, outs[label]))
                p.start()
                procs.append(p)
            for key in env:
                os.environ.pop(key, None)
        sent = {label: timed_sends(queue) for label, queue in queues.items()}
        for label in queues:
            for _ in range(tp):
                kind, rank, payload = outs[label].get(timeout=120)
        time.sleep(0.3)
        rng = random.Random(1)
        started = {label: {} for label in queues}
        returned = {label: {} for label in queues}
        for _ in range(n):
            for label, queue in queues.items():
                time.sleep(0.002 + rng.random() * 0.003)
                t0 = ns()
                seq = queue.put_tasks(batch, timeout=30)
                returned[label][seq] = ns()
                started[label][seq] = t0
        rows = {}
        for label in queues:
            times = {}
            for _ in range(tp):
                kind, rank, payload = outs[label].get(timeout=120)
                times[rank] = payload
            seqs = sorted(started[label])[10:]  # the first batches map the pool, warm caches
            last = {s: max(range(tp), key=lambda r: times[r][1][s]) for s in seqs}
            rows[label] = {
                "held": [times[last[s]][1][s] - started[label][s] for s in seqs],
                "put": [returned[label][s] - started[label][s] for s in seqs],
                "send": [sent[label][s] - started[label][s] for s in seqs
                         if s in sent[label]],
                "transport": [times[last[s]][0][s] - returned[label][s] for s in seqs],
                "decode": [times[last[s]][1][s] - times[last[s]][0][s] for s in seqs],
                "cpu": [times[r][2] for r in range(tp)],
                "decode_calls": [t for r in range(tp) for t in times[r][3]]}
        return rows
    finally:
        for queue in queues.values():
            queue.close(timeout=10)
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()


# -- report ----------------------------------------------------------------------------------

def line(label, samples, ref=None):
    p50, p99 = pct(samples, 50), pct(samples, 99)
    ratio = ""
    if ref:
        ratio = (f"   {ref / p50:8.1f}x faster" if ref >= p50 else f"   {p50 / ref:8.1f}x slower")
    print(f"  {label:<46} p50 {p50:10.2f} us   p99 {p99:10.2f} us{ratio}")
    return p50


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=5000)
    ap.add_argument("--sections", default="1,2,3,4,5,6,7,8,9,10",
                    help="comma-separated section numbers to run (default: all)")
    ap.add_argument("--metrics-hz", type=float, default=0,
                    help="scrape a metrics collector on each engine queue of sections 1-3 "
                         "this many times a second (default 0: no collector)")
    args = ap.parse_args()
    if args.metrics_hz:
        os.environ["BENCH_METRICS_HZ"] = str(args.metrics_hz)
    n = args.iters
    want = {int(x) for x in args.sections.split(",")}
    print(f"fastdeploy_sync micro-benchmark, python {sys.version.split()[0]}, "
          f"{os.cpu_count()} cores, {n} iterations; perf_counter_ns overhead "
          f"{timer_overhead():.2f} us (included below)"
          + (f"; metrics scraped {args.metrics_hz:g}/s" if args.metrics_hz else ""))
    sections = [_section_1, _section_2, _section_3, _section_4, _section_5, _section_6,
                _section_7, _section_8, _section_9, _section_10]
    for k, section in enumerate(sections, 1):
        if k in want:
            section(n)


def _section_1(n):
    print("\n1. rank-0 exist_tasks() with nothing pending, TP=2")
    rows = bench_exist(n)
    ref = line("fd-manager exist_tasks() (shared memory, 0 RT)", rows["fd-manager exist_tasks()"])
    line("fd-manager idle check, every rank (1 RT)", rows["fd-manager idle check"], ref)
    line("fd-manager num_tasks() (3 round trips)", rows["fd-manager num_tasks()"], ref)
    line("sync  exist_tasks() (polls the socket)", rows["sync"], ref)
    line("async exist_tasks() (flag read)", rows["async"], ref)



def _section_2(n):
    print("\n2. a step that takes a ready batch of 64 requests x 512 int64 token ids, TP=1")
    rows = bench_take(max(n // 5, 200))
    ref = line("fd-manager exist_tasks()+get_tasks() (11 RT)", rows["fd-manager"])
    line("sync  exist_tasks()+get_tasks() (recv+decode)", rows["sync"], ref)
    line("async exist_tasks()+get_tasks()", rows["async"], ref)



def _section_3(n):
    print(f"\n3. barrier() at TP=2, both ranks arriving together (per call on rank 0, after "
          f"{BUSY_WARMUP} barriers: the busy loop's steady state)")
    rows = bench_barrier_together(n)
    ref = line("fd-manager Barrier proxy", rows["fd-manager"])
    line("sync  barrier() (shared memory, drains socket)", rows["sync"], ref)
    line("async barrier() (shared memory)", rows["async"], ref)
    gloo = bench_gloo(max(n // 5, 300))
    if gloo is None:
        print("  (paddlepaddle not installed: gloo rows skipped)")
    else:
        line("paddle.distributed gloo barrier()", gloo["gloo"], ref)
        line("coordinator='paddle' barrier() (all-reduce)", gloo["paddle coordinator"], ref)



def _section_4(n):
    print("\n4. barrier() at TP=2, rank 1 arriving 0-3 ms late: release latency on rank 0 "
          "after rank 1 arrives, and rank 0's CPU while waiting")
    for label, (latency, cpu_pct) in bench_barrier_late(max(n // 5, 300)).items():
        line(label, latency)
        print(f"  {'':<46} waiting rank CPU {cpu_pct:5.1f} % of a core")



def _section_5(n):
    print("\n5. decode of 64 requests x 512 token ids (GIL held by the prefetch thread)")
    for label, (samples, frames) in bench_decode().items():
        line(f"{label}, {frames} frames", samples)



def _section_6(n):
    print("\n6. StepProfiler overhead per step (FD_SYNC_PROFILE=1): exist_tasks+barrier+"
          "get_tasks, TP=1, nothing pending, alternating blocks of 2000 steps")
    plain, profiled = bench_profiler_overhead(max(n // 25, 40))
    diff = profiled - plain
    print(f"  {'step without profiler':<46} p50 {np.median(plain) / 1e3:10.2f} us (block means)")
    print(f"  {'step with profiler':<46} p50 {np.median(profiled) / 1e3:10.2f} us (block means)")
    print(f"  {'overhead (paired block difference)':<46} p50 {np.median(diff) / 1e3:10.2f} us   "
          f"p25-p75 {np.percentile(diff, 25) / 1e3:.2f}-{np.percentile(diff, 75) / 1e3:.2f} us")


def _section_7(n):
    print("\n7. put -> every rank holds a batch of 64 requests x 512 int64 token ids, TP=2 "
          "(engine in this process; ranks idle, rank 0 in wait_for_tasks)")
    n = max(n // 25, 100)
    rows = bench_delivery(n)
    for label, parts in rows.items():
        line(label, parts["held"])
        sent = (f" (the first send {pct(parts['send'], 50):.1f} us after the call)"
                if parts["send"] else " (nothing sent)")
        print(f"  {'':<46} of which, p50: put_tasks {pct(parts['put'], 50):7.1f} us{sent}, "
              f"then until the last rank began to decode it (socket: its receiver has the "
              f"frames) {pct(parts['transport'], 50):7.1f} us, its check+decode(+publish) "
              f"{pct(parts['decode'], 50):7.1f} us")
        cpu = np.mean(parts["cpu"]) / 1000
        if parts["decode_calls"]:
            decode = pct(parts["decode_calls"], 50)
            print(f"  {'':<46} background threads' CPU per batch and rank {cpu:7.1f} us; "
                  f"one decode from the ring p50 {decode:7.1f} us: {cpu / decode:.2f}x")
        else:
            print(f"  {'':<46} background threads' CPU per batch and rank {cpu:7.1f} us")
    enc = bench_encode_parts()
    print(f"  {'':<46} in this process alone, p50: encode {enc['encode']:.1f} us "
          f"({enc['encode after idle']:.1f} us after 3 ms asleep, as between the puts above), "
          f"checksum {enc['checksum']:.1f} us, decode {enc['decode']:.1f} us")


def bench_encode_parts(iters=500):
    """The engine's and a rank's CPU work for the 64 x 512 batch, without wake-ups."""
    batch = make_requests()
    frames = codec.encode_payload(batch)
    check = codec.payload_checksum(frames)
    after_idle = []
    for _ in range(100):  # what the puts above pay: caches cooled by 3 ms of other work
        time.sleep(0.003)
        t0 = ns()
        codec.encode_payload(batch)
        after_idle.append(ns() - t0)
    return {"encode after idle": pct(after_idle, 50),
            "encode": pct(timed_calls(lambda: codec.encode_payload(batch), iters, 50), 50),
            "checksum": pct(timed_calls(lambda: codec.payload_checksum(frames), iters, 50), 50),
            "decode": pct(timed_calls(lambda: codec.decode_payload(frames, check), iters, 50), 50)}


def _section_8(n):
    count = max(n // 20, 100)
    print(f"\n8. put -> every rank took it, TP=2 busy loop (2 ms step), {count} batches of 64 x "
          f"512 token ids 5-15 ms apart, per step kind and mode, alternating, 2 rounds (ms)")
    rows, by_loop = bench_busy_delivery(count)
    for step in ("python", "sleep"):
        holds = "holds the GIL" if step == "python" else "releases the GIL"
        for mode in ("sync", "async"):
            ms = np.asarray(rows[(step, mode)])
            extra = ""
            if mode == "async":
                extra = (f"   received or decoded by the event loop: "
                         f"{100 * float(np.mean(by_loop[step])):.0f} % of batches")
            print(f"  {step + ' step (' + holds + '), ' + mode:<46} p50 "
                  f"{np.percentile(ms, 50):8.2f} ms p99 {np.percentile(ms, 99):8.2f} ms{extra}")


def _section_9(n):
    print("\n9. what the barrier's busy-loop question and the look at the sockets cost "
          "(per call, best of 5 blocks)")
    for label, cost in bench_questions().items():
        print(f"  {label:<52} {cost:8.1f} ns")


def stale_poll_rank(name, out, async_prefetch=True, step_s=0.002):
    """TP=1: a loop whose model step holds the GIL; per step, the time of
    exist_tasks() + barrier() + get_tasks(), whether the prefetch thread's poll result was
    set (a batch woke it) when the step began (async; sync: False), and how many batches
    it took. Stops at the batch "stop"."""
    rows = []
    with TaskClient(name, 1, 0, async_prefetch=async_prefetch) as client:
        out.put(("ready", None))
        ready = client._receiver.ready if async_prefetch else None
        while True:
            woken = ready is not None and ready.ready(0)
            t0 = ns()
            client.exist_tasks()
            client.barrier()
            tasks, _ = client.get_tasks()
            rows.append((ns() - t0, woken, len(tasks)))
            if tasks and tasks[-1] == "stop":
                break
            _gil_holding_step(step_s)
        received_by_loop = client.stats().get("received_by_loop", 0)
    out.put(("rows", (rows, received_by_loop)))


def bench_stale_poll(n, async_prefetch=True):
    """Section 10: ``stale_poll_rank`` against an engine here putting a 64 x 512 batch
    every 10 ms."""
    name = "sp" + uuid.uuid4().hex[:8]
    batch = make_requests()
    out = SPAWN.Queue()
    with TaskQueue(name, 1, max_inflight=8) as queue:
        proc = SPAWN.Process(target=stale_poll_rank, args=(name, out, async_prefetch))
        proc.start()
        try:
            assert out.get(timeout=60)[0] == "ready"
            for _ in range(n):
                time.sleep(0.010)
                queue.put_tasks(batch, timeout=30)
            queue.put_tasks("stop", timeout=30)
            kind, (rows, by_loop) = out.get(timeout=60)
        finally:
            proc.join(20)
            if proc.is_alive():
                proc.kill()
    times = np.asarray([r[0] for r in rows], dtype=np.float64)
    woken = np.asarray([r[1] for r in rows], dtype=bool)
    took = np.asarray([r[2] for r in rows]) > 0
    return times, woken, took, by_loop


def _section_10(n):
    count = max(n // 20, 100)
    print(f"\n10. check + barrier + take in a loop whose 2 ms step holds the GIL, TP=1, async "
          f"then sync, {count} batches of 64 x 512 token ids 10 ms apart")
    times, woken, took, by_loop = bench_stale_poll(count)
    idle = ~took
    took_async = line(f"steps that took a batch ({int(took.sum())})", times[took])
    line(f"steps without, prefetch poll result set ({int((idle & woken).sum())})",
         times[idle & woken])
    line(f"steps without, result clear ({int((idle & ~woken).sum())})", times[idle & ~woken])
    line("every step", times)
    print(f"  {'':<46} received by the event loop: {by_loop} of {count + 1} batches")
    # The same loop in sync mode: there the event loop receives every batch too, but no
    # other thread waits for the GIL meanwhile (in async mode the woken prefetch thread
    # does, and each GIL release of the loop's receive hands it a futex wake-up)
    times, _, took, _ = bench_stale_poll(count, async_prefetch=False)
    took_sync = line(f"sync: steps that took a batch ({int(took.sum())})", times[took])
    line(f"sync: steps without ({int((~took).sum())})", times[~took])
    line("sync: every step", times)
    print(f"  {'':<46} a step that took a batch, async / sync: {took_async / took_sync:.2f}")


if __name__ == "__main__":
    main()

