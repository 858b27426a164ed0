#!/usr/bin/env python3
"""Consistency soak across rebuilds: worker processes that build their clients again
in-process at random points, and an engine that restarts at random (closed cleanly, or
SIGKILLed), while batches flow.

    python scripts/tools/soak_rebuild.py --batches 100000

Real processes: one engine process per engine life (the driver tells it what to put, and
ends the life with close() or SIGKILL), and ``--tp`` worker processes, each running a
FastDeploy-shaped loop (rank 0 checks, barrier, every rank takes, a random model step)
that closes its ``TaskClient`` and builds a new one after every error, and at random
(``--rebuild-every`` steps on average, per rank).

Checked, and printed: for every group incarnation, every rank passed the same barriers and
took the same batches at each ("every rank identical"); within an incarnation batches come
in the order they were put ("in order"); every batch id 0..N-1 was taken by exactly one
incarnation ("none lost or twice"). A batch an engine life did not get consumed (its group
retired, the engine closed or was killed) is put again in a later life, but only once
every worker client that could still take it has closed and reported that it did not.
Exits non-zero on the first violation.
"""

import argparse
import collections
import multiprocessing as mp
import os
import queue as queue_module
import random
import signal
import sys
import time
import uuid

from fastdeploy_sync import cleanup

FAST = (0.2, 1.0)  # heartbeat interval, timeout (s): restarts are noticed within ~1 s


def engine_life(commands, replies, name, tp, life):
    """One engine life: put what the driver says (``("put", batch id, put index)``) and
    reply ``("put", id, ok)``; ``("close", timeout)`` ends the life cleanly."""
    import numpy as np

    from fastdeploy_sync import Heartbeat, TaskQueue

    with TaskQueue(name, tp, max_inflight=8, heartbeat=Heartbeat(*FAST)) as q:
        replies.put(("up", life, os.getpid()))
        while True:
            cmd = commands.get()
            if cmd[0] == "close":
                q.close(timeout=cmd[1])
                replies.put(("closed", life, None))
                return
            _, batch_id, index = cmd
            tokens = np.arange(batch_id, batch_id + 64 + batch_id % 7, dtype=np.int64)
            try:
                q.put_tasks(((batch_id, life, index), tokens), timeout=0.5)
                ok = True
            except TimeoutError:  # no group takes right now: the driver puts it again
                ok = False
            replies.put(("put", batch_id, ok))


def worker(out, stop, rank, name, tp, seed, rebuild_every, async_prefetch):
    """Step, rebuild after every error and at random; report every client's life:
    ("opened", rank, serial) when built, ("closed", rank, (serial, incarnation, steps,
    error)) when closed, steps being [(barrier count, [(id, life, index), ...]), ...]."""
    from fastdeploy_sync import Heartbeat, TaskClient, TaskSyncError
    from fastdeploy_sync.testing.processes import engine_cause

    os.environ["FD_SYNC_ATTACH_TIMEOUT"] = "3"
    rng = random.Random(seed * 1000 + rank)
    serial = 0
    while not stop.is_set():
        # Announced before the client exists: the driver must count a client open from
        # before any engine can welcome it (an announcement after the constructor could
        # still be in flight when the driver ends the engine's life, and a batch this
        # client takes would be put again meanwhile).
        serial += 1
        out.put(("opened", rank, serial))
        try:
            client = TaskClient(name, tp, rank, async_prefetch=async_prefetch,
                                heartbeat=Heartbeat(*FAST))
        except (TaskSyncError, TimeoutError):
            out.put(("closed", rank, (serial, None, [], None)))
            time.sleep(rng.random() * 0.05)
            continue
        steps, step, error = [], 0, None
        try:
            while not stop.is_set():
                if rank == 0:
                    client.exist_tasks()
                client.barrier(timeout=5)
                step += 1
                taken = []
                for key, tokens in client.get_tasks()[0]:
                    assert int(tokens[0]) == key[0] and len(tokens) == 64 + key[0] % 7
                    taken.append(key)
                steps.append((step, taken))
                time.sleep(rng.random() * 0.001)  # the model step
                if rng.random() < 1.0 / rebuild_every:
                    error = "rebuilt on purpose"
                    break
        except TaskSyncError as exc:
            error = type(engine_cause(exc)).__name__
        time.sleep(rng.random() * 0.05)  # the server's own clean-up, old client still open
        client.close()
        out.put(("closed", rank, (serial, client.incarnation,
                                  [s for s in steps if s[1]] if len(steps) > 2000 else steps,
                                  error)))


