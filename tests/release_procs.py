"""Processes for tests/integration/test_release_at_close.py: an engine whose Python threads
are starved while connections come and go, and processes that count what they hold."""

import os
import sys
import threading
import time
import traceback


def busy_engine(conn, busy, name, close_timeout):
    """An engine (tp_size 1) whose main thread holds the GIL, never giving it away, from
    when it says ``busy`` until ``busy.value`` is 0 (a shared byte, read without releasing
    the GIL): meanwhile its I/O thread cannot read the socket monitor, while libzmq's own
    I/O thread (no GIL) keeps accepting connections and reporting them to it. Then, told
    (any message), it closes the queue in a thread and sends ``("closed", seconds)``, or ``("hung", seconds)``
    after 20 s (and exits without waiting for that thread); ``("error", traceback)`` on
    a failure."""
    try:
        from fastdeploy_sync import TaskQueue

        queue = TaskQueue(name, 1)
        sys.setswitchinterval(1000.0)  # the main thread keeps the GIL while it runs
        conn.send(("busy", queue.endpoint))
        deadline = time.monotonic() + 120
        while busy.value and time.monotonic() < deadline:
            pass
        sys.setswitchinterval(0.005)
        conn.recv()  # "close"
        started = time.monotonic()
        closer = threading.Thread(target=queue.close, kwargs={"timeout": close_timeout},
                                  daemon=True)
        closer.start()
        closer.join(20)
        took = time.monotonic() - started
        conn.send(("hung" if closer.is_alive() else "closed", took))
        if closer.is_alive():
            os._exit(3)  # the queue is wedged: an orderly exit would wait on it
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _our_fds_and_maps(name):
    """``(descriptors open, mappings of a shared-memory name of queue ``name``)`` of this
    process."""
    fds = len(os.listdir("/proc/self/fd"))
    with open("/proc/self/maps") as maps:
        ours = sum(1 for line in maps if f"fdsync.{name}." in line)
    return fds, ours


def client_lives(conn, name, lives, async_prefetch, tp=1, rank=0):
    """With the garbage collector disabled, ``lives`` times: wait to be told (any message),
    build a ``TaskClient`` (rank ``rank`` of ``tp``), say ``("ready", life)``, take one
    step's batches, drop them, close the client. Sends ``("counts", [(descriptors, our
    mappings) after each life])``, or ``("error", traceback and the counts so far)``."""
    import gc

    counts = []
    try:
        from fastdeploy_sync import TaskClient

        gc.disable()
        for life in range(lives):
            conn.recv()
            client = TaskClient(name, tp, rank, async_prefetch=async_prefetch)
            conn.send(("ready", life))
            deadline = time.monotonic() + 20
            tasks = []
            while not tasks:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"life {life}: no batch within 20 s")
                if rank == 0:
                    client.wait_for_tasks(0.05)
                client.barrier(20)
                tasks, _ = client.get_tasks()
            del tasks
            client.close()
            del client
            counts.append(_our_fds_and_maps(name))
        conn.send(("counts", counts))
    except BaseException:
        conn.send(("error", f"{traceback.format_exc()}counts so far: {counts}"))


def _take_one_then_close(conn, name):
    """A worker (tp_size 1): takes one step's batches, says ``took``, closes its client when
    told (leaving what was put since untaken) and says ``closed``."""
    from fastdeploy_sync import TaskClient

    with TaskClient(name, 1, 0) as client:
        deadline = time.monotonic() + 20
        tasks = []
        while not tasks and time.monotonic() < deadline:
            client.wait_for_tasks(0.05)
            client.barrier()
            tasks, _ = client.get_tasks()
        conn.send("took" if tasks else "nothing")
        del tasks
        conn.recv()
    conn.send("closed")


def engine_lives(conn, name, lives):
    """An engine (collector disabled) that serves ``lives`` worker groups in turn, each
    retired with a pool-sized batch unfinished; it keeps every ``GroupLost`` event, as an
    engine that re-queues their requests later would. Sends ``("counts", [(descriptors,
    our mappings) after each retirement])``, or ``("error", traceback and the counts so
    far)``."""
    import gc
    import multiprocessing
    import queue as queue_mod

    import numpy as np

    counts = []
    try:
        from fastdeploy_sync import TaskQueue

        spawn = multiprocessing.get_context("spawn")
        gc.disable()
        events = []
        with TaskQueue(name, 1) as engine:
            for life in range(lives):
                here, there = spawn.Pipe()
                worker = spawn.Process(target=_take_one_then_close, args=(there, name))
                worker.start()
                try:
                    engine.put_tasks([np.arange(8)], timeout=20)
                    if not here.poll(30) or here.recv() != "took":
                        raise TimeoutError(f"life {life}: the worker took nothing")
                    engine.put_tasks([np.ones(1 << 20)], timeout=20)  # 8 MiB, never taken
                    here.send("close")
                    if not here.poll(30):
                        raise TimeoutError(f"life {life}: the worker did not close")
                    worker.join(timeout=10)
                    events.append(engine.group_events.get(timeout=20))
                    if not events[-1].unfinished:
                        raise AssertionError(f"life {life}: {events[-1]!r} lost no batch")
                finally:
                    if worker.is_alive():
                        worker.kill()
                        worker.join(timeout=10)
                counts.append(_our_fds_and_maps(name))
        conn.send(("counts", counts))
    except (BaseException, queue_mod.Empty):
        conn.send(("error", f"{traceback.format_exc()}counts so far: {counts}"))
