"""Engine side: ``TaskQueue``, the queue the engine puts task batches into.

Every batch gets a sequence number and is kept until every TP rank of the group has
acknowledged taking it (``ledger``). An I/O thread (``io_loop``) owns the sockets: it
delivers new batches to every connected rank, replays the retained ones to a rank that
connects late (so no batch is lost to ZeroMQ's slow-joiner effect, even while the
engine's own code is busy), answers heartbeats, and applies acknowledgements, which free
room for ``put_tasks()``.

Acknowledgements arrive two ways: as ACK messages (``tcp://`` endpoints), or, when the
engine is node-local (``ipc://``), on the ack board in shared memory, which costs the
worker one store instead of a send (``shm.ack_board``).

Worker groups: the ranks that serve the queue form one group, and the engine serves one
group at a time; who belongs to it, and when a group is retired (its unfinished batches
handed back as ``GroupLost`` events), is ``membership``'s. ``put_tasks()`` returns the
queue's own, global sequence number; the wire speaks the group's.

Node-local producers in other processes put through the queue's producer endpoint
(``producer_endpoint``; ``producer.TaskProducer`` is their side).

Made of: ``ledger`` (the batches in flight and the window), ``encoder`` (the put path's
encoding), ``kept_batches`` (the ring and the shared memory batches hold), ``io_loop``
(the thread and its sockets), ``outbox`` (every send to a rank), ``membership``,
``producer_endpoint``, ``flood_guard``, ``peer_log`` and ``status``. This module wires
them and is the public API over them.
"""

import collections
import contextlib
import logging
import os
import queue
import secrets
import time
import weakref
from types import TracebackType
from typing import Any, Optional

import zmq

from .. import envs
from ..errors import EndpointInUseError, ForkedProcessError
from ..forks import refuse_calls
from ..shm.ack_board import AckBoard
from ..shm.ownership import on_fork
from ..shm.segment import unlink_segment
from ..status_client import query_status  # public here too: engine.queue.__all__
from ..wire import codec
from ..wire.auth import ServerAuth
from ..wire.endpoints import (
    claim_ipc_path,
    close_listeners,
    default_endpoint,
    ipc_path,
    listener_address,
    secure_socket_file,
    unlink_quietly,
    validate_name,
)
from ..wire.liveness import Heartbeat, id_tag
from ..wire.sockets import (
    ENGINE_FDS,
    FdLimitHold,
    anon_rss_bytes,
    close_monitor,
    ensure_free_fds,
    new_socket,
    open_monitor,
)
from .encoder import BatchEncoder
from .flood_guard import InputGuard
from .io_loop import IOLoop
from .ledger import DELIVERY_BOUNDS_S, RETIREMENT_KINDS, Ledger
from .membership import GroupLost, LostBatch, Membership
from .outbox import Outbox
from .peer_log import PeerLog
from .producer import TaskProducer
from .producer_endpoint import ProducerEndpoint
from .rank_link import NEVER
from .status_reply import StatusReply

__all__ = ["TaskQueue", "TaskProducer", "GroupLost", "LostBatch", "query_status",
           "DELIVERY_BOUNDS_S", "RETIREMENT_KINDS"]

log = logging.getLogger(__name__)

# Workers only send small messages (HELLO, ACK, PING, BYE: a header and a name): anything
# larger is not ours, and ZeroMQ drops the connection instead of allocating it.
_MAX_INBOUND_BYTES = 4096
# Messages queued per connection towards a peer that does not read them (its replies to a
# flood): a send beyond it fails at once and is dropped (a rank's batch is sent again on a
# later pass). Raised to 4 x max_inflight for queues with a larger window.
_OUTBOUND_HWM = 1000
# What peers may make the engine hold, beyond what it accounts for (batches retained,
# producers' PUTs waiting), in messages they have not finished (InputGuard): on the
# workers' socket, whose messages are small, this much; on the producers', one
# maximum-size batch more (a PUT in flight).
_UNFINISHED_INPUT_BYTES = 128 << 20
# How fast libzmq's I/O thread encrypts with CURVE, assumed low (docs/security.md has the
# rate seen).
_CURVE_BYTES_PER_S = 256 << 20
# Socket-monitor events the engine follows on both sockets.
_WATCHED_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


