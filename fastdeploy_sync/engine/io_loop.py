"""The engine's I/O thread: it owns the workers' and the producers' sockets.

A pass reads: receive (at most ``_RECEIVE_BUDGET`` messages from the workers' socket, then
from the producers'; ``flood_guard`` cuts a connection that sends too much that is
unwelcome) -> dispatch (to ``membership`` or the producer endpoint) -> tick (liveness:
probes, retirements, every heartbeat interval or at the next deadline) -> send (new
batches; sends never block: ``outbox``). What a peer can make it do or hold is bounded
(see ``docs/security.md``).

The workers' socket is used under ``lock`` only: by this thread for each pass, and by
``put_tasks()`` to send its batch at once when no pass is running (``send_now``). The
membership state and the links are used under it too. Between passes the thread sleeps in
a poll of the socket's descriptor, outside the lock.
"""

import logging
import threading
import time

import zmq

from ..errors import ProtocolError
from ..wire import codec
from ..wire.sockets import WakePipe, close_monitor, monitor_events, receive_available
from .flood_guard import FloodGuard

__all__ = ["IOLoop"]

log = logging.getLogger(__name__)

# Messages the I/O thread takes from one socket per pass before it runs the liveness tick
# and sends batches: no socket is drained unboundedly first.
_RECEIVE_BUDGET = 256
# How long after the socket monitor reports a dropped connection the ranks are probed.
_PROBE_AFTER_DROP_S = 0.02
# A connection of the workers' socket that sends more than this many unwelcome messages
# (garbage, stale, refused, status requests) within a second is cut (flood_guard: the
# socket cannot have a receive high-water mark). A rank of the group sends none.
_UNWELCOME_PER_S = 200
# How long close() waits, after sending CLOSE, for every rank it told to answer BYE (a
# gone or stopped worker must not make close() hang). The workers' socket is read all
# that time and closed with no linger: libzmq 4.3.5 aborts the process ("Assertion
# failed: !_io_error (src/stream_engine_base.cpp:310)") when a socket closed with a
# linger receives a message on a connection it still flushes, that peer then hangs up,
# and the connection's ZMTP heartbeat fires before the linger ends (libzmq issues #4364,
# #4841; docs/failure-model.md).
# Without a linger nothing keeps a connection's object alive past the close.
CLOSE_LINGER_MS = 1000
# How long TaskQueue.close() waits for the thread to stop.
_JOIN_S = 5.0


