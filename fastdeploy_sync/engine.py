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

Worker groups: the ranks that serve the queue form one group, and the engine serves one
group at a time; who belongs to it, and when a group is retired (its unfinished batches
handed back as ``GroupLost`` events), is ``membership``'s. Sequence numbers on the wire are
relative to the group (every group starts at 1), so a new group never sees the previous
group's numbering; ``put_tasks()`` returns the queue's own, global number.

Node-local producers in other processes put through the queue's producer endpoint
(``producer``: ``TaskProducer``).

The I/O thread's pass reads: receive (at most ``_RECEIVE_BUDGET`` messages from the
workers' socket, then from the producers'; ``flood_guard`` cuts a connection that sends
too much that is unwelcome) -> dispatch (to ``membership`` or the producer endpoint) ->
tick (liveness: probes, retirements, every heartbeat interval or at the next deadline) ->
send (new batches; sends never block). What a peer can make it do or hold is bounded
(see ``docs/security.md``).

Lock invariant: ``_mutex`` guards ``_next_seq``, ``_retained``, ``_consumed``, ``_base``,
``_group``, ``_previous``, ``_board`` (detached at close), ``_finished``, ``_error`` and
the metrics (``_put_times``, ``_delivery``, ``_retirements``); ``_not_full`` is a
condition on it, notified whenever the slowest rank's acknowledgement advances, a group is
retired or the queue closes. Only the I/O thread touches the sockets.
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
from zmq.utils.monitor import recv_monitor_message

from . import codec, envs
from .ack_board import AckBoard
from .auth import ServerAuth
from .batch_encoder import BatchEncoder
from .errors import ClosedError, EndpointInUseError, ProtocolError, TaskSyncError
from .flood_guard import FloodGuard, InputGuard
from .liveness import CONNECTED, NEVER, Heartbeat, RankLink, id_tag
from .logs import RateLimitedLog
from .membership import GroupLost, LostBatch, Membership
from .producer import ProducerEndpoint, TaskProducer
from .shm import forget_in_child, unlink_segment
from .transport import (ENGINE_FDS, WakePipe, anon_rss_bytes, claim_ipc_path, close_listeners,
                        default_endpoint, ensure_free_fds, ipc_path, listener_address,
                        new_socket, raise_fd_limit, secure_socket_file, unlink_quietly,
                        validate_name)

__all__ = ["TaskQueue", "TaskProducer", "GroupLost", "LostBatch", "query_status"]

log = logging.getLogger(__name__)

# A put_tasks() blocked on the bound re-reads the ack board at this pace (doubling).
_BOARD_POLL_MIN_S = 50e-6
_BOARD_POLL_MAX_S = 1e-3
# Workers only send small messages (HELLO, ACK, PING, BYE: a header and a name): anything
# larger is not ours, and ZeroMQ drops the connection instead of allocating it.
_MAX_INBOUND_BYTES = 4096
# A connection of the workers' socket that sends more than this many unwelcome messages
# (garbage, stale, refused, status requests) within a second is cut (flood_guard: the
# socket cannot have a receive high-water mark). A rank of the group sends none.
_UNWELCOME_PER_S = 200
# Messages queued per connection towards a peer that does not read them (its replies to a
# flood): a send beyond it fails at once and is dropped (a rank's batch is sent again on a
# later pass). Raised to 4 x max_inflight for queues with a larger window.
_OUTBOUND_HWM = 1000
# Messages the I/O thread takes from one socket per pass before it runs the liveness tick
# and sends batches: no socket is drained unboundedly first.
_RECEIVE_BUDGET = 256
# How long after the socket monitor reports a dropped connection the ranks are probed.
_PROBE_AFTER_DROP_S = 0.02
# A STATUS reply is rebuilt at most this often (a status is for people and scrapers; a
# flood of STATUS requests must not cost a JSON encoding each).
_STATUS_CACHE_S = 0.2
# What peers may make the engine hold, beyond what it accounts for (batches retained,
# producers' PUTs waiting), in messages they have not finished (InputGuard): on the
# workers' socket, whose messages are small, this much; on the producers', one
# maximum-size batch more (a PUT in flight).
_UNFINISHED_INPUT_BYTES = 128 << 20
# How fast libzmq's I/O thread encrypts with CURVE, assumed low: measured ~400 MiB/s for
# encrypt + decrypt over loopback on these 2 shared cores (docs/security.md).
_CURVE_BYTES_PER_S = 256 << 20
# Socket-monitor events the engine follows on both sockets.
_WATCHED_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
# How long close() waits, after sending CLOSE, for every rank it told to answer BYE (a
# gone or stopped worker must not make close() hang). The workers' socket is read all
# that time and closed with no linger: libzmq 4.3.5 aborts the process ("Assertion
# failed: !_io_error (src/stream_engine_base.cpp:310)") when a socket closed with a
# linger receives a message on a connection it still flushes, that peer then hangs up,
# and the connection's ZMTP heartbeat fires before the linger ends (libzmq issues #4364,
# #4841; measured: every time, tests/test_engine.py, scripts/libzmq_linger_abort.py).
# Without a linger nothing keeps a connection's object alive past the close.
_CLOSE_LINGER_MS = 1000

