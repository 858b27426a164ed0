"""A process the engine (or rank 0) forks never holds their ownership: after the parent is
SIGKILLed while its forked child lives on, the next engine of the same name starts and
reclaims the old pool; and a forked child that exits normally removes nothing of its
parent's. Real processes, real fork; every wait is bounded."""

import glob
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from fastdeploy_sync import TaskQueue, envs
from workers import free_ports

# An engine that makes a pool (a 2 MiB batch), forks a child that sleeps (as a helper
# FastDeploy forks would), prints "ready <child pid>" and waits to be killed.
_FORKING_ENGINE = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from fastdeploy_sync import TaskQueue
    name, endpoint = sys.argv[1], sys.argv[2] or None
    queue = TaskQueue(name, 1, endpoint=endpoint)
    queue.put_tasks([np.ones(1 << 18)], timeout=10)
    child = os.fork()
    # one write each: with PYTHONUNBUFFERED a print() is several, and the two processes'
    # words could interleave on the pipe
    if child == 0:
        os.write(1, b"forked\\n")  # the after-fork hooks have run in this child
        time.sleep(60)
        os._exit(0)
    os.write(1, f"ready {child}\\n".encode())
    time.sleep(60)
    """)


def _names(name):
    return sorted(glob.glob(f"/dev/shm/*fdsync.{name}.*")
                  + glob.glob(os.path.join(envs.ipc_dir(), f"fdsync-{name}-*")))


def _start_forking_engine(name, endpoint=""):
    p = subprocess.Popen([sys.executable, "-c", _FORKING_ENGINE, name, endpoint],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # both lines, in either order: the parent's "ready" can come before the child has run
    # its after-fork hooks (a loaded machine: the test then killed the engine while the
    # child still held the inherited listener)
    lines = [p.stdout.readline().split() for _ in range(2)]
    ready = [line for line in lines if line and line[0] == "ready"]
    if not ready or ["forked"] not in lines:
        p.kill()
        raise AssertionError(f"engine not ready ({lines}): {p.communicate(timeout=30)[1]}")
    return p, int(ready[0][1])


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_a_killed_engines_forked_child_does_not_keep_its_name(name):
    """Before: EndpointInUseError (the child held the ipc listener) and the old pool was
    never reclaimed (the child held its flock)."""
    engine, child = _start_forking_engine(name)
    try:
        old_pool = [n for n in _names(name) if ".dp0.bp" in n]
        assert old_pool, _names(name)
        engine.kill()
        engine.wait(timeout=30)
        assert os.path.exists(f"/proc/{child}")  # the helper lives on
        with TaskQueue(name, 1) as queue:  # starts: the endpoint is free
            assert not any(os.path.exists(n) for n in old_pool)  # the old pool reclaimed
            queue.put_tasks("after the crash", timeout=5)
            queue.close(timeout=0)
    finally:
        _kill(child)
        engine.kill()
        engine.communicate(timeout=30)


def test_a_killed_tcp_engines_forked_child_does_not_keep_its_port(name, loopback_tcp):
    port = free_ports(1)[0]
    endpoint = f"tcp://127.0.0.1:{port}"
    engine, child = _start_forking_engine(name, endpoint)
    try:
        engine.kill()
        engine.wait(timeout=30)
        with TaskQueue(name, 1, endpoint=endpoint) as queue:  # before: Address in use
            assert queue.endpoint == endpoint
            queue.close(timeout=0)
    finally:
        _kill(child)
        engine.kill()
        engine.communicate(timeout=30)


# A parent that owns an engine with a pool and rank 0 of a TP group, forks a child that
# exits normally (atexit and finalizers run there), then reports what is left of its names.
_EXITING_CHILD = textwrap.dedent("""
    import glob, os, sys
    import numpy as np
    from fastdeploy_sync import TaskQueue, envs
    from fastdeploy_sync.tp.shm_group import ShmTPGroup
    name = sys.argv[1]
    def names():
        return sorted(glob.glob(f"/dev/shm/*fdsync.{name}.*")
                      + glob.glob(os.path.join(envs.ipc_dir(), f"fdsync-{name}-*")))
    queue = TaskQueue(name, 2)
    queue.put_tasks([np.ones(1 << 18)], timeout=10)
    group = ShmTPGroup(name, 0, 2, 0, attach_timeout=5)
    before = names()
    child = os.fork()
    if child == 0:
        sys.exit(0)  # a helper that returns normally: atexit, finalizers
    _, status = os.waitpid(child, 0)
    after = names()
    print("status", status)
    print("before", " ".join(before))
    print("after", " ".join(after))
    group.close()
    queue.close(timeout=0)
    """)


def test_a_forked_child_that_exits_normally_removes_nothing_of_its_parent(name):
    """Before: the child's exit ran the parent's finalizers and unlinked the live engine's
    pool and socket files and rank 0's semaphores."""
    out = subprocess.run([sys.executable, "-c", _EXITING_CHILD, name], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert lines["status"] == "0"
    before, after = lines["before"].split(), lines["after"].split()
    assert any(".dp0.bp" in n for n in before) and any("sem." in n for n in before), before
    assert any(n.endswith(".ipc") for n in before), before
    assert after == before


# -- a forked child never acts on its parent's objects -------------------------------------

# What a forked child reports of each call it makes on an inherited object: "refused" for
# the one clear error (naming the building process and the child, saying what to do),
# anything else as it came.
_CHILD_CALLS = textwrap.dedent("""
    import os
    from fastdeploy_sync import ForkedProcessError

    def child_calls(calls):
        out = []
        for call in calls:
            try:
                call()
                out.append("returned")
            except ForkedProcessError as exc:
                text = str(exc)
                ok = (f"process {os.getppid()}" in text and f"({os.getpid()})" in text
                      and "build your own in the child" in text)
                out.append("refused" if ok else "unclear:" + text.replace(" ", "_"))
            except BaseException as exc:
                out.append(type(exc).__name__)
        return " ".join(out)

    def wait_child(child, what, limit=30):
        deadline = time.monotonic() + limit
        while True:
            pid, status = os.waitpid(child, os.WNOHANG)
            if pid:
                return status
            if time.monotonic() > deadline:
                os.kill(child, 9)
                os.waitpid(child, 0)
                raise TimeoutError(f"{what}: the forked child did not exit within {limit} s")
            time.sleep(0.01)
    """)

# A rank of a TP=2 group that takes N batches; with fork_at > 0 it forks once it has
# taken that many: the child calls every step call on the inherited client, closes it,
# prints what each did and exits normally (atexit, finalizers, the with block's exit).
_FORKING_RANK = "import sys, time\n" + _CHILD_CALLS + textwrap.dedent("""
    from fastdeploy_sync import TaskClient
    name, rank, n, fork_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    async_prefetch = sys.argv[5] == "1"
    taken, forked = 0, False
    deadline = time.monotonic() + 90
    with TaskClient(name, 2, rank, async_prefetch=async_prefetch) as client:
        while taken < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: took {taken} of {n} batches")
            if rank == 0:
                client.exist_tasks()
            client.barrier(timeout=30)
            taken += len(client.get_tasks()[0])
            if fork_at and not forked and taken >= fork_at:
                forked = True
                child = os.fork()
                if child == 0:
                    calls = [client.exist_tasks, client.num_tasks, client.get_tasks,
                             lambda: client.barrier(timeout=1), client.sync_step,
                             client.ready_count, client.step_size, client.stats,
                             client.close]
                    print("child", child_calls(calls), flush=True)
                    sys.exit(0)
                print("child_status", wait_child(child, f"rank {rank}"), flush=True)
        print("taken", taken, flush=True)
        sys.stdin.readline()  # closes its client when the test says so (or is gone)
    """)


def _read_lines(p, into):
    """A thread that puts every line ``p`` prints into the queue ``into``, then None."""
    def run():
        for line in p.stdout:
            into.put(line)
        into.put(None)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _lines_until(lines, key, timeout):
    """``{first word: rest}`` of the lines taken from ``lines`` until one starts with
    ``key`` (or the process's output ends); waits at most ``timeout`` seconds in all."""
    found, deadline = {}, time.monotonic() + timeout
    while key not in found:
        try:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        word, _, rest = line.strip().partition(" ")
        found[word] = rest
    return found


@pytest.mark.parametrize("async_prefetch", [True, False], ids=["async", "sync"])
def test_a_rank_forked_mid_run_cannot_act_on_its_parents_group(name, async_prefetch):
    """Before: the child got True from exist_tasks(), ([], True) from get_tasks(), passed
    the barrier, and its close() said goodbye on the inherited connection: the engine
    retired the parent's group (about half the batches taken)."""
    n = 200
    flag = "1" if async_prefetch else "0"
    with TaskQueue(name, 2) as engine:
        ranks = [subprocess.Popen([sys.executable, "-c", _FORKING_RANK, name, str(rank), str(n),
                                   str(fork_at), flag], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank, fork_at in ((0, 0), (1, n // 4))]
        outputs = [queue.SimpleQueue() for _ in ranks]
        readers = [_read_lines(p, out) for p, out in zip(ranks, outputs)]
        try:
            for i in range(n):
                engine.put_tasks(("batch", i), timeout=30)
            lines = [_lines_until(out, "taken", 90) for out in outputs]
            # before the ranks close their clients (which retires their group, normally)
            events = []
            while not engine.group_events.empty():
                events.append(engine.group_events.get_nowait())
            retirements = engine.stats()["retirements"]
            for p in ranks:
                p.stdin.close()
            for p in ranks:
                p.wait(timeout=60)
        finally:
            for p in ranks:
                if not p.stdin.closed:
                    p.stdin.close()
                p.kill()
                p.wait(timeout=30)
            for reader in readers:
                reader.join(timeout=10)
            errors = [p.stderr.read() for p in ranks]  # they have exited: never blocks
            for p in ranks:
                p.stdout.close()
                p.stderr.close()
        assert [p.returncode for p in ranks] == [0, 0], errors
        assert lines[0].get("taken") == str(n), (lines, errors)
        assert lines[1].get("taken") == str(n), (lines, errors)  # the parent's group: all
        assert lines[1]["child"] == " ".join(["refused"] * 8 + ["returned"]), lines[1]
        assert lines[1]["child_status"] == "0"
        assert events == [] and sum(retirements.values()) == 0  # the engine retired nobody
        assert engine.close(timeout=5) == []


# An engine (TP=1 with a rank and a producer in this process) that forks: the child calls
# every call on the inherited queue and producer, closes them, prints what each did and
# exits normally; the parent then goes on serving: it puts, its rank takes everything.
_FORKED_ENGINE = "import sys, time\n" + _CHILD_CALLS + textwrap.dedent("""
    from fastdeploy_sync import TaskClient, TaskProducer, TaskQueue
    name = sys.argv[1]
    with TaskQueue(name, 1) as queue, TaskClient(name, 1, 0) as client, \
            TaskProducer(name, timeout=10) as producer:
        queue.put_tasks("before", timeout=10)
        child = os.fork()
        if child == 0:
            calls = [lambda: queue.put_tasks("from the child", timeout=1), queue.num_tasks,
                     queue.exist_tasks, queue.ranks, queue.stats, queue.status, client.num_tasks,
                     lambda: producer.put_tasks("from the child", timeout=1),
                     producer.num_tasks, producer.status]
            producer.close()
            print("child", child_calls(calls), "closed", queue.close(timeout=1), flush=True)
            sys.exit(0)
        print("child_status", wait_child(child, "engine"), flush=True)
        queue.put_tasks("after", timeout=10)
        got, deadline = [], time.monotonic() + 30
        while len(got) < 2 and time.monotonic() < deadline:
            got += client.sync_step(timeout=10)
            time.sleep(0.001)
        print("taken", ",".join(got), flush=True)
        print("unconsumed", queue.close(timeout=5), flush=True)
    """)


def test_a_child_forked_from_the_engine_cannot_put(name):
    """Before: put_tasks() in the child raised "TaskSyncError: the I/O thread failed" (and
    the queries answered from the parent's state)."""
    out = subprocess.run([sys.executable, "-c", _FORKED_ENGINE, name], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert lines["child"] == " ".join(["refused"] * 10 + ["closed", "[]"]), lines
    assert lines["child_status"] == "0"
    assert lines["taken"] == "before,after"
    assert lines["unconsumed"] == "[]"


# The FastDeploy drop-in in one process: the server, the engine's client (in the server's
# process) and TP rank 0 (role "worker"). It forks once a batch was taken: the child calls
# the task path, the attribute objects and a side channel on all three inherited objects,
# cleans them up, prints what each did and exits normally; the parent then goes on.
_FORKED_DROPIN = "import sys, time\n" + _CHILD_CALLS + textwrap.dedent("""
    from fastdeploy_sync.fastdeploy import EngineWorkerQueue
    name = sys.argv[1]

    def take(worker, count):
        got, deadline = [], time.monotonic() + 30
        while len(got) < count and time.monotonic() < deadline:
            if worker.exist_tasks():
                got += worker.get_tasks()[0]
            time.sleep(0.001)
        return got

    server = EngineWorkerQueue(("0.0.0.0", 0), is_server=True, num_client=1, name=name)
    address = ("0.0.0.0", server.get_server_port())
    engine = EngineWorkerQueue(address, client_id=0, name=name)
    worker = EngineWorkerQueue(address, client_id=0, name=name, role="worker",
                               connect_timeout=30)
    engine.put_tasks("before", timeout=10)
    got = take(worker, 1)
    child = os.fork()
    if child == 0:
        report = []
        for q in (server, engine, worker):
            calls = [lambda: q.put_tasks("from the child", timeout=1), q.exist_tasks,
                     q.num_tasks, q.get_tasks, q.clear_data, lambda: q.set_exist_tasks(False),
                     q.num_connected_clients, q.read_finish_flag.get,
                     lambda: q.worker_process_tp_barrier.wait(1),
                     lambda: q.lock.acquire(timeout=1), q.num_cache_infos]
            report.append(child_calls(calls))
            q.cleanup()
        print("child", " | ".join(report), flush=True)
        sys.exit(0)
    print("child_status", wait_child(child, "drop-in"), flush=True)
    engine.put_tasks("after", timeout=10)
    got += take(worker, 1)
    print("taken", ",".join(got), flush=True)
    for q in (worker, engine, server):
        q.cleanup()
    """)


def test_a_child_forked_from_the_dropins_process_cannot_act_on_its_objects(name):
    """Before: the child's calls on the inherited server, engine client and TP rank acted on
    the parent's queue, group and links (or hung on a lock held at fork)."""
    out = subprocess.run([sys.executable, "-c", _FORKED_DROPIN, name], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert lines["child"] == " | ".join([" ".join(["refused"] * 11)] * 3), lines
    assert lines["child_status"] == "0"
    assert lines["taken"] == "before,after"


# An engine and its TP=1 rank in one process (node-local: batches are read from the ring,
# arrays are views of its slots). The rank keeps a batch it took; a child forked then drops
# its copy and exits; the engine then puts enough batches to go round the ring several
# times, and the parent reports whether the batch it keeps still reads as it was put.
_RELEASING_CHILD = "import sys, time\n" + _CHILD_CALLS + textwrap.dedent("""
    import gc
    import numpy as np
    from fastdeploy_sync import TaskClient, TaskQueue
    name = sys.argv[1]

    def take(client, count):
        got, deadline = [], time.monotonic() + 30
        while len(got) < count and time.monotonic() < deadline:
            got += client.sync_step(timeout=10)
        return got

    with TaskQueue(name, 1) as queue, TaskClient(name, 1, 0) as client:
        queue.put_tasks(np.full(512, 7), timeout=10)
        kept = take(client, 1)
        child = os.fork()
        if child == 0:
            del kept
            gc.collect()
            sys.exit(0)
        print("child_status", wait_child(child, "rank"), flush=True)
        for i in range(100):  # round the ring: its slots are 2 * max_inflight + 2
            queue.put_tasks(np.full(512, 1000 + i), timeout=10)
            take(client, 1)
        print("kept", sorted(set(kept[0].tolist())), flush=True)
        del kept
        print("unconsumed", queue.close(timeout=5), flush=True)
    """)


def test_a_forked_child_that_drops_a_ranks_arrays_does_not_release_them(name):
    """Before: the child's copy of the arrays, freed, published the rank's release of the
    batch's ring slot: the engine wrote later batches into the slot the parent still read
    (its kept batch changed under it)."""
    out = subprocess.run([sys.executable, "-c", _RELEASING_CHILD, name], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert lines["child_status"] == "0"
    assert lines["kept"] == "[7]"
    assert lines["unconsumed"] == "[]"
