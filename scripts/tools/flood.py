#!/usr/bin/env python3
"""Floods from inside the trust boundary against a live worker group: the group's rate
under each flood, as a fraction of its rate without it, and the engine's peak memory.

    python scripts/tools/flood.py [--seconds 8] [--rate 100 | --saturate] [--floods producer,tcp,killed,hog]

Each flood gets its own engine (this process), two TP ranks (TaskClient processes, async
prefetch) and a baseline phase of the same length without the flood, then the flood:
  producer  a same-user process sends QUERY, STATUS and garbage to the queue's producer
            endpoint as fast as it can, never reading a reply (the group: ipc)
  tcp       a process holding the worker key sends stale PINGs and HELLOs of ever new
            groups over CURVE as fast as it can, never reading a reply (the group: tcp
            with CURVE keys)
  hog       the control: a process that only spins a core (what any busy process on the
            same cores costs the group; the floods' own CPU use is part of their cost)
  killed    waves of producers each send 16 PUTs of 2 MiB into a full queue without
            waiting for the replies and are SIGKILLed (6 per wave; 384 PUTs in all; the
            group: ipc; with --saturate the queue stays full and their PUTs wait)
The engine puts batches of 64 x 512 int64 token ids at ``--rate`` per second; "the
group's rate" is the engine's own batches consumed by every rank per second (a producer's
batch enqueued while it was alive is not counted). Goal: >= 0.8 of the rate
without the flood and the engine's peak RSS <= +64 MiB (issue 15). Prints one line per
phase. Asserts nothing.
"""

import argparse
import multiprocessing as mp
import os
import signal
import tempfile
import threading
import time
import uuid

import numpy as np

from fastdeploy_sync import TaskClient, TaskQueue, TaskSyncError
from fastdeploy_sync.testing.peers import (
    PeakRSS,
    producer_endpoint_flooder,
    put_and_die,
    worker_key_flooder,
)
from fastdeploy_sync.wire.auth import create_keys

SPAWN = mp.get_context("spawn")


def rank_loop(name, tp, rank, endpoint, keys_dir, stop):
    """Take batches until the engine closes (or ``stop`` is set)."""
    if keys_dir:
        os.environ["FD_SYNC_KEYS_DIR"] = keys_dir
    with TaskClient(name, tp, rank, endpoint=endpoint) as client:
        while not stop.is_set():
            try:
                if not client.sync_step(timeout=60):
                    time.sleep(0.001)
            except TaskSyncError:
                return


def cpu_hog(out, rank, seconds):
    """The control: a process that spins a core for ``seconds`` and touches nothing of
    the library (what any busy process on the same cores does to the group)."""
    out.put(("flooded_started", rank, os.getpid()))
    deadline = time.monotonic() + seconds
    spins = 0
    while time.monotonic() < deadline:
        spins += 1
    out.put(("hogged", rank, spins))


def put_and_die_on(event, out, rank, endpoint, count, mib):
    """A pre-started producer: waits for ``event``, then puts and waits to be killed."""
    event.wait()
    put_and_die(out, rank, endpoint, count, mib)


