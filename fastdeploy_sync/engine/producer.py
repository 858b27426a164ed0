"""``TaskProducer``: engine processes other than the queue's own put through it.

FastDeploy splits its engine over several processes (one per DP rank); one of them owns the
``TaskQueue``, the others put through ``TaskProducer``. The queue's side of the endpoint is
``engine.producer_endpoint``: node-local (an ``ipc://`` socket in the private 0700
directory, so the same user only), with its own socket, so that the workers' socket keeps
its small message bound. A PUT is checked before it is enqueued, so that no worker is ever
sent bytes it will refuse, and waits in the endpoint until the queue has room or the
producer's own wait runs out.
"""

import json
import threading
import time
from typing import Any, Optional

import zmq

from .. import envs
from ..errors import ClosedError, ProtocolError, TaskSyncError
from ..forks import refuse_in_child
from ..wire import codec
from ..wire.endpoints import check_ipc_endpoint, default_endpoint, ipc_path, validate_name
from ..wire.sockets import ENGINE_FDS, ensure_free_fds, new_socket

__all__ = ["TaskProducer"]


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
    serves as many producer connections as it may already (``engine.producer_endpoint.MAX_PRODUCERS``).

    Thread-safe (one request at a time). Use as a context manager, or call ``close()``.
    In a child forked from its process every call raises ``ForkedProcessError`` and
    ``close()`` does nothing (``forks``).
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
        self._fork_guard = refuse_in_child(self, f"TaskProducer {name!r} dp_id={dp_id}",
                                           idle={"close": None})
        try:
            self.num_tasks()
        except TaskSyncError as exc:
            self.close()
            raise ConnectionError(f"TaskProducer: no TaskQueue {name!r} dp_id={dp_id} answered "
                                  f"at {self.endpoint} within {timeout:g} s; is its engine "
                                  f"running on this node, as this user?") from exc

    def put_tasks(self, tasks: Any, timeout: Optional[float] = None) -> int:
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
        """Batches put but not yet consumed by every rank (one round trip to the queue)."""
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

    def __enter__(self) -> "TaskProducer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _next_request(self) -> int:
        if self._closed:
            raise ClosedError(f"TaskProducer {self.name!r} is closed")
        self._request += 1
        return self._request

    def _recv(self, deadline: Optional[float]) -> list:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and (remaining <= 0 or not self._sock.poll(int(remaining * 1000))):
            raise TaskSyncError(f"TaskProducer {self.name!r}: no TaskQueue answered at "
                                f"{self.endpoint} (none running, or it died); a batch being "
                                f"put may or may not have been enqueued")
        return self._sock.recv_multipart()

    def _header(self, frames: list) -> codec.Header:
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

    def _reply(self, request: int, kind: int, timeout: Optional[float]) -> codec.Header:
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
            if self._sock.poll(int(self._timeout * 1000)):  # ms (pyzmq truncates floats too)
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
