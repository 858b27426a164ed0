#!/usr/bin/env python3
"""20 000-batch consistency soak of the FastDeploy drop-in under each FastDeploy loop shape.

    python scripts/tools/soak_dropin.py --shape develop --batches 20000 --tp 2 --dp 2 [--sync]

Runs FastDeploy's engine loop (``while exist_tasks(): sleep(1 ms)`` then ``put_tasks``) per
DP group against TP ranks running the loop shape of ``testing/fd_loops.py`` (develop's
``exist_tasks()``, 2.x's ``num_tasks() > 0``, the 2.0-era top barrier), one node, and
checks what every rank took: identical batches at identical steps and calls on every rank
of a group, every batch exactly once, in put order, none of another group's. Prints the
counts and PASS, or the first difference and exits 1. Every 97th batch is a
ControlRequest stand-in.
"""

import argparse
import multiprocessing as mp
import sys
import threading
import time

from fastdeploy_sync.testing.fd_loops import batches, engine_loop, ids_of, loop_worker


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="develop", choices=["develop", "v2x", "v20"])
    ap.add_argument("--batches", type=int, default=20000)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--sync", action="store_true")
    ap.add_argument("--max-inflight", type=int, default=None)
    args = ap.parse_args()
    from fastdeploy_sync.fastdeploy import EngineWorkerQueue

    ctx = mp.get_context("spawn")
    kw = {} if args.max_inflight is None else {"max_inflight": args.max_inflight}
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=args.tp,
                               local_data_parallel_size=args.dp, **kw)
    address = ("0.0.0.0", server.get_server_port())
    results = ctx.Queue()
    procs, keep = [], []
    deadline = args.batches / 50 + 120  # seconds: generous, but bounded
    for d in range(args.dp):
        barrier, signal = ctx.Barrier(args.tp), ctx.Value("i", 0)
        keep.append((barrier, signal))
        for r in range(args.tp):
            p = ctx.Process(target=loop_worker, daemon=True,
                            args=(address, args.shape, args.tp, r, d, barrier, signal, results),
                            kwargs=dict(sync=args.sync, deadline_s=deadline))
            p.start()
            procs.append(p)
    put = {d: batches(d, args.batches, every_control=97, array_len=8) for d in range(args.dp)}
    errors = []

    def engine(d):
        c = EngineWorkerQueue(address=address, num_client=args.tp, client_id=0,
                              local_data_parallel_id=d)
        try:
            engine_loop(c, put[d], put_timeout=120)
        except BaseException as exc:
            errors.append(exc)

    t0 = time.monotonic()
    threads = [threading.Thread(target=engine, args=(d,)) for d in range(args.dp)]
    for t in threads:
        t.start()
    reports = {}
    for _ in procs:
        kind, d, r, payload = results.get(timeout=deadline + 60)
        if kind != "ok":
            print(f"FAIL: dp {d} rank {r}:\n{payload}")
            sys.exit(1)
        reports[(d, r)] = payload
    for t in threads:
        t.join(timeout=60)
    elapsed = time.monotonic() - t0
    for p in procs:
        p.join(timeout=10)
    server.cleanup()
    if errors:
        print(f"FAIL: engine: {errors}")
        sys.exit(1)
    for d in range(args.dp):
        ref = reports[(d, 0)]["calls"]
        for r in range(1, args.tp):
            if reports[(d, r)]["calls"] != ref:
                diff = next(i for i, (a, b) in enumerate(zip(ref, reports[(d, r)]["calls"]))
                            if a != b)
                print(f"FAIL: dp {d} rank {r} differs from rank 0 at call {diff}")
                sys.exit(1)
        taken = [x for _, _, ids in ref for x in ids]
        if taken != ids_of(put[d]) + ["stop"]:
            print(f"FAIL: dp {d}: took {len(taken)} ids, not the {args.batches} put + STOP "
                  f"in order")
            sys.exit(1)
        print(f"dp {d}: {args.tp} ranks took {args.batches} batches (+STOP) in "
              f"{len(ref)} get_tasks() calls over {reports[(d, 0)]['steps']} steps, "
              f"identical on every rank")
    print(f"PASS shape={args.shape} {'sync' if args.sync else 'async'} TP={args.tp} "
          f"DP={args.dp}: {args.batches} batches per DP group in {elapsed:.1f} s")


if __name__ == "__main__":
    main()
