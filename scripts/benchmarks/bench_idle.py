#!/usr/bin/env python3
"""What an idle worker costs, and how fast a sleeping rank 0 wakes: side by side, one run.

    python scripts/benchmarks/bench_idle.py [--seconds 3] [--puts 300] [--iters 3000]

1. CPU of idle TP=2 workers (% of one core per process: event loop, prefetch thread and
   ZeroMQ's I/O thread together), nothing put:
     - FastDeploy's polling loop without task sync (sleep 1 ms, no client): the floor;
     - a client built, its loop calling only num_tasks(): the client's background cost;
     - FastDeploy's 1 ms loop (rank 0: exist_tasks, barrier, get_tasks, sleep 1 ms; other
       ranks: barrier, get_tasks, sleep 1 ms), adaptive barrier (this library);
     - the same loop with the barrier forced to spin its full window first (50 µs, the
       barrier before it became adaptive), and never spinning (FD_SYNC_BARRIER_SPIN_US=0);
     - the blocking loop (rank 0: wait_for_tasks(0.1), barrier, get_tasks; other ranks:
       barrier, get_tasks).
2. Put -> rank 0 sees the batch (TP=2, both ranks must hold it): rank 0 blocked in
   wait_for_tasks() vs polling exist_tasks() every 1 ms. Includes the engine's send, the
   transport, decoding and the wake-up (CLOCK_MONOTONIC is shared across processes), then
   split at the moment the last rank's receiver published the batch.
3. barrier() at TP=2 with both ranks arriving together: adaptive vs fixed 50 µs spin.
4. CPU per call of FastDeploy's idle 1 ms loop, by the event-loop thread's own clock
   (time.thread_time_ns around each call; its own cost, ~0.5 µs, included): what the
   check, the barrier and the take cost an idle worker, without the process's other
   threads and without the sleep.
5. A client's start-up, as an idle loop sees it: in a worker that has already built and
   closed clients, CPU of all its threads (each thread's /proc schedstat) in the first 10
   iterations of FastDeploy's idle 1 ms loop after a new client was built, against 10
   later ones (the mean of iterations 10-59). What the profile's idle windows skip
   (profiling.loops.IDLE_WARMUP_STEPS).

Absolute figures drift ~30 % between runs on a shared 2-core machine: compare the rows
of one run. Nothing here asserts a timing.

White-box benchmark: section 2 splits the wake-up at the moment the last rank's receiver
published the batch by wrapping the client's private group (``client._group``); users
never reach it. scripts/tools/layout_check.py allows it (``WHITE_BOX``).
"""

import argparse
import multiprocessing as mp
import os
import random
import sys
import time
import uuid

import numpy as np

from fastdeploy_sync import TaskClient, TaskQueue

SPAWN = mp.get_context("spawn")
ns = time.perf_counter_ns


def _fixed_spin():
    """The barrier before it became adaptive: always spin the full window first."""
    from fastdeploy_sync.tp.spin import SpinPolicy

    SpinPolicy.budget_s = lambda self, now_ns=0, late=0: self.spin_s


# -- helper processes (module level so that spawn can import them) ---------------------------

