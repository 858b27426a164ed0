"""The rank's background thread: it receives (async mode), pings the engine and judges it.

Async mode: the thread blocks in an OS-level ``poll()`` of the sockets' descriptors
(``Receiver.ready``: the GIL released, no socket touched, its answer visible to the event
loop at once), then, holding ``recv_lock``, drains them: decodes each batch into the local
slot, publishes "I hold up to seq N" to the group, answers nothing. The event loop may
have drained the data socket first (``Receiver.drain``). ZeroMQ's descriptors signal
edges: after every drain to EAGAIN the next arrival signals again, so nothing waits unseen.

Sync mode: the event loop owns the data socket; the thread only pings the engine on its
own socket and watches that socket's connection, so that a step longer than the heartbeat
timeout is not taken for a dead worker.

Either way the thread pings every heartbeat interval on a socket that never carries a batch
and judges the engine (``EngineWatch.check``); what it learns goes to ``Faults.fail``,
which the next step call raises.
"""

import threading
import time

import zmq

__all__ = ["BackgroundThread", "threads_cpu_seconds", "stop_threads"]


class BackgroundThread:
    """The thread (``thread``) of one rank; ``start`` picks the mode."""

    def __init__(self, name, receiver, connection, watch, faults, heartbeat, closing):
        self._name = name  # the thread's name
        self._receiver, self._conn, self._watch, self._faults = receiver, connection, watch, faults
        self._interval = heartbeat.interval
        self._closing = closing
        self.thread = None

    def start(self, async_prefetch: bool) -> None:
        target = self._receiver_main if async_prefetch else self._heartbeat_main
        self.thread = threading.Thread(target=target, daemon=True, name=self._name)
        self.thread.start()

    def stop(self) -> None:
        """Wake the thread so that it sees the client closing. Thread-safe."""
        self._receiver.wake.wake()

    def _fail(self, exc) -> None:
        self._faults.fail(exc, self._closing.is_set())

    def _receiver_main(self):
        """Async mode: receive, decode, ping, watch the engine (module docstring)."""
        receiver, conn, watch = self._receiver, self._conn, self._watch
        poller = receiver.ready
        interval = self._interval
        try:
            with conn.recv_lock:
                receiver.send_hello()
            next_ping = time.monotonic() + interval
            while True:
                with conn.recv_lock:
                    if self._closing.is_set():
                        return
                    receiver.receive_available()
                    if watch.close_seq is not None:
                        return  # the engine closed: nothing more will come, say nothing more
                    receiver.receive_heartbeat_socket()
                    now = time.monotonic()
                    watch.check(now)
                    if now >= next_ping:
                        next_ping = now + interval
                        conn.send_ping()
                    # A send processes the socket's pending commands and may consume the
                    # descriptor's signal for messages that arrived meanwhile: look.
                    pending = ((conn.data.getsockopt(zmq.EVENTS)
                                | conn.hb.getsockopt(zmq.EVENTS)) & zmq.POLLIN)
                if pending:
                    continue
                while True:
                    until = min(next_ping, watch.deadline())
                    # blocks with the GIL released: no CPU when idle
                    poller.wait(max(0.0, until - time.monotonic()) * 1000)
                    if not self._loop_took_wake(poller, until):
                        break
                receiver.wake.drain()
        except BaseException as exc:  # never silent: raised on the event loop
            self._fail(exc)

    def _loop_took_wake(self, poller, until) -> bool:
        """Back from its poll: True if the only thing that woke the thread was the data
        socket, which the event loop has emptied since (``Receiver.drain``), and nothing is
        due before ``until`` (monotonic s): it can poll again at once. A pass would touch
        every socket, and each pyzmq call hands the GIL to a pure-Python step and waits up
        to the switch interval to get it back."""
        return (self._receiver.looked_at == poller.polls and not self._closing.is_set()
                and not poller.ready_other_than(0) and time.monotonic() < until)

    def _heartbeat_main(self):
        """Sync mode: ping and watch on the heartbeat socket only (module docstring)."""
        receiver, conn, watch = self._receiver, self._conn, self._watch
        poller = zmq.Poller()
        poller.register(conn.hb, zmq.POLLIN)
        poller.register(conn.hb_monitor, zmq.POLLIN)
        poller.register(receiver.wake.r, zmq.POLLIN)
        interval = self._interval
        try:
            next_ping = time.monotonic()
            while not self._closing.is_set():
                wait_s = max(0.0, min(next_ping, watch.deadline()) - time.monotonic())
                poller.poll(wait_s * 1000)
                if self._closing.is_set():
                    return
                receiver.receive_heartbeat_socket()
                if self._faults.error is not None:
                    return  # the engine closed, or the event loop has something to raise
                # ping even before the event loop has read the WELCOME (a model may load
                # for minutes before the first step): the engine must hear this rank
                now = time.monotonic()
                watch.check(now)
                if now >= next_ping:
                    next_ping = now + interval
                    conn.send_ping()
        except BaseException as exc:
            self._fail(exc)


def threads_cpu_seconds(threads):
    """CPU time ``threads`` have used so far (user + system), from their own thread clocks;
    None where the platform has no per-thread clock or none of them has run (a thread that
    exited, or None, adds nothing)."""
    if not hasattr(time, "pthread_getcpuclockid"):
        return None
    total = None
    for thread in threads:
        try:
            used = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, TypeError, AttributeError):  # exited, never started, none
            continue
        total = used + (total or 0.0)
    return total


def stop_threads(threads, timeout: float) -> bool:
    """Join each thread of ``threads`` (None: none) for up to ``timeout`` seconds; True if
    every one has stopped. Call it once they were told to stop."""
    threads = [t for t in threads if t is not None]
    for thread in threads:
        thread.join(timeout=timeout)
    return not any(thread.is_alive() for thread in threads)
