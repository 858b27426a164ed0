"""Large batches to a node-local TP group: over the socket (one copy per rank) vs through
shared memory (one copy per node, ``payload_shm``), side by side in one run.

  (1) delivery: a ``--mb`` MiB batch (16 float32 arrays, "multimodal features") put to a
      TP=``--tp`` group on one node (ipc); time from ``put_tasks()`` to the moment every
      rank holds it (the last rank's ``get_tasks()`` returned it; CLOCK_MONOTONIC is
      system-wide), and ``put_tasks()`` alone; medians over ``--rounds`` batches, one at a
      time; effective GB/s = batch bytes / median delivery. Rows interleave, round by
      round, so load drifting during the run hits both alike.
  (2) engine memory: in a fresh process per mode, the peak RSS (VmHWM) reached by one
      ``put_tasks()`` above the RSS of the caller's own arrays and an idle queue, as a
      multiple of the batch size (shared memory the engine wrote counts: it is resident).
  (3) small batches: 64 requests x 512 int64 token ids (256 KiB of arrays, below the
      threshold, so both modes take the socket path): delivery median, and
      ``encode_payload`` next to the previous encoder (bytearray + bytes(), reproduced
      here) in the same run.

Asserts nothing: numbers to read. FD_SYNC_SHM_PAYLOAD_MIN_KB selects the path per queue
(``off``: socket). Workers poll ``sync_step()`` every 0.2 ms, which on 2 shared cores
adds scheduling noise to every row alike.

    PYTHONPATH=$PWD python scripts/bench_large_batches.py [--tp 4] [--mb 64] [--rounds 7]
        [--small-rounds 40] [--huge]    # --huge adds one 1 GiB array to a TP=2 group
"""

import argparse
import array
import multiprocessing
import os
import pickle
import queue as queue_mod
import statistics
import time
import uuid

import numpy as np

from fastdeploy_sync import TaskClient, TaskQueue, codec

MiB = 1 << 20
SPAWN = multiprocessing.get_context("spawn")
MODES = (("socket", "off"), ("shm", "1024"))


def big_batch(mb, arrays=16):
    per = mb * MiB // arrays // 4
    return [{"request_id": f"mm-{i}", "features": np.full(per, i, dtype=np.float32)}
            for i in range(arrays)], arrays


def small_batch():
    return [{"request_id": f"req-{i}", "prompt_token_ids": np.arange(512, dtype=np.int64) + i}
            for i in range(64)], 64


def rank_main(name, tp, rank, n, out):
    """Take n batches; report (rank, batch index, monotonic time it was in hand)."""
    try:
        with TaskClient(name, tp, rank, async_prefetch=True) as client:
            out.put(("ready", rank, None))
            taken = 0
            deadline = time.monotonic() + 600
            while taken < n and time.monotonic() < deadline:
                for tasks in client.sync_step(timeout=60):
                    t = time.monotonic()
                    requests, _ = tasks
                    first = requests[0]
                    arr = first.get("features", first.get("prompt_token_ids"))
                    assert not arr.flags.writeable
                    out.put(("held", rank, (taken, t)))
                    taken += 1
                time.sleep(0.0002)
            out.put(("done", rank, taken))
    except BaseException as exc:
        out.put(("error", rank, repr(exc)))


def _wait(out, tag, count, timeout=120):
    got = {}
    deadline = time.monotonic() + timeout
    while len(got) < count:
        kind, rank, payload = out.get(timeout=max(0.01, deadline - time.monotonic()))
        if kind == "error":
            raise RuntimeError(f"rank {rank}: {payload}")
        if kind == tag:
            got[rank] = payload
    return got


class Group:
    """One queue (its own path setting) and its TP worker processes."""

    def __init__(self, tp, setting, n):
        self.name = "blb" + uuid.uuid4().hex[:8]
        os.environ["FD_SYNC_SHM_PAYLOAD_MIN_KB"] = setting  # read by TaskQueue() only
        self.queue = TaskQueue(self.name, tp, max_inflight=2)
        self.out = SPAWN.Queue()
        self.procs = [SPAWN.Process(target=rank_main, args=(self.name, tp, r, n, self.out),
                                    daemon=True) for r in range(tp)]
        for p in self.procs:
            p.start()
        _wait(self.out, "ready", tp)
        self.tp = tp

    def deliver(self, batch):
        """(seconds put -> every rank holds it, seconds in put_tasks)."""
        t0 = time.monotonic()
        self.queue.put_tasks(batch, timeout=120)
        t1 = time.monotonic()
        held = _wait(self.out, "held", self.tp)
        return max(t for _, t in held.values()) - t0, t1 - t0

    def close(self):
        self.queue.close(timeout=10)
        for p in self.procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def delivery(tp, make, rounds, warmup=1):
    """Interleaved rounds over both modes; {mode: (deliveries, puts)}."""
    batch = make()
    groups = {mode: Group(tp, setting, rounds + warmup) for mode, setting in MODES}
    results = {mode: ([], []) for mode in groups}
    try:
        for i in range(rounds + warmup):
            for mode, group in groups.items():
                d, p = group.deliver(batch)
                if i >= warmup:
                    results[mode][0].append(d)
                    results[mode][1].append(p)
    finally:
        for group in groups.values():
            group.close()
    return results


