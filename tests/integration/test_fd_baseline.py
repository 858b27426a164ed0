"""Tests of the FastDeploy-style baseline queue (fastdeploy_sync.profiling.fd_baseline) with real processes."""

import importlib.util
import multiprocessing as mp
import os
import queue
import socket
import subprocess
import sys
import time
import traceback

import numpy as np
import pytest

from conftest import ROOT
from fastdeploy_sync import names

try:
    from fastdeploy_sync.profiling.fd_baseline import FDManagerQueue
except Exception:  # the package may be mid-rewrite: fall back to loading the module by path
    _path = os.path.join(ROOT, "fastdeploy_sync", "profiling", "fd_baseline.py")
    _spec = importlib.util.spec_from_file_location("fd_baseline", _path)
    _mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
    FDManagerQueue = _mod.FDManagerQueue

NUM_BATCHES = 50
TP_SIZE = 2
STOP = "STOP"
STEP_TIMEOUT = 20.0  # bound on every blocking call inside the workers


def _make_batch(i):
    return {"seq": i, "token_ids": np.arange(i, i + 16, dtype=np.int64)}


def _worker_loop(address, tp_size, rank, result_q):
    """One TP rank, shaped like a FastDeploy worker's event loop; reports what it received."""
    try:
        with FDManagerQueue(address=address, tp_size=tp_size, tp_rank=rank,
                            connect_timeout=STEP_TIMEOUT) as q:
            received, lasts = [], []  # lasts: all_client_read of each of this rank's reads
            empty_reads = 0
            deadline = time.monotonic() + 45.0
            while time.monotonic() < deadline:
                # FastDeploy's event_loop_normal on one node: rank 0 decides for the group
                # through the shared-memory group flag; the other ranks must not decide on
                # their own, or a rank could read a batch a step before the others and then
                # read it again.
                if rank == 0 and q.exist_tasks():
                    q.set_exist_task_signal(True)
                q.barrier(timeout=STEP_TIMEOUT)
                if q.exist_task_signal() or q.get_read_finish_flag():
                    tasks, last = q.get_tasks()
                    if last:
                        q.set_exist_task_signal(False)
                    lasts.append(last)
                    if not tasks:
                        empty_reads += 1
                    for batch in tasks:
                        if isinstance(batch, str) and batch == STOP:
                            result_q.put(("ok", rank, (received, lasts), empty_reads))
                            return
                        expected = np.arange(batch["seq"], batch["seq"] + 16, dtype=np.int64)
                        assert np.array_equal(batch["token_ids"], expected), batch
                        received.append(batch["seq"])
                else:
                    time.sleep(0.0005)  # idle: do not spin on the manager
                # Stands in for the TP collectives of the model step, which keep a real
                # worker group in lock-step between two reads.
                q.barrier(timeout=STEP_TIMEOUT)
            result_q.put(("timeout", rank, received, empty_reads))
    except BaseException:
        result_q.put(("error", rank, traceback.format_exc(), None))


def _stop_processes(procs):
    for p in procs:
        p.join(timeout=5)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_every_rank_gets_every_batch_once_in_order(start_method):
    ctx = mp.get_context(start_method)
    server = FDManagerQueue(is_server=True, tp_size=TP_SIZE)
    result_q = ctx.Queue()
    procs = []
    try:
        host, port = server.address
        assert port != 0
        procs = [ctx.Process(target=_worker_loop, args=((host, port), TP_SIZE, r, result_q), daemon=True)
                 for r in range(TP_SIZE)]
        for p in procs:
            p.start()
        for i in range(NUM_BATCHES):
            server.put_tasks(_make_batch(i), timeout=STEP_TIMEOUT)
        server.put_tasks(STOP, timeout=STEP_TIMEOUT)

        results = {}
        for _ in range(TP_SIZE):
            status, rank, payload, empty_reads = result_q.get(timeout=40)
            assert status == "ok", f"rank {rank}: {status}\n{payload}"
            results[rank] = (payload, empty_reads)
        for rank in range(TP_SIZE):
            (received, _), empty_reads = results[rank]
            assert received == list(range(NUM_BATCHES)), f"rank {rank} got {received}"
            assert empty_reads == 0
        # all_client_read is True for exactly one rank per batch, the last reader (STOP's
        # read included: it is recorded before the loop returns).
        lasts = [results[r][0][1] for r in range(TP_SIZE)]
        assert all(len(flags) == NUM_BATCHES + 1 for flags in lasts), [len(f) for f in lasts]
        per_batch = [sum(flags[i] for flags in lasts) for i in range(NUM_BATCHES + 1)]
        assert per_batch == [1] * (NUM_BATCHES + 1), per_batch
        # STOP was read by every rank: nothing is pending and the next put would not block.
        assert server.num_tasks() == 0
        assert not server.exist_tasks()
    finally:
        _stop_processes(procs)
        server.close()


