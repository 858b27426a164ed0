"""Per-connection limits on what a peer that passed authentication can make the engine
hold: a connection that sends too many unwelcome messages is cut.

Why not a receive high-water mark: ZeroMQ's ``RCVHWM`` would slow a flooding peer down
by its own socket, but libzmq 4.3.5 aborts the process ("Assertion failed: !_io_error
(src/stream_engine_base.cpp:310)") when a ZMTP heartbeat fires on a connection whose
input the mark had stopped and whose peer then hung up: measured, a worker-key holder
flooding the engine and exiting aborted it in 3 runs of 3 (libzmq issues #4364, #4841).
The engine's socket for its workers needs those heartbeats (they find a frozen rank
without the GIL), so it has no receive mark, and what a flooder queues there is bounded
by cutting its connection instead: after ``limit`` unwelcome messages within ``window``
seconds (a rank of the group sends none: its messages are welcome). Measured under the
floods of ``tests/test_floods.py`` and ``scripts/flood.py``.

Cutting: every message carries the descriptor of the connection it came on
(``zmq.SRCFD``); ``shutdown()`` on it ends that connection as if the peer had closed it
(libzmq cleans up; a peer that reconnects starts a new, counted connection). A
descriptor is only cut while a send to the message's routing id still succeeds, i.e.
while that connection, which owns the descriptor, is alive, so a number reused by a
newer connection is not cut by mistake.
"""

import collections
import logging
import os
import socket

import zmq

from .logs import RateLimitedLog

__all__ = ["FloodGuard"]

log = logging.getLogger(__name__)


class FloodGuard:
    """Counts unwelcome messages per connection of a ROUTER socket and cuts a connection
    past ``limit`` of them within ``window`` seconds. Remembers at most ``memory``
    connections (the oldest are forgotten). One owning thread (the socket's)."""

    def __init__(self, sock: zmq.Socket, limit: int = 200, window: float = 1.0,
                 memory: int = 4096):
        self._sock = sock
        self.limit, self.window, self._memory = limit, window, memory
        self._seen = collections.OrderedDict()  # routing id -> [window start, count, cut]
        self._log = RateLimitedLog(log)
        self.cut = 0  # connections cut so far

    def unwelcome(self, identity: zmq.Frame, now: float, why: str = "") -> bool:
        """Count one unwelcome message that came with routing-id frame ``identity``;
        True if that made the guard cut its connection."""
        key = identity.bytes
        entry = self._seen.get(key)
        if entry is None or now - entry[0] >= self.window:
            if entry is None and len(self._seen) >= self._memory:
                self._seen.popitem(last=False)
            entry = self._seen[key] = [now, 0, entry[2] if entry else False]
        self._seen.move_to_end(key)
        entry[1] += 1
        if entry[1] <= self.limit or entry[2]:
            return False
        entry[2] = True
        return self._cut(identity, key, entry[1], why)

    def _cut(self, identity, key, count, why) -> bool:
        try:
            fd = identity.get(zmq.SRCFD)
            peer = identity.get("Peer-Address") or "local"
        except zmq.ZMQError:
            return False
        try:  # alive? (an empty message: nothing a fastdeploy_sync peer would act on)
            self._sock.send_multipart([key, b""], zmq.NOBLOCK)
        except zmq.Again:
            pass  # alive, only not reading
        except zmq.ZMQError:
            return False  # gone already: its descriptor may belong to someone else now
        try:
            with socket.socket(fileno=os.dup(fd)) as conn:
                conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
        self.cut += 1
        self._log.log(("cut", peer), logging.WARNING,
                      "cut a connection from %s: %d unwelcome messages within %g s (%s); "
                      "%d connection(s) cut so far", peer, count, self.window,
                      why or "flood", self.cut)
        return True
