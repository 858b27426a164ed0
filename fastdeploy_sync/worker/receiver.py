"""What one rank receives from its engine, and who receives it.

Receiving is handed over, not shared: the data socket and its monitor are used only by the
thread holding the connection's ``recv_lock`` (a lock is a full memory barrier). In async
mode the background thread (``background``) takes it after every wake-up; the event loop
may take it without waiting (``drain``), when frames have arrived that the background
thread has not handled (it is waiting for the GIL the event loop holds), and handles them
itself. In sync mode the event loop receives in its step calls (``receive_now``) and while
it waits in a barrier (``receive_in_wait``).

Every message goes through ``Receiver.on_message``: the header names the rank and worker it
is for and the engine instance it comes from; stale traffic (another worker's, another
engine's) is counted and dropped; a batch is checked and decoded before anything of it is
held (``wire.codec``, ``shm.payload``).
"""

import errno
import logging
import time

import zmq

from ..errors import (
    AuthenticationError,
    ClosedError,
    EngineClosedError,
    EngineGoneError,
    EngineRejectedError,
    GroupLostError,
    ProtocolError,
)
from ..logs import RateLimitedLog
from ..wire import codec
from ..wire.auth import HANDSHAKE_FAILED_EVENTS, handshake_failure_message
from ..wire.endpoints import ipc_path
from ..wire.sockets import ReadinessPoll, WakePipe, monitor_event_nowait, recv_nowait

__all__ = ["Receiver"]

log = logging.getLogger(__name__)

# How long the event loop waits for the background thread in the middle of handling what
# arrived before going on without the batch (``drain``).
_DRAIN_WAIT_S = 0.002
# A look at the data socket by the event loop stands for this long: the barrier that
# follows the check of the same step does not look again (``drain``).
_RELOOK_NS = 200_000


