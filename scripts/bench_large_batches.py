"""Large batches to a node-local TP group: over the socket (one copy per rank) vs through
shared memory (one copy per node, ``payload_shm``), side by side in one run.

  (1) delivery: a ``--mb`` MiB batch (16 float32 arrays, "multimodal features") put to a
      TP=``--tp`` group on one node (ipc); time from ``put_tasks()`` to the moment every
      rank holds it (every rank's RECEIVED watermark in the group's shared memory reached
      the batch: what makes ``exist_tasks()`` true; the engine process polls it every
      50 µs), and ``put_tasks()`` alone; medians over ``--rounds`` batches, one at a time;
      effective GB/s = batch bytes / median delivery. Rows interleave, round by round, so
      load drifting during the run hits both alike.
  (2) engine memory: in a fresh process per mode, the peak RSS (VmHWM) reached by one
      ``put_tasks()`` until its one rank took the batch (the sends included), above the
      RSS of the caller's own arrays and the queue, as a multiple of the batch size; and,
      separately, the bytes of shared memory the batch occupies in /dev/shm (node memory,
      not mapped by the engine, so not in its RSS).
  (3) small batches: 64 requests x 512 int64 token ids (256 KiB of arrays, below the
      threshold, so both modes take the socket path): delivery median, and
      ``encode_payload`` next to the previous encoder (bytearray + bytes(), reproduced
      here) in the same run.

Asserts nothing: numbers to read. FD_SYNC_SHM_PAYLOAD_MIN_KB selects the path per queue
(``off``: socket). Workers take batches with ``sync_step()`` every 2 ms (only to free room:
taking is not timed).

    PYTHONPATH=$PWD python scripts/bench_large_batches.py [--tp 4] [--mb 64] [--rounds 7]
        [--small-rounds 40] [--sections 123] [--huge]

``--huge`` adds section (4): one 1 GiB array to a TP=2 group, 2 rounds per mode, with
FD_SYNC_MAX_MESSAGE_MB=2048 and FD_SYNC_HEARTBEAT_TIMEOUT=60: over the socket the
engine's PONGs queue behind the 1 GiB message on the same connection, and with the
default 3 s timeout the ranks declare the engine gone before it arrives.
"""

import argparse
import array
import glob
import multiprocessing
import os
import pickle
import queue as queue_mod
import statistics
import time
import uuid

import numpy as np

from fastdeploy_sync import TaskClient, TaskQueue, codec
from fastdeploy_sync.shm import Segment
from fastdeploy_sync.tp_group import R_RECEIVED, RANK_BASE, RANK_STRIDE, group_shm_name

MiB = 1 << 20
SPAWN = multiprocessing.get_context("spawn")
MODES = (("socket", "off"), ("shm", "1024"))


def big_batch(mb, arrays=16):
    per = int(mb * MiB) // arrays // 4
    return [{"request_id": f"mm-{i}", "features": np.full(per, i, dtype=np.float32)}
            for i in range(arrays)], arrays


def small_batch():
    return [{"request_id": f"req-{i}", "prompt_token_ids": np.arange(512, dtype=np.int64) + i}
            for i in range(64)], 64


def rank_main(name, tp, rank, n, out):
    """Take n batches (checking each is read-only and from the right request)."""
    try:
        with TaskClient(name, tp, rank, async_prefetch=True) as client:
            out.put(("ready", rank, None))
            taken = 0
            deadline = time.monotonic() + 600
            while taken < n and time.monotonic() < deadline:
                for requests, _ in client.sync_step(timeout=60):
                    first = requests[0]
                    arr = first.get("features", first.get("prompt_token_ids"))
                    assert not arr.flags.writeable and int(arr[0]) == arr[0]
                    taken += 1
                time.sleep(0.002)
            out.put(("done", rank, taken))
    except BaseException as exc:
        out.put(("error", rank, repr(exc)))


