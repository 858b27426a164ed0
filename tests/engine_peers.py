"""Peers of the engine spoken at the wire level (raw ZeroMQ sockets), for tests of the
engine alone: a rank that says exactly what a test wants (HELLO, PING, ACK, BYE) and
reports what it receives, an intruder, flooders. Real sockets, in this process or in a
child (module-level functions, so that spawn can import them).
"""

import os
import secrets
import signal
import socket
import struct
import threading
import time

import zmq

from fastdeploy_sync.testing.peers import (  # noqa: F401
    PeakRSS,
    curve_keys,
    hold_gil,
    producer_endpoint_flooder,
    put_and_die,
    worker_key_flooder,
)
from fastdeploy_sync.wire import codec


class SlowRelay:
    """A TCP relay between ranks and an engine that passes the engine's bytes on at
    ``rate`` bytes/s (the ranks' bytes at once): a batch that takes longer to cross than a
    heartbeat timeout, with ordinary TCP buffers. (Shrinking the rank's receive buffer to
    1 KiB did it too, but on loopback the window then fell below the MSS and the transfer
    stalled in zero-window probes for minutes in about one run of four under load.)
    ``endpoint``: where ranks connect. ``close()`` stops it."""

    def __init__(self, engine_endpoint, rate):
        host, port = engine_endpoint[len("tcp://"):].rsplit(":", 1)
        self._target, self._rate = (host, int(port)), rate
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.endpoint = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._socks, self._threads = [], []
        self._start(self._accept)

    def _start(self, target, *args):
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _accept(self):
        while not self._stop.is_set():
            try:
                rank_side, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            engine_side = socket.create_connection(self._target, timeout=5)
            self._socks += [rank_side, engine_side]
            self._start(self._pass_on, engine_side, rank_side, self._rate)
            self._start(self._pass_on, rank_side, engine_side, None)

    def _pass_on(self, src, dst, rate):
        src.settimeout(0.2)
        chunk = 1 << 16 if rate is None else max(1024, rate // 100)
        while not self._stop.is_set():
            try:
                data = src.recv(chunk)
            except socket.timeout:
                continue
            except OSError:
                break
            if not data:
                break
            try:
                dst.sendall(data)
            except OSError:
                break
            if rate:
                time.sleep(len(data) / rate)
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        self._stop.set()
        self._listener.close()
        for sock in self._socks:
            sock.close()
        for thread in self._threads:
            thread.join(timeout=5)


class RawRank:
    """One rank of a worker group, as bytes on a DEALER socket.

    ``group``/``worker``: the ids it claims (fresh random ones by default). ``curve``:
    ``(server_public, public, secret)`` for a tcp engine with keys. It binds to the engine
    that WELCOMEs it (``engine``), as a TaskClient does."""

    def __init__(self, endpoint, name, tp_size, rank, *, group=None, worker=None, ctx=None,
                 curve=None, options=None):
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        for option, value in (options or {}).items():  # before connect: they apply to it
            self.sock.setsockopt(option, value)
        if curve is not None:
            self.sock.curve_serverkey, self.sock.curve_publickey, self.sock.curve_secretkey = curve
        self.sock.connect(endpoint)
        self.name, self.tp_size, self.rank = name, tp_size, rank
        self.group = group or (secrets.randbits(63) | 1)
        self.worker = worker or (secrets.randbits(63) | 1)
        self.engine = 0
        self.epoch = None

    def _header(self, kind, seq=0, aux=0):
        return codec.pack_header(kind, self.rank, self.tp_size, seq=seq, aux=aux,
                                 engine=self.engine, group=self.group, worker=self.worker)

    def hello(self, first_missing=1, taken=0):
        self.sock.send_multipart([self._header(codec.HELLO, seq=first_missing, aux=taken),
                                  self.name.encode()])

    def ping(self):
        self.sock.send(self._header(codec.PING))

    def ack(self, seq):
        self.sock.send(self._header(codec.ACK, seq=seq))

    def bye(self, taken):
        self.sock.send(self._header(codec.BYE, seq=taken))

    def status(self):
        self.sock.send(codec.pack_header(codec.STATUS))

    def recv(self, timeout=5.0):
        """The next message as ``(Header, [payload frames])``, or None after ``timeout``."""
        if not self.sock.poll(timeout * 1000):
            return None
        frames = self.sock.recv_multipart()
        header = codec.unpack_header(frames[0])
        if header.kind == codec.WELCOME and self.engine == 0:
            self.engine, self.epoch = header.engine, header.aux
        return header, frames[1:]

    def expect(self, kind, timeout=5.0, skip=(codec.PONG,)):
        """Receive until a message of ``kind``; fail on anything else but ``skip``."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.recv(max(0.0, deadline - time.monotonic()))
            if got is None:
                raise AssertionError(f"rank {self.rank}: no message of kind {kind} within "
                                     f"{timeout} s")
            header, frames = got
            if header.kind == kind:
                return header, frames
            if header.kind not in skip:
                raise AssertionError(f"rank {self.rank}: expected kind {kind}, got {header!r} "
                                     f"{frames[:1]!r}")

    def join(self, timeout=5.0):
        """HELLO and wait for the WELCOME; returns self."""
        self.hello()
        self.expect(codec.WELCOME, timeout)
        return self

    def close(self):
        self.sock.close(linger=0)
        if self._own_ctx:
            self.ctx.term()


def raw_rank_process(out, rank, endpoint, name, tp_size, group, seconds, ping_every=0.2,
                     take=True):
    """A child process: one rank that joins, pings every ``ping_every`` s, acknowledges
    (``take``) every batch it receives, reports ("joined", rank, pid) and
    ("received", rank, [seqs]) every time a batch arrives, until killed or ``seconds``
    pass (then it reports ("done", rank, [seqs]))."""
    peer = RawRank(endpoint, name, tp_size, rank, group=group)
    peer.join(timeout=30)
    out.put(("joined", rank, os.getpid()))
    seqs = []
    deadline = time.monotonic() + seconds
    next_ping = time.monotonic()
    while time.monotonic() < deadline:
        now = time.monotonic()
        if now >= next_ping:
            peer.ping()
            next_ping = now + ping_every
        got = peer.recv(min(ping_every, max(0.0, deadline - now)))
        if got is None:
            continue
        header, _ = got
        if header.kind == codec.DATA:
            seqs.append(header.seq)
            if take:
                peer.ack(header.seq)
            out.put(("received", rank, list(seqs)))
        elif header.kind in (codec.ERROR, codec.CLOSE):
            out.put(("ended", rank, (header.kind, header.aux, list(seqs))))
            peer.close()
            return
    out.put(("done", rank, list(seqs)))
    peer.close()


def engine_closing_on_a_reader_that_stopped(out, name, interval):
    """A child process: an engine (ZMTP heartbeats every ``interval`` s, batches over the
    socket) that waits for its one rank, puts 4 batches of 4 MiB, reports ("closing", pid)
    and closes with a 0.3 s drain bound; ("closed", unconsumed) if the process survived."""
    os.environ["FD_SYNC_SHM_PAYLOAD_MIN_KB"] = "off"
    import numpy as np

    from fastdeploy_sync import TaskQueue
    from fastdeploy_sync.wire.liveness import Heartbeat
    from workers import wait_until

    queue = TaskQueue(name, 1, max_inflight=8, heartbeat=Heartbeat(interval, 3.0))
    out.put(("ready", 0, queue.endpoint))
    # the rank's HELLO (not checked: the test judges what close() returns)
    wait_until(lambda: queue.stats().get("hellos", 0) >= 1, timeout=30, interval=0.01)
    for i in range(4):
        queue.put_tasks(np.full(4 << 17, i, dtype=np.int64), timeout=10)
    out.put(("closing", 0, os.getpid()))
    out.put(("closed", 0, queue.close(timeout=0.3)))


def suicide(delay):
    """Kill the calling process with SIGKILL after ``delay`` seconds (a peer that dies
    mid-conversation, with no chance to say anything)."""
    time.sleep(delay)
    os.kill(os.getpid(), signal.SIGKILL)


def intruder_process(out, rank, endpoint, name, tp_size, keys_dir, listen_s):
    """A process holding the worker key that tries to take ``rank``'s place in the live
    group: it asks the engine for its status, claims the rank with every id the status
    shows (read as hex numbers), and listens ``listen_s`` seconds. Reports
    ("intruded", rank, {"status": the raw reply, "welcomed": bool, "data": batches
    received, "errors": [error codes]}), then leaves."""
    import json

    ctx = zmq.Context()
    try:
        curve = curve_keys(keys_dir)
        asker = RawRank(endpoint, name, tp_size, rank, ctx=ctx, curve=curve)
        asker.status()
        header, frames = asker.expect(codec.STATUS_REPLY, timeout=30)
        raw_status = frames[0]
        status = json.loads(raw_status)

        def as_id(text):
            try:
                return int(text, 16)
            except (TypeError, ValueError):
                return None

        group = as_id(status.get("group")) or 1
        claims = [as_id(r.get("worker")) for r in status["ranks"]] + [None]
        welcomed, data, errors = False, 0, []
        for worker in claims:
            claimant = RawRank(endpoint, name, tp_size, rank, group=group, worker=worker,
                               ctx=ctx, curve=curve)
            # claim to hold what the rank holds, as the rank itself would on a reconnect
            consumed = status["ranks"][rank]["consumed"]
            claimant.hello(first_missing=consumed + 1, taken=consumed)
            deadline = time.monotonic() + listen_s
            while time.monotonic() < deadline:
                got = claimant.recv(max(0.0, deadline - time.monotonic()))
                if got is None:
                    break
                h, _ = got
                if h.kind == codec.WELCOME:
                    welcomed = True
                elif h.kind == codec.DATA:
                    data += 1
                elif h.kind == codec.ERROR:
                    errors.append(h.aux)
                    break
            claimant.close()
        out.put(("intruded", rank, {"status": raw_status, "welcomed": welcomed, "data": data,
                                    "errors": errors}))
    finally:
        ctx.destroy(linger=0)


def gil_holding_rank(out, rank, name, tp, n, hold_s, hold_after, heartbeat):
    """A TaskClient rank (async) that steps until it took ``n`` batches; once it took
    ``hold_after``, its main thread holds the GIL for ``hold_s`` seconds (reported as
    ("holding", rank, None) before and ("held", rank, seconds) after). Reports
    ("taken", rank, [batches]) or ("raised", rank, repr)."""
    from fastdeploy_sync import Heartbeat, TaskClient

    got = []
    try:
        with TaskClient(name, tp, rank, async_prefetch=True,
                        heartbeat=Heartbeat(*heartbeat)) as client:
            out.put(("ready", rank, os.getpid()))
            deadline = time.monotonic() + 60 + hold_s
            held = False
            while len(got) < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {rank}: took {len(got)}/{n}")
                got.extend(client.sync_step(timeout=30 + hold_s))
                if hold_s and not held and len(got) >= hold_after:
                    held = True
                    out.put(("holding", rank, None))
                    start = time.monotonic()
                    hold_gil(hold_s)
                    out.put(("held", rank, time.monotonic() - start))
                time.sleep(0.001)
            out.put(("taken", rank, got))
    except Exception as exc:
        out.put(("raised", rank, f"{exc!r} (cause {exc.__cause__!r}); took {got}"))


# -- floods from inside the trust boundary -----------------------------------------------


def endless_peer(path, frame_bytes, seconds):
    """Connect to ``path`` as a raw ZMTP 3.0 DEALER (NULL security) and stream frames of
    ``frame_bytes``, each flagged MORE, for ``seconds``; returns (MiB sent, whether the
    receiver (an engine, a drop-in's side channels) cut the connection)."""
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(path)
    conn.settimeout(5)
    conn.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32))
    name, value = b"Socket-Type", b"DEALER"
    body = b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
    conn.sendall(bytes([0x04, len(body)]) + body)
    time.sleep(0.2)
    frame = bytes([0x03]) + struct.pack(">Q", frame_bytes) + bytes(frame_bytes)  # MORE|LONG
    blob = frame * max(1, (1 << 20) // len(frame))
    sent, cut = 0, False
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            conn.sendall(blob)
            sent += len(blob)
    except OSError:
        cut = True
    finally:
        conn.close()
    return sent >> 20, cut
