"""Engine side: ``TaskQueue``, the queue the engine puts task batches into.

Every batch gets a sequence number and is kept until every TP rank of the group has
acknowledged taking it. An I/O thread owns the ROUTER socket: it delivers new batches to
every connected rank, replays the retained ones to a rank that connects late (so no
batch is lost to ZeroMQ's slow-joiner effect, even while the engine's own code is busy),
answers heartbeats, and applies acknowledgements, which free room for ``put_tasks()``.

Acknowledgements arrive two ways: as ACK messages (``tcp://`` endpoints), or, when the
engine is node-local (``ipc://``), on the ack board in shared memory, which costs the
worker one store instead of a send (see ``ack_board``). The board is read whenever the
engine needs a count or room; a ``put_tasks()`` blocked on the bound re-reads it with a
short sleeping backoff (50 µs doubling to 1 ms).

Worker groups and their lives. The ranks that serve the queue form one *group*, named by
an incarnation id the ranks agree on (``tp_group``); each rank's process has its own
worker id. The engine serves one group at a time:
  * a rank's place belongs to the worker that first took it; another worker asking for
    it while the holder is heard from is refused (``E_PLACE_TAKEN``);
  * when a rank of the group goes silent for the heartbeat timeout, or a new process
    takes a rank whose holder died, the group is *retired*: its live ranks are told
    (they raise ``GroupLostError``), every batch the group did not finish is handed back
    to the engine's code as a ``GroupLost`` event (``group_events``), and the queue waits
    for a new group, which receives only what is put from then on;
  * a new group (a new incarnation) that asks while the old one is still heard from is
    held back until the old one is gone, and refused if it stays alive.
Sequence numbers on the wire are relative to the group (every group starts at 1), so a
new group never sees the previous group's numbering; ``put_tasks()`` returns the queue's
own, global number.

Lock invariant: ``_mutex`` guards ``_next_seq``, ``_retained``, ``_consumed``, ``_base``,
``_group`` and ``_error``; ``_not_full`` is a condition on it, notified whenever the
slowest rank's acknowledgement advances, a group is retired or the queue closes. Only the
I/O thread touches the socket.
"""

import bisect
import collections
import json
import logging
import os
import queue
import secrets
import threading
import time
import weakref

import zmq

from . import codec, envs
from .ack_board import AckBoard
from .auth import ServerAuth
from .batch_encoder import BatchEncoder
from .errors import ClosedError, EndpointInUseError, ProtocolError, TaskSyncError
from .liveness import CONNECTED, NEVER, Heartbeat, RankLink
from .logs import RateLimitedLog
from .shm import unlink_segment
from .transport import (ENGINE_FDS, WakePipe, claim_ipc_path, default_endpoint,
                        ensure_free_fds, ipc_path, new_socket, secure_socket_file,
                        unlink_quietly, validate_name)

__all__ = ["TaskQueue", "TaskProducer", "GroupLost", "LostBatch", "query_status"]

log = logging.getLogger(__name__)

# A put_tasks() blocked on the bound re-reads the ack board at this pace (doubling).
_BOARD_POLL_MIN_S = 50e-6
_BOARD_POLL_MAX_S = 1e-3
# Workers only send small messages (HELLO, ACK, PING): anything larger is not ours, and
# ZeroMQ drops the connection instead of allocating it.
_MAX_INBOUND_BYTES = 64 * 1024
# How long close() lets CLOSE messages leave before dropping them (a gone worker must not
# make close() hang).
_CLOSE_LINGER_MS = 1000
# Incarnations of retired groups remembered, to refuse their stragglers precisely.
_RETIRED_MEMORY = 64


# Delivery latency (put -> consumed by every rank) histogram, upper bounds in seconds (the
# last bucket is +Inf). Fixed, so that observing is one bisect and an add; read by stats().
DELIVERY_BOUNDS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0)
# Why a group was retired, by kind: the first keyword of _retire's reason found (metrics).
RETIREMENT_KINDS = (("silent", "silent"), ("restarted", "rank_restarted"),
                    ("replaced", "replaced"), ("left", "left"))


class LostBatch:
    """A batch a retired group did not finish: ``seq`` (as ``put_tasks()`` returned it),
    ``tasks`` (the object put, decoded again from the retained bytes: numpy arrays in it
    are read-only) and ``taken_by`` (the ranks known to have taken it; empty if none did)."""

    __slots__ = ("seq", "tasks", "taken_by")

    def __init__(self, seq, tasks, taken_by):
        self.seq, self.tasks, self.taken_by = seq, tasks, taken_by

    def __repr__(self):
        return f"LostBatch(seq={self.seq}, taken_by={self.taken_by})"


class GroupLost:
    """Event: the engine retired a worker group (see the module docstring).

    ``incarnation`` (int), ``reason`` (str), ``at`` (wall-clock time), ``ranks`` (one dict
    per rank: state, since, silent_s, worker, reason) and ``unfinished``: the
    ``LostBatch`` es it had not finished on every rank, in put order. The engine's
    scheduler should re-queue (or fail) their requests: a new group starts from an empty
    model state and receives only batches put after this event."""

    __slots__ = ("incarnation", "reason", "at", "ranks", "unfinished")

    def __init__(self, incarnation, reason, at, ranks, unfinished):
        self.incarnation, self.reason, self.at = incarnation, reason, at
        self.ranks, self.unfinished = ranks, unfinished

    def __repr__(self):
        return (f"GroupLost(incarnation={self.incarnation:#x}, reason={self.reason!r}, "
                f"unfinished={[b.seq for b in self.unfinished]})")


class _Group:
    """The worker group the queue currently serves (I/O thread writes, others read)."""

    __slots__ = ("incarnation", "epoch", "links")

    def __init__(self, incarnation, epoch, tp_size):
        self.incarnation, self.epoch = incarnation, epoch
        self.links = [RankLink(r) for r in range(tp_size)]


