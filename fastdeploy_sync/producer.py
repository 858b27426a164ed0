"""The queue's producer endpoint: engine processes other than the queue's own put into it.

FastDeploy splits its engine over several processes (one per DP rank); one of them owns the
``TaskQueue``, the others put through ``TaskProducer``. The endpoint is node-local (an
``ipc://`` socket in the private 0700 directory, so the same user only) and has its own
socket, so that the workers' socket keeps its small message bound.

Both ends live here: ``TaskProducer`` (the client) and ``ProducerEndpoint`` (the queue's
side, run by the queue's I/O thread). A PUT is checked before it is enqueued, so that no
worker is ever sent bytes it will refuse, and waits in the endpoint until the queue has
room or the producer's own wait runs out.
"""

import collections
import json
import logging
import os
import socket
import threading
import time

import zmq

from . import codec, envs
from .errors import ClosedError, ProtocolError, TaskSyncError
from .transport import (ENGINE_FDS, check_ipc_endpoint, default_endpoint, ensure_free_fds,
                        ipc_path, new_socket, validate_name)

__all__ = ["TaskProducer", "ProducerEndpoint"]


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

    Answers QUERY and STATUS; checks each PUT and enqueues it through the queue's
    ``_enqueue`` when there is room. What producers can make it hold is bounded: at most
    ``_MAX_PENDING_PUTS`` waiting PUTs and ``_MAX_PENDING_BYTES`` of them (one PUT of any
    size may always wait; beyond, ``P_BUSY``), at most ``_INBOUND_HWM`` messages per
    connection queued in libzmq, at most ``_OUTBOUND_HWM`` replies queued for a peer that
    does not read them (beyond, replies are dropped). A waiting PUT whose producer went
    away is dropped, never enqueued."""

    def __init__(self, queue, sock, input_guard=None, max_producers=MAX_PRODUCERS):
        self._queue = queue
        self.sock = sock
        self._input_guard = input_guard  # told of every finished message (flood_guard)
        self.max_producers = max_producers
        self._connections = set()  # descriptors of the producers' connections, served
        self.refusing = {}  # descriptor of a connection beyond the bound -> when to cut it
        self._counters = queue._counters
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
        queue = self._queue
        for _ in range(budget):
            try:
                msg = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            queue._current = msg[0]
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
                        codec.QUERY_REPLY, seq=h.seq, aux=queue._in_flight(),
                        engine=queue.instance)])
                elif h.kind == codec.STATUS:
                    self._counters["status_requests"] += 1
                    self._send(identity, [
                        codec.pack_header(codec.STATUS_REPLY, engine=queue.instance),
                        queue._status_reply()])
                else:
                    raise ProtocolError(f"message kind {h.kind} on the producer endpoint")
            except ProtocolError as exc:
                queue._garbage(exc)

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
            self._queue._peer_log.log(("put_invalid",), logging.WARNING,
                                      "TaskQueue %s: refused a producer's batch (%d so far): "
                                      "%s", self._queue.name, self._counters["puts_invalid"],
                                      exc)
            return self.reply(identity, h, codec.P_INVALID)
        size = sum(len(frame) for frame in payload)
        try:
            self._queue._check_encrypted_size(size)
        except ValueError as exc:
            self._counters["puts_too_large"] += 1
            return self._send(identity, [codec.pack_header(
                codec.PUT_REPLY, seq=h.seq, aux=codec.P_TOO_LARGE, engine=self._queue.instance),
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
                                                engine=self._queue.instance),
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
        queue = self._queue
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
                status, seq = queue._enqueue(frames, h.check, expired=now >= deadline)
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
                codec.QUERY_REPLY, seq=0, engine=self._queue.instance)], zmq.NOBLOCK)
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
            codec.PUT_REPLY, seq=h.seq, aux=status, engine=self._queue.instance, group=seq)])

    def _send(self, identity, frames):
        """Answer a producer or status asker without blocking; one that went away is
        simply gone, one that does not read its replies loses them."""
        try:
            self.sock.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._counters["sends_dropped_full"] += 1
        except zmq.ZMQError:
            self._counters["unreachable"] += 1


class TaskProducer:
    """Put into a ``TaskQueue`` that another process of this node owns.

    ``TaskProducer(name, *, dp_id=0)`` connects to the queue's node-local producer endpoint
    (``TaskQueue.producer_endpoint``; a private 0700 directory, so the same user only),
    whether the queue's workers are reached over ipc or tcp. For engines split over
    several processes (FastDeploy's per-DP-rank engine processes) that put into a queue
    one of them owns. The batches take the queue's path from there: same sequence
    numbers, bound, checksum, delivery and liveness. Batches go over the socket (never the
    shared-memory payload path).

    The constructor asks the queue once, waiting up to ``timeout`` seconds (also the
    bound on every later query's answer): ``ConnectionError`` when no queue of that name
    and dp_id answers on this node, ``ConnectionRefusedError`` (one) saying why when it
    serves as many producer connections as it may already (``MAX_PRODUCERS``).

    Thread-safe (one request at a time). Use as a context manager, or call ``close()``.
    """

    def __init__(self, name: str, *, dp_id: int = 0, timeout: float = 5.0):
        validate_name(name, dp_id)
        self.name, self.dp_id = name, dp_id
        self.endpoint = default_endpoint(name, dp_id, "put")
        check_ipc_endpoint(ipc_path(self.endpoint))
        self._timeout = timeout  # for a reply to a query or to a put once decided
        self._last_reason = ""  # the reason frame of the last reply that carried one
        self._lock = threading.Lock()
        self._request = 0
        ensure_free_fds(ENGINE_FDS, f"TaskProducer {name!r} dp_id={dp_id}")
        self._ctx = zmq.Context(io_threads=1)
        self._sock = new_socket(self._ctx, zmq.DEALER)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # replies are headers
        self._sock.connect(self.endpoint)
        self._closed = False
        try:
            self.num_tasks()
        except TaskSyncError as exc:
            self.close()
            raise ConnectionError(f"TaskProducer: no TaskQueue {name!r} dp_id={dp_id} answered "
                                  f"at {self.endpoint} within {timeout:g} s; is its engine "
                                  f"running on this node, as this user?") from exc

    def put_tasks(self, tasks, timeout: float = None) -> int:
        """As ``TaskQueue.put_tasks``: serialize, then wait for room, up to ``timeout``
        seconds (None = forever); return the queue's sequence number for the batch.

        Raises ``TypeError``/``ValueError`` for a batch that does not encode (nothing is
        sent), ``TimeoutError`` when there was no room within ``timeout`` (the queue says
        so; the batch was not enqueued), ``ClosedError`` when the queue closed, and
        ``TaskSyncError`` when no queue answers at all (none running, or it died) within
        ``timeout`` plus a few seconds: then whether the batch was enqueued is unknown.
        When the queue holds too many other producers' batches waiting for room
        (``P_BUSY``, only under a flood) it sends the batch again after a short pause
        (5 ms doubling to 200 ms) within the same ``timeout``."""
        limit = envs.max_message_bytes()  # the engine's bound for a PUT's frames
        parts = codec.encode_parts(tasks, max_body_bytes=limit)
        size = len(parts.body) + len(parts.offsets) + parts.data_size
        if size > limit:  # before the copy: the engine would drop the connection
            raise ValueError(f"TaskProducer {self.name!r}: the batch encodes to {size} bytes, "
                             f"above the {limit}-byte limit (FD_SYNC_MAX_MESSAGE_MB, the same "
                             f"on the engine and the workers); not sent")
        frames = parts.frames()
        check = codec.payload_checksum(frames)
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.005
        while True:
            # the queue holds the batch until room or this wait ends, then always answers
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            wait_ms = 2**62 if remaining is None else int(remaining * 1000)
            with self._lock:
                request = self._next_request()
                self._sock.send_multipart([codec.pack_header(
                    codec.PUT, seq=request, aux=wait_ms, check=check), *frames], copy=False)
                h = self._reply(request, codec.PUT_REPLY, None if remaining is None
                                else remaining + self._timeout)
            if h.aux != codec.P_BUSY:
                break
            if deadline is not None and time.monotonic() + pause > deadline:
                raise TimeoutError(f"TaskProducer {self.name!r}: the queue was busy with "
                                   f"other producers' batches for {timeout} s; not enqueued")
            time.sleep(pause)
            pause = min(pause * 2, 0.2)
        if h.aux == codec.P_ACCEPTED:
            return h.group
        if h.aux == codec.P_TIMEOUT:
            raise TimeoutError(f"TaskProducer {self.name!r}: no room in the queue within "
                               f"{timeout} s (max_inflight batches not yet consumed by every "
                               f"rank: see fastdeploy-sync status {self.name}); not enqueued")
        if h.aux == codec.P_CLOSED:
            raise ClosedError(f"TaskProducer {self.name!r}: the queue is closed; not enqueued")
        if h.aux == codec.P_TOO_LARGE:
            raise ValueError(f"TaskProducer {self.name!r}: the queue refused the batch: "
                             f"{self._last_reason}; not enqueued")
        raise ProtocolError(f"TaskProducer {self.name!r}: the queue refused the batch "
                            f"(status {h.aux}); not enqueued")

    def num_tasks(self) -> int:
        """Batches put but not yet consumed by every rank (one round trip, ~100 µs)."""
        with self._lock:
            request = self._next_request()
            self._sock.send(codec.pack_header(codec.QUERY, seq=request))
            return self._reply(request, codec.QUERY_REPLY, self._timeout).aux

    def exist_tasks(self) -> bool:
        """True while some batch is not yet consumed by every rank."""
        return self.num_tasks() > 0

    def ranks(self) -> list:
        """The queue's ``TaskQueue.ranks()``, through ``status()``."""
        return self.status()["ranks"]

    def status(self) -> dict:
        """The queue's ``TaskQueue.status()`` (per-rank states included)."""
        with self._lock:
            self._sock.send(codec.pack_header(codec.STATUS))
            deadline = time.monotonic() + self._timeout
            while True:
                frames = self._recv(deadline)
                h = codec.unpack_header(frames[0])
                if h.kind == codec.STATUS_REPLY and len(frames) == 2:
                    return json.loads(frames[1])

    def close(self) -> None:
        """Close the socket. Idempotent; never blocks."""
        if not self._closed:
            self._closed = True
            self._ctx.destroy(linger=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _next_request(self) -> int:
        if self._closed:
            raise ClosedError(f"TaskProducer {self.name!r} is closed")
        self._request += 1
        return self._request

    def _recv(self, deadline):
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and (remaining <= 0 or not self._sock.poll(remaining * 1000)):
            raise TaskSyncError(f"TaskProducer {self.name!r}: no TaskQueue answered at "
                                f"{self.endpoint} (none running, or it died); a batch being "
                                f"put may or may not have been enqueued")
        return self._sock.recv_multipart()

    def _header(self, frames):
        """The header of a reply; ``ConnectionRefusedError`` (saying why) if the queue
        refused this producer (``E_TOO_MANY``: it serves as many as it may)."""
        h = codec.unpack_header(frames[0])
        self._last_reason = (frames[1][:1024].decode("utf-8", "replace") if len(frames) > 1
                             else "")
        if h.kind == codec.ERROR:
            reason = frames[1][:1024].decode("utf-8", "replace") if len(frames) > 1 else ""
            raise ConnectionRefusedError(f"TaskProducer {self.name!r}: the TaskQueue at "
                                         f"{self.endpoint} refused this producer: {reason}")
        return h

    def _reply(self, request, kind, timeout):
        """The reply of ``kind`` to ``request``, skipping stale replies of earlier requests
        whose caller gave up. ``timeout=None`` (a put with no bound) still notices a queue
        that is gone: while nothing comes, it asks the queue (QUERY, request id 0) every
        ``self._timeout`` seconds and gives up when that is not answered either."""
        if timeout is not None:
            deadline = time.monotonic() + timeout
            while True:
                h = self._header(self._recv(deadline))
                if h.kind == kind and h.seq == request:
                    return h
        heard = time.monotonic()
        asked = False
        while True:
            if self._sock.poll(self._timeout * 1000):
                h = self._header(self._sock.recv_multipart())
                heard, asked = time.monotonic(), False
                if h.kind == kind and h.seq == request:
                    return h
            elif not asked:
                self._sock.send(codec.pack_header(codec.QUERY, seq=0))  # still there?
                asked = True
            else:
                raise TaskSyncError(
                    f"TaskProducer {self.name!r}: the TaskQueue at {self.endpoint} stopped "
                    f"answering ({time.monotonic() - heard:.1f} s); the batch may or may not "
                    f"have been enqueued")
