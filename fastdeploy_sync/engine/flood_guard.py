"""Per-connection limits on what a peer that passed authentication can make the engine
hold: a connection that sends too many unwelcome messages is cut (``FloodGuard``), and so
is one that may be holding a message it never finishes, when the engine's heap grows past
what it accounts for (``InputGuard``).

Why not a receive high-water mark: ZeroMQ's ``RCVHWM`` would slow a flooding peer down
by its own socket, but libzmq 4.3.5 aborts the process ("Assertion failed: !_io_error
(src/stream_engine_base.cpp:310)") when a ZMTP heartbeat fires on a connection whose
input the mark had stopped and whose peer then hung up: a worker-key holder flooding the
engine and exiting aborts it (libzmq issues #4364, #4841; docs/security.md).
The engine's socket for its workers needs those heartbeats (they find a frozen rank
without the GIL), so it has no receive mark, and what a flooder queues there is bounded
by cutting its connection instead: after ``limit`` unwelcome messages within ``window``
seconds (a rank of the group sends none: its messages are welcome). docs/security.md
has the floods it is held against.

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
import struct
from typing import Optional

import zmq

from ..logs import RateLimitedLog
from ..wire.sockets import trim_heap

__all__ = ["FloodGuard", "InputGuard"]

log = logging.getLogger(__name__)


class FloodGuard:
    """Counts unwelcome messages per connection of a ROUTER socket and cuts a connection
    past ``limit`` of them within ``window`` seconds. Remembers at most ``memory``
    connections (the oldest are forgotten). One owning thread (the socket's)."""

    def __init__(self, sock: zmq.Socket, limit: int = 200, window: float = 1.0,
                 memory: int = 4096):
        self._sock = sock
        self.limit, self.window, self._memory = limit, window, memory
        # routing id -> [window start, count, cut]
        self._seen: collections.OrderedDict = collections.OrderedDict()
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


class InputGuard:
    """What peers can make the engine hold in messages they never finish: bounded.

    ``MAXMSGSIZE`` bounds a frame, not a message, and libzmq hands a multipart message to
    the socket only once its last frame has arrived (frames of an unfinished one are not
    readable, ``RCVMORE`` or not, and a high-water mark counts finished messages only): a
    peer that streams frames and never sends the last one grows the receiving process
    without bound, out of its sight, and glibc keeps those pages after the peer left.
    So the guard watches the process's own heap (``wire.sockets.anon_rss_bytes``, at most
    every ``check_s``) against what the engine knowingly holds (``legit``: batches
    retained, producers' PUTs waiting) and, when the excess passes a budget, cuts the
    connections that may be holding such a message: one that has finished no message
    since it was accepted ``quiet_s`` ago (a peer in the middle of an endless message
    finishes nothing), or none for ``idle_s``; never one of a trusted peer (``trust``:
    the engine trusts the peer of every connection a rank of its group spoke on, by its
    process over ipc (``SO_PEERCRED``) or its host over tcp, so a rank's other
    connections, which may not have spoken yet, are never cut either). Two budgets:
    ``small`` for the workers' socket (its peers' messages are a few KiB), ``large`` for
    the producers' (a PUT may legitimately be one maximum-size batch in flight); another
    owner names its sockets (``sockets``: the first is held to ``small``; the drop-in's
    side channels use one socket and pass their budget as ``small``). After a
    cut the freed heap is given back (``wire.sockets.trim_heap``). An excess with no
    connection to suspect (the engine's own allocations) becomes the new baseline.

    Connections are known from the sockets' monitors (``accepted``/``closed``, by
    descriptor) and ``spoke`` (a finished message, by ``zmq.SRCFD``). One owning thread
    (the engine's I/O thread)."""

    _MAX_TRUSTED = 4096

    def __init__(self, read_heap, small: int, large: int, check_s: float = 0.1,
                 quiet_s: float = 0.2, idle_s: float = 2.0,
                 sockets=("workers", "producers")):
        self._read_heap = read_heap
        self.small, self.large = small, large
        self.check_s, self.quiet_s, self.idle_s = check_s, quiet_s, idle_s
        self._baseline = read_heap()
        # per socket (the first is held to ``small``, the others to ``large``):
        # descriptor -> [when accepted, when it last finished a message or None, its peer
        # (peer_key)]
        self._conns: dict = {which: {} for which in sockets}
        self._trusted: set = set()  # peers (peer_key) never cut
        self._trim_at: Optional[float] = None
        self.next_check = 0.0
        self.cut = 0  # connections cut so far
        self._log = RateLimitedLog(log)

    def accepted(self, which: str, fd: int, now: float) -> None:
        conns = self._conns[which]
        if len(conns) < 65536:  # bounded by the descriptors a process can have anyway
            conns[fd] = [now, None, peer_key(fd)]
            self.next_check = min(self.next_check, now + self.check_s)

    def closed(self, which: str, fd: int) -> None:
        self._conns[which].pop(fd, None)

    def spoke(self, which: str, fd: int, now: float) -> None:
        entry = self._conns[which].get(fd)
        if entry is not None:
            entry[1] = now

    def trust(self, which: str, fd: int) -> None:
        """The peer of connection ``fd`` is a rank of the group: none of its connections is
        ever cut. Bounded (forgotten wholesale past ``_MAX_TRUSTED``)."""
        entry = self._conns[which].get(fd)
        if entry is not None and entry[2] is not None and entry[2] not in self._trusted:
            if len(self._trusted) >= self._MAX_TRUSTED:
                self._trusted.clear()
            self._trusted.add(entry[2])

    def check(self, now: float, legit: int) -> int:
        """At most every ``check_s``: the connections cut now (0 mostly). ``legit``: the
        bytes the engine knowingly holds."""
        if now < self.next_check:
            return 0
        # checks are due only while a connection of an untrusted peer is up (the engine's
        # I/O thread then wakes every check_s; a group alone costs it nothing)
        self.next_check = now + self.check_s if self._watching() else float("inf")
        if self._trim_at is not None:
            if now >= self._trim_at:
                self._trim_at = None
                trim_heap()
            else:
                self.next_check = min(self.next_check, self._trim_at)
        heap = self._read_heap()
        excess = heap - self._baseline - legit
        if excess <= self.small:
            return 0
        suspects = {which: self._suspects(which, now) for which in self._conns}
        cut = 0
        for i, (which, fds) in enumerate(suspects.items()):
            if i == 0 or excess > self.large:
                cut += self._cut(which, fds, excess)
        if cut:
            self._trim_at = now + 0.2  # once libzmq has let go of their buffers
            self.next_check = now + self.check_s
        elif not any(suspects.values()):
            self._baseline = heap - legit  # no peer could be holding it: the engine's own
        return cut

    def _watching(self) -> bool:
        trusted = self._trusted
        return any(peer is None or peer not in trusted
                   for conns in self._conns.values() for _, _, peer in conns.values())

    def _suspects(self, which, now):
        trusted = self._trusted
        return [fd for fd, (accepted, last, peer) in self._conns[which].items()
                if (peer is None or peer not in trusted)
                and (now - accepted >= self.quiet_s if last is None
                     else now - last >= self.idle_s)]

    def _cut(self, which, fds, excess) -> int:
        cut = 0
        for fd in fds:
            self._conns[which].pop(fd, None)
            try:
                with socket.socket(fileno=os.dup(fd)) as conn:
                    conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                continue
            cut += 1
        if cut:
            self.cut += cut
            self._log.log(("input", which), logging.WARNING,
                          "cut %d connection(s) of the %s' socket that had finished no message "
                          "lately, while the engine held %d MiB more than it accounts for (a "
                          "message that never ends?); %d cut so far", cut, which, excess >> 20,
                          self.cut)
        return cut


def peer_key(fd: int):
    """Who is at the other end of connection ``fd``: ``("pid", pid)`` over a unix socket
    (``SO_PEERCRED``, the pid as this process's namespace sees it), ``("host", address)``
    over tcp; None if it cannot be told. Never blocks."""
    try:
        with socket.socket(fileno=os.dup(fd)) as conn:
            if conn.family == socket.AF_UNIX:
                pid, _, _ = struct.unpack("3i", conn.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
                return ("pid", pid)
            return ("host", conn.getpeername()[0])
    except (OSError, ValueError):
        return None