def _vm_hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def memory_probe(setting, mb, out):
    """Fresh process: peak RSS of one put_tasks() above the caller's arrays + idle queue."""
    os.environ["FD_SYNC_SHM_PAYLOAD_MIN_KB"] = setting
    batch = big_batch(mb)
    queue = TaskQueue("blm" + uuid.uuid4().hex[:8], 1, max_inflight=2)
    base = _vm_hwm()
    queue.put_tasks(batch, timeout=10)
    peak = _vm_hwm()
    queue.close(timeout=0.1)
    out.put((peak - base) / (mb * MiB))


def engine_memory(mb):
    ratios = {}
    for mode, setting in MODES:
        out = SPAWN.Queue()
        p = SPAWN.Process(target=memory_probe, args=(setting, mb, out), daemon=True)
        p.start()
        ratios[mode] = out.get(timeout=120)
        p.join(timeout=20)
    return ratios


def old_encode_payload(obj):
    """The encoder before this change (bytearray grown per buffer, then bytes()), kept here
    only as the same-run reference."""
    buffers = []

    def cb(pb):
        raw = pb.raw()
        if raw.nbytes < codec.OOB_MIN_BYTES:
            return True
        buffers.append(raw)
        return False

    body = pickle.dumps(obj, protocol=5, buffer_callback=cb)
    if not buffers:
        return [body]
    offsets, data = array.array("q"), bytearray()
    for raw in buffers:
        start = (len(data) + 63) // 64 * 64
        data.extend(bytes(start - len(data)))
        offsets.extend((start, raw.nbytes))
        data += raw
    return [body, offsets.tobytes(), bytes(data)]


def encode_medians_us(batch, repeat):
    fns = (("encode_payload", lambda: codec.encode_payload(batch)),
           ("previous encoder", lambda: old_encode_payload(batch)))
    samples = {label: [] for label, _ in fns}
    for i in range(repeat + 5):
        for label, fn in fns:
            t = time.perf_counter()
            fn()
            if i >= 5:
                samples[label].append(time.perf_counter() - t)
    return {label: statistics.median(s) * 1e6 for label, s in samples.items()}


def report_delivery(title, results, nbytes):
    print(title)
    base = statistics.median(results["socket"][0])
    for mode, (deliveries, puts) in results.items():
        d = statistics.median(deliveries)
        print(f"  {mode:6s}: put -> every rank holds it  median {d * 1e3:8.2f} ms "
              f"(min {min(deliveries) * 1e3:.2f}, max {max(deliveries) * 1e3:.2f}), "
              f"put_tasks {statistics.median(puts) * 1e3:7.2f} ms, "
              f"{nbytes / d / 1e9:6.2f} GB/s effective, socket/this {base / d:5.2f}x")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--small-rounds", type=int, default=40)
    ap.add_argument("--huge", action="store_true", help="also one 1 GiB array to TP=2")
    args = ap.parse_args()
    nbytes = args.mb * MiB
    print(f"fastdeploy_sync large batches: {os.cpu_count()} cores, TP={args.tp}, "
          f"{args.mb} MiB batch, {args.rounds} rounds per mode (interleaved)\n")

    report_delivery(f"(1) {args.mb} MiB batch to TP={args.tp} on one node (ipc)",
                    delivery(args.tp, lambda: big_batch(args.mb), args.rounds), nbytes)

    ratios = engine_memory(args.mb)
    print(f"\n(2) engine peak RSS of one put_tasks() above the caller's arrays, "
          f"{args.mb} MiB batch (fresh process per mode)")
    for mode, ratio in ratios.items():
        print(f"  {mode:6s}: {ratio:5.2f}x the batch")

    small = small_batch()
    small_bytes = sum(r["prompt_token_ids"].nbytes for r in small[0])
    report_delivery(f"\n(3) small batches, 64 x 512 int64 tokens ({small_bytes >> 10} KiB, "
                    f"below the threshold: both modes take the socket path), TP={args.tp}",
                    delivery(args.tp, small_batch, args.small_rounds), small_bytes)
    enc = encode_medians_us(small, 200)
    enc_big = encode_medians_us(big_batch(args.mb), 5)
    print(f"  encode_payload {enc['encode_payload']:.1f} µs vs previous encoder "
          f"{enc['previous encoder']:.1f} µs (ratio previous/new "
          f"{enc['previous encoder'] / enc['encode_payload']:.2f}); {args.mb} MiB batch: "
          f"{enc_big['encode_payload'] / 1e3:.1f} ms vs {enc_big['previous encoder'] / 1e3:.1f} ms "
          f"(socket path only; the shared path writes the segment instead)")

    if args.huge:
        gib = 1024
        huge = lambda: ([{"request_id": "huge", "features": np.ones(gib * MiB // 4, np.float32)}], 1)
        os.environ["FD_SYNC_MAX_MESSAGE_MB"] = "2048"  # the socket path needs the room
        report_delivery("\n(4) one 1 GiB array to TP=2 on one node (ipc)",
                        delivery(2, huge, 2, warmup=0), gib * MiB)


if __name__ == "__main__":
    try:
        main()
    except queue_mod.Empty:
        raise SystemExit("a worker or probe did not report in time") from None
