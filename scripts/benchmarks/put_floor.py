#!/usr/bin/env python3
"""What "put -> every rank holds a 64 x 512 batch" could cost without ZeroMQ's I/O
threads: the floor of a node-local data path, next to this library's two paths, one run.

Beside it, a busy-polling ring in the manner of vLLM's ``shm_broadcast.MessageQueue`` (a
ring of chunks with a written word and one read word per reader; readers poll, yielding the
core between polls): the baseline a design whose readers spin reaches, and the CPU each of
its readers spends per put doing so.

The floor: the engine encodes the batch as ``put_tasks`` does (``codec.encode_parts``),
copies its body, offsets and arrays into one shared-memory buffer, and posts one POSIX
semaphore per rank; each rank's receiving thread, blocked on its semaphore with the GIL
released, wakes, decodes from the buffer (``codec.decode_payload``, arrays as views of it)
and stamps the moment it holds the batch (CLOCK_MONOTONIC, shared by the processes). One
wake-up per rank: no socket, no I/O thread. It has nothing the library's path carries
(order across engine lives, retention for a rank that joins late, backpressure,
authentication, liveness, a buffer per batch in flight): a floor to measure, not a design.

The library's rows are ``bench_sync.py`` section 7's: over the socket, through the
shared-memory pool (64 KiB threshold) and through the ring, the three queues side by side;
and the ring alone, as the floor runs (no other queue's ranks on the cores). Same batch,
same spacing (2-5 ms apart, ranks idle in between), TP=2; floor and library alternate by
rounds. Medians of put -> the last rank holds it decoded. Asserts nothing.

    python scripts/benchmarks/put_floor.py [--puts 200] [--rounds 2]
"""

import argparse
import multiprocessing as mp
import os
import random
import sys
import time
import uuid
from multiprocessing import shared_memory

import numpy as np
import posix_ipc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_sync  # noqa: E402  (section 7's batch and delivery benchmark)

from fastdeploy_sync.wire import codec  # noqa: E402

SPAWN = mp.get_context("spawn")
TP = 2
_HEADER = 64  # int64 lengths of body, offsets and data, then the payload, 64-byte aligned
_BUFFER_BYTES = 4 << 20


def _floor_rank(rank, shm_name, sem_name, stamps_name, n, out):
    shm = shared_memory.SharedMemory(shm_name)
    stamps_shm = shared_memory.SharedMemory(stamps_name)
    stamps = np.ndarray((n,), dtype=np.int64, buffer=stamps_shm.buf, offset=rank * n * 8)
    lengths = np.ndarray((3,), dtype=np.int64, buffer=shm.buf)
    sem = posix_ipc.Semaphore(sem_name)
    out.put(("ready", rank))
    try:
        for i in range(n):
            sem.acquire(30)
            body_len, offsets_len, data_len = (int(x) for x in lengths)
            body = shm.buf[_HEADER:_HEADER + body_len]
            start = _HEADER + ((body_len + offsets_len + 63) & -64)
            offsets = shm.buf[_HEADER + body_len:_HEADER + body_len + offsets_len]
            data = shm.buf[start:start + data_len]
            batch = codec.decode_payload([body, offsets, data])
            stamps[i] = time.monotonic_ns()
            del batch, body, offsets, data
    finally:
        del stamps, lengths
        sem.close()
        shm.close()
        stamps_shm.close()
    out.put(("done", rank))


