"""Liveness: how the engine and its workers learn, within a bounded time, that a peer is
gone, without ever taking a busy peer for a dead one.

Busy is not dead. A worker's main thread may hold the GIL for seconds (a long C call, a
compile, a weight load), a big batch may occupy a socket for seconds, and the engine may
hold the GIL while it pickles a huge batch. Nothing that needs a Python thread to run can
tell those apart from death. So the two questions are answered by different means:

  * **Dead or frozen** (killed, crashed, SIGSTOPped, machine or network gone): the
    connection. A process that dies closes its sockets at once; a frozen one stops
    answering the ZMTP heartbeats (``HEARTBEAT_IVL``/``TIMEOUT``) that libzmq's own I/O
    thread sends and answers without the GIL, and libzmq drops its connection after
    ``timeout``; a host that vanished is found the same way (and by TCP keepalive). The
    application sees the connection go: the engine's sends to a rank whose connection
    is gone fail (ROUTER_MANDATORY, ``EHOSTUNREACH``; the engine probes every connected
    rank every interval and whenever a connection drops), a worker's socket monitor
    reports the disconnect. A peer whose connection is gone and not re-established (a
    HELLO from the *same* worker id) while nothing is heard from it for ``timeout``
    seconds is gone: the engine retires the rank's group (at the earliest one
    ``interval`` after it saw the connection go, so that a reconnect queued behind a
    stall of the engine's own I/O thread is read first), a worker raises
    ``EngineGoneError``.
  * **Alive but hung** (connection up, no application message): application ``PING``/
    ``PONG`` messages carry the ids (engine instance, group incarnation, worker id) that say
    *which* rank or engine is behind a connection. Their silence is reported (``status``:
    ``silent_s``) but only declares a peer hung after ``stall_timeout`` seconds
    (``FD_SYNC_STALL_TIMEOUT``, default 300 s, ``0`` = never): far above any GIL hold a
    healthy process makes, far below forever. Application silence alone, however long
    below that, never retires a group.
  * **Left on purpose**: a worker's ``TaskClient.close()`` sends ``BYE``; the engine knows
    at once and retires the group (its peers learn it as for a death) instead of waiting
    for any timeout. ``TaskQueue.close()`` sends ``CLOSE`` (``EngineClosedError``).

What counts as life for ZMTP: libzmq (4.3.5) cancels a heartbeat timeout only when a
*frame* has been decoded completely; bytes of a frame still in transit do not count.
So a socket whose heartbeat timeout is shorter than a frame's transfer never receives that
frame: its own PINGs re-arm the timeout during the transfer, the connection is dropped
mid-frame, and again after every reconnect (docs/failure-model.md, "Measured"). A TTL asked
by the sender does the same to a single big frame. Hence:
  * the engine's socket runs the heartbeats (``configure_engine_socket``): its PINGs
    leave after whatever message it is sending, and the workers' answers travel on the
    direction that carries only small messages, so a big batch does not trip it (a batch
    that takes longer than the timeout to cross, docs/failure-model.md); it asks the
    workers for no TTL;
  * a worker's socket that *receives* batches must not have a ZMTP timeout shorter than
    its largest batch's transfer (``configure_socket(sock, receives_batches=True)``: it
    still sends PINGs, but never drops the connection for silence); a worker learns that
    a frozen engine is gone on a connection that carries no batches, or by application
    silence past ``stall_timeout``;
  * a worker's TTL is not relied on: libzmq arms it only when a PING arrives and any
    later frame cancels it, so a worker frozen right after sending a message is never
    dropped by it (a SIGSTOPped rank stays connected: docs/failure-model.md).

The protocol:
  * every worker sends ``PING`` every ``interval`` seconds from a thread that is otherwise
    blocked (the receiver thread in async mode, a heartbeat thread in sync mode); the
    engine answers each with ``PONG`` and also sends every connected rank a ``PONG`` each
    interval unasked (the probe above), so that a worker that could not ping for a while
    finds proof of life waiting when it runs again.
  * ``HANDSHAKE_IVL`` is ``timeout``: a connection that accepts but never completes the
    handshake is dropped within it.

Nothing here runs on the step's critical path: the threads that ping are blocked in
``poll`` between pings, and the step calls only read an error slot they already read.
"""

import hashlib
from typing import Optional

