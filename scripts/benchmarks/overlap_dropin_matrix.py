#!/usr/bin/env python3
"""The overlap-scheduler acceptance matrix of the FastDeploy drop-in (not run in CI).

    python scripts/benchmarks/overlap_dropin_matrix.py [--runs 20] [--tp 2,8] [--rates 2,100]
                                            [--modes async,sync] [--seconds 3]

FastDeploy develop's overlap-scheduler loop (``testing/fd_loops.py``, shape ``overlap``: the
queue's ``worker_process_tp_barrier`` the only TP barrier, no idle branch, a no-op idle
step, a 2 ms busy step ending in a real collective with a 10 s timeout), TP ranks in
processes on one node (TP=8 takes develop's ``read_finish_flag`` path, ``nnode = (tp + 8)
// 8``), FastDeploy's engine loop (``while exist_tasks(): sleep(1 ms)`` then ``put_tasks``)
offering batches at the given rate. Nothing is injected: the race is left to the OS.

Per cell (TP, mode, rate) it prints the runs, how many deadlocked (a rank's collective or
the queue's barrier timed out, or a rank never reported), how many were inconsistent (the
ranks did not take identical batches at identical steps, each once, in order), the
batches every rank took of those offered, and the reads the drop-in answered ``[]``
because they came before the step they were for (the race, defused). Exit status 1 if any
run deadlocked or was inconsistent.
"""

import argparse
import multiprocessing as mp
import queue
import sys
import threading
import time

from fastdeploy_sync.testing.fd_loops import (
    STOP,
    batches,
    check_group,
    ids_of,
    loop_worker,
    wait_room,
)

COLLECTIVE_TIMEOUT_S = 10.0


def paced_engine(client, put, rate, errors):
    """FastDeploy's engine loop, offering batch k at t0 + k / rate."""
    try:
        t0 = time.monotonic()
        for k, b in enumerate(put):
            delay = t0 + k / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            wait_room(client, 30)
            client.put_tasks(b, timeout=30)
        wait_room(client, 30)
        client.put_tasks(STOP, timeout=30)
    except BaseException as exc:  # reported with the workers' view
        errors.append(exc)


def one_run(ctx, tp, sync, rate, n):
    """(outcome, taken, early): outcome 'ok', 'deadlock' or 'inconsistent'."""
    from fastdeploy_sync.fastdeploy import EngineWorkerQueue

    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=tp)
    procs = []
    try:
        address = ("0.0.0.0", server.get_server_port())
        results = ctx.Queue()
        collective, signal = ctx.Barrier(tp), ctx.Value("i", 0)
        for r in range(tp):
            p = ctx.Process(target=loop_worker, daemon=True,
                            args=(address, "overlap", tp, r, 0, collective, signal, results),
                            kwargs=dict(sync=sync, multi_node=(tp + 8) // 8 > 1, step_ms=2.0,
                                        barrier_timeout=COLLECTIVE_TIMEOUT_S,
                                        deadline_s=n / rate + 90))
            p.start()
            procs.append(p)
        put = batches(0, n, array_len=64)
        errors = []
        client = EngineWorkerQueue(address=address, num_client=tp, client_id=0)
        engine = threading.Thread(target=paced_engine, args=(client, put, rate, errors))
        engine.start()
        reports, failed = {}, []
        for _ in range(tp):
            try:
                kind, _, r, payload = results.get(timeout=n / rate + 120)
            except queue.Empty:
                failed.append("a rank never reported")
                break
            if kind == "ok":
                reports[r] = payload
            else:
                failed.append(payload.strip().splitlines()[-1])
        engine.join(timeout=30)
        if failed or errors:
            return "deadlock", 0, 0, (failed + [repr(e) for e in errors])[0]
        try:
            check_group(reports, tp, 0, ids_of(put))
        except AssertionError as exc:
            return "inconsistent", 0, 0, str(exc)[:200]
        taken = sum(len(ids) for _, _, ids in reports[0]["calls"]) - 1  # STOP excepted
        return "ok", taken, sum(r["early"] for r in reports.values()), ""
    finally:
        server.cleanup()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--tp", default="2,8")
    ap.add_argument("--rates", default="2,100", help="batches per second offered")
    ap.add_argument("--modes", default="async,sync")
    ap.add_argument("--seconds", type=float, default=3.0,
                    help="offering time per run (at least 5 batches)")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    bad = 0
    print(f"{'tp':>3} {'mode':>5} {'rate/s':>6} {'runs':>4} {'deadlocks':>9} "
          f"{'inconsistent':>12} {'taken/offered':>14} {'early reads':>11} {'wall s':>7}",
          flush=True)
    for tp in (int(x) for x in args.tp.split(",")):
        for mode in args.modes.split(","):
            for rate in (float(x) for x in args.rates.split(",")):
                n = max(5, int(rate * args.seconds))
                t0 = time.monotonic()
                counts = {"ok": 0, "deadlock": 0, "inconsistent": 0}
                taken = early = 0
                first = ""
                for _ in range(args.runs):
                    outcome, got, e, why = one_run(ctx, tp, mode == "sync", rate, n)
                    counts[outcome] += 1
                    taken, early = taken + got, early + e
                    first = first or why
                bad += counts["deadlock"] + counts["inconsistent"]
                print(f"{tp:>3} {mode:>5} {rate:>6g} {args.runs:>4} {counts['deadlock']:>9} "
                      f"{counts['inconsistent']:>12} {taken:>6}/{n * args.runs:<7} "
                      f"{early:>11} {time.monotonic() - t0:>7.1f}"
                      + (f"  first failure: {first}" if first else ""), flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
