"""Every close returns, and releases what it owns before it returns (not at the next
garbage collection)."""

import time

import pytest
import zmq

from conftest import SPAWN
from release_procs import busy_engine, client_lives, engine_lives

# Connections made to a starved engine: each makes its socket monitor report two events
# (accepted, disconnected), more than a default monitor queue holds (1 000 + 1 000).
_BURST = 1500


def _connect_and_close(ctx, endpoint, i) -> bool:
    """One connection to ``endpoint`` that the engine's libzmq accepts, then closed. False
    if it could not be made within 10 s (the engine's libzmq no longer accepts)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.monitor(f"inproc://burst-{i}", zmq.EVENT_CONNECTED)
    mon = ctx.socket(zmq.PAIR)
    try:
        mon.connect(f"inproc://burst-{i}")
        sock.connect(endpoint)
        return bool(mon.poll(10_000))
    finally:
        sock.monitor(None, 0)
        mon.close(linger=0)
        sock.close(linger=0)


def test_close_returns_after_a_burst_of_connections_nobody_read(name):
    """A thousand connections come and go while the engine's I/O thread cannot run (its
    main thread holds the GIL): their socket-monitor events pile up unread. The queue
    must still serve and close within its timeout. Was: the monitor's queue filled,
    libzmq's I/O thread blocked writing the next event, and ``close(timeout=1)`` blocked
    for ever in the monitor's teardown (after 2 000 client build/close cycles)."""
    from fastdeploy_sync.engine.queue import query_status

    here, there = SPAWN.Pipe()
    busy = SPAWN.RawValue("b", 1)
    engine = SPAWN.Process(target=busy_engine, args=(there, busy, name, 1.0), daemon=True)
    engine.start()
    try:
        assert here.poll(30), "the engine did not start within 30 s"
        kind, endpoint = here.recv()
        assert kind == "busy", endpoint
        ctx = zmq.Context()
        try:
            made = 0
            for i in range(_BURST):
                if not _connect_and_close(ctx, endpoint, i):
                    break
                made += 1
        finally:
            ctx.destroy(linger=0)
        busy.value = 0
        # the engine's libzmq still accepts and answers (it did not: wedged on the monitor)
        status = query_status(endpoint, timeout=10)
        assert status["name"] == name
        assert made == _BURST, f"only {made} connections were accepted"
        here.send("close")
        assert here.poll(40), "the engine did not report its close within 40 s"
        kind, took = here.recv()
        assert kind == "closed", f"TaskQueue.close(timeout=1) did not return within {took:.0f} s"
        engine.join(timeout=10)
        assert engine.exitcode == 0, engine.exitcode
    finally:
        busy.value = 0
        if engine.is_alive():
            engine.kill()
            engine.join(timeout=10)


def _serve_lives(name, lives, async_prefetch, tp):
    """One engine; ``tp`` worker processes (collector disabled), the ranks of a group that
    builds and closes its clients ``lives`` times, each life taking one step of a small
    and a pool-sized batch; returns what each rank counted after each life."""
    import numpy as np

    from fastdeploy_sync import TaskQueue

    pipes = [SPAWN.Pipe() for _ in range(tp)]
    workers = [SPAWN.Process(target=client_lives, args=(pipes[r][1], name, lives,
                                                        async_prefetch, tp, r), daemon=True)
               for r in range(tp)]
    with TaskQueue(name, tp) as engine:
        for worker in workers:
            worker.start()
        try:
            for life in range(lives):
                for here, _ in pipes:
                    here.send("go")
                for rank, (here, _) in enumerate(pipes):
                    assert here.poll(30), f"rank {rank} did not start life {life} within 30 s"
                    kind, payload = here.recv()
                    assert kind == "ready", payload
                engine.put_tasks([{"ids": np.arange(64)}, {"big": np.ones(1 << 20)}],
                                 timeout=20)
                # the next life once this group is gone (its ranks' BYE retires it)
                assert engine.group_events.get(timeout=30).incarnation
            counts = []
            for rank, (here, _) in enumerate(pipes):
                assert here.poll(60), f"rank {rank} did not report within 60 s"
                kind, payload = here.recv()
                assert kind == "counts", payload
                counts.append(payload)
            for worker in workers:
                worker.join(timeout=10)
        finally:
            for worker in workers:
                if worker.is_alive():
                    worker.kill()
                    worker.join(timeout=10)
    return counts


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("async_prefetch", [True, False], ids=["async", "sync"])
def test_client_lives_release_at_close_with_the_collector_disabled(name, async_prefetch, tp):
    """A worker that builds and closes its client once per engine life keeps no descriptor
    and no mapping of an old ring, pool or TP group. Was: four descriptors more per life
    (the client's objects refer to one another, and the ring reader, the pools read and
    the batches held, with their mappings and the descriptors mmap keeps, were freed only
    by a garbage collection)."""
    lives = 8
    for rank, counts in enumerate(_serve_lives(name, lives, async_prefetch, tp)):
        fds = [c[0] for c in counts]
        maps = [c[1] for c in counts]
        # from the third life (lazily made things: numpy's, libzmq's first context)
        assert fds[-1] <= fds[2] and maps[-1] <= maps[2], (
            f"rank {rank}: descriptors after each life {fds}, mappings of our names {maps}")


