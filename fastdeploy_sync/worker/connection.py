"""One rank's sockets to its engine, and every message the rank sends on them.

Three DEALER sockets, each with one owner at a time (a ZeroMQ socket is not thread-safe):

  * ``data``: receives batches and the engine's control messages, carries HELLO and BYE.
    Owned by whoever holds ``recv_lock`` (the background thread, or the event loop: see
    ``receiver``). libzmq must not drop it for silence: a batch still crossing is silence
    to it (``wire.liveness``). Its monitor re-sends HELLO on every reconnection.
  * ``ack``: the event loop's, for ACK messages (``acks``); queues at most ``_ACK_HWM`` and
    nothing on a connection that is not up (``IMMEDIATE``): ACKs are cumulative, so one
    that cannot be queued is kept and sent again, never piled up on a dead connection.
    ``close()`` takes ``ack_lock`` before closing it.
  * ``hb``: the background thread's, for pings; the connection the engine is judged by
    (``engine_watch``), carrying only small messages.

Monitors are attached before connecting: a handshake refused in between would be an event
nobody sees (a rejected key would then read as an engine that never came).
"""

import logging
import threading

import zmq

from .. import envs
from ..wire import codec
from ..wire.auth import HANDSHAKE_FAILED_EVENTS
from ..wire.sockets import close_monitor, new_socket, open_monitor

__all__ = ["EngineConnection"]

log = logging.getLogger(__name__)

# How long close() lets its BYE leave (the engine then knows at once that this rank left).
_BYE_LINGER_MS = 200
# How long close() waits for a step call in another thread to let go of a socket before it
# keeps the sockets (leaks them until exit) rather than closing them under that thread.
_CLOSE_WAIT_S = 2.0
# ACKs queued towards the engine at most (tcp); beyond, the latest is kept and sent again.
_ACK_HWM = 64
# Socket-monitor events a worker watches: connection up and down, and handshakes.
_MONITOR_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED_EVENTS)