def bench_floor(n):
    """put -> the last rank holds the batch (decoded), us per put, through the floor."""
    batch = bench_sync.make_requests()
    tag = uuid.uuid4().hex[:8]
    shm = shared_memory.SharedMemory(f"fdsync-floor-{tag}", create=True, size=_BUFFER_BYTES)
    stamps_shm = shared_memory.SharedMemory(f"fdsync-floor-st-{tag}", create=True,
                                            size=TP * n * 8)
    sem_names = [f"/fdsync-floor-{tag}-{r}" for r in range(TP)]
    sems = [posix_ipc.Semaphore(s, posix_ipc.O_CREX, 0o600, 0) for s in sem_names]
    out = SPAWN.Queue()
    procs = [SPAWN.Process(target=_floor_rank, args=(r, shm.name, sem_names[r],
                                                     stamps_shm.name, n, out))
             for r in range(TP)]
    lengths = np.ndarray((3,), dtype=np.int64, buffer=shm.buf)
    view = shm.buf
    try:
        for p in procs:
            p.start()
        for _ in procs:
            out.get(timeout=60)
        time.sleep(0.3)
        rng = random.Random(1)
        started = np.empty(n, dtype=np.int64)
        for i in range(n):
            time.sleep(0.002 + rng.random() * 0.003)
            started[i] = time.monotonic_ns()
            parts = codec.encode_parts(batch)
            body_len, offsets_len = len(parts.body), len(parts.offsets)
            view[_HEADER:_HEADER + body_len] = parts.body
            view[_HEADER + body_len:_HEADER + body_len + offsets_len] = parts.offsets
            start = _HEADER + ((body_len + offsets_len + 63) & -64)
            parts.write_data(view[start:start + parts.data_size])
            lengths[:] = (body_len, offsets_len, parts.data_size)
            for sem in sems:
                sem.release()
        for _ in procs:
            out.get(timeout=60)
        stamps = np.ndarray((TP, n), dtype=np.int64, buffer=stamps_shm.buf).copy()
        return (stamps.max(axis=0) - started)[10:] / 1000.0
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        del lengths, view
        for sem in sems:
            sem.unlink()
            sem.close()
        for segment in (shm, stamps_shm):
            segment.close()
            segment.unlink()


# The busy-polling ring, vLLM's shm_broadcast.MessageQueue in miniature: a ring of chunks,
# each with a "written" word (the put's number) and one "read" word per reader. The writer
# waits until every reader has read a chunk before reusing it; a reader polls its next
# chunk's written word, yielding the core between polls (os.sched_yield, as vLLM's readers
# do), so each reader keeps a core busy while it waits. No semaphore, no socket.
_CHUNKS = 4
_CHUNK_BYTES = 1 << 20  # one 64 x 512 batch's payload fits
_FLAGS = 64  # per chunk: written word, then TP read words, 8 bytes each


