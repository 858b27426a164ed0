"""Peers of a queue that the tests and the scripts (``scripts/tools/flood.py``,
``scripts/benchmarks/liveness_times.py``) share: processes that flood an engine from
inside the trust boundary, a producer that dies with its puts unfinished, a GIL held by a
C call, and this process's peak memory. Module-level functions, so that the "spawn" start
method can import them in a child; each floods or reports as ``(tag, rank, payload)``.
"""

import os
import secrets
import time

import zmq

from ..wire import codec

__all__ = ["hold_gil", "PeakRSS", "producer_endpoint_flooder", "worker_key_flooder",
           "put_and_die", "curve_keys"]


def hold_gil(seconds):
    """Hold the GIL for ``seconds``: one C call that sleeps without releasing it (libc
    ``nanosleep`` through ``ctypes.PyDLL``, which keeps the GIL across the call), so no
    other thread of the process runs Python meanwhile, exactly as during a long numpy,
    compile or weight-load call. Unlike a calibrated busy loop it lasts as long as asked
    on a loaded machine too (a calibration slowed by load made the hold short)."""
    import ctypes

    libc = ctypes.PyDLL(None, use_errno=True)

    class Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    end = time.monotonic() + seconds
    while True:  # a signal may cut nanosleep short: sleep what is left
        left = end - time.monotonic()
        if left <= 0:
            return
        req = Timespec(int(left), int((left % 1) * 1e9))
        libc.nanosleep(ctypes.byref(req), None)


class PeakRSS:
    """This process's peak resident memory above where it stood at ``start()`` (Linux:
    the peak is reset through /proc/self/clear_refs)."""

    def start(self):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base = self._kib("VmRSS")
        return self

    def growth_mib(self) -> float:
        return (self._kib("VmHWM") - self.base) / 1024

    @staticmethod
    def _kib(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        raise RuntimeError(f"no {field} in /proc/self/status")


def curve_keys(keys_dir):
    """``(server_public, public, secret)`` from a worker key directory."""
    import zmq.auth

    from ..wire.auth import CLIENT_SECRET, SERVER_PUBLIC

    server_public, _ = zmq.auth.load_certificate(os.path.join(keys_dir, SERVER_PUBLIC))
    public, secret = zmq.auth.load_certificate(os.path.join(keys_dir, CLIENT_SECRET))
    return server_public, public, secret


def _flood(sock, messages, seconds, out, tag):
    """Send ``messages`` round-robin on ``sock`` as fast as it will take them, without
    ever reading, for ``seconds``; report (tag, 0, messages sent)."""
    out.put((tag + "_started", 0, os.getpid()))
    sent = 0
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        for _ in range(64):
            try:
                sock.send_multipart(messages[i % len(messages)], zmq.NOBLOCK)
                sent += 1
            except zmq.Again:  # the engine reads no faster: this is all the flood can do
                pass
            i += 1
    out.put((tag, 0, sent))


def producer_endpoint_flooder(out, rank, endpoint, seconds):
    """A same-user process on the queue's producer endpoint: QUERY, STATUS and garbage as
    fast as it can, never reading the replies."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        messages = [[codec.pack_header(codec.QUERY, seq=7)], [codec.pack_header(codec.STATUS)],
                    [os.urandom(40)], [b"FDSY" + os.urandom(56), b"x"]]
        _flood(sock, messages, seconds, out, "flooded")
    finally:
        ctx.destroy(linger=0)


def worker_key_flooder(out, rank, endpoint, name, tp_size, keys_dir, seconds):
    """A worker-key holder over tcp: stale PINGs (another engine's, no group's) and HELLOs
    of ever new groups, as fast as it can, never reading the replies."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve_keys(keys_dir)
        sock.connect(endpoint)
        messages = []
        for i in range(256):
            ids = dict(group=secrets.randbits(63) | 1, worker=secrets.randbits(63) | 1)
            messages.append([codec.pack_header(codec.PING, i % tp_size, tp_size,
                                               engine=secrets.randbits(63) | 1, **ids)])
            messages.append([codec.pack_header(codec.PING, i % tp_size, tp_size, **ids)])
            messages.append([codec.pack_header(codec.HELLO, i % tp_size, tp_size, seq=1, **ids),
                             name.encode()])
        _flood(sock, messages, seconds, out, "flooded")
    finally:
        ctx.destroy(linger=0)


def put_and_die(out, rank, endpoint, count, mib):
    """A producer that sends ``count`` PUTs of ``mib`` MiB each (well-formed, waiting for
    room forever) without waiting for replies, reports ("sent", rank, pid), then waits to
    be killed."""
    import numpy as np

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(endpoint)
    frames = codec.encode_payload(("flood", rank, np.zeros(mib << 17, dtype=np.int64)))
    check = codec.payload_checksum(frames)
    for request in range(1, count + 1):
        sock.send_multipart([codec.pack_header(codec.PUT, seq=request, aux=2**62, check=check),
                             *frames])
    out.put(("sent", rank, os.getpid()))
    time.sleep(600)
