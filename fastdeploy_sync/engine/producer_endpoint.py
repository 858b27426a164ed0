"""The queue's side of the producer endpoint: where ``TaskProducer``s put (run by the queue's
I/O thread).

A PUT is checked before it is enqueued (``codec.check_payload``: shape, bounds, checksum),
so that no worker is ever sent bytes it would refuse (it would fail, and its group be
retired); then enqueued as ``put_tasks()`` would, or held until there is room or the
producer's own wait runs out. What producers can make the engine hold is bounded (the
constants below).
"""

import collections
import logging
import os
import socket
import time

import zmq

from ..errors import ProtocolError
from ..wire import codec
from ..wire.sockets import receive_available

__all__ = ["ProducerEndpoint", "MAX_PRODUCERS"]


# Producers' PUTs waiting for room: at most so many, holding at most so many bytes (one PUT
# of any size may always wait); beyond, a PUT is answered P_BUSY at once and its bytes
# are freed. A TaskProducer has one PUT out at a time: the bounds only meet a flood.
_MAX_PENDING_PUTS = 64
_MAX_PENDING_BYTES = 8 << 20
# Per connection, messages libzmq queues towards the I/O thread (a TaskProducer has one
# request and at most one liveness query out at a time; a peer sending faster is slowed
# by its own socket) and replies it queues towards a peer that does not read them.
_INBOUND_HWM = 1
_OUTBOUND_HWM = 64
# Waiting producers are checked this often (a send that fails for one that went away):
# the PUT of a producer that was killed is dropped instead of enqueued later.
_PROBE_S = 0.1
# Connections the producer endpoint serves at once (each holds a descriptor in the
# engine). One beyond is answered E_TOO_MANY at its first message and cut
# _REFUSED_GRACE_S later (at once if it says nothing for twice that): FastDeploy's engine
# has one producer per DP rank.
MAX_PRODUCERS = 256
_REFUSED_GRACE_S = 0.5