def _spin_rank(rank, shm_name, stamps_name, n, out):
    shm = shared_memory.SharedMemory(shm_name)
    stamps_shm = shared_memory.SharedMemory(stamps_name)
    stamps = np.ndarray((n,), dtype=np.int64, buffer=stamps_shm.buf, offset=rank * n * 8)
    flags = np.ndarray((_CHUNKS, _FLAGS // 8), dtype=np.int64, buffer=shm.buf)
    base = _CHUNKS * _FLAGS
    out.put(("ready", rank))
    cpu = time.thread_time_ns()
    try:
        for i in range(n):
            c = i % _CHUNKS
            while flags[c, 0] != i + 1:  # spin until the writer published put i here
                os.sched_yield()
            chunk = base + c * _CHUNK_BYTES
            lengths = flags[c, 1 + TP:4 + TP]
            body_len, offsets_len, data_len = (int(x) for x in lengths)
            body = shm.buf[chunk:chunk + body_len]
            offsets = shm.buf[chunk + body_len:chunk + body_len + offsets_len]
            start = chunk + ((body_len + offsets_len + 63) & -64)
            data = shm.buf[start:start + data_len]
            batch = codec.decode_payload([body, offsets, data])
            stamps[i] = time.monotonic_ns()
            del batch, body, offsets, data
            flags[c, 1 + rank] = i + 1  # read: the writer may reuse the chunk
        cpu = time.thread_time_ns() - cpu
    finally:
        del stamps, flags
        shm.close()
        stamps_shm.close()
    out.put(("done", cpu))


def bench_spin_ring(n):
    """put -> the last rank holds the batch (decoded), us per put, through the busy-polling
    ring; and each reader's CPU per put, us."""
    batch = bench_sync.make_requests()
    tag = uuid.uuid4().hex[:8]
    shm = shared_memory.SharedMemory(f"fdsync-spin-{tag}", create=True,
                                     size=_CHUNKS * (_FLAGS + _CHUNK_BYTES))
    stamps_shm = shared_memory.SharedMemory(f"fdsync-spin-st-{tag}", create=True,
                                            size=TP * n * 8)
    out = SPAWN.Queue()
    procs = [SPAWN.Process(target=_spin_rank, args=(r, shm.name, stamps_shm.name, n, out))
             for r in range(TP)]
    flags = np.ndarray((_CHUNKS, _FLAGS // 8), dtype=np.int64, buffer=shm.buf)
    view = shm.buf
    base = _CHUNKS * _FLAGS
    try:
        for p in procs:
            p.start()
        for _ in procs:
            out.get(timeout=60)
        time.sleep(0.3)
        rng = random.Random(1)
        started = np.empty(n, dtype=np.int64)
        for i in range(n):
            time.sleep(0.002 + rng.random() * 0.003)
            c = i % _CHUNKS
            deadline = time.monotonic() + 30
            while i >= _CHUNKS and (flags[c, 1:1 + TP] < i + 1 - _CHUNKS).any():
                if time.monotonic() > deadline:
                    raise RuntimeError("a spinning reader stopped reading")
                os.sched_yield()  # every reader must have read the chunk's last put
            started[i] = time.monotonic_ns()
            parts = codec.encode_parts(batch)
            body_len, offsets_len = len(parts.body), len(parts.offsets)
            chunk = base + c * _CHUNK_BYTES
            view[chunk:chunk + body_len] = parts.body
            view[chunk + body_len:chunk + body_len + offsets_len] = parts.offsets
            start = chunk + ((body_len + offsets_len + 63) & -64)
            parts.write_data(view[start:start + parts.data_size])
            flags[c, 1 + TP:4 + TP] = (body_len, offsets_len, parts.data_size)
            flags[c, 0] = i + 1  # written (x86-64 keeps the stores in order; a benchmark)
        cpus = [out.get(timeout=60)[1] for _ in procs]
        stamps = np.ndarray((TP, n), dtype=np.int64, buffer=stamps_shm.buf).copy()
        return (stamps.max(axis=0) - started)[10:] / 1000.0, [c / n / 1000.0 for c in cpus]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        del flags, view
        for segment in (shm, stamps_shm):
            segment.close()
            segment.unlink()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--puts", type=int, default=200, help="puts per path and round")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    floor = "floor: shared buffer + one semaphore post per rank"
    spin = "spin ring (vLLM-style: readers poll, one core each)"
    rows = {floor: [], spin: []}
    spin_cpu = []
    ring = [m for m in bench_sync.DELIVERY_MODES if m[0].startswith("ring")]
    for _ in range(args.rounds):
        rows[floor].extend(bench_floor(args.puts))
        held, cpu = bench_spin_ring(args.puts)
        rows[spin].extend(held)
        spin_cpu.extend(cpu)
        # the ring alone, as the floor runs alone: the other paths' ranks would share the
        # two cores with it
        for label, parts in bench_sync.bench_delivery(args.puts, modes=ring).items():
            rows.setdefault(f"library alone, {label}", []).extend(
                np.asarray(parts["held"]) / 1000.0)
        for label, parts in bench_sync.bench_delivery(args.puts).items():
            rows.setdefault(f"library, {label}", []).extend(np.asarray(parts["held"]) / 1000.0)
    print(f"put -> every rank holds a 64 x 512 batch, TP={TP}, {args.rounds} rounds of "
          f"{args.puts} puts per path, alternating by round (median, p99, us)")
    for label, samples in rows.items():
        print(f"  {label:<66} p50 {np.percentile(samples, 50):8.1f}   "
              f"p99 {np.percentile(samples, 99):8.1f}")
    print(f"  spin ring: each reader's CPU per put {np.mean(spin_cpu):.1f} us (mean over "
          f"readers and rounds; spent polling while it waits)")
    lib = next((v for k, v in rows.items() if k.startswith("library alone, ring")), None)
    if lib:
        for label in (floor, spin):
            print(f"  library alone, ring / {label.split(':')[0].split(' (')[0]}: p50 "
                  f"{np.percentile(lib, 50) / np.percentile(rows[label], 50):.2f}x")


if __name__ == "__main__":
    main()
