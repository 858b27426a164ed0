#!/usr/bin/env python3
"""Task-sync cost per step under FastDeploy's loops: the drop-in vs FastDeploy's manager queue.

    python scripts/benchmarks/bench_dropin.py                       # TP=2, 300 batches per mode
    python scripts/benchmarks/bench_dropin.py --tp 4 --batches 500

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

Prints per mode p50/p99 over all steps and over steps that took a batch, the mean over all
steps and the sum per step that took a batch (the whole cost, wherever a batch's receive
and decode fell: a mode that decodes at the take and one that decodes a step earlier differ
in "p50 batch", not here), and the ratios fd-manager / dropin measured in this run. These
machines are noisy: compare ratios, and
run it twice.
"""

import argparse
import multiprocessing as mp
import os
import threading
import time

# One BLAS thread per process, as the profiler runs its children: the simulated model step
# stands for a GPU launch and wait, and multithreaded BLAS spinning on 2 shared cores would
# starve every other process (measured: the sync drop-in fell to 40-60 batches/s).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

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

    def num_tasks(self):
        return self.q.num_tasks()

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

    # role="worker": joins at construction (else at its first read), so that no step of the
    # measured loop includes joining the TP group
    return EngineWorkerQueue(address=address, is_server=False, num_client=tp, client_id=rank,
                             role="worker")


def _model_step(step_ms, gil, a):
    end = time.perf_counter() + step_ms / 1000
    if gil:  # pure Python: holds the GIL for the whole step
        x = 0
        while time.perf_counter() < end:
            for i in range(200):
                x += i
        return a
    while time.perf_counter() < end:  # numpy releases the GIL in the matmul
        a = a @ a * (1.0 / 128)
    return a


def worker_main(mode, shape, address, tp, rank, barrier, signal, step_ms, gil, out):
    try:
        q = _open_worker_queue(mode, address, tp, rank)
    except BaseException as exc:
        out.put(("error", rank, repr(exc), None, None))
        return
    sync_ns, took, taken_at = [], [], {}
    clock = time.perf_counter_ns
    a = np.ones((128, 128), dtype=np.float32)
    busy = 0
    try:
        while True:
            if shape == "v20" and tp > 1:
                barrier.wait(TIMEOUT_S)  # the 2.0-era loop's barrier at the top
            t0 = clock()
            if rank == 0:
                found = q.exist_tasks() if shape == "develop" else q.num_tasks() > 0
                if found:
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
            now = time.time()
            for t in tasks:
                if not (isinstance(t, str) and t == STOP):
                    taken_at[t[0][0]["k"]] = now
            if any(isinstance(t, str) and t == STOP for t in tasks):
                break
            if tasks:
                busy = 1
            if shape != "v20" and not busy:
                # FastDeploy's idle branch: the TP barrier, then sleep 1 ms
                if tp > 1:
                    barrier.wait(TIMEOUT_S)
                time.sleep(0.001)
                continue
            busy = 0
            a = _model_step(step_ms, gil, a)
            # ...and its TP collective: FastDeploy's loop relies on it (or, idle, on its
            # second barrier) so that rank 0 cannot set the next step's signal before every
            # rank has read this step's.
            if tp > 1:
                barrier.wait(TIMEOUT_S)
    except BaseException as exc:
        out.put(("error", rank, repr(exc), None, None))
        return
    finally:
        q.cleanup()
    out.put(("ok", rank, np.array(sync_ns, dtype=np.int64), np.array(took), taken_at))


def _batch(k):
    reqs = [{"request_id": f"{k}-{i}", "k": k,
             "prompt_token_ids": np.arange(512, dtype=np.int64) + i} for i in range(64)]
    return reqs, len(reqs)