class TaskQueue:
    """The engine's end of one TP group's task channel.

    ``TaskQueue(name, tp_size, *, dp_id=0, endpoint=None, max_inflight=8)`` binds at once.
    ``endpoint=None`` derives a node-local ``ipc://`` endpoint from ``name`` and ``dp_id``
    (workers built with the same name and dp_id find it); ``tcp://host:port`` binds there
    (``tcp://127.0.0.1:0`` picks a free port: read it back from ``.endpoint``).

    ``max_inflight`` bounds the batches put but not yet consumed by every rank;
    ``max_inflight=1`` reproduces FastDeploy's one-batch-at-a-time behaviour.

    ``heartbeat``: a ``liveness.Heartbeat`` (None: from ``FD_SYNC_HEARTBEAT_INTERVAL`` /
    ``FD_SYNC_HEARTBEAT_TIMEOUT``, default 1 s / 3 s). A rank silent for the timeout is
    reported disconnected and its group retired (``group_events``).

    Security: a ``tcp://`` endpoint uses ZeroMQ CURVE with the keys in ``keys_dir`` (None:
    ``FD_SYNC_KEYS_DIR``; see ``auth``): only allowlisted workers can connect, and the
    traffic is encrypted. Without keys it raises ``AuthenticationError`` saying how to make
    them, unless ``insecure_tcp=True`` (or ``FD_SYNC_INSECURE_TCP=1``), which logs a
    warning. ``ipc://`` endpoints live in a private 0700 directory (``transport``).

    ``group_events``: a ``queue.SimpleQueue`` of ``GroupLost`` events, one per retired
    worker group, with the batches it did not finish. Poll it from the engine's loop
    (``group_events.get_nowait()``) and re-queue their requests.

    Thread-safe: ``put_tasks`` and the queries may be called from any thread.
    Use as a context manager, or call ``close()``.
    """

    def __init__(self, name: str, tp_size: int, *, dp_id: int = 0, endpoint: str = None,
                 max_inflight: int = 8, heartbeat: Heartbeat = None, keys_dir: str = None,
                 insecure_tcp: bool = None):
        validate_name(name, dp_id)
        if type(tp_size) is not int or tp_size < 1:
            raise ValueError(f"tp_size={tp_size!r}: expected an int >= 1")
        if type(max_inflight) is not int or max_inflight < 1:
            raise ValueError(f"max_inflight={max_inflight!r}: expected an int >= 1")
        self.name, self.tp_size, self.dp_id, self.max_inflight = name, tp_size, dp_id, max_inflight
        self.heartbeat = heartbeat or Heartbeat()
        self._max_batch_bytes = envs.max_message_bytes()
        self._mutex = threading.Lock()
        self._not_full = threading.Condition(self._mutex)
        self._next_seq = 1
        self._retained = collections.OrderedDict()  # global seq -> (payload frames, checksum)
        self._base = 0  # the global seq before the current group's first batch
        self._consumed = [0] * tp_size  # highest global seq acknowledged by each rank
        self._group = None  # the _Group being served, None before the first / after a retire
        self._previous = None  # the last retired group, for ranks() until a new one comes
        self._error = None  # an I/O thread failure, re-raised by every call
        # Stamped on every message to workers and echoed by them: traffic meant for another
        # engine of the same endpoint (a restart) is recognised on both sides.
        self.instance = secrets.randbits(63) | 1
        self._closed = False  # put_tasks() refused from now on
        self._stop = False  # close() has drained: the I/O thread says CLOSE and exits
        self._counters = collections.Counter()
        self.group_events = queue.SimpleQueue()
        # Delivery metrics (stats()["delivery_s"]): put time per retained seq, under _mutex
        self._put_times = {}
        self._delivery = [0] * (len(DELIVERY_BOUNDS_S) + 1) + [0.0]  # bucket counts, sum
        self._retirements = collections.Counter()

        # libzmq aborts the process when it runs out of fds: fail here, cleanly, instead
        ensure_free_fds(ENGINE_FDS + 2 * tp_size, f"TaskQueue {name!r} dp_id={dp_id}")
        endpoint = endpoint or default_endpoint(name, dp_id)
        self._ctx = zmq.Context(io_threads=1)
        try:
            self._auth = ServerAuth.start(self._ctx, endpoint, keys_dir, insecure_tcp)
        except BaseException:
            self._ctx.term()
            raise
        self._sock = new_socket(self._ctx, zmq.ROUTER)
        # Mandatory: a send to a rank that went away raises (EHOSTUNREACH) instead of
        # vanishing; every send goes through _send(), which handles it.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.MAXMSGSIZE, _MAX_INBOUND_BYTES)
        self.heartbeat.configure_socket(self._sock)
        if self._auth is not None:
            self._auth.apply(self._sock)
        self._ipc_path = ipc_path(endpoint)
        # The put path's encoding, and the shared memory its batches hold (node-local
        # ranks map large batches from shared memory; tcp ranks cannot).
        self._encoder = BatchEncoder(name, dp_id, tp_size, node_local=bool(self._ipc_path),
                                     max_message_bytes=self._max_batch_bytes)
        self._board = None
        try:
            if self._ipc_path:
                claim_ipc_path(self._ipc_path)
                # before bind: a worker that was welcomed always finds the board
                try:
                    self._board = AckBoard.create(name, dp_id, tp_size)
                except FileExistsError as exc:
                    raise EndpointInUseError(f"TaskQueue {name!r} dp_id={dp_id}: {exc}") from None
                # no live engine holds the name (the board says so): what shared batches
                # are left of this name were a killed engine's
                self._encoder.reclaim_stale()
            self._sock.bind(endpoint)
            if self._ipc_path:
                secure_socket_file(self._ipc_path)
        except BaseException:
            if self._board is not None:
                self._board.close()
            self._sock.close(linger=0)
            if self._auth is not None:
                self._auth.close()
            self._ctx.term()
            raise
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # The producer endpoint: node-local, for engine processes other than this one
        # (TaskProducer). Its own socket, so that the workers' socket keeps its 64 KiB
        # bound; same-user only, like every node-local endpoint.
        self.producer_endpoint = default_endpoint(name, dp_id, "put")
        self._put_path = ipc_path(self.producer_endpoint)
        self._put_sock = new_socket(self._ctx, zmq.ROUTER)
        self._put_sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._put_sock.setsockopt(zmq.MAXMSGSIZE, self._max_batch_bytes + 4096)
        try:
            claim_ipc_path(self._put_path)
            self._put_sock.bind(self.producer_endpoint)
            secure_socket_file(self._put_path)
        except BaseException:
            self._put_sock.close(linger=0)
            self._sock.close(linger=0)
            if self._board is not None:
                self._board.close()
            if self._auth is not None:
                self._auth.close()
            self._ctx.term()
            unlink_quietly(self._ipc_path)
            raise
        self._pending_puts = collections.deque()  # (deadline, identity, header, frames); I/O thread
        # Process exit without close(): still remove the names others would trip on.
        self._finalizer = weakref.finalize(self, _remove_names, self._ipc_path,
                                           self._board.name if self._board else None,
                                           self._put_path)
        # I/O thread only:
        self._epochs = 0  # groups served so far; tags the ack board (see ack_board)
        self._parked = []  # HELLOs of a new group waiting for the old one to go: (since, identity, header, name)
        self._retired = collections.deque(maxlen=_RETIRED_MEMORY)  # incarnations
        self._peer_log = RateLimitedLog(log)
        self._current = None  # the frame being handled (its peer address, for logs)
        self._wake = WakePipe()
        self._thread = threading.Thread(target=self._io_main, name=f"fdsync-engine-{name}",
                                        daemon=True)
        self._thread.start()

    # -- engine API ------------------------------------------------------------------------

    def put_tasks(self, tasks, timeout: float = None) -> int:
        """Enqueue one batch for every rank of the group; return its sequence number.

        ``tasks`` is any picklable object, typically ``(list_of_requests, real_bsz)``;
        numpy arrays inside it travel as zero-copy frames (see ``codec``). It is
        serialized before anything is enqueued: an unpicklable batch raises ``TypeError``,
        a message larger than ``FD_SYNC_MAX_MESSAGE_MB`` raises ``ValueError``, and the
        queue is unchanged.

        Node-local engine (``ipc://``): a batch whose out-of-band arrays take at least
        ``FD_SYNC_SHM_PAYLOAD_MIN_KB`` (default 1 MiB) is copied once into shared memory,
        which every rank maps read-only (``payload_shm``); only the pickle body and a small
        reference travel over the socket, so the message limit applies to them and the
        arrays are bounded by ``codec.MAX_DATA_BYTES``. When shared memory has no room
        (``/dev/shm`` small or full) the batch goes over the socket instead, never refused
        for it (``batch_encoder``). Either way the arrays are copied once before this
        returns: mutating them afterwards does not change the batch.

        Blocks while ``max_inflight`` batches are not yet consumed by every rank.
        ``timeout`` (seconds, None = forever): raises ``TimeoutError`` naming the ranks that
        are behind and their state; the batch is then not enqueued. Raises ``ClosedError``
        after ``close()`` and ``TaskSyncError`` (chained) if the I/O thread failed.
        """
        batch = self._encoder.encode(tasks)
        deadline = None if timeout is None else time.monotonic() + timeout
        backoff = _BOARD_POLL_MIN_S
        try:
            with self._not_full:
                while True:
                    self._check_usable()
                    self._read_board()
                    if self._next_seq - 1 - min(self._consumed) < self.max_inflight:
                        break
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"put_tasks timed out after {timeout}s: "
                                           f"{self._describe_backlog()}")
                    if self._board is not None:  # the board notifies nobody: re-read it soon
                        remaining = backoff if remaining is None else min(remaining, backoff)
                        backoff = min(backoff * 2, _BOARD_POLL_MAX_S)
                    self._not_full.wait(remaining)
                seq = self._next_seq
                self._next_seq += 1
                self._retained[seq] = (batch.frames, batch.checksum)
                self._put_times[seq] = time.monotonic()
                self._encoder.keep(seq, batch)
        except BaseException:
            self._encoder.discard(batch)  # not enqueued: nobody will ever map it
            raise
        self._wake.wake()
        return seq

    def num_tasks(self) -> int:
        """Batches put but not yet consumed by every rank. Never blocks on the workers."""
        with self._mutex:
            self._read_board()
            return self._next_seq - 1 - min(self._consumed)

    def exist_tasks(self) -> bool:
        """True while some batch is not yet consumed by every rank."""
        return self.num_tasks() > 0

    def ranks(self) -> list:
        """Every rank's state in the current group: a dict per rank with ``state``
        (``connected``, ``disconnected`` or ``never connected``), ``since`` (wall-clock
        time of the last change), ``silent_s`` (seconds since it was last heard from),
        ``worker`` (its worker id), ``reason`` (why it is disconnected) and ``consumed``.
        True within the heartbeat timeout. Never blocks on the workers."""
        now = time.monotonic()
        with self._mutex:
            self._read_board()
            group, consumed = self._group or self._previous, list(self._consumed)
        if group is None:
            return [{"rank": r, "state": NEVER, "since": None, "silent_s": None,
                     "worker": None, "reason": None, "consumed": consumed[r]}
                    for r in range(self.tp_size)]
        out = []
        for link in group.links:
            snap = link.snapshot(now)
            snap["consumed"] = consumed[link.rank]
            out.append(snap)
        return out

    def stats(self) -> dict:
        """Counters (``garbage_frames``, ``acks``, ``hellos``, ``rejected``, ``stale``,
        ``pings``, ``sent``, ``groups_retired``...), the last seq put, every rank's consumed
        seq and state (see ``ranks()``), the group's incarnation; ``retirements``: retired
        groups by kind (``silent``, ``rank_restarted``, ``replaced``, ``left``, ``other``);
        ``delivery_s``: the put -> consumed-by-every-rank latency histogram ``{"bounds":
        upper bounds in s, "counts": per bucket (the last is +Inf), "sum": s, "count": n}``.
        Cheap; for logs and metrics (``fastdeploy_sync.metrics``)."""
        with self._mutex:
            self._read_board()
            out = dict(self._counters)
            out.update(last_seq=self._next_seq - 1, consumed=list(self._consumed),
                       retained=len(self._retained), retirements=dict(self._retirements),
                       delivery_s={"bounds": list(DELIVERY_BOUNDS_S),
                                   "counts": self._delivery[:-1], "sum": self._delivery[-1],
                                   "count": sum(self._delivery[:-1])})
            group = self._group
        out["group"] = f"{group.incarnation:016x}" if group else None
        out["ranks"] = self.ranks()
        out.update(self._encoder.stats())  # shm_*: which path large batches took
        return out

    def status(self) -> dict:
        """Everything ``fastdeploy-sync status`` shows: the queue's name, dp_id, tp_size,
        endpoint, engine instance and ``stats()`` (per-rank state and watermarks included).
        JSON-serialisable. Never blocks on the workers."""
        out = {"name": self.name, "dp_id": self.dp_id, "tp_size": self.tp_size,
               "endpoint": self.endpoint, "engine": f"{self.instance:016x}",
               "max_inflight": self.max_inflight, "pid": os.getpid()}
        out.update(self.stats())
        return out

    def close(self, timeout: float = 5.0) -> list:
        """Close the queue: drain, tell the workers, stop. Idempotent; returns the seqs that
        were put but not consumed by every rank (``[]`` after a clean drain).

        First waits, up to ``timeout`` seconds and only while some rank of the group is
        connected, until every rank has taken every batch put; new ``put_tasks()`` calls
        raise ``ClosedError`` from the start. Then sends every connected rank what it still
        lacks and a CLOSE message (workers raise ``EngineClosedError`` once they have taken
        everything they were sent), and stops the I/O thread (up to ~5 s) and the socket
        (up to 1 s for the CLOSE messages to leave). What was not consumed is logged.
        """
        deadline = time.monotonic() + max(0.0, timeout)
        backoff = _BOARD_POLL_MIN_S
        with self._not_full:
            if self._closed:
                return []
            self._closed = True
            self._not_full.notify_all()
            while self._error is None:
                self._read_board()
                if min(self._consumed) >= self._next_seq - 1 or not self._group_connected():
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._not_full.wait(min(remaining, backoff) if self._board else remaining)
                backoff = min(backoff * 2, _BOARD_POLL_MAX_S)
            low = min(self._consumed)
            unconsumed = list(range(low + 1, self._next_seq))
            if unconsumed:
                log.warning("TaskQueue %s closing with %d batch(es) not consumed by every rank: %s",
                            self.name, len(unconsumed), self._describe_backlog())
            self._stop = True
        self._wake.wake()
        self._thread.join(timeout=5.0)
        if self._thread.is_alive():
            log.error("TaskQueue %s: I/O thread did not stop within 5 s", self.name)
            return unconsumed  # leave the socket to the thread rather than close it under its feet
        self._sock.close()  # the I/O thread set a short linger for the CLOSE messages
        self._put_sock.close()
        if self._auth is not None:
            self._auth.close()
        self._ctx.term()
        self._wake.close()
        if self._board is not None:
            self._board.close()
        self._encoder.close()  # the I/O thread has stopped: nothing sends them now
        unlink_quietly(self._ipc_path)
        unlink_quietly(self._put_path)
        self._finalizer.detach()
        return unconsumed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- helpers (under _mutex) ------------------------------------------------------------

    def _check_usable(self):
        if self._error is not None:
            raise TaskSyncError(f"TaskQueue {self.name}: the I/O thread failed") from self._error
        if self._closed:
            raise ClosedError(f"TaskQueue {self.name} is closed")

    def _group_connected(self) -> bool:
        group = self._group
        return group is not None and any(link.state == CONNECTED for link in group.links)

    def _read_board(self):
        """Fold the ack board into ``_consumed`` (under ``_mutex``). Entries tagged with
        another group's epoch (a retired group's straggler) are ignored."""
        group = self._group
        if self._board is None or group is None:
            return
        last = self._next_seq - 1
        for rank, (epoch, rel) in enumerate(self._board.read()):
            if epoch != group.epoch:
                continue
            seq = self._base + rel
            if seq > self._consumed[rank]:
                if seq > last:
                    self._counters["garbage_acks"] += 1  # not ours to trust; ignore
                    continue
                self._consume(rank, seq)

    def _consume(self, rank, seq):
        """Rank ``rank`` has consumed up to ``seq`` (> its previous value; under ``_mutex``):
        free what every rank has consumed and wake blocked puts."""
        low_before = min(self._consumed)
        self._consumed[rank] = seq
        low = min(self._consumed)
        if low > low_before:
            now = time.monotonic()
            for s in range(low_before + 1, low + 1):
                put_at = self._put_times.pop(s, None)
                if put_at is not None:  # delivered to every rank: one observation
                    self._delivery[bisect.bisect_left(DELIVERY_BOUNDS_S, now - put_at)] += 1
                    self._delivery[-1] += now - put_at
                self._retained.pop(s, None)
                self._encoder.release(s)  # every rank mapped it when it received it
            self._not_full.notify_all()

    def _describe_backlog(self) -> str:
        last = self._next_seq - 1
        low = min(self._consumed)
        group = self._group
        behind = []
        for rank, consumed in enumerate(self._consumed):
            if consumed == low:
                state = (group.links[rank].describe() if group is not None else
                         NEVER if self._previous is None else
                         f"its group was retired ({self._previous.links[rank].describe()}); "
                         f"waiting for a new worker group")
                behind.append(f"rank {rank} consumed up to seq {consumed} of {last} ({state})")
        return (f"{last - low} batch(es) in flight (max_inflight={self.max_inflight}); "
                f"behind: " + "; ".join(behind))

    # -- I/O thread ------------------------------------------------------------------------

    def _io_main(self):
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._put_sock, zmq.POLLIN)
        poller.register(self._wake.r, zmq.POLLIN)
        tick_s = self.heartbeat.interval / 2
        next_tick = time.monotonic() + tick_s
        try:
            while True:
                # blocks with the GIL released; wakes for the liveness tick at the latest,
                # and every millisecond while a producer waits for room (the ack board
                # notifies nobody)
                wait_ms = max(0.0, next_tick - time.monotonic()) * 1000
                if self._pending_puts:
                    wait_ms = min(wait_ms, 1.0)
                events = dict(poller.poll(wait_ms))
                if self._wake.r in events:
                    self._wake.drain()
                if self._stop:
                    self._finish_close()
                    return
                if self._sock in events:
                    self._receive_all()
                if self._put_sock in events:
                    self._receive_puts()
                if self._pending_puts:
                    self._serve_pending_puts()
                now = time.monotonic()
                if now >= next_tick:
                    # the next tick: in tick_s, or when a rank's silence would reach the
                    # timeout, whichever comes first (so silence is reported on time)
                    next_tick = min(now + tick_s, self._tick(now))
                self._send_new()
        except Exception as exc:
            log.exception("TaskQueue %s: I/O thread failed", self.name)
            with self._not_full:
                self._error = exc
                self._not_full.notify_all()

    def _finish_close(self):
        while self._pending_puts:
            _, identity, h, _ = self._pending_puts.popleft()
            self._put_reply(identity, h, codec.P_CLOSED)
        self._put_sock.setsockopt(zmq.LINGER, _CLOSE_LINGER_MS)
        self._send_new()
        group = self._group
        if group is not None:
            last = self._next_seq - 1 - self._base
            for link in group.links:
                if link.identity is not None:
                    self._send(link, [codec.pack_header(
                        codec.CLOSE, link.rank, self.tp_size, seq=last, engine=self.instance,
                        group=group.incarnation, worker=link.worker)])
        self._sock.setsockopt(zmq.LINGER, _CLOSE_LINGER_MS)

    def _send(self, link_or_identity, frames) -> bool:
        """Send to a peer; False (and the rank marked unreachable) if its socket is gone.
        The only place the I/O thread sends: a peer that went away can never kill it."""
        link = link_or_identity if isinstance(link_or_identity, RankLink) else None
        identity = link.identity if link is not None else link_or_identity
        if identity is None:
            return False
        try:
            self._sock.send_multipart([identity, *frames], copy=False)
            return True
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                self._counters["send_errors"] += 1
                self._peer_log.log(("send", exc.errno), logging.WARNING,
                                   "TaskQueue %s: send failed: %s", self.name, exc)
            self._counters["unreachable"] += 1
            if link is not None and link.identity is not None:
                # INFO: a rank closing first is the normal shutdown order; a rank that
                # stays away is reported (WARNING) when its silence retires the group
                log.info("TaskQueue %s: rank %d's socket went away", self.name, link.rank)
                link.disconnect("its socket closed")
            return False

    def _receive_all(self):
        while True:
            try:
                msg = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._current = msg[0]  # for _peer(): where the message came from
            try:
                self._handle([frame.bytes for frame in msg])
            except ProtocolError as exc:
                self._garbage(exc)

    def _peer(self) -> str:
        """The address the current message came from (tcp: its IP; ipc: "local"). Logs are
        rate-limited per address, not per connection, so a peer that reconnects in a loop
        cannot flood them."""
        try:
            return self._current.get("Peer-Address") or "local"
        except (zmq.ZMQError, AttributeError):
            return "unknown"

    def _garbage(self, exc):
        self._counters["garbage_frames"] += 1
        peer = self._peer()
        self._peer_log.log(("garbage", peer), logging.WARNING,
                           "TaskQueue %s: dropped an undecodable message from %s (%d so far): "
                           "%s", self.name, peer, self._counters["garbage_frames"], exc)

    def _handle(self, frames):
        if len(frames) < 2:
            raise ProtocolError(f"{len(frames)} frame(s), expected identity + header")
        identity, header = frames[0], codec.unpack_header(frames[1])
        if not 0 <= header.rank < self.tp_size:
            raise ProtocolError(f"rank {header.rank} out of range")
        if header.kind == codec.HELLO:
            self._counters["hellos"] += 1
            name = frames[2] if len(frames) == 3 else b""
            self._hello(identity, header, name, time.monotonic())
        elif header.kind == codec.ACK:
            self._ack(header)
        elif header.kind == codec.PING:
            self._ping(identity, header)
        elif header.kind == codec.STATUS:
            # Only peers that passed authentication get here (CURVE on tcp, the private
            # directory on ipc): the same people who could run a worker.
            self._counters["status_requests"] += 1
            self._send(identity, [codec.pack_header(codec.STATUS_REPLY, engine=self.instance),
                                  json.dumps(self.status()).encode()])
        else:
            raise ProtocolError(f"a worker sent message kind {header.kind}")

    def _reject(self, identity, header, code, reason, detail=None):
        """Refuse a peer: it learns ``reason`` (nothing about the queue: no name, tp_size
        or watermark), the log gets ``detail`` too, at most once per peer and interval."""
        self._counters["rejected"] += 1
        peer = self._peer()
        self._peer_log.log(("reject", peer, code), logging.WARNING,
                           "TaskQueue %s: rejected a worker from %s claiming rank %d (%d "
                           "rejected so far): %s", self.name, peer, header.rank,
                           self._counters["rejected"], detail or reason)
        self._send(identity, [codec.pack_header(codec.ERROR, header.rank, aux=code,
                                                engine=self.instance, group=header.group,
                                                worker=header.worker), reason.encode()])

    # -- producer endpoint (TaskProducer; node-local, same user) -----------------------------

    def _receive_puts(self):
        while True:
            try:
                msg = self._put_sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._current = msg[0]
            try:
                if len(msg) < 2:
                    raise ProtocolError(f"{len(msg)} frame(s) on the producer endpoint")
                identity, h = msg[0].bytes, codec.unpack_header(msg[1].buffer)
                if h.kind == codec.PUT:
                    self._on_put(identity, h, msg[2:])
                elif h.kind == codec.QUERY:
                    with self._mutex:
                        self._read_board()
                        in_flight = self._next_seq - 1 - min(self._consumed)
                    self._send_to(self._put_sock, identity, [codec.pack_header(
                        codec.QUERY_REPLY, seq=h.seq, aux=in_flight, engine=self.instance)])
                elif h.kind == codec.STATUS:
                    self._send_to(self._put_sock, identity, [
                        codec.pack_header(codec.STATUS_REPLY, engine=self.instance),
                        json.dumps(self.status()).encode()])
                else:
                    raise ProtocolError(f"message kind {h.kind} on the producer endpoint")
            except ProtocolError as exc:
                self._garbage(exc)

    def _on_put(self, identity, h, payload):
        """A producer's batch: checked (its checksum and shape, so that no worker is ever
        sent bytes it will refuse), then enqueued as ``put_tasks()`` would, or held until
        there is room or the producer's wait (``aux`` ms) runs out."""
        if len(payload) not in (1, 3) or codec.payload_checksum(payload) != h.check:
            self._counters["puts_invalid"] += 1
            return self._put_reply(identity, h, codec.P_INVALID)
        frames = [frame.bytes for frame in payload]
        self._pending_puts.append((time.monotonic() + h.aux / 1000, identity, h, frames))
        self._serve_pending_puts()

    def _serve_pending_puts(self):
        """Enqueue waiting producer batches, in arrival order, while there is room; answer
        those whose producer stopped waiting. I/O thread only."""
        now = time.monotonic()
        while self._pending_puts:
            deadline, identity, h, frames = self._pending_puts[0]
            with self._not_full:
                if self._closed:
                    seq, status = 0, codec.P_CLOSED
                else:
                    self._read_board()
                    if self._next_seq - 1 - min(self._consumed) < self.max_inflight:
                        seq, status = self._next_seq, codec.P_ACCEPTED
                        self._next_seq += 1
                        self._retained[seq] = (frames, h.check)
                        self._put_times[seq] = now
                    elif now >= deadline:
                        seq, status = 0, codec.P_TIMEOUT
                    else:
                        return  # no room yet: the head waits, and so does everyone behind it
            self._pending_puts.popleft()
            if status == codec.P_ACCEPTED:
                self._counters["puts_remote"] += 1
            self._put_reply(identity, h, status, seq)

    def _put_reply(self, identity, h, status, seq=0):
        self._send_to(self._put_sock, identity, [codec.pack_header(
            codec.PUT_REPLY, seq=h.seq, aux=status, engine=self.instance, group=seq)])

    def _send_to(self, sock, identity, frames):
        """Answer a producer or status asker; one that went away is simply gone."""
        try:
            sock.send_multipart([identity, *frames], copy=False)
        except zmq.ZMQError:
            self._counters["unreachable"] += 1

    def _hello(self, identity, h, name, now, parked_since=None):
        rank = h.rank
        if name != self.name.encode():
            return self._reject(identity, h, codec.E_REJECTED,
                                "this endpoint does not serve the queue name this worker asked "
                                "for: check the name and dp_id on the engine and the workers",
                                f"it asked for {bytes(name[:64])!r}")
        if h.tp_size != self.tp_size:
            return self._reject(identity, h, codec.E_REJECTED,
                                f"tp_size={h.tp_size} does not match the engine's: start the "
                                f"engine and every rank with the same tp_size",
                                f"it has tp_size={h.tp_size}, the queue {self.tp_size}")
        if h.engine and h.engine != self.instance:
            return self._reject(identity, h, codec.E_STALE_ENGINE,
                                "the engine this worker was bound to is gone (the engine "
                                "restarted): restart the worker group",
                                f"it is bound to engine {h.engine:#x}, this is {self.instance:#x}")
        if not h.group or not h.worker:
            raise ProtocolError("HELLO without group or worker id")
        if h.group in self._retired:
            return self._reject(identity, h, codec.E_GROUP_LOST,
                                "this worker group was retired earlier (a rank went silent or "
                                "restarted): restart the whole group")
        group = self._group
        if group is not None and group.incarnation != h.group:
            self._probe(group)
            if any(link.alive(now, self.heartbeat.timeout) and link.identity is not None
                   for link in group.links):
                since = parked_since if parked_since is not None else now
                if now - since > self.heartbeat.timeout + self.heartbeat.interval:
                    return self._reject(identity, h, codec.E_GROUP_BUSY,
                                        "another live worker group serves this queue: stop it "
                                        "first, or use another name or dp_id")
                self._parked.append((since, identity, h, name))
                return
            self._retire(group, f"replaced by a new worker group ({h.group:#x}) while none "
                                f"of its ranks was reachable")
            group = None
        if group is None:
            if h.seq != 1 or h.aux != 0:  # a fresh group holds nothing yet
                return self._reject(identity, h, codec.E_GROUP_LOST,
                                    "this worker holds batches of a worker group the engine no "
                                    "longer serves: restart the whole group")
            group = self._new_group(h.group)
        link = group.links[rank]
        if link.worker and link.worker != h.worker:
            self._probe(group)
            if link.alive(now, self.heartbeat.timeout) and link.identity is not None:
                return self._reject(identity, h, codec.E_PLACE_TAKEN,
                                    f"rank {rank} is held by a live worker: two processes "
                                    f"cannot serve one rank; check tp_rank on each worker")
            self._reject(identity, h, codec.E_GROUP_LOST,
                         f"rank {rank} restarted inside a live worker group: its peers' "
                         f"model state is gone too, restart the whole group")
            return self._retire(group, f"rank {rank} restarted (a new worker process took its "
                                       f"place)")
        with self._not_full:
            self._read_board()
            consumed = self._consumed[rank] - self._base
            taken = min(h.aux, self._next_seq - 1 - self._base)
            if h.seq - 1 < consumed:
                problem = (f"rank {rank} asks for seq {h.seq} but had consumed up to "
                           f"{consumed}")
            else:
                problem = None
                if self._base + taken > self._consumed[rank]:  # HELLO's implicit ack
                    self._consume(rank, self._base + taken)
        if problem:
            return self._reject(identity, h, codec.E_REJECTED,
                                "this worker's history does not match the engine's: restart "
                                "the worker group", problem)
        link.connect(identity, h.worker, now)
        link.sent = self._base + h.seq - 1
        self._send(link, [codec.pack_header(codec.WELCOME, rank, self.tp_size, aux=group.epoch,
                                            engine=self.instance, group=group.incarnation,
                                            worker=h.worker)])
        log.info("TaskQueue %s: rank %d connected (worker %016x, group %016x), wants seq %d",
                 self.name, rank, h.worker, group.incarnation, h.seq)

    def _new_group(self, incarnation):
        self._epochs += 1
        group = _Group(incarnation, self._epochs, self.tp_size)
        with self._mutex:
            self._group = group
        self._counters["groups"] += 1
        return group

    def _link_of(self, h, unbound_ok=False):
        """The link ``h`` speaks for, or None (counted as stale) if it belongs to another
        engine, another group or another worker of that rank. ``unbound_ok``: a worker
        that has not read its WELCOME yet (engine id 0) counts too (a sync-mode heartbeat
        thread pings before the event loop's first step reads the WELCOME)."""
        group = self._group
        engine_ok = h.engine == self.instance or (unbound_ok and h.engine == 0)
        if (not engine_ok or group is None or h.group != group.incarnation
                or group.links[h.rank].worker != h.worker):
            self._counters["stale"] += 1
            return None
        return group.links[h.rank]

    def _ack(self, h):
        link = self._link_of(h)
        if link is None:
            return
        link.heard(time.monotonic())
        with self._not_full:
            seq = self._base + h.seq
            if seq > self._next_seq - 1:
                raise ProtocolError(f"rank {h.rank} acknowledged seq {h.seq}, only "
                                    f"{self._next_seq - 1 - self._base} were sent to its group")
            self._counters["acks"] += 1
            if seq > self._consumed[h.rank]:  # else stale or duplicate: acks are cumulative
                self._consume(h.rank, seq)

    def _ping(self, identity, h):
        self._counters["pings"] += 1
        link = self._link_of(h, unbound_ok=True)
        if link is None:
            # tell a straggler why nobody answers it, so it fails with the right error
            if h.engine and h.engine != self.instance:
                code, why = codec.E_STALE_ENGINE, "the engine this worker was bound to is gone"
            elif h.group in self._retired:
                code, why = codec.E_GROUP_LOST, "this worker group was retired"
            else:
                return  # not welcomed yet: its HELLO is being handled or parked
            return self._reject(identity, h, code, why)
        link.heard(time.monotonic())
        self._send(identity, [codec.pack_header(codec.PONG, h.rank, engine=self.instance,
                                                group=h.group, worker=h.worker)])

    def _probe(self, group):
        """Send a PONG to every rank thought reachable: a socket that went away fails the
        send at once (ROUTER_MANDATORY), which is quicker than waiting for silence."""
        for link in group.links:
            if link.identity is not None:
                self._send(link, [codec.pack_header(codec.PONG, link.rank, engine=self.instance,
                                                    group=group.incarnation, worker=link.worker)])

    def _tick(self, now) -> float:
        """Liveness: mark silent ranks, retire a group that lost one, admit parked HELLOs.
        Returns when the first rank still heard from would become silent."""
        group = self._group
        if group is not None:
            timeout = self.heartbeat.timeout
            for link in group.links:
                if link.state != NEVER and link.silent_for(now) > timeout:
                    silent = link.silent_for(now)
                    link.disconnect(f"silent for {silent:.1f} s")
                    self._retire(group, f"rank {link.rank} was silent for {silent:.1f} s "
                                        f"(died, hung or unreachable)")
                    break
        if self._parked:
            parked, self._parked = self._parked, []
            for since, identity, h, name in parked:
                self._hello(identity, h, name, now, parked_since=since)
        group = self._group
        if group is None:
            return float("inf")
        return min((link.last_heard + self.heartbeat.timeout + 0.001 for link in group.links
                    if link.state != NEVER), default=float("inf"))

    def _retire(self, group, reason):
        """Stop serving ``group``: tell its reachable ranks, hand back what it did not
        finish as a ``GroupLost`` event, and reset the queue for the next group."""
        with self._not_full:
            self._read_board()
            low = min(self._consumed)
            consumed = list(self._consumed)
            unfinished = [(seq, frames, tuple(r for r, c in enumerate(consumed) if c >= seq))
                          for seq, (frames, _) in self._retained.items() if seq > low]
            self._retained.clear()
            self._put_times.clear()  # never delivered to every rank: not a delivery
            self._retirements[next((k for w, k in RETIREMENT_KINDS if w in reason), "other")] += 1
            # taken out now: batches put after this lock is released belong to the next group
            dropped = self._encoder.drop_all()
            self._base = self._next_seq - 1
            self._consumed = [self._base] * self.tp_size
            self._group, self._previous = None, group
            self._not_full.notify_all()
        self._retired.append(group.incarnation)
        self._counters["groups_retired"] += 1
        for link in group.links:
            if link.identity is not None:
                self._send(link, [codec.pack_header(
                    codec.ERROR, link.rank, aux=codec.E_GROUP_LOST, engine=self.instance,
                    group=group.incarnation, worker=link.worker),
                    f"the engine retired this worker group: {reason}; restart the whole "
                    f"group".encode()])
                link.disconnect("group retired")
        lost = []
        try:
            for seq, frames, taken_by in unfinished:
                try:
                    tasks = self._encoder.decode_retained(frames, dropped.get(seq))
                except ProtocolError as exc:  # cannot happen for our own bytes; never lose the seq
                    tasks = exc
                lost.append(LostBatch(seq, tasks, taken_by))
        finally:
            # Nothing retained any more: free its shared memory (see BatchEncoder.forget).
            self._encoder.forget(dropped)
        now = time.monotonic()
        event = GroupLost(group.incarnation, reason, time.time(),
                          [link.snapshot(now) for link in group.links], lost)
        log.warning("TaskQueue %s: retired worker group %016x: %s; %d batch(es) unfinished "
                    "(group_events)", self.name, group.incarnation, reason, len(lost))
        self.group_events.put(event)

    def _send_new(self):
        """Send each connected rank every retained batch it has not been sent yet."""
        group = self._group
        if group is None:
            return
        with self._mutex:
            last = self._next_seq - 1
            base = self._base
            retained = self._retained
            todo = [(link, [(s, retained[s]) for s in range(link.sent + 1, last + 1) if s in retained])
                    for link in group.links if link.identity is not None and link.sent < last]
        for link, batches in todo:
            for seq, (frames, check) in batches:
                header = codec.pack_header(codec.DATA, link.rank, self.tp_size, seq=seq - base,
                                           engine=self.instance, group=group.incarnation,
                                           worker=link.worker, check=check)
                if not self._send(link, [header, *frames]):
                    break
                self._counters["sent"] += 1
            else:
                link.sent = last


