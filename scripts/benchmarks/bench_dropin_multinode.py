#!/usr/bin/env python3
"""The drop-in across nodes: task sync per step per rank beside one gloo all_reduce.

    python scripts/benchmarks/bench_dropin_multinode.py --tp 2 --seconds 10 --rate 100

Starts ``--tp`` worker processes with paddle.distributed over gloo on 127.0.0.1 and
``FD_SYNC_TP_COORDINATOR=paddle`` (what the drop-in picks when the ranks are on several
nodes; loopback here, so the network adds nothing either number does not also see), and
an engine offering 64 x 512 int64 batches at ``--rate``/s through FastDeploy's engine loop.
Every worker step runs FastDeploy's ``nnode > 1`` loop (rank 0: ``exist_tasks()`` then
``read_finish_flag.set(1)``; ``paddle.distributed.barrier()``; every rank:
``read_finish_flag.get()``, ``get_tasks()`` when it is 1, the reader with ``read_finish``
resets the flag; the idle branch's barrier and 1 ms sleep) and, in the same step, one
extra ``all_reduce`` of a 1-element int64 tensor, the floor of any cross-node step, run
right before the drop-in's calls on even steps and right after them on odd ones (the
first collective after a barrier absorbs the ranks' release skew).
"task sync" = rank 0's check + ``get()`` + ``get_tasks()`` (the caller's barriers
excluded). Prints p50/p99 of both and their ratio, over every step of every rank.
"""

import argparse
import multiprocessing as mp
import os
import socket
import time

import numpy as np

STOP = "stop"


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def worker(address, tp, rank, endpoints, sync, out):
    os.environ.update(PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM=str(tp),
                      PADDLE_TRAINER_ENDPOINTS=",".join(endpoints),
                      PADDLE_CURRENT_ENDPOINT=endpoints[rank], PADDLE_DISTRI_BACKEND="gloo",
                      FD_SYNC_TP_COORDINATOR="paddle", FD_SYNC_INSECURE_TCP="1",
                      DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM="1" if sync else "0")
    import paddle
    import paddle.distributed as dist

    paddle.set_device("cpu")
    dist.init_parallel_env()
    from fastdeploy_sync.fastdeploy import EngineWorkerQueue

    q = EngineWorkerQueue(address=address, num_client=tp, client_id=rank, connect_timeout=60,
                          role="worker")  # joins now (else at its first read)
    assert q.coordinator == "paddle", q.coordinator
    one = paddle.to_tensor([1], dtype="int64")
    clock = time.perf_counter_ns
    sync_ns, reduce_ns, took = [], [], []
    try:
        while True:
            t0 = clock()
            if rank == 0 and q.exist_tasks():
                q.read_finish_flag.set(1)
            t1 = clock()
            dist.barrier()
            # the floor (one gloo all_reduce) right before or right after the drop-in's
            # calls, alternately, so neither always absorbs the barrier's release skew
            floor_first = len(sync_ns) % 2 == 0
            if floor_first:
                t_r = clock()
                dist.all_reduce(one)
                reduce_ns.append(clock() - t_r)
            t2 = clock()
            tasks = []
            if q.read_finish_flag.get() == 1:
                tasks, read_finish = q.get_tasks()
                if read_finish:
                    q.read_finish_flag.set(0)
            t3 = clock()
            if not floor_first:
                dist.all_reduce(one)
                reduce_ns.append(clock() - t3)
            sync_ns.append((t1 - t0) + (t3 - t2))
            took.append(bool(tasks))
            if any(isinstance(t, str) and t == STOP for t in tasks):
                break
            dist.barrier()  # the idle branch's barrier (or the model step's collective)
            time.sleep(0.001)
    finally:
        q.cleanup()
    out.put((rank, np.array(sync_ns), np.array(reduce_ns), np.array(took)))


def _batch(k):
    return [{"request_id": f"{k}-{i}", "prompt_token_ids": np.arange(512, dtype=np.int64)}
            for i in range(64)], 64


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--sync", action="store_true", help="DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM=1")
    args = ap.parse_args()
    os.environ["FD_SYNC_INSECURE_TCP"] = "1"  # loopback only
    from fastdeploy_sync.fastdeploy import EngineWorkerQueue

    server = EngineWorkerQueue(address=("127.0.0.1", 0), is_server=True, num_client=args.tp)
    address = ("127.0.0.1", server.get_server_port())
    engine = EngineWorkerQueue(address=address, num_client=args.tp, client_id=0)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    endpoints = [f"127.0.0.1:{p}" for p in _free_ports(args.tp)]
    procs = [ctx.Process(target=worker, args=(address, args.tp, r, endpoints, args.sync, out),
                         daemon=True) for r in range(args.tp)]
    for p in procs:
        p.start()
    while engine.num_connected_clients() < args.tp:
        time.sleep(0.05)
    n = int(args.seconds * args.rate)
    t_next = time.monotonic()
    for k in range(n):
        time.sleep(max(0.0, t_next - time.monotonic()))
        t_next += 1.0 / args.rate
        while engine.exist_tasks():
            time.sleep(0.001)
        engine.put_tasks(_batch(k), timeout=60)
    while engine.exist_tasks():
        time.sleep(0.001)
    engine.put_tasks(STOP, timeout=60)
    rows = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=10)
    server.cleanup()
    sync = np.concatenate([r[1] for r in rows]) / 1000.0
    red = np.concatenate([r[2] for r in rows]) / 1000.0
    took = np.concatenate([r[3] for r in rows])
    print(f"TP={args.tp} across 'nodes' (paddle coordinator, gloo on loopback), "
          f"{'sync' if args.sync else 'async'}, {n} batches at {args.rate:g}/s, "
          f"{len(sync)} steps x ranks; µs per step per rank")
    for label, x in (("drop-in task sync (all steps)", sync),
                     ("drop-in task sync (steps with a batch)", sync[took]),
                     ("one gloo all_reduce", red)):
        print(f"  {label:<40} p50 {np.percentile(x, 50):8.1f}  p99 {np.percentile(x, 99):8.1f}")
    print(f"  ratio drop-in / all_reduce at p50: "
          f"{np.percentile(sync, 50) / np.percentile(red, 50):.2f}")


if __name__ == "__main__":
    main()
