"""Every close returns, and releases what it owns before it returns (not at the next
garbage collection)."""

import time

import zmq

from conftest import SPAWN
from release_procs import busy_engine

# Connections made to a starved engine: each makes its socket monitor report two events
# (accepted, disconnected), more than a default monitor queue holds (1 000 + 1 000).
_BURST = 1500


def _connect_and_close(ctx, endpoint, i) -> bool:
    """One connection to ``endpoint`` that the engine's libzmq accepts, then closed. False
    if it could not be made within 2 s (the engine's libzmq no longer accepts)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.monitor(f"inproc://burst-{i}", zmq.EVENT_CONNECTED)
    mon = ctx.socket(zmq.PAIR)
    try:
        mon.connect(f"inproc://burst-{i}")
        sock.connect(endpoint)
        return bool(mon.poll(2000))
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