class ProducerEndpoint:
    """The queue's side of the producer endpoint (I/O thread only, except construction).

    Answers QUERY and STATUS; checks each PUT and hands it to ``enqueue`` when there is
    room. What producers can make it hold is bounded: at most
    ``_MAX_PENDING_PUTS`` waiting PUTs and ``_MAX_PENDING_BYTES`` of them (one PUT of any
    size may always wait; beyond, ``P_BUSY``), at most ``_INBOUND_HWM`` messages per
    connection queued in libzmq, at most ``_OUTBOUND_HWM`` replies queued for a peer that
    does not read them (beyond, replies are dropped). A waiting PUT whose producer went
    away is dropped, never enqueued."""

    def __init__(self, sock, *, name, instance, counters, peers, in_flight, status_reply,
                 check_size, enqueue, input_guard=None, max_producers=MAX_PRODUCERS):
        """``sock``: the queue's producer socket (bound, ``configure_socket`` applied);
        ``name``, ``instance``, ``counters``, ``peers`` (``PeerLog``): the queue's;
        ``in_flight()``: batches in flight (QUERY); ``status_reply()``: the STATUS reply's
        JSON; ``check_size(size)``: ``ValueError`` for a batch the queue's endpoint refuses;
        ``enqueue(frames, check, expired)``: ``(status, seq)`` as ``Ledger.offer``
        answers, the batch enqueued when accepted."""
        self.sock = sock
        self._name, self._instance, self._counters, self._peers = name, instance, counters, peers
        self._in_flight, self._status_reply = in_flight, status_reply
        self._check_size, self._enqueue = check_size, enqueue
        self._input_guard = input_guard  # told of every finished message (flood_guard)
        self.max_producers = max_producers
        self._connections = set()  # descriptors of the producers' connections, served
        self.refusing = {}  # descriptor of a connection beyond the bound -> when to cut it
        self.pending = collections.deque()  # (deadline, identity, header, frames, size)
        self._pending_bytes = 0
        self._probed_at = 0.0

    @staticmethod
    def configure_socket(sock):
        """The bounds above, on the queue's producer socket (before bind)."""
        sock.setsockopt(zmq.RCVHWM, _INBOUND_HWM)
        sock.setsockopt(zmq.SNDHWM, _OUTBOUND_HWM)

    def receive(self, budget):
        """At most ``budget`` messages from the producers' socket."""
        for msg in receive_available(self.sock, budget, copy=False):
            self._peers.current = msg[0]
            try:
                fd = msg[0].get(zmq.SRCFD)
            except zmq.ZMQError:
                fd = -1
            if self._input_guard is not None:
                self._input_guard.spoke("producers", fd, time.monotonic())
            if fd in self.refusing:
                self._refuse(msg[0].bytes, fd)
                continue
            try:
                if len(msg) < 2:
                    raise ProtocolError(f"{len(msg)} frame(s) on the producer endpoint")
                identity, h = msg[0].bytes, codec.unpack_header(msg[1].buffer)
                if h.kind == codec.PUT:
                    self._on_put(identity, h, msg[2:])
                elif h.kind == codec.QUERY:
                    self._send(identity, [codec.pack_header(
                        codec.QUERY_REPLY, seq=h.seq, aux=self._in_flight(),
                        engine=self._instance)])
                elif h.kind == codec.STATUS:
                    self._counters["status_requests"] += 1
                    self._send(identity, [
                        codec.pack_header(codec.STATUS_REPLY, engine=self._instance),
                        self._status_reply()])
                else:
                    raise ProtocolError(f"message kind {h.kind} on the producer endpoint")
            except ProtocolError as exc:
                self._peers.garbage(exc)

    def _on_put(self, identity, h, payload):
        """A producer's batch: checked as every worker checks it before unpickling
        (``codec.check_payload``: shape, bounds, checksum), so that no worker is sent
        bytes it would refuse (it would fail, and its group be retired); then enqueued as
        ``put_tasks()`` would, or held until there is room or the producer's wait (``aux``
        ms) runs out. The body is not unpickled here: one that passes these checks and
        still fails to unpickle fails on the workers, as an in-process batch would."""
        try:
            codec.check_payload(payload, h.check or None)
            if not h.check:
                raise ProtocolError("a PUT without a checksum")
        except ProtocolError as exc:
            self._counters["puts_invalid"] += 1
            self._peers.log(("put_invalid",), logging.WARNING,
                            "TaskQueue %s: refused a producer's batch (%d so far): %s",
                            self._name, self._counters["puts_invalid"], exc)
            return self.reply(identity, h, codec.P_INVALID)
        size = sum(len(frame) for frame in payload)
        try:
            self._check_size(size)
        except ValueError as exc:
            self._counters["puts_too_large"] += 1
            return self._send(identity, [codec.pack_header(
                codec.PUT_REPLY, seq=h.seq, aux=codec.P_TOO_LARGE, engine=self._instance),
                str(exc).encode()])
        if self.pending and (len(self.pending) >= _MAX_PENDING_PUTS
                             or self._pending_bytes + size > _MAX_PENDING_BYTES):
            self._counters["puts_busy"] += 1
            return self.reply(identity, h, codec.P_BUSY)
        frames = [frame.bytes for frame in payload]
        self.pending.append((time.monotonic() + h.aux / 1000, identity, h, frames, size))
        self._pending_bytes += size
        self.serve()

    def connection_event(self, kind, fd, now) -> None:
        """A connection of the producers' socket was accepted or dropped (its monitor): one
        beyond ``max_producers`` is refused (``refusing``)."""
        if kind == zmq.EVENT_ACCEPTED:
            if len(self._connections) < self.max_producers:
                self._connections.add(fd)
            else:
                self.refusing[fd] = now + 2 * _REFUSED_GRACE_S
        elif kind == zmq.EVENT_DISCONNECTED:
            self._connections.discard(fd)
            self.refusing.pop(fd, None)

    def _refuse(self, identity, fd):
        """Answer a connection beyond the bound, whatever it asked: ``E_TOO_MANY`` with a
        reason, then it is cut soon (``cut_refused``)."""
        self._counters["producers_refused"] += 1
        self.refusing[fd] = min(self.refusing[fd], time.monotonic() + _REFUSED_GRACE_S)
        self._send(identity, [codec.pack_header(codec.ERROR, aux=codec.E_TOO_MANY,
                                                engine=self._instance),
                              (f"the queue serves at most {self.max_producers} producer "
                               f"connections at once and has that many; close producers this "
                               f"node does not need, or retry later").encode()])

    def cut_refused(self, now) -> None:
        """Cut the refused connections whose time has come (``shutdown`` of their
        descriptor: libzmq then drops them as if the peer had closed)."""
        for fd, when in list(self.refusing.items()):
            if now >= when:
                del self.refusing[fd]
                try:
                    with socket.socket(fileno=os.dup(fd)) as conn:
                        conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    @property
    def pending_bytes(self) -> int:
        """The bytes of the PUTs waiting for room."""
        return self._pending_bytes

    def serve(self):
        """Enqueue waiting producer batches, in arrival order, while there is room; answer
        every one whose producer's wait has run out, wherever it waits in the line; drop
        those whose producer went away (checked every ``_PROBE_S`` and before enqueueing)."""
        now = time.monotonic()
        probe_all = now - self._probed_at >= _PROBE_S
        if probe_all:
            self._probed_at = now
        waiting = collections.deque()
        room = True
        for entry in self.pending:
            deadline, identity, h, frames, size = entry
            if (probe_all or room) and not self._producer_alive(identity):
                self._counters["puts_dropped_gone"] += 1
                self._pending_bytes -= size
                continue
            if room:
                status, seq = self._enqueue(frames, h.check, now >= deadline)
                if status is not None:
                    if status == codec.P_ACCEPTED:
                        self._counters["puts_remote"] += 1
                    self._pending_bytes -= size
                    self.reply(identity, h, status, seq)
                    continue
                room = False  # the head waits, and so does everyone behind it...
            if now >= deadline:  # ...except those who stopped waiting
                self._pending_bytes -= size
                self.reply(identity, h, codec.P_TIMEOUT)
                continue
            waiting.append(entry)
        self.pending = waiting

    def _producer_alive(self, identity) -> bool:
        """False if the connection ``identity`` came on is gone (a send to it fails:
        ROUTER_MANDATORY). The send is a QUERY_REPLY with request id 0, which a
        TaskProducer reads as a sign of life and otherwise ignores."""
        try:
            self.sock.send_multipart([identity, codec.pack_header(
                codec.QUERY_REPLY, seq=0, engine=self._instance)], zmq.NOBLOCK)
        except zmq.Again:
            return True  # not reading its replies, but there
        except zmq.ZMQError:
            return False
        return True

    def close(self):
        """The queue closed: every waiting PUT is told so."""
        while self.pending:
            _, identity, h, _, _ = self.pending.popleft()
            self.reply(identity, h, codec.P_CLOSED)
        self._pending_bytes = 0

    def reply(self, identity, h, status, seq=0):
        self._send(identity, [codec.pack_header(
            codec.PUT_REPLY, seq=h.seq, aux=status, engine=self._instance, group=seq)])

    def _send(self, identity, frames):
        """Answer a producer or status asker without blocking; one that went away is
        simply gone, one that does not read its replies loses them."""
        try:
            self.sock.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._counters["sends_dropped_full"] += 1
        except zmq.ZMQError:
            self._counters["unreachable"] += 1
