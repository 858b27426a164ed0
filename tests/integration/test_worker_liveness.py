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


# A TCP relay, engine to workers at RATE bytes/s (the other way at full speed), as a slow
# network is: started as `python -c _SLOW_LINK TARGET_PORT RATE`, prints the port it listens
# on, relays every connection it accepts until either end closes it.
_SLOW_LINK = r"""
import socket, sys, threading, time

target, rate = int(sys.argv[1]), float(sys.argv[2])
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)


def pump(src, dst, rate):
    start, sent = time.monotonic(), 0
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            dst.sendall(data)
            sent += len(data)
            if rate:  # paced: never ahead of RATE since the connection's first byte
                ahead = sent / rate - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)
    except OSError:
        pass
    for sock in (src, dst):
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


while True:
    worker, _ = listener.accept()
    engine = socket.create_connection(("127.0.0.1", target))
    threading.Thread(target=pump, args=(engine, worker, rate), daemon=True).start()
    threading.Thread(target=pump, args=(worker, engine, 0), daemon=True).start()
"""


@MODES
def test_a_batch_slower_to_cross_than_the_heartbeat_timeout_reaches_a_real_rank(
        name, loopback_tcp, async_prefetch):
    """A 64 MiB batch crosses a link of 12 MiB/s (a relay process: ~5 s) to a rank whose
    heartbeat timeout is 1.5 s (as a 600 MiB one does over a real network with the default
    3 s): the rank's data socket must not drop the connection mid-batch (libzmq counts a
    frame still in transit as silence, and the engine's PINGs queue behind the batch), and
    the rank is not told the engine is gone. The engine is judged on the rank's heartbeat
    socket, which carries no batch. The timeout is one a loaded machine keeps (with 0.1 s,
    and an unthrottled batch to outlast it, a busy scheduler alone broke the contract)."""
    import select
    import subprocess
    import sys

    import numpy as np

    hb = Heartbeat(0.3, 1.5)
    with TaskQueue(name, 1, endpoint="tcp://127.0.0.1:0", heartbeat=hb) as queue:
        port = int(queue.endpoint.rsplit(":", 1)[1])
        link = subprocess.Popen([sys.executable, "-c", _SLOW_LINK, str(port), str(12 << 20)],
                                stdout=subprocess.PIPE, text=True)
        try:
            ready, _, _ = select.select([link.stdout], [], [], 60)
            assert ready, "the relay printed no port within 60 s"
            relay = f"tcp://127.0.0.1:{int(link.stdout.readline())}"
            with TaskClient(name, 1, 0, endpoint=relay, heartbeat=hb,
                            async_prefetch=async_prefetch) as client:
                batch = np.arange(64 << 17, dtype=np.int64)  # 64 MiB
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
                assert elapsed > hb.timeout, (f"crossed in {elapsed:.2f} s: not slower than "
                                              f"the timeout")
                np.testing.assert_array_equal(got[0], batch)
                assert queue.group_events.empty()
        finally:
            link.kill()
            link.wait(timeout=10)
            link.stdout.close()