def _wait(out, tag, count, timeout=120):
    got = {}
    deadline = time.monotonic() + timeout
    while len(got) < count:
        try:
            kind, rank, payload = out.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue_mod.Empty:
            if tag == "never":
                return got
            raise
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
        self.seg = Segment.attach(group_shm_name(self.name, 0))  # rank 0 made it: ready
        self.slots = [RANK_BASE + r * RANK_STRIDE + R_RECEIVED for r in range(tp)]

    def deliver(self, batch):
        """(seconds put -> every rank holds it, seconds in put_tasks). One batch at a
        time: the previous one was taken by every rank and freed."""
        t0 = time.monotonic()
        seq = self.queue.put_tasks(batch, timeout=120)
        t1 = time.monotonic()
        view, deadline = self.seg.view, t0 + 120
        while min(view[s] for s in self.slots) < seq:
            if time.monotonic() > deadline:
                raise RuntimeError(f"batch {seq} did not reach every rank in 120 s")
            time.sleep(50e-6)
        done = time.monotonic()
        # untimed: every rank takes it and the engine frees it (unlinks a shared segment)
        # before the next put, so one batch's clean-up does not land in the next's time
        while self.queue.num_tasks():
            if not self.out.empty():
                _wait(self.out, "never", 1, timeout=1)  # raises a rank's error
            time.sleep(0.0005)
        return done - t0, t1 - t0

    def close(self):
        self.seg.close()
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
    """Fresh process: peak RSS of one put_tasks() above the caller's arrays and a queue
    with one connected rank, until that rank has taken the batch (sends included)."""
    os.environ["FD_SYNC_SHM_PAYLOAD_MIN_KB"] = setting
    batch = big_batch(mb)
    name = "blm" + uuid.uuid4().hex[:8]
    queue = TaskQueue(name, 1, max_inflight=2)
    ranks = SPAWN.Queue()
    rank = SPAWN.Process(target=rank_main, args=(name, 1, 0, 1, ranks), daemon=True)
    rank.start()
    _wait(ranks, "ready", 1)
    base = _vm_hwm()
    queue.put_tasks(batch, timeout=10)
    shared = sum(os.stat(p).st_blocks * 512 for p in glob.glob(f"/dev/shm/fdsync.{name}.dp0.b*"))
    _wait(ranks, "done", 1)
    deadline = time.monotonic() + 60
    while queue.num_tasks() and time.monotonic() < deadline:
        time.sleep(0.001)
    peak = _vm_hwm()
    queue.close(timeout=10)
    rank.join(timeout=10)
    out.put(((peak - base) / (mb * MiB), shared / (mb * MiB)))


def engine_memory(mb):
    ratios = {}
    for mode, setting in MODES:
        out = SPAWN.Queue()
        p = SPAWN.Process(target=memory_probe, args=(setting, mb, out))  # it has a child
        p.start()
        try:
            ratios[mode] = out.get(timeout=120)
        finally:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
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
    ap.add_argument("--mb", type=float, default=64)
    ap.add_argument("--shm-min-kb", default="1024",
                    help="FD_SYNC_SHM_PAYLOAD_MIN_KB of the shm rows (the socket rows: off)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--small-rounds", type=int, default=40)
    ap.add_argument("--sections", default="123", help="which of sections 1-3 to run")
    ap.add_argument("--huge", action="store_true", help="also (4): one 1 GiB array to TP=2")
    args = ap.parse_args()
    global MODES
    MODES = (("socket", "off"), ("shm", args.shm_min_kb))
    nbytes = int(args.mb * MiB)
    print(f"fastdeploy_sync large batches: {os.cpu_count()} cores, TP={args.tp}, "
          f"{args.mb:g} MiB batch, {args.rounds} rounds per mode (interleaved)\n")

    if "1" in args.sections:
        report_delivery(f"(1) {args.mb:g} MiB batch to TP={args.tp} on one node (ipc)",
                        delivery(args.tp, lambda: big_batch(args.mb), args.rounds), nbytes)
    if "2" in args.sections:
        ratios = engine_memory(args.mb)
        print(f"\n(2) engine peak RSS of one put_tasks() (until its one rank took it) above "
              f"the caller's arrays, {args.mb:g} MiB batch (fresh process per mode)")
        for mode, (ratio, shared) in ratios.items():
            print(f"  {mode:6s}: engine RSS +{ratio:5.2f}x the batch; in /dev/shm "
                  f"{shared:5.2f}x")
    if "3" in args.sections:
        small_section(args)
    if args.huge:
        gib = 1024
        huge = lambda: ([{"request_id": "huge", "features": np.ones(gib * MiB // 4, np.float32)}], 1)
        os.environ["FD_SYNC_MAX_MESSAGE_MB"] = "2048"  # the socket path needs the room
        os.environ["FD_SYNC_HEARTBEAT_TIMEOUT"] = "60"  # see the module docstring
        report_delivery("\n(4) one 1 GiB array to TP=2 on one node (ipc)",
                        delivery(2, huge, 2, warmup=0), gib * MiB)


def small_section(args):
    small = small_batch()
    small_bytes = sum(r["prompt_token_ids"].nbytes for r in small[0])
    report_delivery(f"\n(3) small batches, 64 x 512 int64 tokens ({small_bytes >> 10} KiB, "
                    f"below the threshold: both modes take the socket path), TP={args.tp}",
                    delivery(args.tp, small_batch, args.small_rounds), small_bytes)
    enc = encode_medians_us(small, 200)
    enc_big = encode_medians_us(big_batch(args.mb), 5)
    print(f"  encode_payload {enc['encode_payload']:.1f} µs vs previous encoder "
          f"{enc['previous encoder']:.1f} µs (ratio previous/new "
          f"{enc['previous encoder'] / enc['encode_payload']:.2f}); {args.mb:g} MiB batch: "
          f"{enc_big['encode_payload'] / 1e3:.1f} ms vs {enc_big['previous encoder'] / 1e3:.1f} ms "
          f"(socket path only; the shared path writes the segment instead)")


if __name__ == "__main__":
    try:
        main()
    except queue_mod.Empty:
        raise SystemExit("a worker or probe did not report in time") from None