# Delivery latency (put -> consumed by every rank) histogram, upper bounds in seconds (the
# last bucket is +Inf). Fixed, so that observing is one bisect and an add; read by stats().
DELIVERY_BOUNDS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0)
# Why a group was retired, by kind: the first keyword of the retirement's reason found
# (membership words its reasons; metrics labels them). "gone": a rank's connection went
# and it did not come back (died, killed, frozen, unreachable); "hung": connected but
# silent past the stall timeout; "left": a rank closed its client (BYE).
RETIREMENT_KINDS = (("is gone", "gone"), ("is hung", "hung"), ("restarted", "rank_restarted"),
                    ("replaced", "replaced"), ("BYE", "left"))


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
        self._owner_pid = os.getpid()
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
        self._finished = False  # close() has returned: num_tasks() refused too
        self._stop = False  # close() has drained: the I/O thread says CLOSE and exits
        self._counters = collections.Counter()
        # The workers' socket is used under this lock only: by the I/O thread for each
        # pass, and by put_tasks() to send its batch at once when no pass is running
        # (_send_now). The membership state and the links are used under it too.
        self._sock_lock = threading.Lock()
        self.group_events = queue.SimpleQueue()
        # Delivery metrics (stats()["delivery_s"]): put time per retained seq, under _mutex
        self._put_times = {}
        self._delivery = [0] * (len(DELIVERY_BOUNDS_S) + 1) + [0.0]  # bucket counts, sum
        self._retirements = collections.Counter()

        # libzmq aborts the process when it runs out of fds: take what the hard limit
        # allows (many producers may connect at once), and fail here, cleanly, if even
        # the queue's own sockets would not fit
        before, after = raise_fd_limit()
        if after > before:
            log.info("TaskQueue %s: raised the soft limit of open files from %d to the hard "
                     "limit %d (many peers may connect at once)", name, before, after)
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
        self._sock.setsockopt(zmq.SNDHWM, max(_OUTBOUND_HWM, 4 * max_inflight))
        self.heartbeat.configure_engine_socket(self._sock)
        if self._auth is not None:
            self._auth.apply(self._sock)
        self._ipc_path = ipc_path(endpoint)
        # The put path's encoding, and the shared memory its batches hold (node-local
        # ranks map large batches from shared memory; tcp ranks cannot).
        self._encoder = BatchEncoder(name, dp_id, tp_size, node_local=bool(self._ipc_path),
                                     max_message_bytes=self._max_batch_bytes,
                                     encrypted_limit=self._encrypted_limit(),
                                     window=max_inflight)
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
                # the first worker group's ring (epoch 1: membership numbers groups from 1)
                self._encoder.open_ring(1)
            self._sock.bind(endpoint)
            if self._ipc_path:
                secure_socket_file(self._ipc_path)
        except BaseException:
            self._encoder.close()
            if self._board is not None:
                self._board.close()
            self._sock.close(linger=0)
            if self._auth is not None:
                self._auth.close()
            self._ctx.term()
            raise
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # A connection of the workers' socket that drops makes the I/O thread probe the
        # ranks at once instead of at the next tick; connections are followed for the
        # input guard too (both sockets: see _watch_connections).
        self._monitor = self._sock.get_monitor_socket(_WATCHED_EVENTS)
        self._guard = FloodGuard(self._sock, limit=_UNWELCOME_PER_S)
        self._input_guard = InputGuard(anon_rss_bytes, small=_UNFINISHED_INPUT_BYTES,
                                       large=self._max_batch_bytes + _UNFINISHED_INPUT_BYTES)
        # The producer endpoint: node-local, for engine processes other than this one
        # (TaskProducer). Its own socket, so that the workers' socket keeps its small
        # bound; same-user only, like every node-local endpoint.
        self.producer_endpoint = default_endpoint(name, dp_id, "put")
        self._put_path = ipc_path(self.producer_endpoint)
        self._put_sock = new_socket(self._ctx, zmq.ROUTER)
        self._put_sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._put_sock.setsockopt(zmq.MAXMSGSIZE, self._max_batch_bytes + 4096)
        ProducerEndpoint.configure_socket(self._put_sock)
        self._put_monitor = self._put_sock.get_monitor_socket(_WATCHED_EVENTS)
        try:
            claim_ipc_path(self._put_path)
            self._put_sock.bind(self.producer_endpoint)
            secure_socket_file(self._put_path)
        except BaseException:
            self._put_sock.disable_monitor()
            self._put_monitor.close(linger=0)
            self._put_sock.close(linger=0)
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._encoder.close()
            if self._board is not None:
                self._board.close()
            if self._auth is not None:
                self._auth.close()
            self._ctx.term()
            unlink_quietly(self._ipc_path)
            raise
        self._producers = ProducerEndpoint(self, self._put_sock, self._input_guard)
        # Process exit without close(): still remove the names others would trip on.
        self._finalizer = weakref.finalize(self, _remove_names, os.getpid(), self._ipc_path,
                                           self._board.name if self._board else None,
                                           self._put_path)
        # Under _sock_lock (the I/O thread's passes, put_tasks' direct send):
        self._members = Membership(self)
        self._peer_log = RateLimitedLog(log)
        self._current = None  # the frame being handled (its peer address, for logs)
        self._status_cache = (float("-inf"), b"")  # (when, the STATUS reply's JSON)
        self._rank_fds = set()  # descriptors of connections ranks of the group spoke on
        self._wake = WakePipe()
        self._thread = threading.Thread(target=self._io_main, name=f"fdsync-engine-{name}",
                                        daemon=True)
        self._thread.start()
        # A process this one forks (FastDeploy forks helpers) must not keep the endpoint
        # listening after this engine dies: see _forget_in_child.
        self._listeners = [a for a in (listener_address(self.endpoint),
                                       listener_address(self.producer_endpoint)) if a]
        forget_in_child(self)

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

        Once enqueued, the batch is sent to the connected ranks from this thread when the
        I/O thread is not in a pass (it is woken to send otherwise): the sends never block
        (a rank that does not read gets the batch on a later pass) and cost this call ~25 µs
        per rank for a 64 × 512 batch, which then leaves ~50-85 µs sooner.

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
                # published in the group's ring (node-local) before anyone can see the seq
                retained = self._retained[seq] = self._encoder.enqueue(seq, seq - self._base,
                                                                       batch)
                self._put_times[seq] = time.monotonic()
        except BaseException:
            self._encoder.discard(batch)  # not enqueued: nobody will ever map it
            raise
        self._encoder.wake()
        if retained[0] is not None:  # it travels over the socket
            self._send_now()
        return seq

    def _send_now(self):
        """put_tasks(), after enqueueing: send to the ranks from the calling thread if no
        I/O pass is running, instead of waking the I/O thread to do it (that wake-up
        stood 74-89 µs between put_tasks() returning and the first send in
        scripts/bench_sync.py section 7). Never blocks: when a pass holds the socket, or
        the queue is stopping, the I/O thread is woken and sends at its next pass.

        Costs the caller the sends themselves (~25 µs per rank for a 64 × 512 batch after
        the thread slept; docs/performance.md). Sending processes the socket's pending
        commands, which can consume the readiness signal of messages that arrived meanwhile
        (ZMQ_FD signals edges): when any wait, the I/O thread is woken for them."""
        if self._sock_lock.acquire(False):
            try:
                if self._stop or self._error is not None:
                    waiting = True  # the I/O thread finishes (or has failed): its call
                else:
                    self._send_new(by_caller=True)
                    waiting = bool(self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)
            except Exception:  # enqueued all the same: the I/O thread sends it
                log.exception("TaskQueue %s: put_tasks() could not send its batch itself; "
                              "the I/O thread will", self.name)
                waiting = True
            finally:
                self._sock_lock.release()
            if not waiting:
                return
        self._wake.wake()

    def num_tasks(self) -> int:
        """Batches put but not yet consumed by every rank. Never blocks on the workers.
        Answers while ``close()`` drains; raises ``ClosedError`` once it has returned (its
        return value lists what was not consumed)."""
        with self._mutex:
            if self._finished:
                raise ClosedError(f"TaskQueue {self.name} is closed (close() returned what "
                                  f"was not consumed)")
            self._read_board()
            return self._next_seq - 1 - min(self._consumed)

    def exist_tasks(self) -> bool:
        """True while some batch is not yet consumed by every rank; ``ClosedError`` as
        ``num_tasks()``."""
        return self.num_tasks() > 0

    def ranks(self) -> list:
        """Every rank's state in the current group: a dict per rank with ``state``
        (``connected``, ``disconnected`` or ``never connected``), ``since`` (wall-clock
        time of the last change), ``silent_s`` (seconds since it was last heard from),
        ``worker`` (``liveness.id_tag`` of its worker id, which is a secret), ``reason`` (why it is disconnected) and ``consumed``.
        True within the heartbeat timeout. Never blocks on the workers; after ``close()``
        the last state (every rank that was connected: ``disconnected``, "the queue
        closed")."""
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
        ``pings``, ``sent``, ``sent_by_put`` (of ``sent``: by ``put_tasks()`` itself),
        ``groups_retired``, ``connections_cut``...), the last seq put,
        every rank's consumed seq and state (see ``ranks()``), the group (``liveness.id_tag``
        of its incarnation: ids are secrets); ``retirements``: retired groups by kind
        (``gone``, ``hung``, ``left``, ``rank_restarted``, ``replaced``, ``other``);
        ``delivery_s``: the put -> consumed-by-every-rank latency histogram ``{"bounds":
        upper bounds in s, "counts": per bucket (the last is +Inf), "sum": s, "count": n}``.
        Cheap; for logs and metrics (``fastdeploy_sync.metrics``). Never raises after
        ``close()``: the final figures."""
        with self._mutex:
            self._read_board()
            out = dict(self._counters)
            out.update(last_seq=self._next_seq - 1, consumed=list(self._consumed),
                       retained=len(self._retained), retirements=dict(self._retirements),
                       delivery_s={"bounds": list(DELIVERY_BOUNDS_S),
                                   "counts": self._delivery[:-1], "sum": self._delivery[-1],
                                   "count": sum(self._delivery[:-1])})
            group = self._group
        out["group"] = id_tag(group.incarnation) if group else None
        out["ranks"] = self.ranks()
        out.update(self._encoder.stats())  # shm_*: which path large batches took
        return out

    def status(self) -> dict:
        """Everything ``fastdeploy-sync status`` shows: the queue's name, dp_id, tp_size,
        endpoint, engine instance (``liveness.id_tag`` of it: the STATUS reply goes to
        anyone past authentication) and ``stats()`` (per-rank state and watermarks included).
        ``closed`` is True from the start of ``close()``. JSON-serialisable. Never blocks
        on the workers; never raises after ``close()``."""
        out = {"name": self.name, "dp_id": self.dp_id, "tp_size": self.tp_size,
               "endpoint": self.endpoint, "engine": id_tag(self.instance),
               "max_inflight": self.max_inflight, "pid": os.getpid(), "closed": self._closed}
        out.update(self.stats())
        return out

    def close(self, timeout: float = 5.0) -> list:
        """Close the queue: drain, tell the workers, stop. Returns the seqs that were put
        but not consumed by every rank (``[]`` after a clean drain). Any thread may call
        it; a second call returns ``[]`` at once.

        ``put_tasks()`` raises ``ClosedError`` from the start. Then it waits, up to
        ``timeout`` seconds, until every batch put has been taken by every rank of a
        group: a group that is connected is waited for, and so is one that has not come
        yet (workers may start after the engine, or after close() was called); it stops
        waiting early when the group being served has no rank connected any more (its
        workers closed or died). Then it sends every connected rank what it still lacks
        and a CLOSE message (workers raise ``EngineClosedError`` once they have taken
        everything they were sent), and stops the I/O thread (up to ~5 s) and the socket
        (up to 1 s for the CLOSE messages to leave). What was not consumed is logged.

        Batches no worker received by then are returned here and never delivered:
        workers that start after close() returned find no engine (their connect timeout
        applies). Batches of a group retired earlier were handed back in its
        ``GroupLost`` event and are not listed again.
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
                if min(self._consumed) >= self._next_seq - 1:
                    break  # drained
                if self._group is not None and not self._group_connected():
                    break  # the group being served has gone: nobody to deliver to
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
        with self._sock_lock:
            self._close_sockets()
        if self._auth is not None:
            self._auth.close()
        self._ctx.term()
        self._wake.close()
        with self._mutex:  # queries from other threads read the board under the lock
            self._read_board()  # its last word, for stats() and ranks() from now on
            board, self._board = self._board, None
            self._finished = True
        if board is not None:
            board.close()
        self._encoder.close()  # the I/O thread has stopped: nothing sends them now
        unlink_quietly(self._ipc_path)
        unlink_quietly(self._put_path)
        self._finalizer.detach()
        return unconsumed

    def _encrypted_limit(self):
        """``(bytes, why)``: the largest batch a CURVE-encrypted endpoint sends, or None
        (ipc, plain tcp). libzmq encrypts a message in one piece in its I/O thread, and
        the connections to every rank may be encrypted in one pass of it: while it does,
        no heartbeat of any connection is sent or answered. A batch whose ``tp_size``
        copies take longer than half the heartbeat timeout to encrypt makes healthy ranks
        look gone (a 600 MiB batch to TP=2 retired the group), so it is refused at
        ``put_tasks()`` instead; the bound assumes ``_CURVE_BYTES_PER_S``."""
        if self._auth is None:
            return None
        limit = int(_CURVE_BYTES_PER_S * self.heartbeat.timeout / (2 * self.tp_size))
        why = (f"libzmq encrypts a message in one piece, one copy per rank ({self.tp_size}), in "
               f"its I/O thread, which answers no heartbeat meanwhile; past half the heartbeat "
               f"timeout ({self.heartbeat.timeout:g} s) healthy ranks would look gone")
        return limit, why

    def _check_encrypted_size(self, size):
        """For the producer endpoint: ``ValueError`` for a batch this encrypted endpoint
        refuses (``_encrypted_limit``)."""
        self._encoder.check_encrypted_size(size)

    def _forget_in_child(self):
        """In a process forked from this engine's: close the inherited descriptors of the
        endpoints' listening sockets (a child that outlives a killed engine would keep them
        accepting, so the next engine of the name would find it in use); the queue is
        unusable there (its I/O thread did not survive the fork)."""
        close_listeners(self._listeners)
        self._error = TaskSyncError(f"TaskQueue {self.name} belongs to process "
                                    f"{self._owner_pid}; a forked child cannot use it")
        self._closed = self._finished = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        # leaving on an exception: close without waiting for the workers to drain
        self.close(timeout=0 if exc_type is not None else 5.0)

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
        # The workers' socket by its descriptor, not as a socket: put_tasks() may send on
        # it between passes (_send_now), and zmq_poll would touch the socket unlocked.
        # The descriptor signals edges, so each pass ends by asking the socket whether
        # messages wait (ZMQ_EVENTS), and the next poll does not block if they do.
        sock_fd = self._sock.getsockopt(zmq.FD)
        poller.register(sock_fd, zmq.POLLIN)
        poller.register(self._put_sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._put_monitor, zmq.POLLIN)
        poller.register(self._wake.r, zmq.POLLIN)
        interval = self.heartbeat.interval
        next_tick = time.monotonic() + interval
        probe_at = float("inf")  # a connection dropped: probe the ranks then
        waiting = False  # messages wait on the workers' socket
        try:
            while True:
                # Blocks with the GIL released until a message, a wake-up or the next tick
                # (returns at once while a socket still holds messages), and wakes every
                # millisecond while a producer waits for room (the ack board notifies
                # nobody). One pass does a bounded amount of work: receive (at most
                # _RECEIVE_BUDGET messages per socket) -> dispatch -> tick -> send.
                wait_ms = max(0.0, min(next_tick, probe_at, self._input_guard.next_check)
                              - time.monotonic()) * 1000
                if self._producers.pending:
                    wait_ms = min(wait_ms, 1.0)
                if self._producers.refusing:
                    wait_ms = min(wait_ms, 100.0)
                events = dict(poller.poll(0 if waiting else wait_ms))
                if self._wake.r in events:
                    self._wake.drain()
                with self._sock_lock:
                    if self._stop:
                        self._finish_close()
                        return
                    if self._monitor in events and self._connection_dropped():
                        # libzmq reports the drop before the socket has let go of the
                        # connection's pipe (a send to it still succeeds): probe a moment later
                        probe_at = min(probe_at, time.monotonic() + _PROBE_AFTER_DROP_S)
                    if time.monotonic() >= probe_at:
                        probe_at = float("inf")
                        self._members.connections_changed(time.monotonic())
                    # a wake-up may stand for messages: put_tasks() wakes this thread when
                    # its own send consumed their descriptor's signal (_send_now)
                    if waiting or sock_fd in events or self._wake.r in events:
                        self._receive()
                    if self._put_monitor in events:
                        self._watch_connections(self._put_monitor, "producers")
                    if self._put_sock in events:
                        self._producers.receive(_RECEIVE_BUDGET)
                    if self._producers.pending:
                        self._producers.serve()
                    if self._producers.refusing:
                        self._producers.cut_refused(time.monotonic())
                    now = time.monotonic()
                    if now >= next_tick:
                        self._members.tick(now)
                        next_tick = now + interval
                    # sooner if a rank's state would retire its group before then
                    next_tick = min(next_tick, self._members.deadline())
                    if now >= self._input_guard.next_check:
                        self._counters["connections_cut"] += self._input_guard.check(
                            now, self._held_bytes())
                    self._send_new()
                    waiting = bool(self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)
        except BaseException as exc:  # never silent: every caller learns it
            log.exception("TaskQueue %s: I/O thread failed; the queue is unusable (every "
                          "call raises TaskSyncError): close it and start a new one", self.name)
            with self._not_full:
                self._error = exc
                self._not_full.notify_all()
            # Nobody serves the sockets any more: drop every connection, so that workers
            # and producers learn the engine is gone instead of waiting on it.
            with self._sock_lock:
                self._close_sockets(linger=0)

    def _close_sockets(self, linger=None):
        """Close the monitor and both sockets (idempotent). ``linger=None``: what the I/O
        thread set (a short linger for the CLOSE messages)."""
        if not self._sock.closed:
            self._sock.disable_monitor()
        if not self._put_sock.closed:
            self._put_sock.disable_monitor()
        self._monitor.close(linger=0)
        self._put_monitor.close(linger=0)
        self._sock.close(linger=linger)
        self._put_sock.close(linger=linger)

    def _finish_close(self):
        self._producers.close()
        self._put_sock.setsockopt(zmq.LINGER, _CLOSE_LINGER_MS)
        self._send_new()
        group = self._group
        if group is not None:
            last = self._next_seq - 1 - self._base
            told = set()  # routing ids the CLOSE went to (disconnect() forgets them)
            for link in group.links:
                identity = link.identity
                if identity is not None and self._send(link, [codec.pack_header(
                        codec.CLOSE, link.rank, self.tp_size, seq=last, engine=self.instance,
                        group=group.incarnation, worker=link.worker)]):
                    told.add(identity)
                link.disconnect("the queue closed")
            self._await_goodbyes(told)
        # Whatever was not written by now goes to a rank that did not answer: it learns
        # the engine is gone from its heartbeats instead.
        self._sock.setsockopt(zmq.LINGER, 0)

    def _await_goodbyes(self, told):
        """After CLOSE (I/O thread): read the workers' socket until every connection in
        ``told`` (routing ids) answered BYE, at most ``_CLOSE_LINGER_MS``; counts the
        answers (``stats()["close_answered"]``). Everything else that arrives is dropped
        unread; a message that does not decode is too."""
        deadline = time.monotonic() + _CLOSE_LINGER_MS / 1000
        while told:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._sock.poll(remaining * 1000):
                log.info("TaskQueue %s: %d rank(s) did not answer CLOSE within %d ms",
                         self.name, len(told), _CLOSE_LINGER_MS)
                return
            for _ in range(_RECEIVE_BUDGET):
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    kind = codec.unpack_header(frames[1]).kind if len(frames) >= 2 else None
                except ProtocolError:
                    continue
                if kind == codec.BYE and frames[0] in told:
                    told.discard(frames[0])
                    self._counters["close_answered"] += 1

    def _send(self, link_or_identity, frames) -> bool:
        """Send to a peer without ever blocking; False if it was not sent. The only place
        the I/O thread sends to workers: a peer that went away or stopped reading can
        never kill or stall it.

        A peer whose connection is gone (``EHOSTUNREACH``): a rank's link is marked
        disconnected (membership decides what that means). A peer that has not read its
        last ``SNDHWM`` messages (``EAGAIN``: a stopped process, or a flood's sender that
        never reads its replies): dropped and counted; a rank's batches are sent again on
        a later pass, its connection is judged by ZMTP heartbeats."""
        link = link_or_identity if isinstance(link_or_identity, RankLink) else None
        identity = link.identity if link is not None else link_or_identity
        if identity is None:
            return False
        try:
            self._sock.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            self._counters["sends_dropped_full"] += 1
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                self._counters["send_errors"] += 1
                self._peer_log.log(("send", exc.errno), logging.WARNING,
                                   "TaskQueue %s: send failed: %s", self.name, exc)
            self._counters["unreachable"] += 1
            if link is not None and link.identity is not None:
                # INFO: a rank closing first is the normal shutdown order; a rank that
                # stays away is reported (WARNING) when its group is retired
                log.info("TaskQueue %s: rank %d's connection went away", self.name, link.rank)
                link.disconnect("its connection closed")
            return False

    def _receive(self):
        """At most ``_RECEIVE_BUDGET`` messages from the workers' socket (ZeroMQ serves
        its connections in turn, so a flooding peer gets its share, not the pass)."""
        for _ in range(_RECEIVE_BUDGET):
            try:
                msg = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._current = msg[0]  # for _peer(): where the message came from
            try:
                fd = msg[0].get(zmq.SRCFD)
            except zmq.ZMQError:
                fd = -1
            self._input_guard.spoke("workers", fd, time.monotonic())
            try:
                welcome = self._dispatch([frame.bytes for frame in msg])
            except ProtocolError as exc:
                self._garbage(exc)
                welcome = False
            if welcome:
                self._note_rank_connection(fd)
            elif self._guard.unwelcome(msg[0], time.monotonic()):
                self._counters["connections_cut"] += 1

    def _note_rank_connection(self, fd):
        """A rank of the group spoke on connection ``fd``: remember it, so that its drop
        (and only a rank's: not a status asker's) makes the ranks be probed at once
        (``_connection_dropped``), and the input guard never cuts it. Bounded: forgotten
        wholesale past a few per rank (then any drop probes until they are learned
        again)."""
        if fd < 0:
            return
        self._input_guard.trust("workers", fd)
        fds = self._rank_fds
        if fd not in fds:
            if len(fds) >= 4 * self.tp_size + 16:
                fds.clear()
            fds.add(fd)

    def _connection_dropped(self) -> bool:
        """Read what the socket monitor reported (bounded); True if a connection a rank of
        the group spoke on went away (or one of unknown use, while the ranks' are not all
        known). The connections of status askers and other peers come and go without
        making the engine probe its ranks (a scraper asking 50 times a second would wake
        every rank as often)."""
        dropped = False
        fds = self._rank_fds
        for event, fd in self._watch_connections(self._monitor, "workers"):
            if event == zmq.EVENT_DISCONNECTED and (fd in fds or not fds):
                fds.discard(fd)
                dropped = True
        return dropped

    def _watch_connections(self, monitor, which):
        """``(event, descriptor)`` of what ``monitor`` reported (bounded), each accepted or
        dropped connection also told to the input guard."""
        now = time.monotonic()
        out = []
        for _ in range(_RECEIVE_BUDGET):
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            kind, fd = event["event"], int(event["value"])
            if kind == zmq.EVENT_ACCEPTED:
                self._input_guard.accepted(which, fd, now)
            elif kind == zmq.EVENT_DISCONNECTED:
                self._input_guard.closed(which, fd)
            if which == "producers":
                self._producers.connection_event(kind, fd, now)
            out.append((kind, fd))
        return out

    def _held_bytes(self) -> int:
        """What the engine knowingly holds of batches: retained frames (the socket path;
        shared memory, the ring's batches included, is not heap; with CURVE libzmq also
        holds an encrypted copy per rank it is sending to) and producers' PUTs waiting."""
        with self._mutex:
            retained = sum(len(f) for frames, _ in self._retained.values() if frames
                           for f in frames)
        copies = 1 + (self.tp_size if self._auth is not None else 0)
        return retained * copies + self._producers.pending_bytes

    def _status_reply(self) -> bytes:
        """``status()`` as JSON, rebuilt at most every ``_STATUS_CACHE_S`` (I/O thread)."""
        now = time.monotonic()
        when, raw = self._status_cache
        if now - when >= _STATUS_CACHE_S:
            raw = json.dumps(self.status()).encode()
            self._status_cache = (now, raw)
        return raw

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

    def _dispatch(self, frames) -> bool:
        """One message from the workers' socket: STATUS is answered here, the rest is
        membership's (HELLO, ACK, PING, BYE). True if it came from a rank of the group (or
        admitted one); False for what the flood guard counts (status requests, stale or
        refused messages)."""
        if len(frames) < 2:
            raise ProtocolError(f"{len(frames)} frame(s), expected identity + header")
        identity, header = frames[0], codec.unpack_header(frames[1])
        if not 0 <= header.rank < self.tp_size:
            raise ProtocolError(f"rank {header.rank} out of range")
        if header.kind == codec.STATUS:
            # Only peers that passed authentication get here (CURVE on tcp, the private
            # directory on ipc): the same people who could run a worker. No ids in it.
            self._counters["status_requests"] += 1
            self._send(identity, [codec.pack_header(codec.STATUS_REPLY, engine=self.instance),
                                  self._status_reply()])
            return False
        return self._members.handle(identity, header, frames[2:])

    # -- the ledger: what membership and the producer endpoint change (I/O thread) ---------

    def _start_group(self, group):
        """Serve ``group`` from now on (its first batch is the next one put)."""
        with self._mutex:
            self._group = group

    def _admit(self, rank, first_missing, taken):
        """A rank (re)joins saying it lacks (group-relative) seq ``first_missing`` and has
        taken up to ``taken``: None if that fits what it consumed (its implicit ack is
        applied), else what does not fit."""
        with self._not_full:
            self._read_board()
            consumed = self._consumed[rank] - self._base
            taken = min(taken, self._next_seq - 1 - self._base)
            if first_missing - 1 < consumed:
                return (f"rank {rank} asks for seq {first_missing} but had consumed up to "
                        f"{consumed}")
            if self._base + taken > self._consumed[rank]:  # HELLO's implicit ack
                self._consume(rank, self._base + taken)
        return None

    def _acknowledge(self, rank, seq, message=True):
        """Rank ``rank`` took every batch up to (group-relative) ``seq``. ``ProtocolError``
        for a seq never sent to its group. ``message``: it came as an ACK (counted in
        ``stats()["acks"]``), not with a BYE."""
        with self._not_full:
            seq += self._base
            if seq > self._next_seq - 1:
                raise ProtocolError(f"rank {rank} acknowledged seq {seq - self._base}, only "
                                    f"{self._next_seq - 1 - self._base} were sent to its group")
            if message:
                self._counters["acks"] += 1
            if seq > self._consumed[rank]:  # else stale or duplicate: acks are cumulative
                self._consume(rank, seq)

    def _retire_batches(self, group, reason) -> list:
        """Stop serving ``group`` (retired for ``reason``): reset the window for the next
        group and return what ``group`` did not finish, as ``(seq, tasks, taken_by)`` in
        put order (``tasks``: a ``ProtocolError``, cause chained, for bytes that do not
        decode)."""
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
            # (whose ring, epoch group.epoch + 1, exists before any of them is published)
            dropped = self._encoder.drop_all(group.epoch + 1)
            self._base = self._next_seq - 1
            self._consumed = [self._base] * self.tp_size
            self._group, self._previous = None, group
            self._not_full.notify_all()
        lost = []
        try:
            for seq, frames, taken_by in unfinished:
                try:
                    tasks = self._encoder.decode_retained(frames, dropped.get(seq))
                except BaseException as exc:
                    # A producer's bytes (or an object whose unpickling raises, even
                    # SystemExit) must not end the I/O thread; never lose the seq either.
                    tasks = ProtocolError(f"batch {seq} does not decode: {exc!r}")
                    tasks.__cause__ = exc
                lost.append((seq, tasks, taken_by))
        finally:
            # Nothing retained any more: free its shared memory (see BatchEncoder.forget).
            self._encoder.forget(dropped)
        return lost

    def _in_flight(self) -> int:
        with self._mutex:
            self._read_board()
            return self._next_seq - 1 - min(self._consumed)

    def _enqueue(self, frames, check, expired=False):
        """Enqueue a producer's encoded batch if there is room: ``(P_ACCEPTED, seq)``;
        ``(P_CLOSED, 0)`` once the queue closed; ``(P_TIMEOUT, 0)`` when full and
        ``expired``; ``(None, 0)`` when full and the producer still waits. A batch with
        room is first copied into the ring (outside the mutex), as ``put_tasks`` does."""
        if not self._has_room():
            return (codec.P_CLOSED if self._closed else
                    codec.P_TIMEOUT if expired else None), 0
        batch = self._encoder.place_payload(frames, check)
        status, seq = (codec.P_TIMEOUT if expired else None), 0
        with self._not_full:
            if self._closed:
                status = codec.P_CLOSED
            else:
                self._read_board()
                if self._next_seq - 1 - min(self._consumed) < self.max_inflight:
                    seq = self._next_seq
                    self._next_seq += 1
                    self._retained[seq] = self._encoder.enqueue(seq, seq - self._base, batch)
                    self._put_times[seq] = time.monotonic()
                    status = codec.P_ACCEPTED
        if status != codec.P_ACCEPTED:
            self._encoder.discard(batch)  # filled meanwhile by put_tasks(), or closed
            return status, 0
        self._encoder.wake()
        return status, seq

    def _has_room(self) -> bool:
        with self._not_full:
            if self._closed:
                return False
            self._read_board()
            return self._next_seq - 1 - min(self._consumed) < self.max_inflight

    def _send_new(self, by_caller=False):
        """Send each connected rank every retained batch it has not been sent yet. Under
        ``_sock_lock``; ``by_caller``: from put_tasks() (``_send_now``), counted apart."""
        group = self._group
        if group is None:
            return
        with self._mutex:
            last = self._next_seq - 1
            base = self._base
            retained = self._retained
            # batches the ranks read from the ring (frames None) are not sent
            todo = [(link, [(s, retained[s]) for s in range(link.sent + 1, last + 1)
                            if s in retained and retained[s][0] is not None])
                    for link in group.links if link.identity is not None and link.sent < last]
        for link, batches in todo:
            for seq, (frames, check) in batches:
                header = codec.pack_header(codec.DATA, link.rank, self.tp_size, seq=seq - base,
                                           engine=self.instance, group=group.incarnation,
                                           worker=link.worker, check=check)
                if not self._send(link, [header, *frames]):
                    break  # gone, or not reading: the rest waits for a later pass
                link.sent = seq
                self._counters["sent"] += 1
                if by_caller:
                    self._counters["sent_by_put"] += 1
            else:
                link.sent = last