class Receiver:
    """The receiving side of one rank (module docstring).

    Collaborators: ``connection`` (sockets, ``recv_lock``, what a reply sends), ``watch``
    (the engine this rank is bound to), ``slot`` (where batches go), ``faults`` (what the
    next step call raises), ``group`` (watermarks, engine instance), ``acks`` and ``ring``
    (attached at the first WELCOME), ``payload_reader`` (large batches, or None for a
    ``tcp://`` engine), ``closing`` (an Event), ``counters``.

    ``ready`` is the background thread's poll of the data socket, its monitor, a wake pipe
    (``wake``), the heartbeat socket and its monitor; ``revents`` its results, readable by
    the event loop at once (``drain``)."""

    def __init__(self, *, who, client, tp_rank, connection, watch, slot, faults, group, acks,
                 ring, payload_reader, closing, counters):
        self._who, self._client, self._rank = who, client, tp_rank
        self._conn, self._watch, self._slot, self._faults = connection, watch, slot, faults
        self._group, self._acks, self._ring = group, acks, ring
        self._payload_reader = payload_reader
        self._closing = closing
        self._counters = counters
        self._peer_log = RateLimitedLog(log)
        self._connections = 0  # connections of the data socket made so far
        self.wake = WakePipe()
        fds = connection.descriptors()
        self.ready = ReadinessPoll([fds[0], fds[1], self.wake.r, fds[2], fds[3]])
        self.revents = self.ready.revents
        # The background thread's wake-up (ReadinessPoll.polls) whose batch the event loop
        # received itself, down to an empty socket, and when it last looked (drain).
        self.looked_at, self._looked_ns = -1, 0

    # -- who receives --------------------------------------------------------------------

    def drain(self) -> bool:
        """Event loop, async mode: if a batch has arrived that the background thread has
        not handled yet (it waits for the GIL, which this thread holds while the step is
        pure Python), receive and decode it here, now. True if it received a batch.

        Looked at by ``exist_tasks()`` and before arriving at ``barrier()`` (one read of the
        background thread's poll result, which the kernel wrote before that thread woke:
        ``ReadinessPoll``), and while this rank waits in a busy loop's barrier: where sync
        mode would receive, so that a batch is taken at the same step as in sync mode.
        Gives the GIL away only when there is a batch: the data socket is asked with
        ZMQ_EVENTS (pyzmq keeps the GIL for it, while every recv or poll call releases it).
        Waits only when the background thread is in the middle of handling what arrived (it
        holds the receive lock): until it has, at most ``_DRAIN_WAIT_S``, so that this
        rank does not arrive at the barrier without a batch it is about to hold. A failure
        is latched as the background thread's would be (the next step call raises it). The
        socket monitor is left to the background thread (rare and not urgent).

        Once this thread has emptied the socket for a wake-up, the poll result stays set
        until the background thread gets the GIL and polls again: up to the interpreter's
        switch interval under a pure-Python step. Meanwhile a check looks at the socket at
        most once per ``_RELOOK_NS`` (a batch that arrives then is still received at
        once), and never waits for the background thread, whose pass can only find what
        came after."""
        ready = self.ready
        if not ready.ready(0):
            return False
        handled = self.looked_at == ready.polls
        if handled and time.monotonic_ns() - self._looked_ns < _RELOOK_NS:
            return False
        lock = self._conn.recv_lock
        if not lock.acquire(False):
            # The background thread is handling what arrived and needs the GIL to finish.
            # Yielding once would let it run only to its next release of the GIL, and this
            # rank would arrive at the barrier without the batch, so rank 0 could not take
            # it at this step (tp wait_peers): wait for the thread to finish, bounded. Not
            # when this thread emptied the socket for this wake-up: the thread's pass then
            # only re-arms its poll.
            if not handled and lock.acquire(timeout=_DRAIN_WAIT_S):
                lock.release()
            return False
        try:
            if self._closing.is_set() or self._watch.close_seq is not None:
                return False
            data = self._conn.data
            if not data.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self.looked_at, self._looked_ns = ready.polls, time.monotonic_ns()
                return False
            before = self._slot.received
            try:
                if self._receive_data():
                    self.looked_at, self._looked_ns = ready.polls, time.monotonic_ns()
            except BaseException as exc:
                self._faults.fail(exc, self._closing.is_set())
            received = self._slot.received
            if received == before:
                return False
            self._counters["received_by_loop"] += received - before
            return True
        finally:
            lock.release()

    def receive_now(self) -> None:
        """Sync mode: receive what has arrived, on the calling (event loop) thread. A
        failure is raised as is, and latched: every later call raises ``PrefetchError``,
        so nothing can step past a batch this rank lost."""
        try:
            with self._conn.recv_lock:
                if self._closing.is_set():
                    raise ClosedError(f"{self._client} is closed")
                self.receive_available()
        except ClosedError:
            raise
        except BaseException as exc:
            self._faults.raised_now(exc)
            raise

    def receive_in_wait(self) -> None:
        """Sync mode, while this rank waits in a barrier it arrived at: receive, but leave
        a failure for the barrier's check instead of raising it out of the wait (a rank
        that arrived does not leave on its own failure: ``tp.shm_group``)."""
        try:
            with self._conn.recv_lock:
                if not self._closing.is_set():
                    self.receive_available()
        except BaseException as exc:
            self._faults.latch(exc)

    # -- the sockets (holding recv_lock) -------------------------------------------------

    def receive_available(self) -> None:
        """The data socket's monitor, then every message waiting on the data socket."""
        if self._watch.close_seq is not None:
            return  # the engine closed: a later engine on the endpoint is not ours
        self._receive_monitor(self._conn.monitor, watch=False)
        self._receive_data()

    def _receive_data(self) -> bool:
        """Every message waiting on the data socket, until it is empty (True) or the engine
        said CLOSE (False: nothing after it is ours)."""
        data, watch = self._conn.data, self._watch
        while (frames := recv_nowait(data, copy=False)) is not None:
            self.on_message(frames)
            if watch.close_seq is not None:
                return False
        return True

    def receive_heartbeat_socket(self) -> None:
        """The background thread's own socket: its connection is the one the engine is
        judged by (``watch``), its messages are the engine's PONGs."""
        self._receive_monitor(self._conn.hb_monitor, watch=True)
        hb = self._conn.hb
        while (frames := recv_nowait(hb, copy=False)) is not None:
            self.on_message(frames)

    def _receive_monitor(self, monitor, watch):
        """Handle the socket-monitor events of one of our sockets: re-HELLO on a data
        socket reconnection, authentication failures, and (``watch``: the socket whose
        connection the liveness judgement follows) the connection going down."""
        while (event := monitor_event_nowait(monitor)) is not None:
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_CONNECTED:
                self._watch.connected()
                if monitor is self._conn.monitor:
                    self._connections += 1
                    if self._connections > 1:
                        self.send_hello()
            elif kind & HANDSHAKE_FAILED_EVENTS:
                auth = self._conn.auth
                if auth is not None and not (
                        kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and value == errno.EAGAIN):
                    # nothing was received from that peer: CURVE failed before any message
                    raise AuthenticationError(f"{self._who}: " + handshake_failure_message(
                        kind, self._conn.endpoint, value, auth.keys_dir))
                # a handshake that timed out (a frozen peer accepts but never answers):
                # the connection is not up, as for a disconnect
                if watch:
                    self._watch.connection_down()
            elif kind == zmq.EVENT_DISCONNECTED:
                if watch:
                    self._watch.connection_down()

    def send_hello(self) -> None:
        """HELLO on the data socket (holding ``recv_lock``), saying what this rank holds."""
        slot = self._slot
        self._conn.send_hello(slot.received, slot.taken)

    # -- messages ------------------------------------------------------------------------

    def on_message(self, frames) -> None:
        """One message from the engine (holding ``recv_lock``, or on the heartbeat socket's
        owner). Raises what the rank must stop at: an engine's ERROR, a lost batch, a batch
        that does not decode."""
        try:
            header = codec.unpack_header(frames[0].buffer)
        except ProtocolError as exc:
            self._garbage(exc)
            return
        if header.worker != self._conn.worker_id or header.rank != self._rank:
            self._counters["stale"] += 1  # addressed to another worker: not ours
            return
        kind = header.kind
        watch = self._watch
        if kind == codec.ERROR:
            raise self._engine_error(header, frames)
        if header.engine != watch.engine:
            if kind == codec.WELCOME and not watch.bound:
                watch.engine = header.engine
            else:
                self._counters["stale"] += 1  # from an engine this rank is not bound to
                return
        watch.heard()  # a message from our engine: the connection is back
        if kind == codec.DATA:
            self._on_data(header, frames)
        elif kind == codec.PONG:
            self._counters["pongs"] += 1
        elif kind == codec.WELCOME:
            board = self._acks.welcomed(header.aux, header.engine)
            if board is not None:
                self._ring.attach(header.aux, board.owner_pid)
            if not watch.bound:
                # after the ring, before any batch is published: rank 0 latches nothing
                # until every rank's engine is written (tp all_welcomed)
                self._group.publish_engine(header.engine)
            watch.bound = True
        elif kind == codec.CLOSE:
            if watch.close_seq is None:
                self._conn.answer_close(self._slot.taken)
            watch.close_seq = header.seq
            if self._faults.error is None:
                self._faults.error = EngineClosedError(
                    f"{self._who}: the engine at {self._conn.endpoint} closed the queue; every "
                    f"batch it sent was taken")
            self._group.wake()
        else:
            self._garbage(ProtocolError(f"unexpected message kind {kind}"))

    def _on_data(self, header, frames):
        if not self._watch.bound:
            self._garbage(ProtocolError("a batch before the engine's WELCOME"))
            return
        seq = header.seq
        slot = self._slot
        received = slot.received
        if seq <= received or seq <= slot.taken:
            self._counters["duplicates"] += 1  # replayed after a reconnect
            return
        if seq != received + 1 and not self._ring.covers(received + 1, seq):
            raise ProtocolError(f"rank {self._rank} received seq {seq} after "
                                f"{received}: a batch was lost in transport")
        if len(frames) == 3:  # header, body, shared-memory reference (shm.payload)
            tasks = self._decode_shared(frames[1], frames[2], header.check)
        else:
            tasks = codec.decode_payload(frames[1:], header.check)
        slot.receive(seq, tasks)
        self._group.publish_received(seq)  # after the slot: whoever sees it can take it

    def _decode_shared(self, body, ref, check):
        """A batch whose arrays the engine wrote into node-local shared memory: checked as
        for the socket path before anything is mapped or unpickled, then decoded zero-copy
        from a read-only mapping (``shm.payload.PayloadReader``)."""
        if self._payload_reader is None or ipc_path(self._conn.endpoint) is None:
            raise ProtocolError(f"{self._who}: a shared-memory batch from "
                                f"{self._conn.endpoint}, which is not node-local")
        self._counters["shared_batches"] += 1
        return self._payload_reader.decode(body.buffer, ref.buffer, check)

    def _engine_error(self, header, frames):
        reason = (bytes(frames[1].buffer[:4096]).decode("utf-8", "replace") if len(frames) > 1
                  else "no reason given")
        msg = f"{self._who}, engine at {self._conn.endpoint}: {reason}"
        if header.aux == codec.E_STALE_ENGINE:
            return EngineGoneError(msg)
        if header.aux == codec.E_GROUP_LOST:
            return GroupLostError(msg)
        return EngineRejectedError(msg)

    def _garbage(self, exc):
        self._counters["garbage_frames"] += 1
        self._peer_log.log("garbage", logging.WARNING, "%s: dropped a message (%d so far): %s",
                           self._client, self._counters["garbage_frames"], exc)