class TaskQueue:
    """The engine's end of one TP group's task channel.

    ``TaskQueue(name, tp_size, *, dp_id=0, endpoint=None, max_inflight=8)`` binds at once.
    ``endpoint=None`` derives a node-local ``ipc://`` endpoint from ``name`` and ``dp_id``
    (workers built with the same name and dp_id find it); ``tcp://host:port`` binds there
    (``tcp://127.0.0.1:0`` picks a free port: read it back from ``.endpoint``).

    ``max_inflight`` bounds the batches put but not yet consumed by every rank;
    ``max_inflight=1`` reproduces FastDeploy's one-batch-at-a-time behaviour.

    ``heartbeat``: a ``wire.liveness.Heartbeat`` (None: from ``FD_SYNC_HEARTBEAT_INTERVAL``
    / ``FD_SYNC_HEARTBEAT_TIMEOUT``, default 1 s / 3 s). A rank silent for the timeout is
    reported disconnected and its group retired (``group_events``).

    Security: a ``tcp://`` endpoint uses ZeroMQ CURVE with the keys in ``keys_dir`` (None:
    ``FD_SYNC_KEYS_DIR``; see ``wire.auth``): only allowlisted workers can connect, and the
    traffic is encrypted. Without keys it raises ``AuthenticationError`` saying how to make
    them, unless ``insecure_tcp=True`` (or ``FD_SYNC_INSECURE_TCP=1``), which logs a
    warning. ``ipc://`` endpoints live in a private 0700 directory (``wire.endpoints``).

    ``group_events``: a ``queue.SimpleQueue`` of ``GroupLost`` events, one per retired
    worker group, with the batches it did not finish. Poll it from the engine's loop
    (``group_events.get_nowait()``) and re-queue their requests.

    Thread-safe: ``put_tasks`` and the queries may be called from any thread.
    Use as a context manager, or call ``close()``.

    Open files: while the queue is open the process's soft ``RLIMIT_NOFILE`` is raised to
    the hard limit (libzmq aborts the process when it runs out of descriptors:
    ``wire.sockets.FdLimitHold``); ``close()`` of the process's last open queue puts back
    the soft limit the application had. Children started meanwhile inherit the raised one,
    except forked ones (they get the application's back at once).

    Fork: in a child forked from this process the queue is the parent's: every call raises
    ``ForkedProcessError`` and ``close()`` does nothing (``after_fork_in_child``).
    """

    def __init__(self, name: str, tp_size: int, *, dp_id: int = 0,
                 endpoint: Optional[str] = None, max_inflight: int = 8,
                 heartbeat: Optional[Heartbeat] = None, keys_dir: Optional[str] = None,
                 insecure_tcp: Optional[bool] = None) -> None:
        validate_name(name, dp_id)
        if type(tp_size) is not int or tp_size < 1:
            raise ValueError(f"tp_size={tp_size!r}: expected an int >= 1")
        if type(max_inflight) is not int or max_inflight < 1:
            raise ValueError(f"max_inflight={max_inflight!r}: expected an int >= 1")
        self.name, self.tp_size, self.dp_id, self.max_inflight = name, tp_size, dp_id, max_inflight
        self._owner_pid = os.getpid()
        self.heartbeat = heartbeat or Heartbeat()
        max_batch = envs.max_message_bytes()
        # Stamped on every message to workers and echoed by them: traffic meant for another
        # engine of the same endpoint (a restart) is recognised on both sides.
        self.instance = secrets.randbits(63) | 1
        self.group_events: queue.SimpleQueue = queue.SimpleQueue()
        self._counters: collections.Counter = collections.Counter()
        endpoint = endpoint or default_endpoint(name, dp_id)
        self._ipc_path = ipc_path(endpoint)
        self.producer_endpoint = default_endpoint(name, dp_id, "put")
        self._put_path = ipc_path(self.producer_endpoint)
        with contextlib.ExitStack() as undo:
            # libzmq aborts the process when it runs out of fds: take what the hard limit
            # allows while the queue is open (many producers may connect at once; close()
            # gives the application its own limit back), and fail here, cleanly, if even
            # the queue's own sockets would not fit
            self._fd_hold = FdLimitHold(f"TaskQueue {name!r} dp_id={dp_id}")
            undo.callback(self._fd_hold.release)
            ensure_free_fds(ENGINE_FDS + 2 * tp_size, f"TaskQueue {name!r} dp_id={dp_id}")
            self._bind(endpoint, keys_dir, insecure_tcp, max_batch, undo)
            undo.pop_all()  # bound: close() frees it from now on
        # Process exit without close(): still remove the names others would trip on.
        self._finalizer = weakref.finalize(self, _remove_names, os.getpid(), self._ipc_path,
                                           self._board.name if self._board else None,
                                           self._put_path)
        self._io.start()
        # A process this one forks (FastDeploy forks helpers) must not keep the endpoint
        # listening after this engine dies: see after_fork_in_child.
        self._listeners = [a for a in (listener_address(self.endpoint),
                                       listener_address(self.producer_endpoint)) if a]
        on_fork(self)

    def _bind(self, endpoint: str, keys_dir: Optional[str], insecure_tcp: Optional[bool],
              max_batch: int, undo: contextlib.ExitStack) -> None:
        """Make what the queue is made of and bind both endpoints; every resource made is
        pushed on ``undo`` (an ``ExitStack``), which frees them in reverse if a later step
        fails."""
        ctx = self._ctx = zmq.Context(io_threads=1)
        undo.callback(ctx.term)
        self._auth = ServerAuth.start(ctx, endpoint, keys_dir, insecure_tcp)
        if self._auth is not None:
            undo.callback(self._auth.close)
        sock = _workers_socket(ctx, self.heartbeat, self._auth, self.max_inflight)
        undo.callback(sock.close, linger=0)
        # The put path's encoding, and the shared memory its batches hold (node-local
        # ranks map large batches from shared memory; tcp ranks cannot).
        self._encoder = BatchEncoder(self.name, self.dp_id, self.tp_size,
                                     node_local=bool(self._ipc_path), max_message_bytes=max_batch,
                                     encrypted_limit=self._encrypted_limit(),
                                     window=self.max_inflight)
        self._kept = self._encoder.kept  # the ring and every kept slot or region
        undo.callback(self._kept.close)
        self._board = None
        if self._ipc_path:
            claim_ipc_path(self._ipc_path)
            # before bind: a worker that was welcomed always finds the board
            try:
                self._board = AckBoard.create(self.name, self.dp_id, self.tp_size,
                                             self.instance)
            except FileExistsError as exc:
                raise EndpointInUseError(f"TaskQueue {self.name!r} dp_id={self.dp_id}: "
                                         f"{exc}") from None
            undo.callback(self._board.close)
            # no live engine holds the name (the board says so): what shared batches are
            # left of this name were a killed engine's
            self._kept.reclaim_stale()
            # the first worker group's ring (epoch 1: membership numbers groups from 1)
            self._kept.open_ring(1)
        sock.bind(endpoint)
        if self._ipc_path:
            undo.callback(unlink_quietly, self._ipc_path)
            secure_socket_file(self._ipc_path)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # A connection of the workers' socket that drops makes the I/O thread probe the
        # ranks at once instead of at the next tick; connections are followed for the
        # input guard too (both sockets).
        monitor = open_monitor(sock, _WATCHED_EVENTS)
        undo.callback(close_monitor, sock, monitor)
        input_guard = InputGuard(anon_rss_bytes, small=_UNFINISHED_INPUT_BYTES,
                                 large=max_batch + _UNFINISHED_INPUT_BYTES)
        # The producer endpoint: node-local, for engine processes other than this one
        # (TaskProducer). Its own socket, so that the workers' socket keeps its small
        # bound; same-user only, like every node-local endpoint.
        put_sock = new_socket(ctx, zmq.ROUTER)
        undo.callback(put_sock.close, linger=0)
        put_sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        put_sock.setsockopt(zmq.MAXMSGSIZE, max_batch + 4096)
        ProducerEndpoint.configure_socket(put_sock)
        put_monitor = open_monitor(put_sock, _WATCHED_EVENTS)
        undo.callback(close_monitor, put_sock, put_monitor)
        claim_ipc_path(self._put_path)
        put_sock.bind(self.producer_endpoint)
        secure_socket_file(self._put_path)
        self._peers = peers = PeerLog(self.name, self._counters)
        self._ledger = ledger = Ledger(self.name, self.tp_size, self.max_inflight,
                                       self._kept, self._board, self._counters)
        outbox = Outbox(sock, self.name, self.tp_size, self.instance, peers, self._counters)
        status_reply = StatusReply(self.status)
        producers = ProducerEndpoint(
            put_sock, name=self.name, instance=self.instance, counters=self._counters,
            peers=peers, in_flight=ledger.in_flight, status_reply=status_reply,
            check_size=self._encoder.check_encrypted_size, enqueue=self._offer,
            input_guard=input_guard)
        members = Membership(self.name, self.tp_size, self.instance, self.heartbeat, ledger,
                             outbox, peers, self.group_events, self._counters)
        self._io = IOLoop(name=self.name, tp_size=self.tp_size, instance=self.instance,
                          heartbeat=self.heartbeat, ledger=ledger, sock=sock, monitor=monitor,
                          put_sock=put_sock, put_monitor=put_monitor, members=members,
                          producers=producers, outbox=outbox, peers=peers,
                          input_guard=input_guard, status_reply=status_reply,
                          counters=self._counters,
                          copies=1 + (self.tp_size if self._auth is not None else 0))

    # -- engine API ------------------------------------------------------------------------

    def put_tasks(self, tasks: Any, timeout: Optional[float] = None) -> int:
        """Enqueue one batch for every rank of the group; return its sequence number.

        ``tasks`` is any picklable object, typically ``(list_of_requests, real_bsz)``;
        numpy arrays inside it travel as zero-copy frames (see ``wire.codec``). It is
        serialized before anything is enqueued: an unpicklable batch raises ``TypeError``,
        a message larger than ``FD_SYNC_MAX_MESSAGE_MB`` raises ``ValueError``, and the
        queue is unchanged.

        Node-local engine (``ipc://``): the batch is written once into the worker group's
        ring, which every rank of the node reads (``shm.batch_ring``); a batch whose
        out-of-band arrays take at least ``FD_SYNC_SHM_PAYLOAD_MIN_KB`` (default 1 MiB) is
        copied once into shared memory, which every rank maps read-only (``shm.payload``),
        and the arrays are bounded by ``codec.MAX_DATA_BYTES``. When shared memory has no
        room (``/dev/shm`` small or full) the batch goes over the socket instead, never
        refused for it (``engine.encoder``). Either way the arrays are copied once before
        this returns: mutating them afterwards does not change the batch.

        A batch that travels over the socket is sent to the connected ranks from this
        thread when the I/O thread is not in a pass (it is woken to send otherwise): the
        sends never block (a rank that does not read gets the batch on a later pass); this
        call pays for them, and the batch leaves sooner (docs/performance.md).

        Blocks while ``max_inflight`` batches are not yet consumed by every rank.
        ``timeout`` (seconds, None = forever): raises ``TimeoutError`` naming the ranks that
        are behind and their state; the batch is then not enqueued. Raises ``ClosedError``
        after ``close()`` and ``TaskSyncError`` (chained) if the I/O thread failed.
        """
        batch = self._encoder.encode(tasks)
        try:
            seq, retained = self._ledger.put(batch, timeout)
        except BaseException:
            self._kept.discard(batch)  # not enqueued: nobody will ever map it
            raise
        self._kept.wake()
        if retained[0] is not None:  # it travels over the socket
            self._io.send_now()
        return seq

    def _offer(self, frames: list, check: int, expired: bool) -> tuple:
        """A producer's batch (I/O thread, ``ProducerEndpoint``): ``Ledger.offer``'s answer,
        the batch first copied into the ring (outside the ledger's lock) when there is
        room, as ``put_tasks`` does."""
        ledger = self._ledger
        if not ledger.has_room():
            return (_closed_or_full(ledger.closed, expired)), 0
        batch = self._encoder.place_payload(frames, check)
        status, seq = ledger.offer(batch, expired)
        if seq == 0:
            self._kept.discard(batch)  # filled meanwhile by put_tasks(), or closed
            return status, 0
        self._kept.wake()
        return status, seq

    def num_tasks(self) -> int:
        """Batches put but not yet consumed by every rank. Never blocks on the workers.
        Answers while ``close()`` drains; raises ``ClosedError`` once it has returned (its
        return value lists what was not consumed)."""
        return self._ledger.count()

    def exist_tasks(self) -> bool:
        """True while some batch is not yet consumed by every rank; ``ClosedError`` as
        ``num_tasks()``."""
        return self.num_tasks() > 0

    def ranks(self) -> list:
        """Every rank's state in the current group: a dict per rank with ``state``
        (``connected``, ``disconnected`` or ``never connected``), ``since`` (wall-clock
        time of the last change), ``silent_s`` (seconds since it was last heard from),
        ``worker`` (``liveness.id_tag`` of its worker id, which is a secret), ``reason`` (why
        it is disconnected) and ``consumed``. True within the heartbeat timeout. Never
        blocks on the workers; after ``close()`` the last state (every rank that was
        connected: ``disconnected``, "the queue closed")."""
        now = time.monotonic()
        group, consumed = self._ledger.rank_view()
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
        out, group = self._ledger.snapshot()
        out["group"] = id_tag(group.incarnation) if group else None
        out["ranks"] = self.ranks()
        out.update(self._kept.stats())  # shm_*: which path large batches took
        return out

    def status(self) -> dict:
        """Everything ``fastdeploy-sync status`` shows: the queue's name, dp_id, tp_size,
        endpoint, engine instance (``liveness.id_tag`` of it: the STATUS reply goes to
        anyone past authentication) and ``stats()`` (per-rank state and watermarks included).
        ``closed`` is True from the start of ``close()``. JSON-serialisable. Never blocks
        on the workers; never raises after ``close()``."""
        out = {"name": self.name, "dp_id": self.dp_id, "tp_size": self.tp_size,
               "endpoint": self.endpoint, "engine": id_tag(self.instance),
               "max_inflight": self.max_inflight, "pid": os.getpid(),
               "closed": self._ledger.closed}
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

        Gives the application back its soft limit of open files when this is the process's
        last open queue (see the class docstring). In a child forked from the queue's
        process: returns ``[]`` and does nothing (the queue is the parent's).
        """
        unconsumed = self._ledger.drain(timeout)
        if unconsumed is None:
            return []
        if not self._io.stop():
            return unconsumed  # leave the sockets to the thread rather than close them
        with self._io.lock:
            self._io.close_sockets()
        if self._auth is not None:
            self._auth.close()
        self._ctx.term()
        board = self._ledger.finish()
        if board is not None:
            board.close()
        self._kept.close()  # the I/O thread has stopped: nothing sends them now
        unlink_quietly(self._ipc_path)
        unlink_quietly(self._put_path)
        self._finalizer.detach()
        self._fd_hold.release()  # the queue's descriptors are closed
        return unconsumed

    def _encrypted_limit(self) -> Optional[tuple[int, str]]:
        """``(bytes, why)``: the largest batch a CURVE-encrypted endpoint sends, or None
        (ipc, plain tcp). libzmq encrypts a message in one piece in its I/O thread, and
        the connections to every rank may be encrypted in one pass of it: while it does,
        no heartbeat of any connection is sent or answered. A batch whose ``tp_size``
        copies take longer than half the heartbeat timeout to encrypt would make healthy
        ranks look gone, so it is refused at ``put_tasks()`` instead; the bound assumes
        ``_CURVE_BYTES_PER_S``."""
        if self._auth is None:
            return None
        limit = int(_CURVE_BYTES_PER_S * self.heartbeat.timeout / (2 * self.tp_size))
        why = (f"libzmq encrypts a message in one piece, one copy per rank ({self.tp_size}), in "
               f"its I/O thread, which answers no heartbeat meanwhile; past half the heartbeat "
               f"timeout ({self.heartbeat.timeout:g} s) healthy ranks would look gone")
        return limit, why

    def after_fork_in_child(self) -> None:
        """In a process forked from this engine's: close the inherited descriptors of the
        endpoints' listening sockets (a child that outlives a killed engine would keep them
        accepting, so the next engine of the name would find it in use); the queue is
        unusable there (its I/O thread did not survive the fork, a lock another thread held
        at fork stays held, its ring is the parent's): every call raises
        ``ForkedProcessError`` and ``close()`` does nothing (``forks``)."""
        close_listeners(self._listeners)
        what = f"TaskQueue {self.name!r} dp_id={self.dp_id} at {self.endpoint}"
        self._ledger.forget_in_child(ForkedProcessError.inherited(what, self._owner_pid,
                                                                  os.getpid()))
        refuse_calls(self, what, self._owner_pid, idle={"close": []})

    def __enter__(self) -> "TaskQueue":
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        # leaving on an exception: close without waiting for the workers to drain
        self.close(timeout=0 if exc_type is not None else 5.0)


def _workers_socket(ctx: zmq.Context, heartbeat: Heartbeat, auth: Optional[ServerAuth],
                    max_inflight: int) -> zmq.Socket:
    """The workers' ROUTER socket (not bound yet), with its bounds and authentication."""
    sock = new_socket(ctx, zmq.ROUTER)
    # Mandatory: a send to a rank that went away raises (EHOSTUNREACH) instead of
    # vanishing; every send goes through Outbox.send, which handles it.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, _MAX_INBOUND_BYTES)
    sock.setsockopt(zmq.SNDHWM, max(_OUTBOUND_HWM, 4 * max_inflight))
    heartbeat.configure_engine_socket(sock)
    if auth is not None:
        auth.apply(sock)
    return sock


def _closed_or_full(closed: bool, expired: bool) -> Optional[int]:
    return codec.P_CLOSED if closed else codec.P_TIMEOUT if expired else None


def _remove_names(owner_pid: int, ipc_file: Optional[str], board_name: Optional[str],
                  put_file: Optional[str] = None) -> None:
    if os.getpid() != owner_pid:
        return  # a forked child exiting: the names are its parent's, still in use
    unlink_quietly(ipc_file)
    unlink_quietly(put_file)
    if board_name:
        unlink_segment(board_name)
