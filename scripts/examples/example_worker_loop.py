#!/usr/bin/env python3
"""A FastDeploy-shaped worker event loop on fastdeploy_sync: the main demo.

One engine process puts batches of requests (token ids as numpy arrays) at a steady rate;
``--tp`` worker processes run ``event_loop_normal`` as FastDeploy's worker does:
rank 0 checks for tasks, the TP barrier, every rank takes, a simulated model step.

    python scripts/examples/example_worker_loop.py                 # async prefetch (default)
    DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM=1 python scripts/examples/example_worker_loop.py   # sync

At the end it prints, per rank, the batches taken, the per-step time of check+take and
of the barrier wait, and checks that every rank took identical batches at identical
steps (a digest of (step, batch) pairs per rank).
"""

import argparse
import hashlib
import multiprocessing as mp
import time

import numpy as np

from fastdeploy_sync import TaskClient, TaskQueue


class Worker:
    """The parts of a FastDeploy worker that touch the engine, plus a stand-in model."""

    def __init__(self, name, tp_size, tp_rank, step_ms):
        self.tp_size, self.tp_rank = tp_size, tp_rank
        # DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM decides async vs sync; nothing else changes.
        self.task_client = TaskClient(name, tp_size, tp_rank)
        self.step_ms = step_ms
        self.running = {}  # request_id -> tokens still to generate
        self.weights = np.random.default_rng(tp_rank).standard_normal((256, 256)).astype(np.float32)

    # The pair FastDeploy's loop calls; everything async/sync lives behind them.
    def _exist_tasks_from_engine(self) -> bool:
        return self.task_client.exist_tasks()

    def _get_tasks_from_engine(self):
        return self.task_client.get_tasks()

    def _tp_barrier_wait(self):
        self.task_client.barrier(timeout=60)

    def execute_model(self):
        """Stand-in model step: numpy matmuls (release the GIL) for about step_ms."""
        end = time.perf_counter() + self.step_ms / 1000
        x = self.weights
        while time.perf_counter() < end:
            x = np.tanh(x @ self.weights)
        for request_id in list(self.running):
            self.running[request_id] -= 1
            if self.running[request_id] <= 0:
                del self.running[request_id]

    def event_loop_normal(self, n_batches, report):
        own_ns, wait_ns, steps_with_tasks, digest = [], [], 0, hashlib.sha256()
        taken = step = 0
        clock = time.perf_counter_ns
        while taken < n_batches:
            t0 = clock()
            if self.tp_rank == 0:
                self._exist_tasks_from_engine()  # latches "take up to N" for this step
            t1 = clock()
            if self.tp_size > 1:
                self._tp_barrier_wait()
            t2 = clock()
            tasks, read_finished = self._get_tasks_from_engine()
            own_ns.append((t1 - t0) + (clock() - t2))
            wait_ns.append(t2 - t1)
            for requests, real_bsz in tasks:
                for request in requests[:real_bsz]:
                    self.running[request["request_id"]] = request["max_tokens"]
                digest.update(f"{step}:{requests[0]['request_id']};".encode())
                taken += 1
            steps_with_tasks += bool(tasks)
            step += 1
            if not self.running:
                time.sleep(0.001)  # idle, as FastDeploy's loop does
                continue
            self.execute_model()
        report.put((self.tp_rank, dict(steps=step, steps_with_tasks=steps_with_tasks,
                                       digest=digest.hexdigest()[:16], own_ns=own_ns,
                                       wait_ns=wait_ns,
                                       mode="async" if self.task_client.async_prefetch else "sync")))
        self.task_client.close()


def worker_main(name, tp_size, tp_rank, step_ms, n_batches, report):
    Worker(name, tp_size, tp_rank, step_ms).event_loop_normal(n_batches, report)


def engine_main(name, tp_size, n_batches, rate, batch, prompt_len, report):
    rng = np.random.default_rng(0)
    with TaskQueue(name, tp_size, max_inflight=8) as queue:
        t0 = time.perf_counter()
        for b in range(n_batches):
            requests = [{"request_id": f"b{b}-r{i}",
                         "prompt_token_ids": rng.integers(0, 100_000, prompt_len, dtype=np.int64),
                         "max_tokens": int(rng.integers(4, 32))} for i in range(batch)]
            queue.put_tasks((requests, batch), timeout=60)
            time.sleep(max(0.0, t0 + (b + 1) / rate - time.perf_counter()))
        while queue.num_tasks():  # keep serving until every rank has taken everything
            time.sleep(0.01)
        report.put(("engine", queue.stats()))


def main():
    ap = argparse.ArgumentParser(description="FastDeploy-shaped worker loop on fastdeploy_sync")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--rate", type=float, default=100.0, help="batches per second")
    ap.add_argument("--batch", type=int, default=16, help="requests per batch")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--step-ms", type=float, default=2.0)
    args = ap.parse_args()

    ctx = mp.get_context("spawn")
    report = ctx.Queue()
    name = f"demo{int(time.time() * 1000) % 10**9}"
    procs = [ctx.Process(target=worker_main,
                         args=(name, args.tp, r, args.step_ms, args.batches, report))
             for r in range(args.tp)]
    procs.append(ctx.Process(target=engine_main, args=(name, args.tp, args.batches, args.rate,
                                                       args.batch, args.prompt_len, report)))
    for p in procs:
        p.start()
    results = {}
    try:
        while len(results) < args.tp + 1:
            key, value = report.get(timeout=120)
            results[key] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    engine = results.pop("engine")
    print(f"engine: put {engine['last_seq']} batches of {args.batch} requests x "
          f"{args.prompt_len} tokens at {args.rate:g}/s; consumed per rank {engine['consumed']}")
    for rank in sorted(results):
        r = results[rank]
        own = np.asarray(r["own_ns"]) / 1000
        wait = np.asarray(r["wait_ns"]) / 1000
        print(f"rank {rank} ({r['mode']}): {r['steps']} steps, {r['steps_with_tasks']} took tasks; "
              f"per step: check+take p50 {np.percentile(own, 50):.1f} us p99 "
              f"{np.percentile(own, 99):.1f} us, barrier wait p50 {np.percentile(wait, 50):.1f} us; "
              f"digest {r['digest']}")
    print("(the barrier wait includes waiting for the slower rank's model step; "
          "fastdeploy-sync's own cost is check+take plus a few us of barrier)")
    same = len({r["digest"] for r in results.values()}) == 1
    print("every rank took identical batches at identical steps:", "yes" if same else "NO")
    raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()
