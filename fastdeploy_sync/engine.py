"""Engine side: ``TaskQueue``, the queue the engine puts task batches into.

Every batch gets a sequence number and is kept until every TP rank of the group has
acknowledged taking it. An I/O thread owns the ROUTER socket: it delivers new batches to
every connected rank, replays the retained ones to a rank that connects late (so no
batch is lost to ZeroMQ's slow-joiner effect, even while the engine's own code is busy),
and applies acknowledgements, which free room for ``put_tasks()``.

Acknowledgements arrive two ways: as ACK messages (``tcp://`` endpoints), or, when the
engine is node-local (``ipc://``), on the ack board in shared memory, which costs the
worker one store instead of a send (see ``ack_board``). The board is read whenever the
engine needs a count or room; a ``put_tasks()`` blocked on the bound re-reads it with a
short sleeping backoff (50 µs doubling to 1 ms).

Lock invariant: ``_mutex`` guards ``_next_seq``, ``_retained``, ``_consumed`` and
``_error``; ``_not_full`` is a condition on it, notified whenever the slowest rank's
acknowledgement advances or the queue closes. Only the I/O thread touches the socket.
"""

import collections
import logging
import secrets
import threading
import time
import weakref

import zmq

from . import codec
from .ack_board import AckBoard
from .shm import unlink_segment
from .errors import ClosedError, EndpointInUseError, ProtocolError, TaskSyncError
from .transport import (WakePipe, claim_ipc_path, default_endpoint, ipc_path, new_socket,
                        unlink_quietly, validate_name)

__all__ = ["TaskQueue"]

log = logging.getLogger(__name__)

# Garbage is logged for the first few frames, then every Nth, so a misbehaving peer
# cannot flood the log; the exact count is always in ``stats()``.
_LOG_FIRST_GARBAGE = 5
_LOG_EVERY_GARBAGE = 1000
# A put_tasks() blocked on the bound re-reads the ack board at this pace (doubling).
_BOARD_POLL_MIN_S = 50e-6
_BOARD_POLL_MAX_S = 1e-3


class _Peer:
    """What the I/O thread knows of one rank's data socket."""

    __slots__ = ("identity", "sent")

    def __init__(self, identity: bytes, sent: int):
        self.identity = identity
        self.sent = sent  # highest seq sent to this identity