# What query_status accepts: a STATUS reply is a few KiB (a TP=8 queue: ~2 KiB); a frame
# beyond this drops the connection, and a reply that makes this process hold more than
# _STATUS_INPUT_BOUND without completing (a peer that never sends its last frame, which
# libzmq buffers out of our sight) is abandoned.
_STATUS_MAX_BYTES = 4 << 20
_STATUS_INPUT_BOUND = 64 << 20
_STATUS_MAX_RANKS = 1 << 16


def query_status(endpoint: str, *, keys_dir: str = None, insecure_tcp: bool = None,
                 timeout: float = 2.0) -> dict:
    """Ask the live ``TaskQueue`` at ``endpoint`` for its ``status()``; the engine knows
    every rank's state and watermark whatever the TP coordinator (shared memory or
    paddle.distributed). tcp endpoints need the worker keys (``keys_dir`` or
    ``FD_SYNC_KEYS_DIR``), exactly as a ``TaskClient`` would.

    Blocks at most ``timeout`` seconds; raises ``TimeoutError`` naming the endpoint when no
    engine answers (none running, or the handshake failed), ``ProtocolError`` for a reply
    that is not a status: another message kind, more than two frames, a frame over 4 MiB,
    JSON that does not parse (or nests too deep), or a value that is not a status of the
    shape ``TaskQueue.status()`` gives (the result has every field the CLI prints, of the
    right type). A peer that streams a reply without ever finishing it makes this process
    hold at most ~64 MiB before the call gives up (``ProtocolError``), and that memory is
    given back."""
    from .auth import ClientAuth
    from .transport import anon_rss_bytes, check_ipc_endpoint, trim_heap

    path = ipc_path(endpoint)
    if path is not None:
        check_ipc_endpoint(path)
    auth = ClientAuth.load(endpoint, keys_dir, insecure_tcp)
    ctx = zmq.Context(io_threads=1)
    overrun = False
    try:
        sock = new_socket(ctx, zmq.DEALER)
        sock.setsockopt(zmq.MAXMSGSIZE, _STATUS_MAX_BYTES)
        if auth is not None:
            auth.apply(sock)
        sock.connect(endpoint)
        sock.send(codec.pack_header(codec.STATUS))
        deadline = time.monotonic() + timeout
        held = anon_rss_bytes()
        # in short slices: what an unfinished reply makes libzmq buffer is seen only as
        # memory, and a local peer can fill it at the memory's speed (a 20 ms slice let a
        # loaded machine's client reach 1.2 GiB before it looked)
        while not sock.poll(2):
            if anon_rss_bytes() - held > _STATUS_INPUT_BOUND:
                overrun = True
                raise ProtocolError(f"{endpoint} sent more than {_STATUS_INPUT_BOUND >> 20} MiB "
                                    f"without finishing a reply: not a fastdeploy_sync engine")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no TaskQueue answered at {endpoint} within {timeout:g} s "
                                   f"(none running there, or keys that do not match)")
        frames = [sock.recv()]
        while sock.getsockopt(zmq.RCVMORE):  # one frame at a time: the count is bounded too
            if len(frames) == 2:
                raise ProtocolError(f"{endpoint} answered with more than 2 frames")
            frames.append(sock.recv())
        header = codec.unpack_header(frames[0])
        if header.kind != codec.STATUS_REPLY or len(frames) != 2:
            raise ProtocolError(f"{endpoint} answered with message kind {header.kind} in "
                                f"{len(frames)} frame(s), not a status")
        try:
            status = json.loads(frames[1])
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise ProtocolError(f"{endpoint} answered with a status that is not JSON: "
                                f"{type(exc).__name__}") from None
        _check_status(status, endpoint)
        return status
    finally:
        ctx.destroy(linger=0)
        if overrun:
            trim_heap()