class Driver:
    def __init__(self, args):
        self.args = args
        self.ctx = mp.get_context("spawn")
        self.name = "soakrb" + uuid.uuid4().hex[:8]
        self.out = self.ctx.Queue()
        self.stop = self.ctx.Event()
        self.open = {r: set() for r in range(args.tp)}  # client serials open, per rank
        self.lives = collections.defaultdict(dict)  # incarnation -> {rank: steps}
        self.taken = collections.Counter()  # batch id -> incarnations that took it
        self.errors = collections.Counter()
        self.fresh = collections.deque(range(args.batches))  # ids never put
        self.again = collections.deque()  # ids to put again, in id order
        self.pending = []  # (id, {rank: serials that must close first})
        self.in_life = set()  # ids put in the current life
        self.put_index = 0
        self.restarts = collections.Counter()

    def handle(self, block_s=0.0):
        try:
            kind, rank, payload = self.out.get(timeout=block_s) if block_s else \
                self.out.get_nowait()
        except queue_module.Empty:
            return False
        if kind == "opened":
            self.open[rank].add(payload)
        elif kind == "closed":
            serial, incarnation, steps, error = payload
            self.open[rank].discard(serial)
            if incarnation is None:
                return True  # its constructor failed: it never served
            if error:
                self.errors[error] += 1
            mine = self.lives[incarnation]
            if rank in mine:
                raise SystemExit(f"FAIL: rank {rank} served incarnation {incarnation:#x} "
                                 f"with two client objects")
            mine[rank] = steps
            if rank == 0:
                for _, keys in steps:
                    for key in keys:
                        self.taken[key[0]] += 1
        elif kind == "error":
            raise SystemExit(f"FAIL: worker rank {rank} crashed: {payload}")
        return True

    def end_life(self, engine, commands, replies):
        """End the current life (close or SIGKILL); its unconsumed batches become pending
        until every client open now has closed."""
        if random.random() < self.args.kill_fraction:
            self.restarts["killed"] += 1
            os.kill(engine.pid, signal.SIGKILL)
        else:
            self.restarts["closed"] += 1
            commands.put(("close", random.random()))
        engine.join(timeout=30)
        # every client the life could have welcomed announced itself before it was built:
        # read what has arrived before deciding who must close first
        while self.handle(block_s=0.05):
            pass
        must_close = {r: set(s) for r, s in self.open.items()}
        self.pending.extend((i, must_close) for i in self.in_life)
        self.in_life = set()

    def settle(self):
        """Put pending ids back in line once every client that could take them closed."""
        still = []
        ready = []
        for batch_id, must_close in self.pending:
            if any(must_close[r] & self.open[r] for r in must_close):
                still.append((batch_id, must_close))
            elif not self.taken[batch_id]:
                ready.append(batch_id)
        self.pending = still
        self.again.extend(sorted(ready))

    def run(self):
        a = self.args
        workers = [self.ctx.Process(target=worker, args=(self.out, self.stop, r, self.name,
                                                         a.tp, a.seed, a.rebuild_every,
                                                         not a.sync), daemon=True)
                   for r in range(a.tp)]
        for p in workers:
            p.start()
        t0 = time.monotonic()
        life = 0
        last_print = t0
        try:
            while self.fresh or self.again or self.pending or life == 0:
                life += 1
                commands, replies = self.ctx.Queue(), self.ctx.Queue()
                engine = self.ctx.Process(target=engine_life, daemon=True,
                                          args=(commands, replies, self.name, a.tp, life))
                engine.start()
                kind, _, _ = replies.get(timeout=60)
                assert kind == "up"
                life_end = time.monotonic() + random.uniform(0.5, a.max_life_s)
                while time.monotonic() < life_end:
                    while self.handle():
                        pass
                    self.settle()
                    line = self.again or self.fresh
                    if not line:
                        self.handle(block_s=0.05)
                        if not self.pending:
                            break
                        continue
                    batch_id = line[0]
                    self.put_index += 1
                    commands.put(("put", batch_id, self.put_index))
                    kind, got_id, ok = replies.get(timeout=60)
                    assert kind == "put" and got_id == batch_id
                    if ok:
                        line.popleft()
                        self.in_life.add(batch_id)
                    time.sleep(random.random() * 0.0005)
                self.end_life(engine, commands, replies)
                if time.monotonic() - last_print > 10:
                    last_print = time.monotonic()
                    done = sum(1 for i in range(a.batches) if self.taken[i])
                    print(f"  {time.monotonic() - t0:6.0f} s: life {life}, {done} of "
                          f"{a.batches} batches taken, {len(self.lives)} incarnations, "
                          f"restarts {dict(self.restarts)}", flush=True)
        finally:
            self.stop.set()
            deadline = time.monotonic() + 60
            while any(self.open.values()) and time.monotonic() < deadline:
                self.handle(block_s=0.1)
            for p in workers:
                p.join(timeout=20)
                if p.is_alive():
                    p.kill()
            while self.handle(block_s=0.5):
                pass
        return time.monotonic() - t0, life

    def check(self):
        a = self.args
        problems = []
        steps_total = 0
        for inc, per_rank in self.lives.items():
            ranks = [per_rank.get(r) for r in range(a.tp)]
            if any(s is None for s in ranks):
                if any(any(keys for _, keys in s) for s in ranks if s):
                    problems.append(f"incarnation {inc:#x}: ranks {[r for r in range(a.tp) if ranks[r] is None]} "
                                    f"never reported but others took batches in it")
                continue
            # reports longer than 2000 steps keep only taking steps, on every rank alike
            if any(s != ranks[0] for s in ranks):
                problems.append(f"incarnation {inc:#x}: ranks differ ({[len(s) for s in ranks]} steps)")
            keys = [k for _, ks in ranks[0] for k in ks]
            steps_total += len(ranks[0])
            index = [k[2] for k in keys]
            if index != sorted(index) or len(set(index)) != len(index):
                problems.append(f"incarnation {inc:#x}: batches out of put order")
        twice = [i for i, n in self.taken.items() if n > 1]
        lost = [i for i in range(a.batches) if not self.taken[i]]
        if twice:
            problems.append(f"{len(twice)} batch(es) taken by two incarnations, e.g. {twice[:5]}")
        if lost:
            problems.append(f"{len(lost)} batch(es) never taken, e.g. {lost[:5]}")
        return problems, steps_total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=20000)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--sync", action="store_true", help="DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM=1")
    ap.add_argument("--rebuild-every", type=float, default=2000,
                    help="average steps between a rank's rebuilds on purpose")
    ap.add_argument("--max-life-s", type=float, default=6.0, help="longest engine life")
    ap.add_argument("--kill-fraction", type=float, default=0.5,
                    help="share of engine restarts by SIGKILL (the rest close cleanly)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    random.seed(args.seed)
    driver = Driver(args)
    print(f"soak_rebuild: {args.batches} batches, tp={args.tp}, "
          f"{'sync' if args.sync else 'async'}, a rank rebuilds every ~{args.rebuild_every:g} "
          f"steps, engine lives 0.5-{args.max_life_s:g} s ({args.kill_fraction:.0%} killed)",
          flush=True)
    elapsed, lives = driver.run()
    # engines killed on purpose leave their names (ack board, socket files); the next run
    # of a name reclaims them, but each soak has a name of its own: remove them now
    removed = cleanup.remove(cleanup.scan(driver.name))
    problems, steps = driver.check()
    rebuilds = driver.errors
    print(f"{args.batches} batches in {elapsed:.0f} s over {lives} engine lives "
          f"({dict(driver.restarts)}) and {len(driver.lives)} group incarnations, "
          f"{steps} barrier steps; client lives ended by {dict(rebuilds)}; "
          f"{len(removed)} name(s) of killed engines removed")
    if problems:
        for p in problems[:20]:
            print("FAIL:", p)
        sys.exit(1)
    print("every rank identical, in order, none lost or twice")


if __name__ == "__main__":
    main()