import zmq

from .. import envs

__all__ = ["Heartbeat", "id_tag"]

# "Never" for a ZMTP heartbeat timeout (libzmq takes an int of milliseconds: ~24 days).
_NEVER_MS = 2**31 - 1


def id_tag(value: int) -> str:
    """A short, non-reversible tag (8 hex digits) of a worker id or group incarnation, for
    status, logs and events. The ids themselves are secrets: a message carrying a rank's
    worker id speaks for that rank, so they never leave the engine (``STATUS`` replies
    included) except towards the worker that owns them. The same id always gives the
    same tag, so a worker can print its own tag to match the engine's view."""
    digest = hashlib.blake2b(int(value).to_bytes(8, "little"), digest_size=4,
                             person=b"fdsync-id-tag")
    return digest.hexdigest()


class Heartbeat:
    """Heartbeat settings in seconds: ``interval`` and ``timeout`` (``None``: from
    ``FD_SYNC_HEARTBEAT_INTERVAL`` / ``FD_SYNC_HEARTBEAT_TIMEOUT``, default 1 s and 3 s),
    and ``stall_timeout`` (``None``: ``FD_SYNC_STALL_TIMEOUT``, default 300 s; 0 = never),
    the application silence of a still-connected peer that counts as hung (see the
    module docstring)."""

    __slots__ = ("interval", "timeout", "stall_timeout")

    def __init__(self, interval: Optional[float] = None, timeout: Optional[float] = None,
                 stall_timeout: Optional[float] = None):
        self.interval = envs.heartbeat_interval_s() if interval is None else float(interval)
        self.timeout = envs.heartbeat_timeout_s() if timeout is None else float(timeout)
        self.stall_timeout = (envs.stall_timeout_s() if stall_timeout is None
                              else float(stall_timeout))
        if not 0 < self.interval < self.timeout:
            raise ValueError(f"heartbeat interval {self.interval}s must be > 0 and below the "
                             f"timeout {self.timeout}s (FD_SYNC_HEARTBEAT_INTERVAL/_TIMEOUT)")
        if self.stall_timeout and self.stall_timeout < self.timeout:
            raise ValueError(f"stall timeout {self.stall_timeout}s must be 0 (never) or at "
                             f"least the heartbeat timeout {self.timeout}s "
                             f"(FD_SYNC_STALL_TIMEOUT)")

    def stalled(self, silent_s: float) -> bool:
        """True when a connected peer silent for ``silent_s`` seconds counts as hung."""
        return bool(self.stall_timeout) and silent_s > self.stall_timeout

    def configure_socket(self, sock: zmq.Socket, receives_batches: bool = False) -> None:
        """ZMTP heartbeats on a worker's socket: libzmq (its I/O thread, no GIL) sends a
        PING every ``interval``, each asking the engine's side to drop the connection if
        nothing follows within ``timeout`` (``HEARTBEAT_TTL``: a frozen worker loses its
        connection), and drops the connection itself when nothing complete arrives for
        ``timeout``; a handshake that does not complete within ``timeout`` is dropped too.

        ``receives_batches=True``: for a socket whose receive direction carries batches.
        It never drops the connection for silence (a batch still in transit is not life to
        libzmq, see the module docstring) but still sends its PINGs and asks the TTL."""
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(self.interval * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT,
                        _NEVER_MS if receives_batches else int(self.timeout * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, int(self.timeout * 1000))
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(self.timeout * 1000))

    def configure_engine_socket(self, sock: zmq.Socket) -> None:
        """The engine's socket for its workers: ZMTP heartbeats of its own (a PING every
        ``interval``; a connection on which nothing complete arrives for ``timeout`` is
        dropped: a frozen or vanished worker), no TTL asked of the workers, a handshake
        bound of ``timeout``, and TCP keepalive (after ``timeout`` idle seconds, every
        ``interval``, 3 probes) below it all. The socket must have no receive high-water
        mark (see ``flood_guard``: libzmq aborts with both)."""
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(self.interval * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.timeout * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, 0)
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(self.timeout * 1000))
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, max(1, round(self.timeout)))
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, max(1, round(self.interval)))
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)

    def __repr__(self) -> str:
        return (f"Heartbeat(interval={self.interval}, timeout={self.timeout}, "
                f"stall_timeout={self.stall_timeout})")