# The fields of a status the CLI reads, and their types (JSON: int, float, str, None).
_STATUS_FIELDS = {"name": str, "dp_id": int, "tp_size": int, "endpoint": str, "engine": str,
                  "pid": int, "last_seq": int, "retained": int, "max_inflight": int,
                  "group": (str, type(None)), "ranks": list}
_RANK_FIELDS = {"rank": int, "state": str, "consumed": int,
                "silent_s": (int, float, type(None)), "worker": (str, type(None)),
                "reason": (str, type(None))}


def _check_status(status, endpoint) -> None:
    """``ProtocolError`` unless ``status`` has the shape ``TaskQueue.status()`` gives."""
    def bad(what):
        return ProtocolError(f"{endpoint} answered with a status that is not a TaskQueue's: "
                             f"{what}")

    if not isinstance(status, dict):
        raise bad(f"a JSON {type(status).__name__}, not an object")
    for key, kind in _STATUS_FIELDS.items():
        if not isinstance(status.get(key), kind) or isinstance(status.get(key), bool):
            raise bad(f"field {key!r} missing or of the wrong type")
    if len(status["ranks"]) > _STATUS_MAX_RANKS:
        raise bad(f"{len(status['ranks'])} ranks")
    for rank in status["ranks"]:
        if not isinstance(rank, dict):
            raise bad("a rank that is not an object")
        for key, kind in _RANK_FIELDS.items():
            if not isinstance(rank.get(key), kind) or isinstance(rank.get(key), bool):
                raise bad(f"a rank's field {key!r} missing or of the wrong type")


def _remove_names(owner_pid, ipc_file, board_name, put_file=None):
    if os.getpid() != owner_pid:
        return  # a forked child exiting: the names are its parent's, still in use
    unlink_quietly(ipc_file)
    unlink_quietly(put_file)
    if board_name:
        unlink_segment(board_name)