def run_mode(mode, shape, tp, n, rate, step_ms, gil, max_inflight):
    """One mode: returns (sync µs per step per rank, took mask, delivered/s, delivery ms).
    ``mode@k``: the drop-in with a server of ``max_inflight=k``."""
    ctx = mp.get_context("spawn")
    if "@" in mode:
        mode, max_inflight = mode.split("@")[0], int(mode.split("@")[1])
    if mode == "fd-manager":
        from fastdeploy_sync.profiling.fd_baseline import FDManagerQueue

        engine = FDManagerQueue(address=("127.0.0.1", 0), is_server=True, tp_size=tp)
        address = engine.address
        put, exist, close = engine.put_tasks, engine.exist_tasks, engine.close
    else:
        from fastdeploy_sync.fastdeploy import EngineWorkerQueue

        kw = {} if max_inflight is None else {"max_inflight": max_inflight}
        server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=tp, **kw)
        address = ("0.0.0.0", server.get_server_port())
        client = EngineWorkerQueue(address=address, is_server=False, num_client=tp, client_id=0)
        put, exist, close = client.put_tasks, client.exist_tasks, server.cleanup
    out = ctx.Queue()
    barrier, signal = ctx.Barrier(tp), ctx.Value("i", EMPTY)
    procs = [ctx.Process(target=worker_main, daemon=True,
                         args=(mode, shape, address, tp, r, barrier, signal, step_ms, gil, out))
             for r in range(tp)]
    for p in procs:
        p.start()
    errors = []
    put_at = {}

    def engine_loop():
        try:
            time.sleep(1.0)  # let every rank connect and settle
            t_next = time.monotonic()
            for k in range(n):
                # offered at `rate`: the k-th batch is due at start + k / rate
                time.sleep(max(0.0, t_next - time.monotonic()))
                t_next += 1.0 / rate
                while exist():  # FastDeploy's engine loop
                    time.sleep(0.001)
                put_at[k] = time.time()
                put(_batch(k), timeout=TIMEOUT_S)
            while exist():
                time.sleep(0.001)
            put(STOP, timeout=TIMEOUT_S)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=engine_loop)
    t.start()
    rows = [out.get(timeout=TIMEOUT_S * 4) for _ in procs]
    t.join(timeout=TIMEOUT_S)
    for p in procs:
        p.join(timeout=10)
    close()
    bad = [r for r in rows if r[0] != "ok"]
    if bad or errors:
        raise SystemExit(f"{mode}: failed: {bad or errors}")
    sync = np.concatenate([r[2] for r in rows]) / 1000.0  # µs
    took = np.concatenate([r[3] for r in rows])
    done = {k: max(r[4][k] for r in rows) for k in range(n)}  # every rank took it
    delivery = np.array([done[k] - put_at[k] for k in range(n)]) * 1000.0
    span = max(done.values()) - put_at[0]
    return sync, took, n / span, delivery


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--rate", type=float, default=100.0, help="batches offered per second")
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--gil-step", action="store_true",
                    help="a pure-Python model step that holds the GIL (default: numpy, "
                         "which releases it)")
    ap.add_argument("--shape", default="develop", choices=["develop", "v2x", "v20"])
    ap.add_argument("--max-inflight", type=int, default=None,
                    help="the drop-in server's max_inflight (default: the drop-in's default)")
    ap.add_argument("--modes", default="dropin,dropin-sync,fd-manager",
                    help="comma-separated; dropin@4 = the drop-in with max_inflight=4")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the modes alternately this many times; report each round")
    args = ap.parse_args()
    modes = args.modes.split(",")
    print(f"shape {args.shape}, TP={args.tp}, {args.batches} batches of 64 x 512 int64 token "
          f"ids offered at {args.rate:g}/s, {args.step_ms:g} ms "
          f"{'GIL-holding' if args.gil_step else 'GIL-releasing'} step; task sync per step per "
          f"rank (µs, barrier excluded); delivery = put -> every rank took it (ms)")
    print(f"{'mode':<12} {'steps':>6} {'p50 all':>8} {'p99 all':>8} {'p50 batch':>9} "
          f"{'p99 batch':>9} {'deliv/s':>8} {'deliv p50':>9} {'deliv p99':>9} {'mean all':>8} "
          f"{'per batch':>9}")
    stats = {}
    for _ in range(args.rounds):
        for mode in modes:
            sync, took, per_s, delivery = run_mode(mode, args.shape, args.tp, args.batches,
                                                   args.rate, args.step_ms, args.gil_step,
                                                   args.max_inflight)
            with_batch = sync[took]
            s = (np.percentile(sync, 50), np.percentile(sync, 99),
                 np.percentile(with_batch, 50), np.percentile(with_batch, 99), per_s,
                 np.percentile(delivery, 50), np.percentile(delivery, 99),
                 # the whole cost: wherever a batch's receive and decode fell, every step
                 # of the run, per step and per step that took a batch
                 np.mean(sync), np.sum(sync) / max(1, len(with_batch)))
            stats.setdefault(mode, []).append(s)
            print(f"{mode:<12} {len(sync):>6} {s[0]:>8.1f} {s[1]:>8.1f} {s[2]:>9.1f} "
                  f"{s[3]:>9.1f} {s[4]:>8.1f} {s[5]:>9.2f} {s[6]:>9.2f} {s[7]:>8.1f} "
                  f"{s[8]:>9.1f}", flush=True)
    if "fd-manager" in stats:
        f = np.median(np.array(stats["fd-manager"]), axis=0)
        for mode in modes:
            if mode == "fd-manager":
                continue
            d = np.median(np.array(stats[mode]), axis=0)
            print(f"medians, fd-manager / {mode}: sync p50 all {f[0] / d[0]:.1f}x, p99 all "
                  f"{f[1] / d[1]:.1f}x, p50 batch {f[2] / d[2]:.1f}x; throughput {mode} / "
                  f"fd-manager {d[4] / f[4]:.2f}; delivery p50 {d[5]:.2f} vs {f[5]:.2f} ms")


if __name__ == "__main__":
    main()