def idle_loop_rank(name, tp, rank, loop, seconds, barrier, out):
    """Run one idle loop until the test's "stop" batch arrives (every rank takes it at the
    same step); report this process's CPU % of one core over that time. ``barrier``:
    "adaptive", "fixed" (always spin the window first) or "block" (never spin)."""
    if barrier == "fixed":
        _fixed_spin()
    elif barrier == "block":
        os.environ["FD_SYNC_BARRIER_SPIN_US"] = "0"
    if loop == "no-sync":  # the floor: no client at all
        out.put(("ready", rank, None))
        c0, w0 = time.process_time(), time.monotonic()
        while time.monotonic() - w0 < seconds:
            time.sleep(0.001)
        out.put(("cpu", rank, 100.0 * (time.process_time() - c0) / (time.monotonic() - w0)))
        return
    with TaskClient(name, tp, rank, async_prefetch=True) as client:
        client.barrier(timeout=60)  # every rank is up
        out.put(("ready", rank, None))
        c0, w0 = time.process_time(), time.monotonic()
        while True:
            if loop == "client-only":  # no step calls: the client's own background cost
                if client.num_tasks():
                    break
                time.sleep(0.001)
                continue
            if rank == 0:
                if loop == "wait":
                    client.wait_for_tasks(0.1)
                else:
                    client.exist_tasks()
            client.barrier(timeout=60)
            if client.get_tasks()[0]:
                break
            if loop != "wait":
                time.sleep(0.001)
        cpu = 100.0 * (time.process_time() - c0) / (time.monotonic() - w0)
        if loop == "client-only":
            # each rank saw the stop batch on its own: meet before closing, or the first
            # to close (BYE) retires the group while the other has not yet seen it, and
            # the other's num_tasks() raises GroupLostError
            client.barrier(timeout=60)
        out.put(("cpu", rank, cpu))


def wake_rank(name, tp, rank, loop, n, out):
    """Take ``n`` batches; rank 0 records when it learned of each (batch id -> ns), every
    rank when its receiver published it (seq -> ns)."""
    seen = {}
    published = {}
    with TaskClient(name, tp, rank, async_prefetch=True) as client:
        group = client._group
        publish = group.publish_received

        def timed_publish(seq):  # the receiver's moment, for the breakdown
            published[seq] = ns()
            publish(seq)

        group.publish_received = timed_publish
        client.barrier(timeout=60)  # every rank is up
        out.put(("ready", rank))
        taken = 0
        while taken < n:
            if rank == 0:
                if loop == "wait":
                    client.wait_for_tasks(1.0)
                else:
                    client.exist_tasks()
                t = ns()
            client.barrier(timeout=60)
            tasks, _ = client.get_tasks()
            if rank == 0:
                for batch_id in tasks:
                    seen[batch_id] = t
            taken += len(tasks)
            if loop == "poll" and not tasks:
                time.sleep(0.001)
    out.put(("seen", rank, (seen, published)))


def together_rank(name, rank, iters, fixed_spin, out):
    if fixed_spin:
        _fixed_spin()
    with TaskClient(name, 2, rank, async_prefetch=True) as client:
        client.barrier(timeout=60)
        samples = np.empty(iters, dtype=np.int64)
        for i in range(iters):
            t0 = ns()
            client.barrier(timeout=60)
            samples[i] = ns() - t0
    out.put((rank, samples))


def call_cpu_rank(name, tp, rank, n, out):
    """FastDeploy's idle 1 ms loop for ``n`` iterations; the event-loop thread's CPU time
    per call (µs, mean): check (rank 0), barrier, take."""
    tt = time.thread_time_ns
    with TaskClient(name, tp, rank, async_prefetch=True) as client:
        client.barrier(timeout=60)
        check = barrier = take = 0
        for _ in range(n):
            a = tt()
            if rank == 0:
                client.exist_tasks()
            b = tt()
            client.barrier(timeout=60)
            c = tt()
            client.get_tasks()
            d = tt()
            time.sleep(0.001)
            check, barrier, take = check + b - a, barrier + c - b, take + d - c
    out.put((rank, (check / n / 1e3, barrier / n / 1e3, take / n / 1e3)))


