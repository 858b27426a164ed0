"""Liveness: how the engine and its workers learn, within a bounded time, that a peer is gone.

Why application heartbeats (PING/PONG messages) and not only ZeroMQ's ZMTP heartbeats:
ZMTP heartbeats (``HEARTBEAT_IVL``/``TIMEOUT``/``TTL``) make libzmq drop a silent
connection, but nothing of that reaches the application except socket-monitor events,
and on the engine's ROUTER those name a file descriptor, not the rank or worker behind
it; libzmq also reconnects on its own, so "disconnected" is not "gone". The engine must
say *which rank* is silent and since when, and a worker must tell "the engine is gone"
from a reconnect: both need our own ids, so both sides track silence in messages that
carry them. ZMTP heartbeats are set too (``configure_socket``): they tear down half-open
TCP connections (after a partition) so that libzmq reconnects when the network heals.

The protocol:
  * every worker sends ``PING`` every ``interval`` seconds, from a thread that is otherwise
    blocked (the prefetch thread in async mode, a heartbeat thread in sync mode, so a long
    model step never looks like a dead worker); the engine answers each with ``PONG``.
  * a worker that heard nothing from its engine (no PONG, batch or any other message) for
    ``timeout`` seconds raises ``EngineGoneError`` from its next step call.
  * the engine marks a rank disconnected when nothing came from it for ``timeout`` seconds
    (or at once when a send to it fails because its socket is gone), and retires the
    rank's worker group (see ``engine.py``).

Nothing here runs on the step's critical path: the threads that ping are blocked in
``poll`` between pings, and the step calls only read an error slot they already read.
"""

import time

import zmq

from . import envs

__all__ = ["Heartbeat", "RankLink", "NEVER", "CONNECTED", "DISCONNECTED"]


class Heartbeat:
    """Heartbeat settings: ``interval`` and ``timeout`` in seconds (``None``: from
    ``FD_SYNC_HEARTBEAT_INTERVAL`` / ``FD_SYNC_HEARTBEAT_TIMEOUT``, default 1 s and 3 s)."""

    __slots__ = ("interval", "timeout")

    def __init__(self, interval: float = None, timeout: float = None):
        self.interval = envs.heartbeat_interval_s() if interval is None else float(interval)
        self.timeout = envs.heartbeat_timeout_s() if timeout is None else float(timeout)
        if not 0 < self.interval < self.timeout:
            raise ValueError(f"heartbeat interval {self.interval}s must be > 0 and below the "
                             f"timeout {self.timeout}s (FD_SYNC_HEARTBEAT_INTERVAL/_TIMEOUT)")

    def configure_socket(self, sock: zmq.Socket) -> None:
        """ZMTP heartbeats on ``sock``: libzmq drops a connection silent for ``timeout``
        so that a half-open TCP connection is replaced by a reconnect."""
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(self.interval * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.timeout * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, int(self.timeout * 1000))

    def __repr__(self):
        return f"Heartbeat(interval={self.interval}, timeout={self.timeout})"


NEVER = "never connected"
CONNECTED = "connected"
DISCONNECTED = "disconnected"


class RankLink:
    """What the engine knows of one rank of its current worker group (I/O thread only,
    except ``describe``/``snapshot``, which read plain attributes).

    ``state`` is ``NEVER`` until the rank's HELLO is accepted, ``CONNECTED`` while it is
    heard from, ``DISCONNECTED`` once its socket went away or it was silent for the
    heartbeat timeout (``since`` and ``reason`` say when and why).
    """

    __slots__ = ("rank", "state", "worker", "identity", "since", "last_heard", "sent", "reason")

    def __init__(self, rank: int):
        self.rank = rank
        self.state = NEVER
        self.worker = 0  # the worker instance id that holds this rank
        self.identity = None  # its data socket's ZeroMQ routing id, None when unreachable
        self.since = None  # wall-clock time of the last state change
        self.last_heard = 0.0  # monotonic time of the last message from this worker
        self.sent = 0  # highest (global) seq sent to this rank's data socket
        self.reason = ""

    def connect(self, identity: bytes, worker: int, now: float) -> None:
        if self.state != CONNECTED or self.worker != worker:
            self.since = time.time()
        self.state, self.worker, self.identity, self.last_heard = CONNECTED, worker, identity, now
        self.reason = ""

    def heard(self, now: float) -> None:
        self.last_heard = now

    def disconnect(self, reason: str) -> None:
        if self.state == CONNECTED:
            self.state, self.since, self.reason = DISCONNECTED, time.time(), reason
        self.identity = None

    def silent_for(self, now: float) -> float:
        return now - self.last_heard

    def alive(self, now: float, timeout: float) -> bool:
        """Heard from within ``timeout`` (a rank whose socket dropped may still reconnect
        within that time, so this is not the same as ``state == CONNECTED``)."""
        return self.state != NEVER and now - self.last_heard <= timeout

    def describe(self) -> str:
        if self.state == NEVER:
            return NEVER
        if self.state == CONNECTED:
            return CONNECTED
        return f"disconnected since {time.strftime('%H:%M:%S', time.localtime(self.since))} ({self.reason})"

    def snapshot(self, now: float) -> dict:
        return {"rank": self.rank, "state": self.state, "since": self.since,
                "silent_s": None if self.state == NEVER else round(now - self.last_heard, 3),
                "worker": f"{self.worker:016x}" if self.worker else None,
                "reason": self.reason or None}