class TaskQueue:
    """The engine's end of one TP group's task channel.

    ``TaskQueue(name, tp_size, *, dp_id=0, endpoint=None, max_inflight=8)`` binds at once.
    ``endpoint=None`` derives a node-local ``ipc://`` endpoint from ``name`` and ``dp_id``
    (workers built with the same name and dp_id find it); ``tcp://host:port`` binds there
    (``tcp://127.0.0.1:0`` picks a free port: read it back from ``.endpoint``).

    ``max_inflight`` bounds the batches put but not yet consumed by every rank;
    ``max_inflight=1`` reproduces FastDeploy's one-batch-at-a-time behaviour.

    Thread-safe: ``put_tasks`` and the queries may be called from any thread.
    Use as a context manager, or call ``close()``.
    """

    def __init__(self, name: str, tp_size: int, *, dp_id: int = 0, endpoint: str = None,
                 max_inflight: int = 8):
        validate_name(name, dp_id)
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size={tp_size!r}: expected an int >= 1")
        if not isinstance(max_inflight, int) or max_inflight < 1:
            raise ValueError(f"max_inflight={max_inflight!r}: expected an int >= 1")
        self.name, self.tp_size, self.dp_id, self.max_inflight = name, tp_size, dp_id, max_inflight
        self._mutex = threading.Lock()
        self._not_full = threading.Condition(self._mutex)
        self._next_seq = 1
        self._retained = collections.OrderedDict()  # seq -> [header, body, *buffers]
        self._consumed = [0] * tp_size  # highest seq acknowledged by each rank
        self._error = None  # an I/O thread failure, re-raised by every call
        # Stamped on every batch and echoed in HELLO: a worker that reconnects to a new
        # engine of the same name (a restart) is refused instead of splicing two streams.
        self.instance = secrets.randbits(62) | 1
        self._closed = False
        self._counters = collections.Counter()

        self._ctx = zmq.Context(io_threads=1)
        self._sock = new_socket(self._ctx, zmq.ROUTER)
        # Mandatory: a send to a rank that went away raises instead of vanishing.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Handover: a rank that reconnects with the same identity replaces the old pipe.
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        endpoint = endpoint or default_endpoint(name, dp_id)
        self._ipc_path = ipc_path(endpoint)
        self._board = None
        try:
            if self._ipc_path:
                claim_ipc_path(self._ipc_path)
                # before bind: a worker that received a batch always finds the board
                try:
                    self._board = AckBoard.create(name, dp_id, tp_size)
                except FileExistsError as exc:
                    raise EndpointInUseError(f"TaskQueue {name!r} dp_id={dp_id}: {exc}") from None
            self._sock.bind(endpoint)
        except BaseException:
            if self._board is not None:
                self._board.close()
            self._sock.close(linger=0)
            self._ctx.term()
            raise
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # Process exit without close(): still remove the names others would trip on.
        self._finalizer = weakref.finalize(self, _remove_names, self._ipc_path,
                                           self._board.name if self._board else None)
        self._wake = WakePipe()
        self._peers = {}  # rank -> _Peer; I/O thread only
        self._seen = set()  # ranks that ever said HELLO, for error messages
        self._thread = threading.Thread(target=self._io_main, name=f"fdsync-engine-{name}",
                                        daemon=True)
        self._thread.start()

    # -- engine API ------------------------------------------------------------------------

    def put_tasks(self, tasks, timeout: float = None) -> int:
        """Enqueue one batch for every rank of the group; return its sequence number.

        ``tasks`` is any picklable object, typically ``(list_of_requests, real_bsz)``;
        numpy arrays inside it travel as zero-copy frames (see ``codec``). It is
        serialized before anything is enqueued: an unpicklable batch raises ``TypeError``
        and the queue is unchanged.

        Blocks while ``max_inflight`` batches are not yet consumed by every rank.
        ``timeout`` (seconds, None = forever): raises ``TimeoutError`` naming the ranks that
        are behind; the batch is then not enqueued. Raises ``ClosedError`` after ``close()``
        and ``TaskSyncError`` (chained) if the I/O thread failed.
        """
        frames = codec.encode_payload(tasks)
        deadline = None if timeout is None else time.monotonic() + timeout
        backoff = _BOARD_POLL_MIN_S
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
            self._retained[seq] = [codec.pack_header(codec.DATA, seq=seq, aux=self.instance),
                                   *frames]
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

    def stats(self) -> dict:
        """Counters (``garbage_frames``, ``acks``, ``hellos``, ``sent``...), the last seq put,
        and every rank's consumed seq. Cheap; for logs and tests."""
        with self._mutex:
            self._read_board()
            out = dict(self._counters)
            out.update(last_seq=self._next_seq - 1, consumed=list(self._consumed),
                       retained=len(self._retained))
        return out

    def close(self) -> None:
        """Stop the I/O thread, close the socket, remove the ipc file. Idempotent.

        Batches not yet consumed by every rank are dropped, with a warning naming them.
        Blocks at most ~5 s for the I/O thread to finish what it is doing.
        """
        with self._not_full:
            if self._closed:
                return
            self._closed = True
            self._read_board()
            backlog = self._next_seq - 1 - min(self._consumed)
            if backlog:
                log.warning("TaskQueue %s closing with %d batch(es) not consumed by every rank: %s",
                            self.name, backlog, self._describe_backlog())
            self._not_full.notify_all()
        self._wake.wake()
        self._thread.join(timeout=5.0)
        if self._thread.is_alive():
            log.error("TaskQueue %s: I/O thread did not stop within 5 s", self.name)
            return  # leave the socket to the thread rather than close it under its feet
        self._sock.close(linger=0)
        self._ctx.term()
        self._wake.close()
        if self._board is not None:
            self._board.close()
        unlink_quietly(self._ipc_path)
        self._finalizer.detach()

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

    def _read_board(self):
        """Fold the ack board into ``_consumed`` (under ``_mutex``)."""
        if self._board is None:
            return
        last = self._next_seq - 1
        for rank, seq in enumerate(self._board.read()):
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
            for s in range(low_before + 1, low + 1):
                self._retained.pop(s, None)
            self._not_full.notify_all()

    def _describe_backlog(self) -> str:
        last = self._next_seq - 1
        low = min(self._consumed)
        behind = []
        for rank, consumed in enumerate(self._consumed):
            if consumed == low:
                state = ("connected" if rank in self._peers else
                         "disconnected" if rank in self._seen else "never connected")
                behind.append(f"rank {rank} consumed up to seq {consumed} of {last} ({state})")
        return (f"{last - low} batch(es) in flight (max_inflight={self.max_inflight}); "
                f"behind: " + "; ".join(behind))

    # -- I/O thread ------------------------------------------------------------------------

    def _io_main(self):
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake.r, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll())  # blocks with the GIL released
                if self._wake.r in events:
                    self._wake.drain()
                if self._closed:
                    return
                if self._sock in events:
                    self._receive_all()
                self._send_new()
        except Exception as exc:
            log.exception("TaskQueue %s: I/O thread failed", self.name)
            with self._not_full:
                self._error = exc
                self._not_full.notify_all()

    def _receive_all(self):
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle(frames)
            except ProtocolError as exc:
                self._garbage(frames, exc)

    def _garbage(self, frames, exc):
        with self._mutex:
            self._counters["garbage_frames"] += 1
            n = self._counters["garbage_frames"]
        if n <= _LOG_FIRST_GARBAGE or n % _LOG_EVERY_GARBAGE == 0:
            log.warning("TaskQueue %s: dropped an undecodable message (%d so far): %s; frames=%s",
                        self.name, n, exc, [bytes(f[:32]) for f in frames])

    def _handle(self, frames):
        if len(frames) < 2:
            raise ProtocolError(f"{len(frames)} frame(s), expected identity + header")
        identity, header = frames[0], codec.unpack_header(frames[1])
        if not 0 <= header.rank < self.tp_size:
            raise ProtocolError(f"rank {header.rank} out of range for tp_size={self.tp_size}")
        if header.kind == codec.HELLO:
            self._hello(identity, header, frames[2:])
        elif header.kind == codec.ACK:
            self._ack(header)
        else:
            raise ProtocolError(f"a worker sent message kind {header.kind}")

    def _hello(self, identity, header, rest):
        rank, next_wanted = header.rank, header.seq
        worker_name = bytes(rest[0]).decode("utf-8", "replace") if rest else "?"
        seen_instance = int.from_bytes(bytes(rest[1]), "little") if len(rest) > 1 else 0
        problem = None
        if seen_instance and seen_instance != self.instance:
            problem = (f"rank {rank} holds batches from another engine of {self.name!r} (it "
                       f"restarted, or two engines share the name): restart the worker group "
                       f"together with its engine")
        elif header.tp_size != self.tp_size:
            problem = (f"tp_size mismatch: the engine of {self.name!r} serves tp_size="
                       f"{self.tp_size}, rank {rank} was built with tp_size={header.tp_size}")
        elif worker_name != self.name:
            problem = f"name mismatch: the engine serves {self.name!r}, the worker asked for {worker_name!r}"
        else:
            with self._mutex:
                self._read_board()
                consumed = self._consumed[rank]
            if next_wanted - 1 < consumed:
                problem = (f"rank {rank} connected asking for seq {next_wanted} but it had already "
                           f"consumed up to seq {consumed}: restarting one rank mid-stream is not "
                           f"supported, restart the whole group and its engine")
        self._counters["hellos"] += 1
        if problem:
            log.error("TaskQueue %s: rejected a worker: %s", self.name, problem)
            self._sock.send_multipart([identity, codec.pack_header(codec.ERROR, rank=rank),
                                       problem.encode()])
            return
        with self._not_full:  # aux: what the rank has taken, an implicit acknowledgement
            taken = min(header.aux, self._next_seq - 1)
            if taken > self._consumed[rank]:
                self._consume(rank, taken)
        self._peers[rank] = _Peer(identity, next_wanted - 1)
        self._seen.add(rank)
        log.debug("TaskQueue %s: rank %d connected, wants seq %d", self.name, rank, next_wanted)

    def _ack(self, header):
        rank, seq = header.rank, header.seq
        with self._not_full:
            if seq > self._next_seq - 1:
                raise ProtocolError(f"rank {rank} acknowledged seq {seq}, "
                                    f"only {self._next_seq - 1} were put")
            self._counters["acks"] += 1
            if seq > self._consumed[rank]:  # else stale or duplicate: acks are cumulative
                self._consume(rank, seq)

    def _send_new(self):
        """Send each connected rank every retained batch it has not been sent yet."""
        if not self._peers:
            return
        with self._mutex:
            last = self._next_seq - 1
            retained = self._retained
            todo = [(rank, peer, [retained[s] for s in range(peer.sent + 1, last + 1) if s in retained])
                    for rank, peer in self._peers.items() if peer.sent < last]
        for rank, peer, batches in todo:
            try:
                for frames in batches:
                    self._sock.send_multipart([peer.identity, *frames], copy=False)
                    self._counters["sent"] += 1
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                # The rank's socket went away; it says HELLO again when it reconnects and
                # gets everything it has not consumed, so nothing is lost.
                log.warning("TaskQueue %s: rank %d disconnected", self.name, rank)
                del self._peers[rank]
                continue
            peer.sent = last


def _remove_names(ipc_file, board_name):
    unlink_quietly(ipc_file)
    if board_name:
        unlink_segment(board_name)
