#!/usr/bin/env python3
"""The libzmq 4.3.5 abort that shapes ``TaskQueue.close()``, reproduced with pyzmq alone.

A ROUTER socket with ZMTP heartbeats (as the engine's socket for its workers) sends a peer
more than it reads, then closes with a linger. The peer sends one message after the close
and hangs up. The connection's engine object, kept alive by the linger for its unwritten
bytes, stops reading (the socket is closing), marks itself failed at the hang-up, and its
next heartbeat timer runs ``zmq_assert(!_io_error)``: the process aborts ("Assertion
failed: !_io_error (src/stream_engine_base.cpp:310)"; libzmq issues #4364, #4841).
Closing without a linger leaves nothing to keep that object alive.

Each trial runs in a fresh process (an abort kills it); prints, per linger, how many of
``--trials`` processes aborted. Asserts nothing.

    python scripts/tools/libzmq_linger_abort.py [--trials 10]
"""

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time

import zmq


def _peer(address, closed):
    """Connects, reads nothing (its buffers fill), sends once after the ROUTER closed,
    hangs up."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(address)
    sock.send(b"hello")
    closed.wait(10)
    sock.send(b"bye")
    time.sleep(0.05)
    sock.close(linger=0)
    ctx.term()


def trial(linger_ms):
    """One ROUTER process: heartbeats every 100 ms, 80 MiB queued to a peer that reads
    nothing, then close with ``linger_ms``."""
    address = f"ipc://{tempfile.gettempdir()}/fdsync-abort-{os.getpid()}"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.HEARTBEAT_IVL, 100)
    router.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
    router.setsockopt(zmq.SNDBUF, 4096)
    router.bind(address)
    closed = mp.get_context("spawn").Event()
    peer = mp.get_context("spawn").Process(target=_peer, args=(address, closed))
    peer.start()
    if not router.poll(10_000):
        sys.exit("the peer never connected")
    identity, _ = router.recv_multipart()
    for _ in range(20):
        router.send_multipart([identity, b"x" * (4 << 20)])
    time.sleep(0.2)
    router.close(linger=linger_ms)
    closed.set()
    ctx.term()  # returns once the linger ends, or aborts the process
    peer.join(10)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--trial", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trial is not None:
        trial(args.trial)
        return
    print(f"libzmq {zmq.zmq_version()}, pyzmq {zmq.__version__}")
    for linger_ms in (1000, 0):
        aborted = 0
        for _ in range(args.trials):
            proc = subprocess.run([sys.executable, __file__, "--trial", str(linger_ms)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  timeout=60)
            aborted += proc.returncode == -6
        print(f"  close with linger {linger_ms:4d} ms: the process aborted in {aborted} of "
              f"{args.trials} trials")


if __name__ == "__main__":
    main()
