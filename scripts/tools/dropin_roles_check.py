#!/usr/bin/env python3
"""How long the drop-in's workers take to raise, per loop shape (not run in CI).

    python scripts/tools/dropin_roles_check.py [--tp 2,4] [--runs 3]

For each loop shape of ``testing/fd_loops.py`` (develop, 2.x, 2.0, overlap, overlap reading
only its signal, docs/index.md's loop), TP ranks in processes built with FastDeploy's worker
arguments (no ``role=``), the engine's client beside the server: the ranks idle in the loop,
then the server's ``cleanup()``; it prints, per shape, what every rank raised and the
largest time from ``cleanup()`` to a rank's raise. Then docs/index.md's loop with nothing
to tell rank 0 its role (the engine puts through the server object): the time from the
workers' start to each rank's error, and whether the error names ``role='worker'``.
Exit status 1 if a rank raised anything but ``EngineClosedError`` after ``cleanup()``.
"""

import argparse
import multiprocessing as mp
import os
import queue
import sys
import time
import uuid

from fastdeploy_sync.testing.fd_loops import batches, closing_worker, engine_loop, loop_worker

SHAPES = [("develop", True), ("v2x", True), ("v20", True), ("overlap", True),
          ("overlap", False), ("index", True)]


def cleanup_run(ctx, shape, read_flag, tp):
    """(kinds raised, seconds from cleanup() to the last raise)."""
    from fastdeploy_sync.fastdeploy import EngineWorkerQueue

    name = "r" + uuid.uuid4().hex[:12]
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=tp,
                               name=name)
    results, procs = ctx.Queue(), []
    try:
        address = ("0.0.0.0", server.get_server_port())
        EngineWorkerQueue(address=address, num_client=tp, client_id=0, name=name)
        barrier, signal = ctx.Barrier(tp), ctx.Value("i", 0)
        for r in range(tp):
            p = ctx.Process(target=closing_worker, daemon=True,
                            args=(address, shape, tp, r, barrier, signal, results),
                            kwargs=dict(name=name, read_flag=read_flag))
            p.start()
            procs.append(p)
        for _ in range(tp):
            kind, r, payload = results.get(timeout=90)
            if kind != "stepping":
                return [f"rank {r}: {kind} {payload}"], float("nan")
    finally:
        closed_at = time.monotonic()
        server.cleanup()
    kinds, last = [], 0.0
    for _ in range(tp):
        try:
            kind, r, payload = results.get(timeout=60)
        except queue.Empty:
            kinds.append("no report")
            continue
        if kind == "raised":
            kinds.append(payload[0])
            last = max(last, payload[2] - closed_at)
        else:
            kinds.append(f"{kind}: {payload}")
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    return kinds, last


def undecided_run(ctx, tp):
    """docs/index.md's loop with nothing to tell rank 0 its role: per rank (seconds from the
    start to its report, its error's last line names role='worker')."""
    import threading

    from fastdeploy_sync.fastdeploy import EngineWorkerQueue

    name = "r" + uuid.uuid4().hex[:12]
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=tp,
                               name=name)
    results, procs, out = ctx.Queue(), [], {}
    try:
        address = ("0.0.0.0", server.get_server_port())
        barrier, signal = ctx.Barrier(tp), ctx.Value("i", 0)
        t0 = time.monotonic()
        for r in range(tp):
            p = ctx.Process(target=loop_worker, daemon=True,
                            args=(address, "index", tp, r, 0, barrier, signal, results),
                            kwargs=dict(name=name, barrier_timeout=10.0, deadline_s=30.0))
            p.start()
            procs.append(p)
        thread = threading.Thread(target=lambda: _quiet(engine_loop, server, batches(0, 4)))
        thread.start()
        for _ in range(tp):
            kind, _, r, payload = results.get(timeout=90)
            out[r] = (round(time.monotonic() - t0, 2), kind, "role='worker'" in str(payload))
        thread.join(30)
    finally:
        server.cleanup()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return out


def _quiet(fn, *args):
    try:
        fn(*args, put_timeout=10)
    except Exception:  # the workers' errors are what is measured
        pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", default="2,4")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    os.environ["FD_SYNC_ATTACH_TIMEOUT"] = "5"
    bad = 0
    print(f"{'tp':>3} {'shape':<22} {'raised (every rank, every run)':<34} "
          f"{'max s after cleanup':>19}")
    for tp in [int(t) for t in args.tp.split(",")]:
        for shape, read_flag in SHAPES:
            kinds, worst = set(), 0.0
            for _ in range(args.runs):
                k, last = cleanup_run(ctx, shape, read_flag, tp)
                kinds.update(k)
                worst = max(worst, last)
            bad += any(k != "EngineClosedError" for k in kinds)
            label = shape + ("" if read_flag else " (signal only)")
            print(f"{tp:>3} {label:<22} {', '.join(sorted(kinds)):<34} {worst:>19.2f}")
    print("docs/index.md loop, rank 0's role undecided (TP=2): rank: (s from start, report, "
          "names role='worker')")
    for _ in range(args.runs):
        print("   ", undecided_run(ctx, 2))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
