#!/usr/bin/env python3
"""Long step-consistency soak: the CI test's FastDeploy-shaped loop, many more batches.

    python scripts/tools/soak.py --batches 100000 --tp 4 --mode both

Real processes, random step times, random engine pauses, random slow ranks, and steps
that check but do not take. Checks that every rank took identical batches at identical
steps, in put order, none lost and none twice; prints throughput. Exits non-zero on the
first violation.
"""

import argparse
import multiprocessing as mp
import time
import uuid

from fastdeploy_sync import TaskQueue
from fastdeploy_sync.testing.processes import (
    check_consistency,
    collect,
    consistency_rank,
    put_with_pauses,
)


def run(tp, async_prefetch, n, seed, skip_every):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    name = "soak" + uuid.uuid4().hex[:8]
    t0 = time.perf_counter()
    with TaskQueue(name, tp, max_inflight=8) as queue:
        procs = [ctx.Process(target=consistency_rank,
                             args=(out, r, name, tp, n, async_prefetch, seed, skip_every),
                             kwargs=dict(deadline_s=max(60.0, n / 50)))
                 for r in range(tp)]
        for p in procs:
            p.start()
        try:
            put_with_pauses(queue, n, seed)
            steps = collect(out, "steps", tp, timeout=max(120.0, n / 50))
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    check_consistency(steps, tp, n)
    elapsed = time.perf_counter() - t0
    print(f"tp={tp} {'async' if async_prefetch else 'sync '} skip_every={skip_every}: "
          f"{n} batches in {len(steps[0])} taking steps, {elapsed:.1f}s "
          f"({n / elapsed:.0f} batches/s): every rank identical, in order, none lost or twice")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=20000)
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mode", choices=["async", "sync", "both"], default="both")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    modes = {"async": [True], "sync": [False], "both": [True, False]}[args.mode]
    for tp in args.tp:
        for async_prefetch in modes:
            for skip_every in (0, 3):
                run(tp, async_prefetch, args.batches, args.seed, skip_every)


if __name__ == "__main__":
    main()
