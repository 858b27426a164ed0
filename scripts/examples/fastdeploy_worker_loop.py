#!/usr/bin/env python3
"""FastDeploy's engine and worker loops on the drop-in, with only the import changed.

    python scripts/examples/fastdeploy_worker_loop.py                    # TP=2, DP=1, async
    python scripts/examples/fastdeploy_worker_loop.py --tp 4 --dp 2
    DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM=1 python scripts/examples/fastdeploy_worker_loop.py

The engine is ``start_queue_service`` + ``insert_tasks`` (a server, then a client with
client_id=0 per DP group, ``while exist_tasks(): sleep(0.001)`` before each
``put_tasks((tasks, real_bsz))``); each worker is ``start_task_queue_service`` +
``event_loop_normal``'s task path. FastDeploy's TP barrier on GPU without the overlap
scheduler (``paddle.distributed.barrier``) and its ``exist_task_signal`` IPCSignal are stood
in for by a multiprocessing Barrier and Value per DP group (the overlap scheduler's and
XPU's barrier is the queue's own ``worker_process_tp_barrier``: testing/fd_loops.py, shape
``overlap``). At the end it prints, per DP
group, a digest of every rank's (step, request ids) and the verification line.
"""

import argparse
import hashlib
import multiprocessing as mp
import random
import threading
import time

import numpy as np

# FastDeploy: from fastdeploy.inter_communicator import EngineWorkerQueue
from fastdeploy_sync.fastdeploy import EngineWorkerQueue

EXIST, EMPTY = 1, 0  # FastDeploy's ExistTaskStatus
STOP = "stop"


def worker_main(port, tp, rank, dp_id, tp_barrier, exist_task_signal, step_ms, out):
    # start_task_queue_service
    task_queue = EngineWorkerQueue(address=("0.0.0.0", port), is_server=False, num_client=tp,
                                   client_id=rank, local_data_parallel_id=dp_id)
    rng = random.Random(rank)
    steps, reads, calls, step = [], 0, 0, 0
    try:
        while True:  # event_loop_normal, task path
            if rank == 0:
                if task_queue.exist_tasks():
                    exist_task_signal.value = EXIST
            if tp > 1:
                tp_barrier.wait(30)  # paddle.distributed.barrier(tp_group)
            req_dicts = None
            if exist_task_signal.value == EXIST or task_queue.read_finish_flag.get() == 1:
                tasks, read_finish = task_queue.get_tasks()
                calls += 1
                if read_finish:
                    exist_task_signal.value = EMPTY
                    reads += 1
                if any(t == STOP for t in tasks):
                    steps.append((step, STOP))
                    break
                req_dicts = []
                for req_dict, _bsz in tasks:
                    req_dicts.extend(req_dict)
                steps.append((step, tuple(r["request_id"] for r in req_dicts)))
            time.sleep(rng.uniform(0.5, 1.5) * step_ms / 1000)  # execute_model
            if tp > 1:
                # execute_model's TP collective (idle: the loop's second barrier). FastDeploy's
                # loop relies on it: rank 0 must not set the next step's signal before every
                # rank has read this step's.
                tp_barrier.wait(30)
            step += 1
    finally:
        task_queue.cleanup()
    digest = hashlib.sha256(repr(steps).encode()).hexdigest()[:16]
    out.put((dp_id, rank, digest, len(steps) - 1, reads, calls))


def engine_insert_loop(client, dp_id, n, rate_hz):
    for k in range(n):
        while client.exist_tasks():  # insert_tasks: one batch at a time
            time.sleep(0.001)
        reqs = [{"request_id": f"dp{dp_id}-{k}-{i}",
                 "prompt_token_ids": np.arange(512, dtype=np.int64) + k} for i in range(8)]
        client.put_tasks((reqs, len(reqs)))
        time.sleep(1.0 / rate_hz)
    client.put_tasks(STOP)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--rate", type=float, default=100.0, help="batches per second per DP group")
    ap.add_argument("--step-ms", type=float, default=2.0)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")

    # start_queue_service: the server, then the engine's own client per DP group
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=args.tp,
                               local_data_parallel_size=args.dp)
    port = server.get_server_port()
    out = ctx.Queue()
    procs, keep = [], []
    for d in range(args.dp):
        barrier, signal = ctx.Barrier(args.tp), ctx.Value("i", EMPTY)
        keep.append((barrier, signal))
        for r in range(args.tp):
            p = ctx.Process(target=worker_main, daemon=True,
                            args=(port, args.tp, r, d, barrier, signal, args.step_ms, out))
            p.start()
            procs.append(p)
    clients = [EngineWorkerQueue(address=("0.0.0.0", port), is_server=False,
                                 num_client=args.tp, client_id=0, local_data_parallel_id=d)
               for d in range(args.dp)]
    t0 = time.monotonic()
    threads = [threading.Thread(target=engine_insert_loop, args=(c, d, args.batches, args.rate))
               for d, c in enumerate(clients)]
    for t in threads:
        t.start()
    results = [out.get(timeout=120) for _ in procs]
    for t in threads:
        t.join(timeout=30)
    elapsed = time.monotonic() - t0
    for p in procs:
        p.join(timeout=10)
    server.cleanup()

    ok = True
    print(f"TP={args.tp} DP={args.dp}, {args.batches} batches per DP group in {elapsed:.2f} s")
    for d in range(args.dp):
        rows = sorted(r for r in results if r[0] == d)
        for _, rank, digest, nsteps, reads, calls in rows:
            print(f"  dp {d} rank {rank}: took {nsteps} batches in {calls} get_tasks calls, "
                  f"digest {digest}, last reader {reads}x")
        digests = {r[2] for r in rows}
        took_all = all(r[3] == args.batches for r in rows)
        # all_client_read: exactly one rank per get_tasks call
        one_reader = sum(r[4] for r in rows) == rows[0][5]
        print(f"  dp {d}: exactly one all_client_read per get_tasks call: "
              f"{'yes' if one_reader else 'NO'}")
        ok = ok and len(digests) == 1 and took_all and one_reader
    print(f"every rank took identical batches at identical steps: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
