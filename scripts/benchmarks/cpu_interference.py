#!/usr/bin/env python3
"""Do this machine's cores slow each other down? Context for the profiler's inflation.

    python scripts/benchmarks/cpu_interference.py [--steps 300]

Runs the profiler's pure-Python model step (a fixed number of work units) pinned to each
core alone, then on both cores at once, and prints the step time of each. On a machine
whose cores are independent the "both" rows match the "alone" rows; where they do not,
any process that runs next to a worker (the engine, I/O threads) slows it even when a core
looks free. Linux only (uses os.sched_setaffinity).
"""

import argparse
import multiprocessing as mp
import os
import time

import numpy as np

from fastdeploy_sync.profiling.workload import ModelStep

UNITS = 100


def run(cpu, steps, out, start):
    os.sched_setaffinity(0, {cpu})
    model = ModelStep("python", 2.0)
    model.units = UNITS
    start.wait(30)
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        model()
        samples.append(time.perf_counter_ns() - t0)
    out.put((cpu, np.asarray(samples) / 1e6))


def measure(cpus, steps):
    ctx = mp.get_context("spawn")
    out, start = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=run, args=(cpu, steps, out, start)) for cpu in cpus]
    for p in procs:
        p.start()
    start.set()
    results = dict(out.get(timeout=300) for _ in cpus)
    for p in procs:
        p.join(30)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))[:2]
    print(f"pure-Python step of {UNITS} units, {args.steps} steps per row, ms")
    for label, group in [(f"cpu {c} alone", [c]) for c in cpus] + [("both at once", cpus)]:
        for cpu, ms in sorted(measure(group, args.steps).items()):
            p10, p50, p90 = np.percentile(ms, [10, 50, 90])
            print(f"  {label:<13} cpu {cpu}: p10 {p10:.2f}  p50 {p50:.2f}  p90 {p90:.2f}")


if __name__ == "__main__":
    main()