def query_status(endpoint: str, *, keys_dir: str = None, insecure_tcp: bool = None,
                 timeout: float = 2.0) -> dict:
    """Ask the live ``TaskQueue`` at ``endpoint`` for its ``status()``; the engine knows
    every rank's state and watermark whatever the TP coordinator (shared memory or
    paddle.distributed). tcp endpoints need the worker keys (``keys_dir`` or
    ``FD_SYNC_KEYS_DIR``), exactly as a ``TaskClient`` would.

    Blocks at most ``timeout`` seconds; raises ``TimeoutError`` naming the endpoint when no
    engine answers (none running, or the handshake failed), ``ProtocolError`` for a reply
    that is not a status."""
    from .auth import ClientAuth
    from .transport import check_ipc_endpoint

    path = ipc_path(endpoint)
    if path is not None:
        check_ipc_endpoint(path)
    auth = ClientAuth.load(endpoint, keys_dir, insecure_tcp)
    ctx = zmq.Context(io_threads=1)
    try:
        sock = new_socket(ctx, zmq.DEALER)
        sock.setsockopt(zmq.MAXMSGSIZE, 16 << 20)
        if auth is not None:
            auth.apply(sock)
        sock.connect(endpoint)
        sock.send(codec.pack_header(codec.STATUS))
        if not sock.poll(timeout * 1000):
            raise TimeoutError(f"no TaskQueue answered at {endpoint} within {timeout:g} s (none "
                               f"running there, or keys that do not match)")
        frames = sock.recv_multipart()
        header = codec.unpack_header(frames[0])
        if header.kind != codec.STATUS_REPLY or len(frames) != 2:
            raise ProtocolError(f"{endpoint} answered with message kind {header.kind}")
        return json.loads(frames[1])
    finally:
        ctx.destroy(linger=0)


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
    and dp_id answers on this node.

    Thread-safe (one request at a time). Use as a context manager, or call ``close()``.
    """

    def __init__(self, name: str, *, dp_id: int = 0, timeout: float = 5.0):
        from .transport import check_ipc_endpoint

        validate_name(name, dp_id)
        self.name, self.dp_id = name, dp_id
        self.endpoint = default_endpoint(name, dp_id, "put")
        check_ipc_endpoint(ipc_path(self.endpoint))
        self._timeout = timeout  # for a reply to a query or to a put once decided
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
        ``timeout`` plus a few seconds: then whether the batch was enqueued is unknown."""
        frames = codec.encode_payload(tasks)
        check = codec.payload_checksum(frames)
        # the queue holds the batch until room or this wait ends, then always answers
        wait_ms = 2**62 if timeout is None else max(0, int(timeout * 1000))
        with self._lock:
            request = self._next_request()
            self._sock.send_multipart([codec.pack_header(codec.PUT, seq=request, aux=wait_ms,
                                                         check=check), *frames], copy=False)
            h = self._reply(request, codec.PUT_REPLY, None if timeout is None
                            else timeout + self._timeout)
        if h.aux == codec.P_ACCEPTED:
            return h.group
        if h.aux == codec.P_TIMEOUT:
            raise TimeoutError(f"TaskProducer {self.name!r}: no room in the queue within "
                               f"{timeout} s (max_inflight batches not yet consumed by every "
                               f"rank: see fastdeploy-sync status {self.name}); not enqueued")
        if h.aux == codec.P_CLOSED:
            raise ClosedError(f"TaskProducer {self.name!r}: the queue is closed; not enqueued")
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

    def _reply(self, request, kind, timeout):
        """The reply of ``kind`` to ``request``, skipping stale replies of earlier requests
        whose caller gave up. ``timeout=None`` (a put with no bound) still notices a queue
        that is gone: while nothing comes, it asks the queue (QUERY, request id 0) every
        ``self._timeout`` seconds and gives up when that is not answered either."""
        if timeout is not None:
            deadline = time.monotonic() + timeout
            while True:
                h = codec.unpack_header(self._recv(deadline)[0])
                if h.kind == kind and h.seq == request:
                    return h
        heard = time.monotonic()
        asked = False
        while True:
            if self._sock.poll(self._timeout * 1000):
                h = codec.unpack_header(self._sock.recv_multipart()[0])
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


def _remove_names(ipc_file, board_name, put_file=None):
    unlink_quietly(ipc_file)
    unlink_quietly(put_file)
    if board_name:
        unlink_segment(board_name)
