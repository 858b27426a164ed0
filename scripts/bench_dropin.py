#!/usr/bin/env python3
"""Task-sync cost per step under FastDeploy's loops: the drop-in vs FastDeploy's manager queue.

    python scripts/bench_dropin.py                       # TP=2, 300 batches per mode
    python scripts/bench_dropin.py --tp 4 --batches 500

Both modes run, in this one run, the same engine loop (``while exist_tasks(): sleep(0.001)``
then ``put_tasks((64 requests x 512 numpy token ids, bsz))`` at up to ``--rate`` batches/s)
and the same worker loop (``event_loop_normal``'s task path: rank 0 ``exist_tasks()`` sets
the group's signal, the TP barrier (a multiprocessing Barrier standing in for
``paddle.distributed.barrier``), every rank ``signal or read_finish_flag.get()`` then
``get_tasks()``, the last reader resets the signal, a ``--step-ms`` model step that
releases the GIL, then its TP collective, a second barrier). The barriers are the same in
both modes and are not counted: "task sync" is the time of the task-queue calls of a step
on one rank (rank 0's exist check + the flag check + get_tasks), over every step of every
rank.

Modes: ``dropin`` = ``fastdeploy_sync.fastdeploy.EngineWorkerQueue`` (async prefetch);
``dropin-sync`` = the same with ``DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM=1``; ``fd-manager`` =
``fastdeploy_sync.profiling.fd_baseline.FDManagerQueue`` (FastDeploy's manager queue, single
node: shared-memory exist flag; its calls and round trips are FastDeploy's).

Prints per mode p50/p99 over all steps and over steps that took a batch, and the ratios
fd-manager / dropin measured in this run. These machines are noisy: compare ratios, and
run it twice.
"""

import argparse
import multiprocessing as mp
import os
import threading
import time

import numpy as np

EXIST, EMPTY = 1, 0
STOP = "stop"
TIMEOUT_S = 60.0


class _FDManagerAdapter:
    """FDManagerQueue behind FastDeploy's attribute names (``read_finish_flag.get()``)."""

    def __init__(self, queue):
        self.q = queue
        self.read_finish_flag = self

    def get(self):
        return 1 if self.q.get_read_finish_flag() else 0  # 1 round trip, as FastDeploy

    def exist_tasks(self):
        return self.q.exist_tasks()

    def get_tasks(self):
        return self.q.get_tasks()

    def cleanup(self):
        self.q.close()


def _open_worker_queue(mode, address, tp, rank):
    if mode == "fd-manager":
        from fastdeploy_sync.profiling.fd_baseline import FDManagerQueue

        return _FDManagerAdapter(FDManagerQueue(address=address, tp_size=tp, tp_rank=rank,
                                                connect_timeout=TIMEOUT_S))
    os.environ["DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM"] = "1" if mode == "dropin-sync" else "0"
    from fastdeploy_sync.fastdeploy import EngineWorkerQueue

    return EngineWorkerQueue(address=address, is_server=False, num_client=tp, client_id=rank)


def worker_main(mode, address, tp, rank, barrier, signal, step_ms, out):
    try:
        q = _open_worker_queue(mode, address, tp, rank)
    except BaseException as exc:
        out.put(("error", rank, repr(exc), None))
        return
    sync_ns, took = [], []
    clock = time.perf_counter_ns
    a = np.ones((128, 128), dtype=np.float32)
    try:
        while True:
            t0 = clock()
            if rank == 0 and q.exist_tasks():
                signal.value = EXIST
            t1 = clock()
            if tp > 1:
                barrier.wait(TIMEOUT_S)
            t2 = clock()
            tasks = []
            if signal.value == EXIST or q.read_finish_flag.get() == 1:
                tasks, read_finish = q.get_tasks()
                if read_finish:
                    signal.value = EMPTY
            t3 = clock()
            sync_ns.append((t1 - t0) + (t3 - t2))
            took.append(bool(tasks))
            if any(isinstance(t, str) and t == STOP for t in tasks):
                break
            # the model step: numpy releases the GIL in the matmul, like a GPU launch + wait
            end = time.perf_counter() + step_ms / 1000
            while time.perf_counter() < end:
                a = a @ a * (1.0 / 128)
            # ...and its TP collective: FastDeploy's loop relies on it (or, idle, on its second
            # barrier) so that rank 0 cannot set the next step's signal before every rank has
            # read this step's. Without it the loop races on its own signal.
            if tp > 1:
                barrier.wait(TIMEOUT_S)
    except BaseException as exc:
        out.put(("error", rank, repr(exc), None))
        return
    finally:
        q.cleanup()
    out.put(("ok", rank, np.array(sync_ns, dtype=np.int64), np.array(took)))