class EngineConnection:
    """The sockets of rank ``tp_rank`` to the engine at ``endpoint`` (module docstring).

    ``watch`` (an ``EngineWatch``) says which engine instance messages are addressed to;
    ``closing`` (an Event) is set once the client began to close: nothing is sent after.
    ``auth``: a ``wire.auth.ClientAuth`` (tcp with keys) or None."""

    def __init__(self, name, tp_size, tp_rank, endpoint, heartbeat, auth, watch, incarnation,
                 worker_id, closing):
        self._name, self._tp_size, self._rank = name, tp_size, tp_rank
        self.endpoint, self._heartbeat, self.auth = endpoint, heartbeat, auth
        self._watch, self._incarnation, self.worker_id = watch, incarnation, worker_id
        self._closing = closing
        self.recv_lock = threading.Lock()  # data and its monitor, hb and its monitor
        self._ack_lock = threading.Lock()  # the ack socket against close()
        self._ctx = zmq.Context(io_threads=1)
        try:
            self.data, self.monitor = self._connect(monitored=True, receives_batches=True)
            self._ack = self._connect(acks=True)
            self.hb, self.hb_monitor = self._connect(monitored=True)
        except BaseException:
            self._ctx.destroy(linger=0)
            raise

    def _connect(self, monitored: bool = False, receives_batches: bool = False,
                 acks: bool = False):
        """A DEALER connected to the engine; with ``monitored``, ``(socket, monitor)``.
        ``receives_batches``: see ``Heartbeat.configure_socket``; ``acks``: the ACK socket's
        bounds (module docstring)."""
        sock = new_socket(self._ctx, zmq.DEALER)
        if acks:
            sock.setsockopt(zmq.SNDHWM, _ACK_HWM)
            sock.setsockopt(zmq.IMMEDIATE, 1)
        # What the engine may make us allocate: one batch, plus room for the header.
        sock.setsockopt(zmq.MAXMSGSIZE, envs.max_message_bytes() + 4096)
        self._heartbeat.configure_socket(sock, receives_batches=receives_batches)
        if self.auth is not None:
            self.auth.apply(sock)
        monitor = open_monitor(sock, _MONITOR_EVENTS) if monitored else None
        sock.connect(self.endpoint)
        return (sock, monitor) if monitored else sock

    def descriptors(self) -> list:
        """What the background thread polls: the data socket, its monitor, the heartbeat
        socket and its monitor (``zmq.FD`` each), in that order."""
        return [self.data.getsockopt(zmq.FD), self.monitor.getsockopt(zmq.FD),
                self.hb.getsockopt(zmq.FD), self.hb_monitor.getsockopt(zmq.FD)]

    def header(self, kind, seq=0, aux=0) -> bytes:
        return codec.pack_header(kind, self._rank, self._tp_size, seq=seq, aux=aux,
                                 engine=self._watch.engine, group=self._incarnation,
                                 worker=self.worker_id)

    # -- what a rank sends ---------------------------------------------------------------

    def send_hello(self, received: int, taken: int) -> None:
        """HELLO on the data socket (holding ``recv_lock``): seq is the first batch this
        rank does not hold, aux what it has taken (an implicit acknowledgement, in case an
        ACK was lost with a broken connection), engine the instance it is bound to (0:
        none yet), so a restarted engine knows this worker holds another engine's batches.
        A DEALER queues it until the connection is up: a worker may start first."""
        # with a ring, batches up to ``taken`` may never have crossed the socket
        self.data.send_multipart([self.header(codec.HELLO, seq=max(received, taken) + 1,
                                              aux=taken), self._name.encode()])

    def send_ping(self) -> None:
        """PING on the heartbeat socket (its owner's); dropped while not connected: the
        HELLO queued first will tell the engine."""
        try:
            self.hb.send(self.header(codec.PING), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def answer_close(self, taken: int) -> None:
        """The engine said CLOSE: answer BYE (holding ``recv_lock``). The engine reads its
        socket until every rank it told answers, then closes it without lingering; no room
        or no connection: it stops waiting at its bound."""
        try:
            self.data.send(self.header(codec.BYE, seq=taken), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def send_ack(self, seq: int):
        """The cumulative ACK ``seq`` on the ACK socket, never blocking: True if queued,
        False if not (no connection up, or full), None once the client is closing."""
        with self._ack_lock:  # close() in another thread must not close it meanwhile
            if self._closing.is_set():
                return None
            try:
                self._ack.send(self.header(codec.ACK, seq=seq), zmq.NOBLOCK)
            except zmq.ZMQError:
                return False
            return True

    # -- lifetime ------------------------------------------------------------------------

    def close(self, threads_stopped: bool, bye_seq=None) -> bool:
        """Close every socket, once no thread uses them: waits up to ``_CLOSE_WAIT_S`` each
        for ``recv_lock`` and the ACK lock (a step call of another thread); a thread that
        still uses one (or a background thread that did not stop) makes it keep them open
        until exit, logged, never closed under that thread. ``bye_seq``: say BYE (carrying
        the highest seq this rank took) first, and let it leave for ``_BYE_LINGER_MS``.
        True when the sockets were closed."""
        got_recv = self.recv_lock.acquire(timeout=_CLOSE_WAIT_S)
        got_ack = self._ack_lock.acquire(timeout=_CLOSE_WAIT_S)
        try:
            if not (threads_stopped and got_recv and got_ack):
                log.error("TaskClient %s rank %d: a thread still uses its sockets; they are "
                          "kept open until exit", self._name, self._rank)
                return False
            close_monitor(self.data, self.monitor)
            close_monitor(self.hb, self.hb_monitor)
            if bye_seq is not None:
                try:
                    self.data.send(self.header(codec.BYE, seq=bye_seq), zmq.NOBLOCK)
                except zmq.ZMQError:  # no connection to queue it on: the engine learns otherwise
                    pass
                else:
                    self.data.close(linger=_BYE_LINGER_MS)
            self._ctx.destroy(linger=0)
            return True
        finally:
            if got_ack:
                self._ack_lock.release()
            if got_recv:
                self.recv_lock.release()