class Group:
    """An engine in this process, two ranks, and a thread putting at a fixed rate."""

    def __init__(self, tcp, rate):
        self.name = "fl" + uuid.uuid4().hex[:8]
        self.keys = create_keys(os.path.join(tempfile.mkdtemp(), "keys"))["dir"] if tcp else None
        endpoint = "tcp://127.0.0.1:0" if tcp else None
        self.queue = TaskQueue(self.name, 2, endpoint=endpoint, keys_dir=self.keys)
        self.stop = SPAWN.Event()
        ep = self.queue.endpoint if tcp else None
        self.ranks = [SPAWN.Process(target=rank_loop, daemon=True,
                                    args=(self.name, 2, r, ep, self.keys, self.stop))
                      for r in range(2)]
        for p in self.ranks:
            p.start()
        self.rate = rate
        self.put_errors = 0
        self._halt = threading.Event()
        self._batch = [(np.arange(512, dtype=np.int64) + i, {"id": i}) for i in range(64)]
        self._thread = threading.Thread(target=self._put_loop, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while self.consumed() < 20 and time.monotonic() < deadline:
            time.sleep(0.05)

    def _put_loop(self):
        period = 1.0 / self.rate if self.rate else 0.0
        next_put = time.monotonic()
        while not self._halt.is_set():
            try:
                self.queue.put_tasks(self._batch, timeout=5)
            except TimeoutError:
                self.put_errors += 1
            except TaskSyncError:
                return
            if period:
                next_put += period
                time.sleep(max(0.0, next_put - time.monotonic()))

    def consumed(self):
        return min(self.queue.stats()["consumed"])

    def measure(self, seconds, during=None):
        """(batches/s consumed by every rank, engine peak RSS growth MiB) over ``seconds``."""
        peak = PeakRSS().start()
        start, t0 = self.consumed(), time.monotonic()
        if during is not None:
            during()
        time.sleep(max(0.0, seconds - (time.monotonic() - t0)))
        rate = (self.consumed() - start) / (time.monotonic() - t0)
        return rate, peak.growth_mib()

    def close(self):
        self._halt.set()
        self._thread.join(timeout=10)
        self.queue.close(timeout=5)
        self.stop.set()
        for p in self.ranks:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def run(flood, args):
    rate = 0.0 if args.saturate else args.rate
    group = Group(tcp=(flood == "tcp"), rate=rate)
    out = SPAWN.Queue()
    try:
        base_rate, base_mem = group.measure(args.seconds)
        remote_before = group.queue.stats().get("puts_remote", 0)
        procs = []
        if flood == "producer":
            def start():
                p = SPAWN.Process(target=producer_endpoint_flooder, daemon=True,
                                  args=(out, 0, group.queue.producer_endpoint, args.seconds))
                p.start()
                procs.append(p)
        elif flood == "hog":
            def start():
                p = SPAWN.Process(target=cpu_hog, daemon=True, args=(out, 0, args.seconds))
                p.start()
                procs.append(p)
        elif flood == "tcp":
            def start():
                p = SPAWN.Process(target=worker_key_flooder, daemon=True,
                                  args=(out, 0, group.queue.endpoint, group.name, 2,
                                        group.keys, args.seconds))
                p.start()
                procs.append(p)
        else:
            waves, per_wave, puts, mib = 4, 6, 16, 2
            events = [SPAWN.Event() for _ in range(waves)]
            for w in range(waves):  # started before the phase: their start-up is not measured
                for i in range(per_wave):
                    p = SPAWN.Process(target=put_and_die_on, daemon=True,
                                      args=(events[w], out, w * per_wave + i,
                                            group.queue.producer_endpoint, puts, mib))
                    p.start()
                    procs.append(p)
            time.sleep(3)

            def start():
                def waves_thread():
                    for w in range(waves):
                        events[w].set()
                        time.sleep(0.3)
                        for p in procs[w * per_wave:(w + 1) * per_wave]:
                            os.kill(p.pid, signal.SIGKILL)
                        time.sleep(max(0.0, args.seconds / waves - 0.3))
                threading.Thread(target=waves_thread, daemon=True).start()
        flood_rate, flood_mem = group.measure(args.seconds, during=start)
        for p in procs:
            p.join(timeout=args.seconds + 10)
            if p.is_alive():
                p.kill()
        stats = group.queue.stats()
        # the engine's own batches: what the producers got enqueued (alive then) is not
        # the group's work being slowed or not
        own_rate = flood_rate - (stats.get("puts_remote", 0) - remote_before) / args.seconds
        sent = 0
        while not out.empty():
            kind, _, payload = out.get()
            if kind == "flooded":
                sent += payload
        detail = {k: stats.get(k, 0) for k in ("garbage_frames", "status_requests", "stale",
                                               "rejected", "connections_cut", "puts_busy",
                                               "puts_dropped_gone", "puts_remote",
                                               "groups_retired", "sends_dropped_full")}
        pace = "as fast as it can" if not rate else f"{rate:g}/s"
        print(f"  {flood:<9} (engine puts {pace}) without: {base_rate:6.1f} batches/s, RSS "
              f"+{base_mem:5.1f} MiB | with: {own_rate:6.1f} batches/s "
              f"({own_rate / base_rate:.2f} of without), engine peak RSS +{flood_mem:5.1f} MiB"
              + (f" | flood messages sent {sent}" if sent else ""), flush=True)
        print(f"  {'':<9} {detail}", flush=True)
    finally:
        group.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rate", type=float, default=100.0,
                    help="batches the engine puts per second")
    ap.add_argument("--saturate", action="store_true",
                    help="the engine puts as fast as it can (the queue stays full: the "
                         "group's throughput, which a flood's CPU use on the same cores "
                         "lowers too)")
    ap.add_argument("--floods", default="producer,tcp,killed,hog")
    args = ap.parse_args()
    pace = "as fast as it can" if args.saturate else f"at {args.rate:g}/s"
    print(f"floods against a TP=2 group; {args.seconds:g} s per phase; engine puts 64 x 512 "
          f"int64 batches {pace}; {os.cpu_count()} cpus, load average "
          f"{os.getloadavg()[0]:.1f} at start", flush=True)
    for flood in args.floods.split(","):
        run(flood, args)


if __name__ == "__main__":
    main()