def _batch(k):
    reqs = [{"request_id": f"{k}-{i}", "prompt_token_ids": np.arange(512, dtype=np.int64) + i}
            for i in range(64)]
    return reqs, len(reqs)


def run_mode(mode, tp, n, rate, step_ms):
    ctx = mp.get_context("spawn")
    if mode == "fd-manager":
        from fastdeploy_sync.profiling.fd_baseline import FDManagerQueue

        engine = FDManagerQueue(address=("127.0.0.1", 0), is_server=True, tp_size=tp)
        address = engine.address
        put, exist, close = engine.put_tasks, engine.exist_tasks, engine.close
    else:
        from fastdeploy_sync.fastdeploy import EngineWorkerQueue

        server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=tp)
        address = ("0.0.0.0", server.get_server_port())
        client = EngineWorkerQueue(address=address, is_server=False, num_client=tp, client_id=0)
        put, exist, close = client.put_tasks, client.exist_tasks, server.cleanup
    out = ctx.Queue()
    barrier, signal = ctx.Barrier(tp), ctx.Value("i", EMPTY)
    procs = [ctx.Process(target=worker_main, daemon=True,
                         args=(mode, address, tp, r, barrier, signal, step_ms, out))
             for r in range(tp)]
    for p in procs:
        p.start()
    errors = []

    def engine_loop():
        try:
            batches = [_batch(k) for k in range(8)]
            for k in range(n):
                t_next = time.monotonic() + 1.0 / rate
                while exist():
                    time.sleep(0.001)
                put(batches[k % 8], timeout=TIMEOUT_S)
                time.sleep(max(0.0, t_next - time.monotonic()))
            while exist():
                time.sleep(0.001)
            put(STOP, timeout=TIMEOUT_S)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=engine_loop)
    t0 = time.monotonic()
    t.start()
    rows = [out.get(timeout=TIMEOUT_S * 2) for _ in procs]
    t.join(timeout=TIMEOUT_S)
    elapsed = time.monotonic() - t0
    for p in procs:
        p.join(timeout=10)
    close()
    bad = [r for r in rows if r[0] != "ok"]
    if bad or errors:
        raise SystemExit(f"{mode}: failed: {bad or errors}")
    sync = np.concatenate([r[2] for r in rows]) / 1000.0  # µs
    took = np.concatenate([r[3] for r in rows])
    return sync, took, elapsed


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--rate", type=float, default=100.0, help="batches per second at most")
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--modes", default="dropin,dropin-sync,fd-manager")
    args = ap.parse_args()
    modes = args.modes.split(",")
    print(f"TP={args.tp}, {args.batches} batches of 64 x 512 int64 token ids, up to "
          f"{args.rate:g}/s, {args.step_ms:g} ms step; task sync per step per rank (µs), "
          f"barrier excluded")
    print(f"{'mode':<12} {'steps':>6} {'p50 all':>9} {'p99 all':>9} {'p50 batch':>10} "
          f"{'p99 batch':>10} {'wall s':>7}")
    stats = {}
    for mode in modes:
        sync, took, elapsed = run_mode(mode, args.tp, args.batches, args.rate, args.step_ms)
        with_batch = sync[took]
        s = (np.percentile(sync, 50), np.percentile(sync, 99),
             np.percentile(with_batch, 50), np.percentile(with_batch, 99))
        stats[mode] = s
        print(f"{mode:<12} {len(sync):>6} {s[0]:>9.1f} {s[1]:>9.1f} {s[2]:>10.1f} {s[3]:>10.1f} "
              f"{elapsed:>7.2f}")
    if "fd-manager" in stats:
        for mode in modes:
            if mode == "fd-manager":
                continue
            f, d = stats["fd-manager"], stats[mode]
            print(f"fd-manager / {mode}: p50 all {f[0] / d[0]:.0f}x, p99 all {f[1] / d[1]:.0f}x, "
                  f"p50 batch {f[2] / d[2]:.0f}x, p99 batch {f[3] / d[3]:.0f}x")


if __name__ == "__main__":
    main()