def _process_cpu_ns():
    """CPU time of every thread of this process so far (ns, /proc schedstat: exact, not
    in clock ticks); threads that exited are not counted (none here does meanwhile)."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # the thread exited meanwhile
            pass
    return total


def startup_rank(name, tp, rank, clients, out):
    """Builds ``clients`` clients one after the other (after two unmeasured ones and a
    second's rest, as a long-running worker), each running FastDeploy's idle 1 ms loop for
    60 iterations; reports per client (µs of process CPU in iterations 0-9, in 10-59)."""
    time.sleep(1.0)  # numpy's BLAS threads spin for a while after import
    got = []
    for k in range(clients + 2):
        with TaskClient(name, tp, rank, async_prefetch=True) as client:
            marks = [_process_cpu_ns()]
            for i in range(60):
                if rank == 0:
                    client.exist_tasks()
                client.barrier(timeout=60)
                client.get_tasks()
                time.sleep(0.001)
                if i in (9, 59):
                    marks.append(_process_cpu_ns())
            if k >= 2:
                got.append(((marks[1] - marks[0]) / 1e3, (marks[2] - marks[1]) / 1e3))
    out.put((rank, got))


# -- sections --------------------------------------------------------------------------------

def _run(target, tp, args, tag):
    name = tag + uuid.uuid4().hex[:8]
    out = SPAWN.Queue()
    with TaskQueue(name, tp) as queue:
        ps = [SPAWN.Process(target=target, args=(name, tp, r) + args + (out,)) for r in range(tp)]
        for p in ps:
            p.start()
        try:
            yield queue, out
        finally:
            for p in ps:
                p.join(30)
                if p.is_alive():
                    p.kill()


def bench_idle_cpu(seconds, tp=2):
    rows = []
    for label, loop, barrier in (
            ("FastDeploy loop, no task sync (sleep 1 ms only)", "no-sync", None),
            ("client built, 1 ms loop of num_tasks() only", "client-only", None),
            ("FastDeploy 1 ms loop, adaptive barrier", "polling", "adaptive"),
            ("FastDeploy 1 ms loop, fixed 50 us spin (before)", "polling", "fixed"),
            ("FastDeploy 1 ms loop, never spin (SPIN_US=0)", "polling", "block"),
            ("rank 0 wait_for_tasks(0.1), others barrier()", "wait", "adaptive")):
        for queue, out in _run(idle_loop_rank, tp, (loop, seconds, barrier), "ibi"):
            for _ in range(tp):
                assert out.get(timeout=90)[0] == "ready"
            time.sleep(seconds)
            if loop != "no-sync":
                queue.put_tasks("stop", timeout=10)
            got = {}
            for _ in range(tp):
                kind, rank, cpu = out.get(timeout=60)
                got[rank] = cpu
        rows.append((label, [got[r] for r in range(tp)]))
    return rows


def bench_wake(n, tp=2):
    rows = {}
    for loop in ("wait", "poll"):
        for queue, out in _run(wake_rank, tp, (loop, n), "ibw"):
            for _ in range(tp):
                assert out.get(timeout=60)[0] == "ready"
            time.sleep(0.3)
            rng = random.Random(1)
            put = {}
            for i in range(n):
                time.sleep(0.002 + rng.random() * 0.003)  # rank 0 is back waiting by then
                put[i] = ns()
                queue.put_tasks(i, timeout=10)
            reports = {}
            for _ in range(tp):
                _, rank, report = out.get(timeout=60)
                reports[rank] = report
        seen = reports[0][0]
        # seq i + 1 carries batch i; the batch is complete when the last rank published it
        held = {i: max(reports[r][1][i + 1] for r in range(tp)) for i in range(n)}
        rows[loop] = np.array([seen[i] - put[i] for i in range(n)], dtype=np.int64)
        rows[loop + "-held"] = np.array([held[i] - put[i] for i in range(n)], dtype=np.int64)
        rows[loop + "-wake"] = np.array([seen[i] - held[i] for i in range(n)], dtype=np.int64)
    return rows


def bench_together(iters):
    rows = {}
    for label, fixed in (("adaptive", False), ("fixed 50 us spin (before)", True)):
        name = "ibt" + uuid.uuid4().hex[:8]
        out = SPAWN.Queue()
        with TaskQueue(name, 2):
            ps = [SPAWN.Process(target=together_rank, args=(name, r, iters, fixed, out))
                  for r in range(2)]
            for p in ps:
                p.start()
            got = dict(out.get(timeout=120) for _ in range(2))
            for p in ps:
                p.join(30)
        rows[label] = got[0]
    return rows


def bench_call_cpu(n, tp=2):
    for _queue, out in _run(call_cpu_rank, tp, (n,), "ibc"):
        got = dict(out.get(timeout=120) for _ in range(tp))
    return got


def bench_startup(clients, tp=2):
    for _queue, out in _run(startup_rank, tp, (clients,), "ibs"):
        got = dict(out.get(timeout=120) for _ in range(tp))
    return got


def pct(samples_ns, q):
    return float(np.percentile(samples_ns, q)) / 1000.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="per idle-CPU variant")
    ap.add_argument("--puts", type=int, default=300)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--clients", type=int, default=5, help="section 5's clients per rank")
    ap.add_argument("--sections", default="1,2,3,4,5")
    args = ap.parse_args()
    want = {int(x) for x in args.sections.split(",")}
    print(f"fastdeploy_sync idle benchmark, python {sys.version.split()[0]}, "
          f"{os.cpu_count()} cores, FD_SYNC_BARRIER_SPIN_US="
          f"{os.environ.get('FD_SYNC_BARRIER_SPIN_US', '50 (default)')}")
    if 1 in want:
        print(f"\n1. idle TP=2 workers, nothing put: CPU % of one core per process "
              f"({args.seconds:g} s each)")
        rows = bench_idle_cpu(args.seconds)
        floor = float(np.mean(rows[0][1]))
        for label, per_rank in rows:
            mean = float(np.mean(per_rank))
            ranks = "  ".join(f"r{r} {v:5.2f}" for r, v in enumerate(per_rank))
            print(f"  {label:50s} {ranks}  mean {mean:5.2f} %  ({mean - floor:+5.2f} points)")
    if 2 in want:
        print(f"\n2. put -> rank 0 sees the batch, TP=2 ({args.puts} puts, 2-5 ms apart)")
        rows = bench_wake(args.puts)
        for label, key in (("rank 0 blocked in wait_for_tasks()", "wait"),
                           ("  of which put -> the last rank holds it", "wait-held"),
                           ("  of which the last rank holds it -> rank 0 sees it", "wait-wake"),
                           ("rank 0 polling exist_tasks() every 1 ms", "poll"),
                           ("  of which put -> the last rank holds it", "poll-held"),
                           ("  of which the last rank holds it -> rank 0 sees it", "poll-wake")):
            s = rows[key]
            print(f"  {label:50s} p50 {pct(s, 50):8.1f} us   p99 {pct(s, 99):8.1f} us")
    if 3 in want:
        print(f"\n3. barrier() at TP=2, both ranks arriving together ({args.iters} calls, rank 0)")
        rows = bench_together(args.iters)
        for label, s in rows.items():
            print(f"  {label:50s} p50 {pct(s, 50):8.2f} us   p99 {pct(s, 99):8.2f} us")
    if 4 in want:
        n = args.iters
        print(f"\n4. CPU per call of FastDeploy's idle 1 ms loop, TP=2 ({n} iterations), by "
              f"the event-loop thread's clock, mean")
        for rank, (check, barrier, take) in sorted(bench_call_cpu(n).items()):
            print(f"  rank {rank}: check {check:6.2f} us   barrier {barrier:6.2f} us   "
                  f"take {take:6.2f} us")
    if 5 in want:
        print(f"\n5. a client's start-up in FastDeploy's idle 1 ms loop, TP=2 ({args.clients} "
              f"clients per rank, each after the last closed): CPU of the worker's threads, us")
        for rank, got in sorted(bench_startup(args.clients).items()):
            first = [a for a, _ in got]
            later = [b / 5 for _, b in got]  # 50 iterations: per 10
            extra = [a - b for a, b in zip(first, later)]
            print(f"  rank {rank}: iterations 0-9 median {np.median(first):7.1f}   10 later "
                  f"ones median {np.median(later):7.1f}   the start-up's extra "
                  f"{' / '.join(f'{x:.0f}' for x in extra)}")


if __name__ == "__main__":
    main()
