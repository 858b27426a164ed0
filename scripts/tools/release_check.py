#!/usr/bin/env python3
"""Release at close, not at the next garbage collection: what a worker and an engine hold
over many lives, with the collector disabled in both.

    python scripts/tools/release_check.py --client-lives 1000 --engine-lives 100

Two phases, real processes, one worker process (tp_size 1) and this process as the engine:

* client lives: one engine; the worker builds a ``TaskClient``, takes one step (a small
  batch and an 8 MiB one, read from the ring and the pool), and closes it, ``--client-lives``
  times;
* engine lives: ``--engine-lives`` times a new ``TaskQueue``; the worker builds its client
  for it, takes one batch, and closes while an 8 MiB batch is still unfinished, so that the
  engine retires the group and hands the batch back in a ``GroupLost`` event, which the
  engine keeps (as one that re-queues requests later would); then the queue closes.

Printed every tenth of a phase, for the worker and the engine: descriptors open,
mappings of this queue's shared memory (count and MiB, unlinked ones included), RSS (the
engine's grows by the events it keeps: their arrays are copies, printed beside it), and
the bytes of this queue's names in ``/dev/shm``. Flat columns are the expected result.
"""

import argparse
import gc
import multiprocessing as mp
import os
import time
import uuid

SMALL = 64
BIG = 1 << 20  # float64: 8 MiB, through the large-batch pool


def counts(name):
    """``(descriptors, our mappings, their MiB, RSS MiB, /dev/shm MiB of our names)``."""
    fds = len(os.listdir("/proc/self/fd"))
    maps = mapped = 0
    with open("/proc/self/maps") as lines:
        for line in lines:
            if f"fdsync.{name}." in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                maps += 1
                mapped += hi - lo
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    shm = 0
    for entry in os.listdir("/dev/shm"):
        if f"fdsync.{name}." in entry:
            try:
                shm += os.stat(f"/dev/shm/{entry}").st_blocks * 512
            except FileNotFoundError:
                pass
    return fds, maps, mapped >> 20, rss >> 10, shm >> 20


def worker(conn, name):
    """Per message: ``("take", close_after)`` builds a client, takes one step's batches,
    says ``took``, closes it (after being told, when ``close_after``) and answers with its
    counts; ``"exit"`` ends."""
    from fastdeploy_sync import TaskClient

    gc.disable()
    while True:
        msg = conn.recv()
        if msg == "exit":
            return
        client = TaskClient(name, 1, 0)
        deadline = time.monotonic() + 30
        tasks = []
        while not tasks and time.monotonic() < deadline:
            client.wait_for_tasks(0.05)
            client.barrier()
            tasks, _ = client.get_tasks()
        conn.send("took" if tasks else "nothing")
        del tasks
        if msg[1]:
            conn.recv()
        client.close()
        del client
        conn.send(counts(name))


def row(phase, life, worker_counts, engine_counts, kept=0):
    w, e = worker_counts, engine_counts
    print(f"{phase:6s} {life:5d} | worker fds {w[0]:3d} maps {w[1]:2d} ({w[2]:4d} MiB) "
          f"rss {w[3]:4d} MiB | engine fds {e[0]:3d} maps {e[1]:2d} ({e[2]:4d} MiB) "
          f"rss {e[3]:5d} MiB, events kept {kept >> 20:5d} MiB | /dev/shm {e[4]:4d} MiB",
          flush=True)


def main():
    import numpy as np

    from fastdeploy_sync import TaskQueue

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--client-lives", type=int, default=1000)
    parser.add_argument("--engine-lives", type=int, default=100)
    parser.add_argument("--pool-mb", default="16",
                        help="FD_SYNC_SHM_POOL_MB for this run (default 16: each group "
                             "creates its pool, pre-faulted, at its first large batch)")
    args = parser.parse_args()
    os.environ["FD_SYNC_SHM_POOL_MB"] = args.pool_mb  # before the engine and the worker start
    name = "rel" + uuid.uuid4().hex[:10]
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=worker, args=(there, name), daemon=True)
    proc.start()
    gc.disable()
    started = time.monotonic()
    try:
        every = max(1, args.client_lives // 10)
        with TaskQueue(name, 1) as engine:
            for life in range(1, args.client_lives + 1):
                here.send(("take", False))
                engine.put_tasks([np.arange(SMALL), np.ones(BIG)], timeout=30)
                assert here.recv() == "took", f"client life {life}: nothing taken"
                worker_counts = here.recv()
                engine.group_events.get(timeout=30)  # retired by the client's goodbye
                if life == 1 or life % every == 0:
                    row("client", life, worker_counts, counts(name))
        events = []
        every = max(1, args.engine_lives // 10)
        for life in range(1, args.engine_lives + 1):
            with TaskQueue(name, 1) as engine:
                here.send(("take", True))
                engine.put_tasks([np.arange(SMALL)], timeout=30)
                assert here.recv() == "took", f"engine life {life}: nothing taken"
                engine.put_tasks([np.ones(BIG)], timeout=30)  # never taken
                here.send("close")
                worker_counts = here.recv()
                events.append(engine.group_events.get(timeout=30))
                assert events[-1].unfinished, events[-1]
            if life == 1 or life % every == 0:
                kept = sum(a.nbytes for ev in events for b in ev.unfinished for a in b.tasks)
                row("engine", life, worker_counts, counts(name), kept)
        print(f"{len(events)} GroupLost events kept; {time.monotonic() - started:.0f} s")
    finally:
        here.send("exit")
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


if __name__ == "__main__":
    main()