@pytest.mark.timeout(60)
def test_put_tasks_times_out_when_nobody_reads():
    with FDManagerQueue(is_server=True, tp_size=2) as server:
        server.put_tasks(["first"], timeout=1.0)  # nothing to wait for yet
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            server.put_tasks(["second"], timeout=0.2)
        elapsed = time.monotonic() - t0
        assert 0.2 <= elapsed < 2.0
        # The lock was released and the pending batch left untouched.
        assert server.num_tasks() == 1
        assert server.exist_tasks()
        tasks, all_read = server.get_tasks()  # server's own rank 0 reads
        assert tasks == [["first"]] and not all_read


@pytest.mark.timeout(60)
def test_single_rank_get_tasks_and_counts():
    with FDManagerQueue(is_server=True, tp_size=1) as server:
        with FDManagerQueue(address=server.address, tp_size=1, tp_rank=0, connect_timeout=5) as client:
            assert client.num_tasks() == 0 and not client.exist_tasks()
            assert client.get_tasks() == ([], True)
            server.put_tasks({"x": 1}, timeout=1.0)
            assert client.num_tasks() == 1 and client.exist_tasks()
            assert client.get_tasks() == ([{"x": 1}], True)
            assert client.num_tasks() == 0 and not client.exist_tasks()
            # The group flags belong to the loop: get_tasks() leaves them alone.
            client.set_read_finish_flag(True)
            client.set_exist_task_signal(True)
            client.get_tasks()
            assert client.get_read_finish_flag() and server.exist_task_signal()
            server.put_tasks({"x": 2}, timeout=1.0)  # does not block: batch 1 was read
            with pytest.raises(ValueError):
                FDManagerQueue(address=server.address, tp_size=2, tp_rank=1, connect_timeout=5)
        client.close()  # idempotent
    server.close()


@pytest.mark.timeout(60)
def test_client_connect_timeout():
    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="could not connect"):
        FDManagerQueue(address=("127.0.0.1", port), tp_size=1, tp_rank=0, connect_timeout=0.3)
    assert time.monotonic() - t0 < 3.0


def _barrier_once(address, rank, result_q):
    try:
        with FDManagerQueue(address=address, tp_size=2, tp_rank=rank, connect_timeout=STEP_TIMEOUT) as q:
            q.barrier(timeout=STEP_TIMEOUT)
        result_q.put(("ok", rank))
    except BaseException:
        result_q.put(("error", traceback.format_exc()))


@pytest.mark.timeout(60)
def test_barrier_across_processes_and_timeout():
    ctx = mp.get_context("spawn")
    server = FDManagerQueue(is_server=True, tp_size=2, tp_rank=0)
    result_q = ctx.Queue()
    procs = []
    try:
        procs = [ctx.Process(target=_barrier_once, args=(server.address, 1, result_q), daemon=True)]
        procs[0].start()
        server.barrier(timeout=STEP_TIMEOUT)  # server instance acts as rank 0
        assert result_q.get(timeout=STEP_TIMEOUT) == ("ok", 1)
        # Nobody else arrives: times out, and the barrier stays broken afterwards.
        with pytest.raises(TimeoutError):
            server.barrier(timeout=0.2)
        with pytest.raises(TimeoutError):
            server.barrier(timeout=0.2)
    finally:
        _stop_processes(procs)
        server.close()
    with pytest.raises(queue.Empty):
        result_q.get(timeout=0.01)


