#!/usr/bin/env python3
"""How long each process takes to learn that its peer is gone, and that busy is not dead,
with real processes.

    python scripts/benchmarks/liveness_times.py [--interval 1] [--timeout 3] [--repeat 3] [--gil-hold 60]

Scenarios (TP=2, node-local ipc, async and sync mode where it matters), each repeated:
  engine SIGKILL      -> every rank raises EngineGoneError          (bound: heartbeat timeout)
  engine SIGSTOP      -> every rank raises EngineGoneError          (bound: heartbeat timeout)
  engine close()      -> every rank raises EngineClosedError        (target: <= 100 ms)
  rank SIGKILL        -> the engine reports the rank disconnected, then retires its group
                         (bound: about the heartbeat timeout)
  rank SIGSTOP        -> the engine retires the group (ZMTP heartbeats: the timeout, plus up
                         to one interval for libzmq and one for the reconnect grace)
  ranks close()       -> with a batch in flight, TaskQueue.close(timeout=5) returns
                         (target: at once, not after the heartbeat timeout)
  whole group SIGKILL -> a new group takes its first batch          (target: <= 5 s after the new
                         group starts; the engine re-puts what the GroupLost event hands back)
  engine GIL hold     -> the engine's main thread holds the GIL for 3 heartbeat timeouts:
                         the engine does not retire the group; what the ranks do depends on
                         how the workers judge the engine's silence (printed)
  rank GIL hold       -> rank 1's main thread holds the GIL for --gil-hold seconds (60: a
                         long compile or weight load): not retired, takes the next batch
                         (run once, whatever --repeat says)
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
from fastdeploy_sync.testing.peers import hold_gil

SPAWN = mp.get_context("spawn")


def rank_loop(out, name, tp, rank, async_prefetch, hb, hold_after=0, hold_s=0.0, stop=None,
              barrier_s=30.0):
    """Step until a step call raises; report (rank, cause type, monotonic time). Reports
    ("took", rank, t) at the first batch and ("took_more", rank, t) at each later one.
    ``hold_s``: once it took ``hold_after`` batches, the main thread holds the GIL that
    long (reported as ("held", rank, (start, end))). ``barrier_s``: the barrier's timeout
    (a peer holding the GIL keeps the others waiting in it)."""
    with TaskClient(name, tp, rank, async_prefetch=async_prefetch, heartbeat=Heartbeat(*hb)) as c:
        out.put(("ready", rank, None))
        taken = 0
        while stop is None or not stop.is_set():  # set: close the client (it leaves cleanly)
            try:
                tasks = c.sync_step(timeout=barrier_s)
            except TaskSyncError as exc:
                cause = exc.__cause__ if isinstance(exc, PrefetchError) and exc.__cause__ else exc
                out.put(("raised", rank, (type(cause).__name__, time.monotonic())))
                return
            if tasks:
                taken += len(tasks)
                out.put(("took" if taken == len(tasks) else "took_more", rank, time.monotonic()))
                if hold_s and taken == hold_after:
                    # let the queue's feeder thread send "took" first: it needs the GIL too
                    # (otherwise the scenario's wait for "took" outlasts a long hold)
                    time.sleep(0.5)
                    start = time.monotonic()
                    hold_gil(hold_s)
                    out.put(("held", rank, (start, time.monotonic())))
            time.sleep(0.001)


def engine_proc(out, name, tp, hb):
    with TaskQueue(name, tp, heartbeat=Heartbeat(*hb)) as queue:
        queue.put_tasks("warm-up", timeout=30)
        out.put(("served", 0, None))
        time.sleep(600)


_ASIDE = {}


def wait_for(q, tag, count, timeout=60):
    """{rank: payload} of ``count`` messages tagged ``tag``; others are kept for later."""
    aside = _ASIDE.setdefault(id(q), [])
    got = {}
    for item in list(aside):
        if item[0] == tag and item[1] not in got and len(got) < count:
            got[item[1]] = item[2]
            aside.remove(item)
    deadline = time.monotonic() + timeout
    while len(got) < count:
        kind, rank, payload = q.get(timeout=max(0.01, deadline - time.monotonic()))
        if kind == tag and rank not in got:
            got[rank] = payload
        else:
            aside.append((kind, rank, payload))
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
    returned = time.monotonic() - t0
    raised = wait_for(q, "raised", 2)
    reap(ranks)
    return [(cause, t - t0) for cause, t in raised.values()] + [("close() returned", returned)]


def rank_fault(sig, hb):
    """Kill or stop rank 1: seconds until the engine reports it disconnected, and until
    it retires the group."""
    name = "lt" + uuid.uuid4().hex[:8]
    q = SPAWN.Queue()
    doomed = SPAWN.Queue()
    with TaskQueue(name, 2, heartbeat=Heartbeat(*hb)) as queue:
        ranks = [SPAWN.Process(target=rank_loop, args=(doomed if r else q, name, 2, r, True, hb),
                               daemon=True) for r in range(2)]
        for p in ranks:
            p.start()
        queue.put_tasks("x", timeout=30)
        wait_for(q, "took", 1)
        wait_for(doomed, "took", 1)
        t0 = time.monotonic()
        os.kill(ranks[1].pid, sig)
        disconnected = None
        while queue.group_events.empty() and time.monotonic() - t0 < 120:
            if disconnected is None and queue.ranks()[1]["state"] == "disconnected":
                disconnected = time.monotonic() - t0
            time.sleep(0.002)
        retired = time.monotonic() - t0
        if sig == signal.SIGSTOP:
            os.kill(ranks[1].pid, signal.SIGKILL)
        reap(ranks)
    out = [("retired", retired)]
    if disconnected is not None:
        out.insert(0, ("disconnected", disconnected))
    return out


def ranks_close(hb):
    """Both ranks close their clients with a batch in flight (they took one, a second is
    on its way): how long TaskQueue.close(timeout=5) takes afterwards."""
    name = "lt" + uuid.uuid4().hex[:8]
    q = SPAWN.Queue()
    stop = SPAWN.Event()
    queue = TaskQueue(name, 2, heartbeat=Heartbeat(*hb))
    ranks = [SPAWN.Process(target=rank_loop, args=(q, name, 2, r, True, hb, 0, 0.0, stop),
                           daemon=True) for r in range(2)]
    for p in ranks:
        p.start()
    queue.put_tasks("x", timeout=30)
    wait_for(q, "took", 2)
    stop.set()
    queue.put_tasks("in flight", timeout=30)
    reap(ranks)
    t0 = time.monotonic()
    queue.close(timeout=5)
    return [("close returned", time.monotonic() - t0)]


def engine_gil_hold(hb):
    """The engine's main thread holds the GIL for 3 heartbeat timeouts; then a batch is
    put: seconds from the end of the hold until each rank took it (or raised: negative
    when it raised during the hold), and whether the engine retired the group."""
    name = "lt" + uuid.uuid4().hex[:8]
    q = SPAWN.Queue()
    with TaskQueue(name, 2, heartbeat=Heartbeat(*hb)) as queue:
        ranks = start_ranks(q, name, 2, True, hb)
        queue.put_tasks("x", timeout=30)
        wait_for(q, "took", 2)
        hold_gil(3 * hb[1])
        t0 = time.monotonic()
        try:
            queue.put_tasks("after the hold", timeout=30)
        except TaskSyncError:
            pass
        outcome = first_of(q, ("took_more", "raised"), 2)
        verdict = "engine retired the group" if not queue.group_events.empty() else "not retired"
        result = [(f"rank {r} {'took the next' if kind == 'took_more' else 'raised ' + payload[0]}"
                   f" ({verdict})", (payload if kind == "took_more" else payload[1]) - t0)
                  for r, (kind, payload) in sorted(outcome.items())]
        queue.close(timeout=5)
        reap(ranks)
    return result


def first_of(q, tags, count, timeout=60):
    """{rank: (tag, payload)}: the first message of any of ``tags`` from ``count`` ranks."""
    aside = _ASIDE.setdefault(id(q), [])
    got = {}
    for item in list(aside):
        if item[0] in tags and item[1] not in got and len(got) < count:
            got[item[1]] = (item[0], item[2])
            aside.remove(item)
    deadline = time.monotonic() + timeout
    while len(got) < count:
        kind, rank, payload = q.get(timeout=max(0.01, deadline - time.monotonic()))
        if kind in tags and rank not in got:
            got[rank] = (kind, payload)
        else:
            aside.append((kind, rank, payload))
    return got


def rank_gil_hold(hb, seconds):
    """Rank 1's main thread holds the GIL for ``seconds`` after its first batch; a batch
    is put meanwhile: seconds from the end of the hold until both ranks took it."""
    name = "lt" + uuid.uuid4().hex[:8]
    q = SPAWN.Queue()
    with TaskQueue(name, 2, heartbeat=Heartbeat(*hb)) as queue:
        ranks = [SPAWN.Process(target=rank_loop, daemon=True,
                               args=(q, name, 2, r, True, hb, 1, seconds if r == 1 else 0.0,
                                     None, 3 * seconds + 60))
                 for r in range(2)]
        for p in ranks:
            p.start()
        queue.put_tasks("x", timeout=30)
        wait_for(q, "took", 2)
        time.sleep(1.0)
        queue.put_tasks("during the hold", timeout=30)
        start, end = wait_for(q, "held", 1, timeout=seconds * 3 + 60)[1]
        outcome = first_of(q, ("took_more", "raised"), 2)
        verdict = "engine retired the group" if not queue.group_events.empty() else "not retired"
        queue.close(timeout=5)
        reap(ranks)
    return [(f"rank {r} {'took the next' if kind == 'took_more' else 'raised ' + payload[0]}"
             f" (held {end - start:.0f} s, {verdict})",
             (payload if kind == "took_more" else payload[1]) - end)
            for r, (kind, payload) in sorted(outcome.items())]


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
    ap.add_argument("--gil-hold", type=float, default=60.0,
                    help="seconds rank 1's main thread holds the GIL (0: skip)")
    ap.add_argument("--only", default="", help="run the scenarios whose label contains this")
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
        ("rank 1 SIGKILL -> engine", lambda: rank_fault(signal.SIGKILL, hb)),
        ("rank 1 SIGSTOP -> engine", lambda: rank_fault(signal.SIGSTOP, hb)),
        ("ranks close -> close(5)", lambda: ranks_close(hb)),
        ("whole group restart", lambda: group_restart(hb)),
        ("engine holds the GIL", lambda: engine_gil_hold(hb)),
    ]
    if args.gil_hold:
        scenarios.append(("rank 1 holds the GIL", lambda: rank_gil_hold(hb, args.gil_hold)))
    for label, run in scenarios:
        if args.only not in label:
            continue
        times = {}  # what was measured (the first word of each result) -> seconds
        for i in range(1 if "holds the GIL" in label and "rank" in label else args.repeat):
            result = run()
            for what, t in result:
                times.setdefault(what.split(" (")[0], []).append(t)
            print(f"  {label:<26} run {i + 1}: " +
                  ", ".join(f"{what} {t * 1000:.0f} ms" for what, t in result), flush=True)
        print(f"  {label:<26} " + "; ".join(
            f"{what}: median {statistics.median(ts) * 1000:.0f} ms, max {max(ts) * 1000:.0f} ms"
            for what, ts in times.items()))


if __name__ == "__main__":
    main()
