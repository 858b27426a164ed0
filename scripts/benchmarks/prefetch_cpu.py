#!/usr/bin/env python3
"""The prefetch thread's CPU per batch, split: one TP=2 queue, ``--puts`` 64 x 512 batches
2-5 ms apart (as ``bench_sync.py`` section 7 puts them), rank 0 in ``wait_for_tasks()``,
both ranks async. Per rank, per batch, from thread CPU clocks (user + system): the socket's
receiver thread, the prefetch thread, and within the prefetch thread the decode (median),
the semaphore wait's return (``RingReader.wait``) and waking ``wait_for_tasks()``
(``woke.set``). Asserts nothing.

    python scripts/benchmarks/prefetch_cpu.py [--puts 300]
"""

import argparse
import os
import random
import sys
import time
import uuid

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_sync  # noqa: E402  (section 7's batch)
from fastdeploy_sync import TaskClient, TaskQueue  # noqa: E402
from fastdeploy_sync.worker.background import threads_cpu_seconds  # noqa: E402


def _cpu_timed(obj, attr, samples):
    """Replace ``obj.attr`` by a wrapper that appends each call's thread CPU (ns)."""
    call = getattr(obj, attr)

    def timed(*args, **kwargs):
        t0 = time.thread_time_ns()
        try:
            return call(*args, **kwargs)
        finally:
            samples.append(time.thread_time_ns() - t0)
    setattr(obj, attr, timed)


def _rank(name, tp, rank, n, out):
    with TaskClient(name, tp, rank, async_prefetch=True) as client:
        client.barrier(timeout=60)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (client._rings.thread is not None
                                                   and client._rings.thread.ident):
            time.sleep(0.001)  # the ring attached and its prefetch thread running
        if client._rings.thread is None:
            raise SystemExit(f"rank {rank}: no ring (FD_SYNC_SHM_RING_KB=off, or no room)")
        ring = client._rings.reader
        parts = {"decode": [], "wait": [], "wake": []}
        _cpu_timed(ring, "decode", parts["decode"])
        _cpu_timed(ring, "wait", parts["wait"])
        _cpu_timed(client._rings.woke, "set", parts["wake"])
        receiver, prefetch = client._background.thread, client._rings.thread
        r0, p0 = threads_cpu_seconds((receiver,)), threads_cpu_seconds((prefetch,))
        out.put(("ready", rank, None))
        taken = 0
        while taken < n:
            if rank == 0:
                client.wait_for_tasks(1.0)
            client.barrier(timeout=60)
            tasks, _ = client.get_tasks()
            taken += len(tasks)
            del tasks
        r1, p1 = threads_cpu_seconds((receiver,)), threads_cpu_seconds((prefetch,))
        row = {"receiver": (r1 - r0) / n * 1e6, "prefetch": (p1 - p0) / n * 1e6,
               "decode p50": np.median(parts["decode"]) / 1e3,
               "wait": sum(parts["wait"]) / n / 1e3, "wake": sum(parts["wake"]) / n / 1e3,
               "decoded by the loop": client.stats().get("decoded_by_loop", 0)}
        out.put(("cpu", rank, row))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--puts", type=int, default=300)
    n = ap.parse_args().puts
    name = "pc" + uuid.uuid4().hex[:8]
    queue = TaskQueue(name, 2, max_inflight=4)
    out = bench_sync.SPAWN.Queue()
    procs = [bench_sync.SPAWN.Process(target=_rank, args=(name, 2, rank, n, out))
             for rank in range(2)]
    try:
        for p in procs:
            p.start()
        for _ in procs:
            out.get(timeout=120)
        time.sleep(0.3)
        batch = bench_sync.make_requests()
        rng = random.Random(1)
        for _ in range(n):
            time.sleep(0.002 + rng.random() * 0.003)
            queue.put_tasks(batch, timeout=30)
        rows = sorted(out.get(timeout=120)[1:] for _ in procs)
    finally:
        queue.close(timeout=10)
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()
    print(f"thread CPU per batch, TP=2, {n} puts of 64 x 512 token ids 2-5 ms apart (us):")
    for rank, row in rows:
        print(f"  rank {rank}: receiver {row['receiver']:.1f}, prefetch {row['prefetch']:.1f} "
              f"(decode p50 {row['decode p50']:.1f}, semaphore wait {row['wait']:.1f}, waking "
              f"wait_for_tasks {row['wake']:.1f}); batches decoded by the event loop "
              f"{row['decoded by the loop']}")


if __name__ == "__main__":
    main()