@pytest.mark.timeout(60)
def test_multi_node_flags_go_through_the_manager():
    with FDManagerQueue(is_server=True, tp_size=1, single_node=False) as server, \
            FDManagerQueue(address=server.address, tp_size=1, single_node=False,
                           connect_timeout=5) as client:
        server.put_tasks("b", timeout=1.0)
        assert client.exist_tasks()
        assert client.get_tasks() == (["b"], True)
        assert not server.exist_tasks()
        with pytest.raises(RuntimeError, match="single_node=False"):
            client.exist_task_signal()


class _RoundTrips:
    """Counts manager requests made through proxies in this process."""

    def __init__(self, monkeypatch):
        from multiprocessing.managers import BaseProxy
        self.n = 0
        original = BaseProxy._callmethod

        def counted(proxy, *args, **kwargs):
            self.n += 1
            return original(proxy, *args, **kwargs)
        monkeypatch.setattr(BaseProxy, "_callmethod", counted)

    def of(self, call):
        n0 = self.n
        result = call()
        return self.n - n0, result


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tp", [1, 3])
@pytest.mark.parametrize("single_node", [True, False])
def test_round_trips_match_the_module_table(monkeypatch, tp, single_node):
    """The per-call round trips the module docstring states (and FastDeploy makes)."""
    with FDManagerQueue(is_server=True, tp_size=tp, single_node=single_node) as server:
        ranks = [server] + [FDManagerQueue(address=server.address, tp_size=tp, tp_rank=r,
                                           single_node=single_node, connect_timeout=5)
                            for r in range(1, tp)]
        try:
            rt = _RoundTrips(monkeypatch)
            flag_rt = 0 if single_node else 1
            assert rt.of(server.exist_tasks) == (flag_rt, False)
            assert rt.of(server.num_tasks) == (3, 0)
            assert rt.of(lambda: server.put_tasks({"b": 0}, timeout=5))[0] == tp + 6 + flag_rt
            for r, q in enumerate(ranks):
                n, (tasks, last) = rt.of(q.get_tasks)
                assert tasks == [{"b": 0}] and last == (r == tp - 1)
                assert n == (tp + 10 + flag_rt if last else tp + 9), (r, n)
            assert rt.of(server.get_read_finish_flag) == (1, False)
        finally:
            for q in ranks[1:]:
                q.close()


_FLAGS_HOLDER = """
import os, sys, time
from fastdeploy_sync.shm.segment import Segment
seg = Segment.create(sys.argv[1], 16)  # held: its owner lock lives with it
print("ready", flush=True)
if sys.argv[2] == "exit":
    os._exit(0)  # killed: its flags segment stays behind
time.sleep(60)
"""


def test_a_new_server_removes_flags_left_by_dead_servers_and_no_live_ones():
    """A profile run whose engine was killed left its flags segment in /dev/shm, one per
    run; the next server removes such leftovers (nobody holds their owner lock) and never
    a live server's."""
    dead, live = "/fdsync-fdq-exist-1", "/fdsync-fdq-exist-2"
    out = subprocess.run([sys.executable, "-c", _FLAGS_HOLDER, dead, "exit"],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ready", out.stderr
    holder = subprocess.Popen([sys.executable, "-c", _FLAGS_HOLDER, live, "stay"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with FDManagerQueue(is_server=True, tp_size=1):
            assert not os.path.exists(names.shm_path(dead))
            assert os.path.exists(names.shm_path(live))
    finally:
        holder.kill()
        holder.wait(timeout=30)
        holder.stdout.close()
        for seg in (dead, live):
            if os.path.exists(names.shm_path(seg)):
                os.unlink(names.shm_path(seg))