class IOLoop:
    """The I/O thread of one queue (module docstring). Collaborators: the ``ledger``, the
    workers' ``sock`` and its ``monitor``, the producers' ``put_sock`` and ``put_monitor``,
    ``members`` (``Membership``), ``producers`` (``ProducerEndpoint``), ``outbox``,
    ``peers`` (``PeerLog``), ``input_guard`` (``flood_guard.InputGuard``), ``status_reply``
    (the STATUS reply's JSON), ``counters``; ``copies``: how many copies of each retained
    frame the engine holds (CURVE: libzmq keeps an encrypted one per rank)."""

    def __init__(self, *, name, tp_size, instance, heartbeat, ledger, sock, monitor, put_sock,
                 put_monitor, members, producers, outbox, peers, input_guard, status_reply,
                 counters, copies):
        self.name, self._tp_size, self._instance = name, tp_size, instance
        self._interval = heartbeat.interval
        self._ledger = ledger
        self._sock, self._monitor = sock, monitor
        self._put_sock, self._put_monitor = put_sock, put_monitor
        self._members, self._producers = members, producers
        self._outbox, self._peers = outbox, peers
        self._guard = FloodGuard(sock, limit=_UNWELCOME_PER_S)
        self._input_guard = input_guard
        self._status_reply = status_reply
        self._counters = counters
        self._copies = copies
        self._rank_fds = set()  # descriptors of connections ranks of the group spoke on
        self.lock = threading.Lock()
        self._wake = WakePipe()
        self._thread = threading.Thread(target=self._run, name=f"fdsync-engine-{name}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Make the thread run a pass now (thread-safe, never blocks)."""
        self._wake.wake()

    def send_now(self) -> None:
        """``put_tasks()``, after enqueueing: send to the ranks from the calling thread if no
        pass is running, instead of waking the I/O thread to do it (that wake-up would stand
        between ``put_tasks()`` returning and the first send: docs/performance.md). Never
        blocks: when a pass holds the socket, or the queue is stopping, the I/O thread is
        woken and sends at its next pass.

        Costs the caller the sends themselves (docs/performance.md). Sending processes the
        socket's pending commands, which can consume the readiness signal of messages that
        arrived meanwhile (ZMQ_FD signals edges): when any wait, the I/O thread is woken
        for them."""
        if self.lock.acquire(False):
            try:
                ledger = self._ledger
                if ledger.stopping or ledger.error is not None:
                    waiting = True  # the I/O thread finishes (or has failed): its call
                else:
                    self._outbox.send_new(ledger, by_caller=True)
                    waiting = bool(self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)
            except Exception:  # enqueued all the same: the I/O thread sends it
                log.exception("TaskQueue %s: put_tasks() could not send its batch itself; "
                              "the I/O thread will", self.name)
                waiting = True
            finally:
                self.lock.release()
            if not waiting:
                return
        self._wake.wake()

    def stop(self) -> bool:
        """Wake the thread (the ledger says it is stopping) and wait up to ``_JOIN_S`` for it
        to say CLOSE and exit; True if it did (then its wake pipe is closed)."""
        self._wake.wake()
        self._thread.join(timeout=_JOIN_S)
        if self._thread.is_alive():
            log.error("TaskQueue %s: I/O thread did not stop within 5 s", self.name)
            return False
        self._wake.close()
        return True

    # -- the thread ----------------------------------------------------------------------

    def _run(self):
        poller = zmq.Poller()
        # The workers' socket by its descriptor, not as a socket: put_tasks() may send on
        # it between passes (send_now), and zmq_poll would touch the socket unlocked.
        # The descriptor signals edges, so each pass ends by asking the socket whether
        # messages wait (ZMQ_EVENTS), and the next poll does not block if they do.
        sock_fd = self._sock.getsockopt(zmq.FD)
        poller.register(sock_fd, zmq.POLLIN)
        poller.register(self._put_sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._put_monitor, zmq.POLLIN)
        poller.register(self._wake.r, zmq.POLLIN)
        members, producers, guard = self._members, self._producers, self._input_guard
        interval = self._interval
        next_tick = time.monotonic() + interval
        probe_at = float("inf")  # a connection dropped: probe the ranks then
        waiting = False  # messages wait on the workers' socket
        try:
            while True:
                # Blocks with the GIL released until a message, a wake-up or the next tick
                # (returns at once while a socket still holds messages), and wakes every
                # millisecond while a producer waits for room (the ack board notifies
                # nobody). One pass does a bounded amount of work.
                wait_ms = max(0.0, min(next_tick, probe_at, guard.next_check)
                              - time.monotonic()) * 1000
                if producers.pending:
                    wait_ms = min(wait_ms, 1.0)
                if producers.refusing:
                    wait_ms = min(wait_ms, 100.0)
                events = dict(poller.poll(0 if waiting else wait_ms))
                if self._wake.r in events:
                    self._wake.drain()
                with self.lock:
                    if self._ledger.stopping:
                        self._finish_close()
                        return
                    if self._monitor in events and self._connection_dropped():
                        # libzmq reports the drop before the socket has let go of the
                        # connection's pipe (a send to it still succeeds): probe a moment later
                        probe_at = min(probe_at, time.monotonic() + _PROBE_AFTER_DROP_S)
                    if time.monotonic() >= probe_at:
                        probe_at = float("inf")
                        members.connections_changed(time.monotonic())
                    # a wake-up may stand for messages: put_tasks() wakes this thread when
                    # its own send consumed their descriptor's signal (send_now)
                    if waiting or sock_fd in events or self._wake.r in events:
                        self._receive()
                    if self._put_monitor in events:
                        self._watch_connections(self._put_monitor, "producers")
                    if self._put_sock in events:
                        producers.receive(_RECEIVE_BUDGET)
                    if producers.pending:
                        producers.serve()
                    if producers.refusing:
                        producers.cut_refused(time.monotonic())
                    now = time.monotonic()
                    if now >= next_tick:
                        members.tick(now)
                        next_tick = now + interval
                    # sooner if a rank's state would retire its group before then
                    next_tick = min(next_tick, members.deadline())
                    if now >= guard.next_check:
                        self._counters["connections_cut"] += guard.check(now, self._held_bytes())
                    self._outbox.send_new(self._ledger)
                    waiting = bool(self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)
        except BaseException as exc:  # never silent: every caller learns it
            log.exception("TaskQueue %s: I/O thread failed; the queue is unusable (every "
                          "call raises TaskSyncError): close it and start a new one", self.name)
            self._ledger.fail(exc)
            # Nobody serves the sockets any more: drop every connection, so that workers
            # and producers learn the engine is gone instead of waiting on it.
            with self.lock:
                self.close_sockets(linger=0)

    def close_sockets(self, linger=None) -> None:
        """Close the monitors and both sockets (idempotent; holding ``lock``).
        ``linger=None``: what the I/O thread set (a short linger for the CLOSE messages)."""
        close_monitor(self._sock, self._monitor)  # never blocks, whatever they hold
        close_monitor(self._put_sock, self._put_monitor)
        self._sock.close(linger=linger)
        self._put_sock.close(linger=linger)

    def _finish_close(self):
        """The queue is stopping: producers are told, every rank is sent what it still
        lacks and a CLOSE, and their goodbyes are awaited (bounded)."""
        self._producers.close()
        self._put_sock.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        ledger = self._ledger
        self._outbox.send_new(ledger)
        group = ledger.group
        if group is not None:
            self._await_goodbyes(self._outbox.tell_close(group, ledger.group_last()))
        # Whatever was not written by now goes to a rank that did not answer: it learns
        # the engine is gone from its heartbeats instead.
        self._sock.setsockopt(zmq.LINGER, 0)

    def _await_goodbyes(self, told):
        """After CLOSE: read the workers' socket until every connection in ``told`` (routing
        ids) answered BYE, at most ``CLOSE_LINGER_MS``; counts the answers
        (``stats()["close_answered"]``). Everything else that arrives is dropped unread; a
        message that does not decode is too."""
        deadline = time.monotonic() + CLOSE_LINGER_MS / 1000
        while told:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._sock.poll(remaining * 1000):
                log.info("TaskQueue %s: %d rank(s) did not answer CLOSE within %d ms",
                         self.name, len(told), CLOSE_LINGER_MS)
                return
            for frames in receive_available(self._sock, _RECEIVE_BUDGET):
                try:
                    kind = codec.unpack_header(frames[1]).kind if len(frames) >= 2 else None
                except ProtocolError:
                    continue
                if kind == codec.BYE and frames[0] in told:
                    told.discard(frames[0])
                    self._counters["close_answered"] += 1

    # -- receiving -----------------------------------------------------------------------

    def _receive(self):
        """At most ``_RECEIVE_BUDGET`` messages from the workers' socket (ZeroMQ serves
        its connections in turn, so a flooding peer gets its share, not the pass), fewer
        once ``close()`` asks the thread to stop: close() waits for this pass, and one
        message may cost a worker group (a HELLO of a new one retires the old and makes
        its ring: a backlog of 256 of them after a few hundred client lives held close()
        for seconds, and past its 5 s wait close() returned with nothing freed)."""
        ledger = self._ledger
        for msg in receive_available(self._sock, _RECEIVE_BUDGET, copy=False):
            self._peers.current = msg[0]  # where the message came from, for the log
            try:
                fd = msg[0].get(zmq.SRCFD)
            except zmq.ZMQError:
                fd = -1
            self._input_guard.spoke("workers", fd, time.monotonic())
            try:
                welcome = self._dispatch([frame.bytes for frame in msg])
            except ProtocolError as exc:
                self._peers.garbage(exc)
                welcome = False
            if welcome:
                self._note_rank_connection(fd)
            elif self._guard.unwelcome(msg[0], time.monotonic()):
                self._counters["connections_cut"] += 1
            if ledger.stopping:
                return  # the rest stays on the socket: CLOSE is read for BYEs only

    def _dispatch(self, frames) -> bool:
        """One message from the workers' socket: STATUS is answered here, the rest is
        membership's (HELLO, ACK, PING, BYE). True if it came from a rank of the group (or
        admitted one); False for what the flood guard counts (status requests, stale or
        refused messages)."""
        if len(frames) < 2:
            raise ProtocolError(f"{len(frames)} frame(s), expected identity + header")
        identity, header = frames[0], codec.unpack_header(frames[1])
        if not 0 <= header.rank < self._tp_size:
            raise ProtocolError(f"rank {header.rank} out of range")
        if header.kind == codec.STATUS:
            # Only peers that passed authentication get here (CURVE on tcp, the private
            # directory on ipc): the same people who could run a worker. No ids in it.
            self._counters["status_requests"] += 1
            self._outbox.send(identity, [codec.pack_header(codec.STATUS_REPLY,
                                                           engine=self._instance),
                                         self._status_reply()])
            return False
        return self._members.handle(identity, header, frames[2:])

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
            if len(fds) >= 4 * self._tp_size + 16:
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
        for event in monitor_events(monitor, _RECEIVE_BUDGET):
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
        return self._ledger.retained_bytes() * self._copies + self._producers.pending_bytes
