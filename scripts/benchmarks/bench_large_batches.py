"""Large batches to a node-local TP group: over the socket (one copy per rank) vs through
shared memory (one copy per node, ``payload_shm``), side by side in one run.

  (1) delivery: a ``--mb`` MiB batch (16 float32 arrays, "multimodal features") put to a
      TP=``--tp`` group on one node (ipc); time from ``put_tasks()`` to the moment every
      rank holds it (every rank's RECEIVED watermark in the group's shared memory reached
      the batch: what makes ``exist_tasks()`` true; the engine process polls it every
      50 µs), and ``put_tasks()`` alone; medians over ``--rounds`` batches, one at a time;
      effective GB/s = batch bytes / median delivery. Rows interleave, round by round, so
      load drifting during the run hits both alike. Modes: ``socket``
      (FD_SYNC_SHM_PAYLOAD_MIN_KB=off), ``shm`` (the defaults: through the pool, body and
      reference checksummed, the shared bytes not hashed), ``shm, hashed``
      (FD_SYNC_SHM_CHECKSUM=1: the engine hashes the shared bytes, every rank verifies).
      Then where the shm rows' time goes: the engine's pickling, hashing and copying
      measured alone in this process (the fastest of 15), a rank's hash of the bytes
      alone, the hash's share
      as the difference of the two shm rows, and the rest (wake-ups, messages, decode,
      scheduling four ranks on the cores).
  (2) engine memory: in a fresh process per mode, the peak RSS (VmHWM) reached by one
      ``put_tasks()`` until its one rank took the batch (the sends included), above the
      RSS of the caller's own arrays and the queue after a first 2 MiB batch (which
      creates the shm mode's pool), as a multiple of the batch size; and the bytes of
      /dev/shm the queue's names hold (the pool is a fixed reservation, FD_SYNC_SHM_POOL_MB,
      mapped by the engine and by each rank: shared pages, held once by the node), and
      how long the first put_tasks() took (in the shm mode it creates the pool).
  (3) small batches, 64 requests x 512 int64 token ids (256 KiB of arrays): delivery over
      the socket (below the default threshold) and through the pool (threshold 64 KiB);
      ``codec.encode_parts`` and ``decode_payload`` next to numpy's own pickle reduction
      (which the encoder used before) in the same run.

Asserts nothing: numbers to read. Workers take batches with ``sync_step()`` every 2 ms
(only to free room: taking is not timed).

    PYTHONPATH=$PWD python scripts/benchmarks/bench_large_batches.py [--tp 4] [--mb 64] [--rounds 7]
        [--small-rounds 40] [--sections 123] [--huge]

``--huge`` adds section (4): one 1 GiB array to a TP=2 group, 2 rounds per mode, with
FD_SYNC_MAX_MESSAGE_MB=2048 and FD_SYNC_HEARTBEAT_TIMEOUT=60 (over the socket the
engine's PONGs queue behind the 1 GiB message on the same connection): over the socket,
through a segment of its own (larger than the default 256 MiB pool), and through a
2.5 GiB pool (FD_SYNC_SHM_POOL_MB=2560, one warm-up batch creates it).
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

from fastdeploy_sync import TaskClient, TaskQueue
from fastdeploy_sync.names import group_segment as group_shm_name
from fastdeploy_sync.shm.segment import Segment
from fastdeploy_sync.tp.layout import R_RECEIVED, RANK_BASE, RANK_STRIDE
from fastdeploy_sync.wire import codec

MiB = 1 << 20
SPAWN = multiprocessing.get_context("spawn")
# mode -> the environment its TaskQueue is built with (the engine reads these at construction)
MODES = {"socket": {"FD_SYNC_SHM_PAYLOAD_MIN_KB": "off"},
         "shm": {},
         "shm, hashed": {"FD_SYNC_SHM_CHECKSUM": "1"}}
_SHM_VARS = ("FD_SYNC_SHM_PAYLOAD_MIN_KB", "FD_SYNC_SHM_CHECKSUM", "FD_SYNC_SHM_POOL_MB")


def _apply(settings):
    for var in _SHM_VARS:
        os.environ.pop(var, None)
    os.environ.update(settings)


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

    def __init__(self, tp, settings, n):
        self.name = "blb" + uuid.uuid4().hex[:8]
        _apply(settings)  # read by TaskQueue() only
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


def delivery(tp, make, rounds, warmup=1, modes=None):
    """Interleaved rounds over the modes; {mode: (deliveries, puts)}."""
    batch = make()
    modes = MODES if modes is None else modes
    groups = {mode: Group(tp, settings, rounds + warmup) for mode, settings in modes.items()}
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


def memory_probe(settings, mb, out):
    """Fresh process: peak RSS of one put_tasks() above the caller's arrays and a queue
    with one connected rank that already took a 2 MiB batch (in the shm mode that one
    created the pool), until that rank has taken the batch (sends included)."""
    _apply(settings)
    batch = big_batch(mb)
    name = "blm" + uuid.uuid4().hex[:8]
    queue = TaskQueue(name, 1, max_inflight=2)
    ranks = SPAWN.Queue()
    rank = SPAWN.Process(target=rank_main, args=(name, 1, 0, 2, ranks), daemon=True)
    rank.start()
    _wait(ranks, "ready", 1)
    first = big_batch(2)
    t0 = time.perf_counter()
    queue.put_tasks(first, timeout=30)  # shm mode: creates the pool, in this call
    first_put_ms = (time.perf_counter() - t0) * 1e3
    while queue.num_tasks():
        time.sleep(0.001)
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
    out.put(((peak - base) / (mb * MiB), shared / (mb * MiB), first_put_ms))


def engine_memory(mb):
    ratios = {}
    for mode in ("socket", "shm"):
        out = SPAWN.Queue()
        p = SPAWN.Process(target=memory_probe, args=(MODES[mode], mb, out))  # it has a child
        p.start()
        try:
            ratios[mode] = out.get(timeout=120)
        finally:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return ratios


def numpy_reduction_encode(obj):
    """Protocol-5 pickling with numpy's own reduction for arrays (what the encoder used
    before it rebuilt plain arrays with one ``numpy.ndarray`` call), buffers laid out the
    same way: the same-run reference for ``codec.encode_parts``."""
    buffers = []

    def keep(pickle_buffer):
        raw = pickle_buffer.raw()
        if raw.nbytes < codec.OOB_MIN_BYTES:
            return True
        buffers.append(raw)
        return False

    body = pickle.dumps(obj, protocol=5, buffer_callback=keep)
    offsets, size = array.array("q"), 0
    for raw in buffers:
        start = (size + 63) // 64 * 64
        offsets.extend((start, raw.nbytes))
        size = start + raw.nbytes
    return body, buffers, offsets.tobytes()


def _samples_s(fn, repeat, warmup):
    """Seconds per call of ``fn``, ``repeat`` calls after ``warmup`` untimed ones."""
    samples = []
    for i in range(repeat + warmup):
        t = time.perf_counter()
        fn()
        if i >= warmup:
            samples.append(time.perf_counter() - t)
    return samples


def _median_us(fn, repeat, warmup=5):
    return statistics.median(_samples_s(fn, repeat, warmup)) * 1e6


def codec_medians_us(batch, repeat):
    """Encode and decode of ``batch``, this encoder vs numpy's reduction, interleaved."""
    old_body, old_buffers, old_offsets = numpy_reduction_encode(batch)
    old_frames = [old_body, old_offsets, codec.EncodedPayload(
        old_body, old_buffers, [(int(a), int(b)) for a, b in zip(*[iter(
            array.array("q", old_offsets))] * 2)], old_offsets, 0).frames()[2]]
    frames = codec.encode_payload(batch)
    fns = {"encode": lambda: codec.encode_parts(batch),
           "encode, numpy's reduction": lambda: numpy_reduction_encode(batch),
           "decode": lambda: codec.decode_payload(frames),
           "decode, numpy's reduction": lambda: codec.decode_payload(old_frames)}
    samples = {label: [] for label in fns}
    for _ in range(5):
        for label, fn in fns.items():
            samples[label].append(_median_us(fn, max(repeat // 5, 1)))
    return {label: statistics.median(s) for label, s in samples.items()}


def report_delivery(title, results, nbytes):
    print(title)
    base = statistics.median(results["socket"][0])
    for mode, (deliveries, puts) in results.items():
        d = statistics.median(deliveries)
        print(f"  {mode:14s}: put -> every rank holds it  median {d * 1e3:8.2f} ms "
              f"(min {min(deliveries) * 1e3:.2f}, max {max(deliveries) * 1e3:.2f}), "
              f"put_tasks {statistics.median(puts) * 1e3:7.2f} ms, "
              f"{nbytes / d / 1e9:6.2f} GB/s effective, socket/this {base / d:5.2f}x")


def _fastest_us(fn, repeat, warmup=2):
    return min(_samples_s(fn, repeat, warmup)) * 1e6


def shm_parts_ms(batch, repeat=15):
    """The shm path's CPU work for ``batch``, each part alone in this process, warm, the
    fastest of ``repeat`` (what the work costs without other processes in the way: a
    lower bound on a shared machine): pickling (encode_parts), hashing the arrays
    (data_hash), copying them into a pool region (write_payload), and one rank's hash of
    the region (xxh3 over the mapping)."""
    import xxhash

    from fastdeploy_sync import names
    from fastdeploy_sync.shm.pool import PayloadPool

    parts = codec.encode_parts(batch)
    name = names.pool("blp" + uuid.uuid4().hex[:8], 0, 1)
    pool = PayloadPool.create(name, 1, (parts.data_size + 63) // 64 * 64)
    try:
        region = pool.allocate(parts.data_size)
        view = region.view()
        out = {"pickle": _fastest_us(lambda: codec.encode_parts(batch), repeat) / 1e3,
               "hash": _fastest_us(parts.data_hash, repeat) / 1e3,
               "copy": _fastest_us(lambda: region.write_payload(parts), repeat) / 1e3,
               "rank hash": _fastest_us(lambda: xxhash.xxh3_64(view).intdigest(),
                                        repeat) / 1e3}
        return out
    finally:
        pool.close()


def report_shares(results, batch, tp):
    """Where the shm rows' delivery time goes (see the module docstring)."""
    med = {mode: (statistics.median(d), statistics.median(p)) for mode, (d, p) in results.items()}
    if "shm" not in med or "shm, hashed" not in med:
        return
    parts = shm_parts_ms(batch)
    d, put = (x * 1e3 for x in med["shm"])
    d_hashed = med["shm, hashed"][0] * 1e3
    check = d_hashed - d
    rest = d - parts["pickle"] - parts["copy"]
    print("  where the time goes (delivery medians; each part alone in this process, the "
          "fastest of 15):")
    print(f"    engine: pickle {parts['pickle']:.2f} ms, copy into the pool {parts['copy']:.2f} "
          f"ms, hash (only when hashed) {parts['hash']:.2f} ms; put_tasks {put:.2f} ms in the "
          f"shm row")
    print(f"    shm row, {d:.2f} ms: copy {100 * parts['copy'] / d:.0f} %, pickle "
          f"{100 * parts['pickle'] / d:.0f} %, the rest (wake-ups, messages, decode, "
          f"scheduling {tp} ranks on {os.cpu_count()} cores) {rest:.2f} ms "
          f"({100 * rest / d:.0f} %)")
    print(f"    hashed row, {d_hashed:.2f} ms: the hash adds {check:.2f} ms "
          f"({100 * check / d_hashed:.0f} % of it): the engine's pass over the arrays and "
          f"each rank's over the shared bytes ({parts['rank hash']:.2f} ms per rank alone; "
          f"{tp} ranks read {tp}x the batch from memory)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--mb", type=float, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--small-rounds", type=int, default=40)
    ap.add_argument("--sections", default="123", help="which of sections 1-3 to run")
    ap.add_argument("--huge", action="store_true", help="also (4): one 1 GiB array to TP=2")
    args = ap.parse_args()
    nbytes = int(args.mb * MiB)
    print(f"fastdeploy_sync large batches: {os.cpu_count()} cores, TP={args.tp}, "
          f"{args.mb:g} MiB batch, {args.rounds} rounds per mode (interleaved)\n")

    if "1" in args.sections:
        results = delivery(args.tp, lambda: big_batch(args.mb), args.rounds)
        report_delivery(f"(1) {args.mb:g} MiB batch to TP={args.tp} on one node (ipc)",
                        results, nbytes)
        report_shares(results, big_batch(args.mb), args.tp)
    if "2" in args.sections:
        ratios = engine_memory(args.mb)
        print(f"\n(2) engine peak RSS of one put_tasks() (until its one rank took it) above "
              f"the caller's arrays and a warm queue, {args.mb:g} MiB batch (fresh process "
              f"per mode)")
        for mode, (ratio, shared, first_ms) in ratios.items():
            print(f"  {mode:6s}: engine RSS +{ratio:5.2f}x the batch; /dev/shm held by the "
                  f"queue {shared:5.2f}x the batch; the queue's first 2 MiB put_tasks() "
                  f"took {first_ms:6.1f} ms" + (" (it created the pool)" if mode == "shm" else ""))
    if "3" in args.sections:
        small_section(args)
    if args.huge:
        gib = 1024

        def huge():
            return [{"request_id": "huge", "features": np.ones(gib * MiB // 4, np.float32)}], 1
        os.environ["FD_SYNC_MAX_MESSAGE_MB"] = "2048"  # the socket path needs the room
        os.environ["FD_SYNC_HEARTBEAT_TIMEOUT"] = "60"  # see the module docstring
        modes = {"socket": MODES["socket"], "shm, segment": {},
                 "shm, 2.5G pool": {"FD_SYNC_SHM_POOL_MB": "2560"}}
        report_delivery("\n(4) one 1 GiB array to TP=2 on one node (ipc)",
                        delivery(2, huge, 2, warmup=1, modes=modes), gib * MiB)


def small_section(args):
    small = small_batch()
    small_bytes = sum(r["prompt_token_ids"].nbytes for r in small[0])
    modes = {"socket": {}, "shm pool": {"FD_SYNC_SHM_PAYLOAD_MIN_KB": "64"}}
    report_delivery(f"\n(3) small batches, 64 x 512 int64 tokens ({small_bytes >> 10} KiB: "
                    f"below the default threshold, and through the pool with a 64 KiB "
                    f"threshold), TP={args.tp}",
                    delivery(args.tp, small_batch, args.small_rounds, modes=modes), small_bytes)
    med = codec_medians_us(small, 500)
    numpy_encode, numpy_decode = med["encode, numpy's reduction"], med["decode, numpy's reduction"]
    print(f"  encode_parts {med['encode']:.1f} µs vs numpy's reduction {numpy_encode:.1f} µs; "
          f"decode_payload {med['decode']:.1f} µs vs {numpy_decode:.1f} µs (medians, "
          f"interleaved)")

if __name__ == "__main__":
    try:
        main()
    except queue_mod.Empty:
        raise SystemExit("a worker or probe did not report in time") from None
