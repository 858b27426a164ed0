#!/usr/bin/env python3
"""Where the ring path's time goes, in its parts: one TP=2 queue, both ranks async in
processes of their own (rank 0 in ``wait_for_tasks()``, rank 1 in the barrier), ``--puts``
64 x 512 batches 2-5 ms apart (as ``bench_sync.py`` section 7 and ``put_floor.py`` put
them). Asserts nothing.

White-box benchmark: it times the library's own parts by wrapping private members (the
client's ring, its prefetch thread and background thread, the queue's encoder, ring and
ledger); users never reach them. scripts/tools/layout_check.py allows it (``WHITE_BOX``).

- ``put``: ``put_tasks()`` timed around the library's own calls (wall clock, p50): the
  pickling (``codec.encode_parts``), taking a slot (``allocate``), the copy into it
  (``write_inline``), the whole encode, the ledger (room, seq, publish), waking the ranks.
- ``prefetch``: per rank and batch, from thread CPU clocks (user + system): the socket's
  receiver thread, the prefetch thread, and within the prefetch thread the decode (p50),
  the semaphore wait's return (``RingReader.wait``) and waking ``wait_for_tasks()``.

    python scripts/benchmarks/ring_parts.py [--puts 200] [--parts put,prefetch]
"""

import argparse
import os
import random
import sys
import time
import uuid

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_sync  # noqa: E402  (section 7's batch and its rank loop)

from fastdeploy_sync import TaskClient, TaskQueue  # noqa: E402
from fastdeploy_sync.engine import encoder as encoder_module  # noqa: E402
from fastdeploy_sync.worker.background import threads_cpu_seconds  # noqa: E402


def _timed(obj, attr, samples, clock):
    """Replace ``obj.attr`` by a wrapper that appends each call's ``clock()`` delta (ns)."""
    call = getattr(obj, attr)

    def timed(*args, **kwargs):
        t0 = clock()
        try:
            return call(*args, **kwargs)
        finally:
            samples.append(clock() - t0)
    setattr(obj, attr, timed)


def _rank(name, tp, rank, n, out):
    """A rank whose prefetch thread's parts are timed (thread CPU); reports them."""
    with TaskClient(name, tp, rank, async_prefetch=True) as client:
        client.barrier(timeout=60)
        deadline = time.monotonic() + 10
        ring = client._ring
        while time.monotonic() < deadline and not (ring.thread is not None
                                                  and ring.thread.ident):
            time.sleep(0.001)  # the ring attached and its prefetch thread running
        if ring.thread is None:
            raise SystemExit(f"rank {rank}: no ring (FD_SYNC_SHM_RING_KB=off, or no room)")
        parts = {"decode": [], "wait": [], "wake": []}
        _timed(ring.reader, "decode", parts["decode"], time.thread_time_ns)
        _timed(ring.reader, "wait", parts["wait"], time.thread_time_ns)
        _timed(ring.woke, "set", parts["wake"], time.thread_time_ns)
        threads = (client._background.thread, ring.thread)
        before = [threads_cpu_seconds((t,)) for t in threads]
        out.put(("ready", rank, None))
        bench_sync.take_batches(client, rank, n)
        receiver, prefetch = ((threads_cpu_seconds((t,)) - b) / n * 1e6
                              for t, b in zip(threads, before))
        row = {"receiver": receiver, "prefetch": prefetch,
               "decode p50": np.median(parts["decode"]) / 1e3,
               "wait": sum(parts["wait"]) / n / 1e3, "wake": sum(parts["wake"]) / n / 1e3,
               "decoded by the loop": client.stats().get("decoded_by_loop", 0)}
        out.put(("cpu", rank, row))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--puts", type=int, default=200)
    ap.add_argument("--parts", default="put,prefetch")
    args = ap.parse_args()
    n, want = args.puts, set(args.parts.split(","))
    name = "rp" + uuid.uuid4().hex[:8]
    queue = TaskQueue(name, 2, max_inflight=4)
    out = bench_sync.SPAWN.Queue()
    procs = [bench_sync.SPAWN.Process(target=_rank, args=(name, 2, rank, n, out))
             for rank in range(2)]
    put = {k: [] for k in ("put_tasks", "encode", "pickle", "allocate", "copy", "ledger",
                           "wake")}
    try:
        for p in procs:
            p.start()
        for _ in procs:
            out.get(timeout=120)
        time.sleep(0.3)
        enc = queue._encoder
        ring = enc.kept.ring
        if ring is None:
            raise SystemExit("no ring (FD_SYNC_SHM_RING_KB=off, or /dev/shm has no room)")
        wall = time.perf_counter_ns
        for obj, attr, key in ((enc, "encode", "encode"), (enc.kept, "wake", "wake"),
                               (queue._ledger, "put", "ledger"),
                               (ring, "allocate", "allocate"),
                               (ring, "write_inline", "copy"),
                               (encoder_module.codec, "encode_parts", "pickle")):
            _timed(obj, attr, put[key], wall)
        batch = bench_sync.make_requests()
        rng = random.Random(1)
        for _ in range(n):
            time.sleep(0.002 + rng.random() * 0.003)
            t0 = wall()
            queue.put_tasks(batch, timeout=30)
            put["put_tasks"].append(wall() - t0)
        rows = sorted(out.get(timeout=120)[1:] for _ in procs)
    finally:
        queue.close(timeout=10)
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()
    print(f"the ring path, TP=2, {n} puts of 64 x 512 token ids 2-5 ms apart (us)")
    if "put" in want:
        p50 = {k: np.percentile(np.array(v[10:]) / 1000, 50) for k, v in put.items()}
        print(f"  put_tasks p50 {p50['put_tasks']:.1f} = encode {p50['encode']:.1f} (pickle "
              f"{p50['pickle']:.1f}, slot {p50['allocate']:.1f}, copy {p50['copy']:.1f}) + "
              f"ledger {p50['ledger']:.1f} + wake {p50['wake']:.1f}")
    if "prefetch" in want:
        for rank, row in rows:
            print(f"  rank {rank} thread CPU per batch: receiver {row['receiver']:.1f}, "
                  f"prefetch {row['prefetch']:.1f} (decode p50 {row['decode p50']:.1f}, "
                  f"semaphore wait {row['wait']:.1f}, waking wait_for_tasks "
                  f"{row['wake']:.1f}); batches decoded by the event loop "
                  f"{row['decoded by the loop']}")


if __name__ == "__main__":
    main()
