#!/usr/bin/env python3
"""What `fastdeploy-sync status` scrapes cost a live worker group: the group's rate and
its delivery latency with a scraper asking the engine for its status at a given rate,
against the same group without one, phase by phase.

    python scripts/benchmarks/bench_status_scrape.py [--seconds 8] [--rate 100] [--scrapes 0,10,50,max] [--tcp]

One engine (this process) puts batches of 64 x 512 int64 token ids at ``--rate`` per
second into a TP=2 group (two TaskClient processes, async prefetch; ipc, or with ``--tcp``
tcp on loopback with CURVE keys, the scraper holding the worker keys); a scraper
process calls ``query_status()`` (a fresh connection each time, as the CLI does) at each
``--scrapes`` rate in turn (``max``: back to back). For each phase: scrapes per second
achieved, the group's rate (batches consumed by every rank per second), the delivery
latency put -> taken by rank 0 (p50, p99), and the engine process's CPU (all its threads;
per scrape: above the phase without scrapes). The first phase must be ``0``. Prints one line per phase. Asserts nothing.
"""

import argparse
import multiprocessing as mp
import os
import statistics
import time
import uuid

import numpy as np

from fastdeploy_sync import TaskClient, TaskQueue, TaskSyncError

SPAWN = mp.get_context("spawn")


def rank_loop(name, rank, endpoint, out, stop):
    """Rank ``rank``: take batches (a 1 ms idle loop), rank 0 reports put->taken latency."""
    with TaskClient(name, 2, rank, endpoint=endpoint) as client:
        out.put(("ready", rank))
        while not stop.is_set():
            try:
                tasks = client.sync_step(timeout=60)
            except TaskSyncError:
                return
            now = time.monotonic()
            if rank == 0 and tasks:
                out.put(("took", [now - put_at for put_at, _ in tasks]))
            if not tasks:
                time.sleep(0.001)


def scraper(endpoint, rate, stop, out):
    from fastdeploy_sync.engine.queue import query_status

    period = 0.0 if rate == "max" else 1.0 / float(rate)
    done = 0
    start = time.monotonic()
    while not stop.is_set():
        query_status(endpoint, timeout=2)
        done += 1
        if period:
            time.sleep(max(0.0, start + done * period - time.monotonic()))
    out.put(("scraped", done / (time.monotonic() - start)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--scrapes", default="0,10,50,max")
    ap.add_argument("--tcp", action="store_true", help="tcp on loopback with CURVE keys")
    args = ap.parse_args()
    endpoint = None
    if args.tcp:
        import socket
        import tempfile

        from fastdeploy_sync.wire.auth import create_keys

        keys = tempfile.mkdtemp(prefix="fdsync-keys-")
        create_keys(keys)
        os.environ["FD_SYNC_KEYS_DIR"] = keys  # inherited by the spawned processes
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    name = "scrape" + uuid.uuid4().hex[:6]
    out, stop = SPAWN.Queue(), SPAWN.Event()
    ids = np.arange(64 * 512, dtype=np.int64).reshape(64, 512)
    print(f"status scrapes against a TP=2 group ({'tcp, CURVE' if args.tcp else 'ipc'}); "
          f"engine puts 64 x 512 int64 batches at "
          f"{args.rate:g}/s; {args.seconds:g} s per phase; {os.cpu_count()} cpus, load average "
          f"{os.getloadavg()[0]:.1f} at start")
    with TaskQueue(name, 2, endpoint=endpoint) as queue:
        ranks = [SPAWN.Process(target=rank_loop, args=(name, r, endpoint, out, stop), daemon=True)
                 for r in range(2)]
        for p in ranks:
            p.start()
        for _ in ranks:
            assert out.get(timeout=60)[0] == "ready"
        for rate in args.scrapes.split(","):
            stop_scraper = SPAWN.Event()
            scr = None
            if rate != "0":
                scr = SPAWN.Process(target=scraper, args=(queue.endpoint, rate, stop_scraper, out),
                                    daemon=True)
                scr.start()
                time.sleep(0.5)
            consumed_before = min(queue.stats()["consumed"])
            cpu_before = time.process_time()
            start = time.monotonic()
            n = 0
            while time.monotonic() - start < args.seconds:
                queue.put_tasks((time.monotonic(), ids), timeout=30)
                n += 1
                time.sleep(max(0.0, start + n / args.rate - time.monotonic()))
            deadline = time.monotonic() + 10
            while queue.num_tasks() and time.monotonic() < deadline:
                time.sleep(0.001)
            elapsed = time.monotonic() - start
            cpu = (time.process_time() - cpu_before) / elapsed  # engine process, all threads
            consumed = min(queue.stats()["consumed"]) - consumed_before
            scraped = 0.0
            if scr is not None:
                stop_scraper.set()
            lat = []
            want = 1 + (scr is not None)
            while want:
                kind, value = out.get(timeout=30)
                if kind == "took":
                    lat.extend(value)
                    if len(lat) >= n:
                        want -= 1
                elif kind == "scraped":
                    scraped = value
                    want -= 1
            if scr is not None:
                scr.join(timeout=10)
            lat.sort()
            if rate == "0":
                idle_cpu = cpu
            extra = (f", {(cpu - idle_cpu) / scraped * 1e3:5.2f} ms engine CPU per scrape"
                     if scraped else "")
            print(f"  scrapes {rate:>4}/s (achieved {scraped:6.1f}/s): group {consumed / elapsed:6.1f}"
                  f" batches/s, put->taken p50 {statistics.median(lat) * 1e3:6.2f} ms, p99 "
                  f"{lat[int(len(lat) * 0.99)] * 1e3:6.2f} ms; engine CPU {cpu * 100:5.1f} %"
                  f"{extra}")
        stop.set()
        queue.close(timeout=2)
    for p in ranks:
        p.join(timeout=10)


if __name__ == "__main__":
    main()
