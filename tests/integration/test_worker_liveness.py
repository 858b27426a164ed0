"""The worker's side of the liveness contract (fastdeploy_sync/wire/liveness.py): busy is not
dead, and an engine that never appears is an error after a bound."""

import time

import pytest

import fastdeploy_sync
from fastdeploy_sync import Heartbeat, TaskClient, TaskQueue
from workers import collect, gil_hold_rank, wait_until

MODES = pytest.mark.parametrize("async_prefetch", [True, False], ids=["async", "sync"])


@MODES
def test_a_worker_that_held_the_gil_past_the_heartbeat_timeout_carries_on(
        name, procs, results, async_prefetch):
    """The worker's main thread holds the GIL for 3x its heartbeat timeout (no Python
    thread of it can ping or read meanwhile). libzmq kept the connection alive, so the
    engine is not gone: the worker takes the next batches (it raised EngineGoneError).
    The engine is given a long timeout here: its own side of the contract is tested with
    the engine."""
    hold_s, worker_hb = 3.0, (0.2, 1.0)
    with TaskQueue(name, 1, heartbeat=Heartbeat(0.2, 30)) as queue:
        procs(gil_hold_rank, results, 0, name, 1, async_prefetch, hold_s, worker_hb)
        queue.put_tasks(0, timeout=10)
        collect(results, "took_first", 1, timeout=30)
        queue.put_tasks(1, timeout=10)
        queue.put_tasks(2, timeout=10)
        held, got = collect(results, "after_hold", 1, timeout=60)[0]
    assert held >= hold_s * 0.9
    assert got == [0, 1, 2]


@MODES
def test_an_engine_that_never_appears_is_a_connection_error(name, async_prefetch):
    with TaskClient(name, 1, 0, async_prefetch=async_prefetch, connect_timeout=1.0) as client:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError) as caught:
            while time.monotonic() - t0 < 10:
                client.exist_tasks()
                time.sleep(0.01)
        waited = time.monotonic() - t0
        # raised as itself (not wrapped), by every call from now on
        with pytest.raises(fastdeploy_sync.EngineUnreachableError):
            client.sync_step(timeout=1)
    assert isinstance(caught.value, fastdeploy_sync.EngineUnreachableError)
    assert 0.9 <= waited < 5, waited
    message = str(caught.value)
    assert client.endpoint in message and "rank 0" in message
    assert "no connection could be made" in message and "FD_SYNC_CONNECT_TIMEOUT" in message


@MODES
def test_an_engine_may_start_after_the_worker_within_the_bound(name, async_prefetch):
    with TaskClient(name, 1, 0, async_prefetch=async_prefetch, connect_timeout=10) as client:
        time.sleep(1.0)
        assert not client.exist_tasks()
        with TaskQueue(name, 1) as queue:
            queue.put_tasks("late engine", timeout=5)
            assert wait_until(lambda: client.num_tasks() == 1)
            assert client.sync_step(timeout=5) == ["late engine"]


@MODES
def test_a_batch_slower_to_cross_than_the_heartbeat_timeout_reaches_a_real_rank(
        name, loopback_tcp, async_prefetch):
    """A 256 MiB batch over tcp takes longer to cross than a 0.1 s heartbeat timeout (as
    a 600 MiB one does over a real network with the default 3 s): the rank's data socket
    must not drop the connection mid-batch (libzmq counts a frame still in transit as
    silence), and the rank is not told the engine is gone. The engine is judged on the
    rank's heartbeat socket, which carries no batch."""
    import numpy as np

    hb = Heartbeat(0.03, 0.1)
    with TaskQueue(name, 1, endpoint="tcp://127.0.0.1:0", heartbeat=hb) as queue, \
            TaskClient(name, 1, 0, endpoint=queue.endpoint, heartbeat=hb,
                       async_prefetch=async_prefetch) as client:
        batch = np.arange(256 << 17, dtype=np.int64)  # 256 MiB
        start = time.monotonic()
        queue.put_tasks(batch, timeout=10)
        got = None
        while got is None and time.monotonic() - start < 60:
            took = client.sync_step()
            if took:
                got = took
            else:
                time.sleep(0.001)
        elapsed = time.monotonic() - start
        assert got is not None, "the batch never arrived"
        assert elapsed > hb.timeout, f"crossed in {elapsed:.2f} s: not slower than the timeout"
        np.testing.assert_array_equal(got[0], batch)
        assert queue.group_events.empty()