def test_retired_groups_release_their_pools_while_their_events_are_kept(name):
    """An engine that keeps the ``GroupLost`` events of the groups it retired (their
    unfinished batches' arrays are copies) keeps no mapping or descriptor of their pools.
    Was: one pool (its whole size, pre-faulted) more per retired group, until a garbage
    collection happened to run (the pool and its regions refer to one another)."""
    lives = 5
    here, there = SPAWN.Pipe()
    # not a daemon: it starts the worker processes itself
    engine = SPAWN.Process(target=engine_lives, args=(there, name, lives))
    engine.start()
    try:
        assert here.poll(40 * lives), "the engine did not report"
        kind, counts = here.recv()
        assert kind == "counts", counts
        engine.join(timeout=20)
    finally:
        if engine.is_alive():
            engine.kill()
            engine.join(timeout=10)
    fds = [c[0] for c in counts]
    maps = [c[1] for c in counts]
    assert fds[-1] <= fds[1] and maps[-1] <= maps[1], f"descriptors {fds}, mappings {maps}"


@pytest.mark.parametrize("profile", [False, True], ids=["plain", "profiled"])
@pytest.mark.parametrize("async_prefetch", [True, False], ids=["async", "sync"])
def test_a_closed_client_is_freed_once_dropped_without_a_collection(name, async_prefetch,
                                                                   profile):
    """Nothing of a closed client refers back to it: dropping it frees it (and what its
    close() left to it) at once, with the collector disabled. Was: the idle wait's check
    and the profiler's wrappers (bound methods of the client) made a cycle, and every
    client lived until a collection (the worker's RSS grew by ~20 KiB per client life)."""
    import gc
    import weakref

    import numpy as np

    from fastdeploy_sync import ClosedError, TaskClient, TaskQueue

    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with TaskQueue(name, 1) as engine:
            client = TaskClient(name, 1, 0, async_prefetch=async_prefetch, profile=profile)
            engine.put_tasks([np.arange(8)], timeout=10)
            tasks, deadline = [], time.monotonic() + 20
            while not tasks and time.monotonic() < deadline:
                client.wait_for_tasks(0.05)
                client.barrier()
                tasks, _ = client.get_tasks()
            assert len(tasks) == 1
            del tasks
            client.close()
            with pytest.raises(ClosedError):
                client.exist_tasks()
            with pytest.raises(ClosedError):
                client.wait_for_tasks(0.01)
            freed = weakref.ref(client)
            del client
            assert freed() is None, "the closed client is kept by a reference cycle"
    finally:
        if was_enabled:
            gc.enable()


def test_close_after_a_burst_of_client_lives_frees_everything(name, monkeypatch):
    """300 clients built and closed as fast as they go leave the engine's I/O thread a
    backlog of HELLOs from new worker groups, each of which retires the previous group
    and creates a ring (large rings here: the costly part). close() must still stop the
    thread and free every name (the ``name`` fixture checks). Was: close() waited for the
    thread to finish its pass of up to 256 such HELLOs, gave up after 5 s and returned
    with the sockets, the ring and the names kept (5 names left, close() took 5.01 s)."""
    import logging

    from fastdeploy_sync import TaskClient, TaskQueue

    monkeypatch.setenv("FD_SYNC_SHM_RING_KB", "4096")
    logging.getLogger("fastdeploy_sync").setLevel(logging.WARNING)  # a line per group
    try:
        engine = TaskQueue(name, 1)
        for _ in range(300):
            TaskClient(name, 1, 0).close()
        assert engine.close(timeout=1) == []
    finally:
        logging.getLogger("fastdeploy_sync").setLevel(logging.NOTSET)
