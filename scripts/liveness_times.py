#!/usr/bin/env python3
"""How long each process takes to learn that its peer is gone, with real processes.

    python scripts/liveness_times.py [--interval 1] [--timeout 3] [--repeat 3]

Scenarios (TP=2, node-local ipc, async and sync mode where it matters), each repeated:
  engine SIGKILL      -> every rank raises EngineGoneError          (bound: heartbeat timeout)
  engine SIGSTOP      -> every rank raises EngineGoneError          (bound: heartbeat timeout)
  engine close()      -> every rank raises EngineClosedError        (target: <= 100 ms)
  rank SIGKILL        -> the engine reports the rank disconnected   (bound: heartbeat timeout)
  whole group SIGKILL -> a new group takes its first batch          (target: <= 5 s after the new
                         group starts; the engine re-puts what the GroupLost event hands back)
Prints one line per run and the median per scenario. Asserts nothing.
"""

import argparse
import multiprocessing as mp
import os
import signal
import statistics
import time
import uuid

from fastdeploy_sync import Heartbeat, PrefetchError, TaskClient, TaskQueue, TaskSyncError

SPAWN = mp.get_context("spawn")


def rank_loop(out, name, tp, rank, async_prefetch, hb):
    """Step until a step call raises; report (rank, cause type, monotonic time)."""
    with TaskClient(name, tp, rank, async_prefetch=async_prefetch, heartbeat=Heartbeat(*hb)) as c:
        out.put(("ready", rank, None))
        first = True
        while True:
            try:
                tasks = c.sync_step(timeout=30)
            except TaskSyncError as exc:
                cause = exc.__cause__ if isinstance(exc, PrefetchError) and exc.__cause__ else exc
                out.put(("raised", rank, (type(cause).__name__, time.monotonic())))
                return
            if tasks and first:
                first = False
                out.put(("took", rank, time.monotonic()))
            time.sleep(0.001)


def engine_proc(out, name, tp, hb):
    with TaskQueue(name, tp, heartbeat=Heartbeat(*hb)) as queue:
        queue.put_tasks("warm-up", timeout=30)
        out.put(("served", 0, None))
        time.sleep(600)


def wait_for(q, tag, count, timeout=60):
    got = {}
    deadline = time.monotonic() + timeout
    while len(got) < count:
        kind, rank, payload = q.get(timeout=max(0.01, deadline - time.monotonic()))
        if kind == tag:
            got[rank] = payload
    return got


def start_ranks(q, name, tp, async_prefetch, hb):
    procs = [SPAWN.Process(target=rank_loop, args=(q, name, tp, r, async_prefetch, hb), daemon=True)
             for r in range(tp)]
    for p in procs:
        p.start()
    return procs


def reap(procs):
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def engine_fault(sig, async_prefetch, hb):
    name = "lt" + uuid.uuid4().hex[:8]
    q = SPAWN.Queue()
    doomed = SPAWN.Queue()  # a process SIGKILLed while writing may keep its queue's lock
    engine = SPAWN.Process(target=engine_proc, args=(doomed, name, 2, hb), daemon=True)
    engine.start()
    wait_for(doomed, "served", 1)
    ranks = start_ranks(q, name, 2, async_prefetch, hb)
    wait_for(q, "took", 2)
    t0 = time.monotonic()
    os.kill(engine.pid, sig)
    raised = wait_for(q, "raised", 2)
    if sig == signal.SIGSTOP:
        os.kill(engine.pid, signal.SIGKILL)
    reap(ranks + [engine])
    TaskQueue(name, 1).close()  # reclaim what the killed engine left
    return [(cause, t - t0) for cause, t in raised.values()]


def engine_close(async_prefetch, hb):
    name = "lt" + uuid.uuid4().hex[:8]
    q = SPAWN.Queue()
    queue = TaskQueue(name, 2, heartbeat=Heartbeat(*hb))
    ranks = start_ranks(q, name, 2, async_prefetch, hb)
    queue.put_tasks("x", timeout=30)
    wait_for(q, "took", 2)
    t0 = time.monotonic()
    queue.close(timeout=10)
    raised = wait_for(q, "raised", 2)
    reap(ranks)
    return [(cause, t - t0) for cause, t in raised.values()]


def rank_kill(hb):
    name = "lt" + uuid.uuid4().hex[:8]
    q = SPAWN.Queue()
    with TaskQueue(name, 2, heartbeat=Heartbeat(*hb)) as queue:
        ranks = start_ranks(q, name, 2, True, hb)
        queue.put_tasks("x", timeout=30)
        wait_for(q, "took", 2)
        t0 = time.monotonic()
        os.kill(ranks[0].pid, signal.SIGKILL)
        while queue.ranks()[0]["state"] != "disconnected":
            time.sleep(0.002)
        dt = time.monotonic() - t0
        reap(ranks)
    return [("disconnected", dt)]


def group_restart(hb):
    name = "lt" + uuid.uuid4().hex[:8]
    q = SPAWN.Queue()
    doomed = SPAWN.Queue()  # a process SIGKILLed while writing may keep its queue's lock
    with TaskQueue(name, 2, heartbeat=Heartbeat(*hb)) as queue:
        old = start_ranks(doomed, name, 2, True, hb)
        queue.put_tasks("old", timeout=30)
        wait_for(doomed, "took", 2)
        for p in old:
            os.kill(p.pid, signal.SIGKILL)
        reap(old)
        t0 = time.monotonic()
        new = start_ranks(q, name, 2, True, hb)
        queue.put_tasks("new", timeout=30)
        # as an engine must: what a retired group did not finish comes back as an event
        # (a batch put before the old group was known gone is among it): put it again
        event = queue.group_events.get(timeout=30)
        for lost in event.unfinished:
            queue.put_tasks(lost.tasks, timeout=30)
        took = wait_for(q, "took", 2)
        out = [("new group took", max(took.values()) - t0)]
        queue.close(timeout=10)
        reap(new)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=3.0)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    hb = (args.interval, args.timeout)
    print(f"heartbeat interval {args.interval:g} s, timeout {args.timeout:g} s; TP=2, ipc; "
          f"seconds from the fault to each process raising")
    scenarios = [
        ("engine SIGKILL, async", lambda: engine_fault(signal.SIGKILL, True, hb)),
        ("engine SIGKILL, sync", lambda: engine_fault(signal.SIGKILL, False, hb)),
        ("engine SIGSTOP, async", lambda: engine_fault(signal.SIGSTOP, True, hb)),
        ("engine close(), async", lambda: engine_close(True, hb)),
        ("engine close(), sync", lambda: engine_close(False, hb)),
        ("rank 0 SIGKILL -> engine", lambda: rank_kill(hb)),
        ("whole group restart", lambda: group_restart(hb)),
    ]
    for label, run in scenarios:
        times = []
        for i in range(args.repeat):
            result = run()
            times.extend(t for _, t in result)
            print(f"  {label:<26} run {i + 1}: " +
                  ", ".join(f"{cause} {t * 1000:.0f} ms" for cause, t in result), flush=True)
        print(f"  {label:<26} median {statistics.median(times) * 1000:.0f} ms, "
              f"max {max(times) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
