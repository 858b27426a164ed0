#!/usr/bin/env python3
"""Where ``put_tasks()`` spends its time on the ring path: one TP=2 queue, its two ranks
idle in ``wait_for_tasks()`` in processes of their own, ``--puts`` 64 x 512 batches 2-5 ms
apart (as ``bench_sync.py`` section 7 and ``put_floor.py`` put them), each part timed around
the library's own calls: pickling (``codec.encode_parts``), taking a slot
(``BatchRing.allocate``), copying into it (``write_inline``), the whole encode, the ledger
(room, seq, publish) and waking the ranks. Prints p50s in us. Asserts nothing.

    python scripts/benchmarks/put_parts.py [--puts 200]
"""

import argparse
import os
import random
import sys
import time
import uuid

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_sync  # noqa: E402  (section 7's batch and its idle ranks)
from fastdeploy_sync import TaskQueue  # noqa: E402
from fastdeploy_sync.engine import encoder as encoder_module  # noqa: E402


def _timed(obj, attr, samples):
    """Replace ``obj.attr`` by a wrapper that appends each call's duration (ns)."""
    call = getattr(obj, attr)

    def timed(*args, **kwargs):
        t0 = time.perf_counter_ns()
        try:
            return call(*args, **kwargs)
        finally:
            samples.append(time.perf_counter_ns() - t0)
    setattr(obj, attr, timed)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--puts", type=int, default=200)
    n = ap.parse_args().puts
    name = "pp" + uuid.uuid4().hex[:8]
    queue = TaskQueue(name, 2, max_inflight=4)
    out = bench_sync.SPAWN.Queue()
    procs = [bench_sync.SPAWN.Process(target=bench_sync.delivery_rank,
                                      args=(name, 2, rank, n, out)) for rank in range(2)]
    parts = {k: [] for k in ("put_tasks", "encode", "pickle", "allocate", "copy", "ledger",
                             "wake")}
    try:
        for p in procs:
            p.start()
        for _ in procs:
            out.get(timeout=120)  # ready
        time.sleep(0.3)
        enc = queue._encoder
        if enc._ring is None:
            sys.exit("no ring (FD_SYNC_SHM_RING_KB=off, or /dev/shm has no room)")
        _timed(enc, "encode", parts["encode"])
        _timed(enc, "wake", parts["wake"])
        _timed(queue._ledger, "put", parts["ledger"])
        _timed(enc._ring, "allocate", parts["allocate"])
        _timed(enc._ring, "write_inline", parts["copy"])
        _timed(encoder_module.codec, "encode_parts", parts["pickle"])
        batch = bench_sync.make_requests()
        rng = random.Random(1)
        for _ in range(n):
            time.sleep(0.002 + rng.random() * 0.003)
            t0 = time.perf_counter_ns()
            queue.put_tasks(batch, timeout=30)
            parts["put_tasks"].append(time.perf_counter_ns() - t0)
        for _ in procs:
            out.get(timeout=120)  # the ranks' times
    finally:
        queue.close(timeout=10)
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()

    def p50(samples):
        return np.percentile(np.array(samples[10:]) / 1000, 50)  # after 10 warm-up puts
    print(f"put_tasks() through the ring, TP=2, {n} puts of 64 x 512 token ids 2-5 ms apart, "
          f"p50 us:")
    print(f"  put_tasks {p50(parts['put_tasks']):.1f} = encode {p50(parts['encode']):.1f} "
          f"(pickle {p50(parts['pickle']):.1f}, slot {p50(parts['allocate']):.1f}, copy "
          f"{p50(parts['copy']):.1f}) + ledger {p50(parts['ledger']):.1f} + wake "
          f"{p50(parts['wake']):.1f}")


if __name__ == "__main__":
    main()
