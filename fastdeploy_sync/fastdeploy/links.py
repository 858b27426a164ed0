"""How a client reaches the side channels (``channels.ChannelState``): ``LocalLink`` in the
server's process, ``RemoteLink`` elsewhere, to the ``SideService`` the server runs.

The service is a ZeroMQ ROUTER in a thread of the server's process, on the private ipc
directory (one node) or on tcp with the library's CURVE keys (``auth``), like the task
endpoints: peers are authenticated by the transport before anything they send is decoded,
and every message is checked (structure, size, checksum; ``codec``) before it is unpickled.
It is off the step's critical path: nothing on the task path touches it.

It is held to the task path's guards (docs/security.md): a frame is bounded
(``MAXMSGSIZE``), a connection that may be holding a message it never finishes is cut once
the process's heap grows 128 MiB past what it explains (the engine's
``flood_guard.InputGuard``; never a connection of a client's process), one that sends unwelcome messages fast is cut
(``FloodGuard``), replies queue at most ``_REPLY_HWM`` per connection, and decoding is
total: whatever a peer's message raises, even ``SystemExit`` from a crafted pickle,
becomes an error answer (logged rate-limited), never the end of the thread.

Each request is one message and one reply. An operation FastDeploy would wait in answers
``NotReady``; ``call_until`` asks again (0.5 ms doubling to 5 ms) until the caller's
deadline. Every wait is bounded: a reply within ``timeout`` or ``ConnectionError``
naming the endpoint.
"""

import logging
import os
import struct
import threading
import time
import weakref

import zmq

from .. import envs
from ..engine.flood_guard import FloodGuard, InputGuard
from ..errors import ProtocolError
from ..logs import RateLimitedLog
from ..wire import codec
from ..wire.auth import ClientAuth, ServerAuth
from ..wire.endpoints import (
    check_ipc_endpoint,
    claim_ipc_path,
    ipc_path,
    secure_socket_file,
    unlink_quietly,
)
from ..wire.sockets import (
    CLIENT_FDS,
    ENGINE_FDS,
    WakePipe,
    anon_rss_bytes,
    close_monitor,
    ensure_free_fds,
    monitor_events,
    new_socket,
    open_monitor,
)
from .channels import OPERATIONS as OPS
from .channels import BarrierBroken, NotReady

__all__ = ["LocalLink", "RemoteLink", "SideService", "call_until", "REPLY_TIMEOUT_S"]

log = logging.getLogger(__name__)

_MAGIC = b"FDS1"
_REQUEST = struct.Struct("<4sHhiQQ")  # magic, op, dp_id, client_id, request id, checksum
_REPLY = struct.Struct("<4sBQQ")  # magic, status, request id, checksum
_OK, _NOT_READY, _ERROR, _BROKEN = range(4)
_OP_INDEX = {op: i for i, op in enumerate(OPS)}
# A reply to one request (the service answers at once; this bounds a dead or stuck server)
REPLY_TIMEOUT_S = 10.0
_POLL_MIN_S, _POLL_MAX_S = 0.0005, 0.005
_MESSAGES_PER_TICK = 256
# Replies queued towards one connection that does not read them: a reply beyond is dropped
# (its caller asks again or times out).
_REPLY_HWM = 1000
# What peers may make the server's process hold in side-channel messages they have not
# finished: the task path's bound for its workers' socket (engine.queue's
# _UNFINISHED_INPUT_BYTES). A client says "hello" when it is built, so its process (its
# host over tcp) is trusted, never cut, before it sends anything large.
_UNFINISHED_INPUT_BYTES = 128 << 20
_CONNECTION_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
# Errors a peer may be told about by class name; anything else becomes a RuntimeError.
_ERRORS = {cls.__name__: cls for cls in (ValueError, OverflowError, TypeError, RuntimeError)}


def _encode(obj):
    frames = codec.encode_payload(obj)
    return frames, codec.payload_checksum(frames)


def _decode(frames, checksum, where):
    try:
        return codec.decode_payload(frames, checksum or None)
    except ProtocolError as exc:
        raise ProtocolError(f"{where}: a side-channel message does not decode: {exc}") from None


class LocalLink:
    """In the server's process: calls the state directly. Arguments and results are
    copied through the codec, as they would be through the socket (a caller mutating what
    it put changes nothing in the channel)."""

    def __init__(self, state, where="the server's side channels"):
        self._state, self.endpoint = state, where

    def call(self, op, dp_id, client_id, arg=None):
        frames, check = _encode(arg)
        result = self._state.call(op, dp_id, client_id, _decode(frames, check, self.endpoint))
        frames, check = _encode(result)
        return _decode(frames, check, self.endpoint)

    def close(self):
        pass


class RemoteLink:
    """A DEALER to a ``SideService``: one request at a time (thread-safe). The constructor
    connects and returns at once; ``call`` raises ``ConnectionError`` when no reply comes
    within ``timeout`` (``REPLY_TIMEOUT_S`` by default)."""

    def __init__(self, endpoint, *, keys_dir=None, timeout=REPLY_TIMEOUT_S):
        self.endpoint = endpoint
        self._timeout = timeout
        path = ipc_path(endpoint)
        if path:
            check_ipc_endpoint(path)
        auth = None if path else ClientAuth.load(endpoint, keys_dir)
        ensure_free_fds(CLIENT_FDS, f"EngineWorkerQueue side channels at {endpoint}")
        self._lock = threading.Lock()
        self._request = 0
        self._ctx = zmq.Context(io_threads=1)
        self._sock = new_socket(self._ctx, zmq.DEALER)
        self._sock.setsockopt(zmq.MAXMSGSIZE, envs.max_message_bytes() + 4096)
        if auth is not None:
            auth.apply(self._sock)
        self._sock.connect(endpoint)
        self._pid = os.getpid()
        self._closed = False

    def call(self, op, dp_id, client_id, arg=None, timeout=None):
        """One request; the operation's result, or its error raised here (``NotReady``,
        ``BarrierBroken``, ``ValueError``...). ``ConnectionError`` without a reply."""
        frames, check = _encode(arg)
        timeout = self._timeout if timeout is None else timeout
        with self._lock:
            if self._closed:
                raise ConnectionError(f"the side-channel link to {self.endpoint} is closed")
            if os.getpid() != self._pid:
                raise RuntimeError(f"a side-channel link to {self.endpoint} was inherited "
                                   f"across fork: build the EngineWorkerQueue in this process")
            self._request += 1
            request = self._request
            self._sock.send_multipart([_REQUEST.pack(_MAGIC, _OP_INDEX[op], dp_id, client_id,
                                                     request, check), *frames], copy=False)
            deadline = time.monotonic() + timeout
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._sock.poll(remaining * 1000):
                    raise ConnectionError(
                        f"no answer from the EngineWorkerQueue server's side channels at "
                        f"{self.endpoint} within {timeout:g} s ({op}): is the server "
                        f"(is_server=True) running with this address?")
                reply = self._sock.recv_multipart(copy=False)
                header = reply[0].bytes
                if len(header) != _REPLY.size:
                    continue
                magic, status, seq, check = _REPLY.unpack(header)
                if magic == _MAGIC and seq == request:
                    break  # anything else: a stale reply of a request whose caller gave up
        value = _decode(reply[1:], check, self.endpoint)
        if status == _OK:
            return value
        if status == _NOT_READY:
            raise NotReady
        if status == _BROKEN:
            raise BarrierBroken
        kind, message = value
        raise _ERRORS.get(kind, RuntimeError)(f"{message} (server at {self.endpoint})")

    def close(self):
        with self._lock:
            if not self._closed:
                self._closed = True
                if os.getpid() == self._pid:
                    self._ctx.destroy(linger=0)


def call_until(link, op, dp_id, client_id, arg, deadline, what):
    """``link.call(...)`` again while it answers ``NotReady``, until ``deadline``
    (``time.monotonic()``; None: ``TimeoutError`` never); ``TimeoutError`` naming ``what``
    and the endpoint once it passed."""
    pause = _POLL_MIN_S
    while True:
        try:
            return link.call(op, dp_id, client_id, arg)
        except NotReady:
            pass
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise TimeoutError(f"{what}: still waiting at {link.endpoint} when the wait ended; "
                               f"see the call's timeout")
        time.sleep(pause if deadline is None else max(0.0, min(pause, deadline - now)))
        pause = min(pause * 2, _POLL_MAX_S)


class SideService:
    """The server's side channels on ``endpoint`` (``ipc://`` in the private directory, or
    ``tcp://`` with CURVE keys from ``keys_dir``/``FD_SYNC_KEYS_DIR``), served by one thread.

    The constructor binds (``EndpointInUseError`` when a live server holds the ipc path,
    ``AuthenticationError`` without keys for tcp) and starts the thread. ``close()`` stops
    it (within about 0.1 s) and removes the ipc file; a process that exits without it
    (an uncaught exception included) removes the file at exit. Per tick the thread handles
    at most 256 messages; a message that does not decode, or names an unknown operation, is
    answered with an error (or dropped when it is not even a request) and logged at most
    every 10 s; nothing a peer sends ends the thread. Input is bounded as the module
    docstring says."""

    def __init__(self, state, endpoint, *, keys_dir=None):
        self._state = state
        ensure_free_fds(ENGINE_FDS, f"EngineWorkerQueue side channels at {endpoint}")
        self._ctx = zmq.Context(io_threads=1)
        self._auth = None
        self._path = ipc_path(endpoint)
        try:
            if not self._path:
                self._auth = ServerAuth.start(self._ctx, endpoint, keys_dir)
            sock = new_socket(self._ctx, zmq.ROUTER)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.MAXMSGSIZE, envs.max_message_bytes() + 4096)
            sock.setsockopt(zmq.RCVHWM, 1000)
            sock.setsockopt(zmq.SNDHWM, _REPLY_HWM)
            if self._auth is not None:
                self._auth.apply(sock)
            self._sock = sock
            # connections accepted and dropped, for the input guard
            self._monitor = open_monitor(sock, _CONNECTION_EVENTS)
            if self._path:
                claim_ipc_path(self._path)
            sock.bind(endpoint)
            if self._path:
                secure_socket_file(self._path)
        except BaseException:
            self._ctx.destroy(linger=0)
            if self._auth is not None:
                self._auth.close()
            raise
        # from here the socket file is ours: removed at exit if close() never runs
        self._finalizer = weakref.finalize(self, _remove_socket_file, os.getpid(), self._path)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._bad = RateLimitedLog(log)
        self._flood = FloodGuard(sock)
        self._input = InputGuard(anon_rss_bytes, sockets=("side",),
                                 small=_UNFINISHED_INPUT_BYTES, large=_UNFINISHED_INPUT_BYTES)
        self._stop = False
        self._wake = WakePipe()
        self._thread = threading.Thread(target=self._main, daemon=True,
                                        name=f"fdsync-side-{endpoint}")
        self._thread.start()

    def _main(self):
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake.r, zmq.POLLIN)
        while not self._stop:
            now = time.monotonic()
            try:
                poller.poll(max(0.0, min(0.1, self._input.next_check - now)) * 1000)
            except zmq.ZMQError:
                break
            self._wake.drain()
            now = time.monotonic()
            for event in monitor_events(self._monitor, _MESSAGES_PER_TICK):
                if event["event"] == zmq.EVENT_ACCEPTED:
                    self._input.accepted("side", int(event["value"]), now)
                else:
                    self._input.closed("side", int(event["value"]))
            for _ in range(_MESSAGES_PER_TICK):
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    return
                try:
                    self._receive(frames)
                except BaseException as exc:  # a peer's message never ends the thread
                    self._bad.log("handle", logging.ERROR, "side channels: a message could not "
                                  "be handled (%r); the service goes on", exc)
            if now >= self._input.next_check:
                # legit 0: what the channels hold came from clients, which the guard never
                # cuts; growth it cannot pin on a silent connection becomes its baseline
                self._input.check(now, 0)

    def _receive(self, frames):
        """One message: counted for the guards, then handled."""
        try:
            fd = frames[0].get(zmq.SRCFD)
        except zmq.ZMQError:
            fd = -1
        self._input.spoke("side", fd, time.monotonic())
        if self._handle(frames):
            # a well-formed request: its peer (process, or host over tcp) is a client, and
            # none of its connections is cut by the input guard
            self._input.trust("side", fd)
        else:
            self._flood.unwelcome(frames[0], time.monotonic(), "side-channel garbage")

    def _handle(self, frames) -> bool:
        """Answer one message; True if it was a well-formed request (it decoded and named
        a known operation). Total: whatever decoding or the operation raises, even a
        ``BaseException`` from a crafted pickle, becomes an error answer."""
        identity = frames[0]
        header = frames[1].bytes if len(frames) > 1 else b""
        if len(header) != _REQUEST.size or len(frames) not in (3, 5):
            self._bad.log("shape", logging.WARNING, "side channels: dropped a message that is "
                          "not a request (%d frames)", len(frames))
            return False
        magic, op, dp_id, client_id, request, check = _REQUEST.unpack(header)
        if magic != _MAGIC or op >= len(OPS):
            self._bad.log("magic", logging.WARNING, "side channels: dropped a request of "
                          "another version or kind")
            return False
        status, well_formed = _OK, False
        try:
            arg = _decode_total(frames[2:], check, self.endpoint)
            well_formed = True
            result = self._state.call(OPS[op], dp_id, client_id, arg)
        except NotReady:
            status, result = _NOT_READY, None
        except BarrierBroken:
            status, result = _BROKEN, None
        except Exception as exc:  # the caller's error: answered, never raised here
            status, result = _ERROR, (type(exc).__name__, str(exc))
            if isinstance(exc, ProtocolError):
                self._bad.log("decode", logging.WARNING, "side channels: %s", exc)
        except BaseException as exc:  # an argument's method raised SystemExit...: answered
            status, result = _ERROR, ("RuntimeError", f"{OPS[op]}: the argument raised {exc!r}")
            self._bad.log("operation", logging.WARNING, "side channels: %s of client %d, DP "
                          "group %d: the argument raised %r", OPS[op], client_id, dp_id, exc)
        try:
            body, reply_check = _encode(result)
        except BaseException as exc:  # a result that does not pickle (or raises doing so)
            status, (body, reply_check) = _ERROR, _encode(
                ("TypeError", f"{OPS[op]}: the result cannot be sent: {exc!r}"))
        try:
            self._sock.send_multipart([identity, _REPLY.pack(_MAGIC, status, request,
                                                             reply_check), *body],
                                      zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:  # the peer left (EHOSTUNREACH) or reads no replies (EAGAIN)
            pass
        return well_formed

    def close(self):
        """Stop the thread, close the socket, remove the ipc file. Idempotent."""
        if self._stop:
            return
        self._stop = True
        self._wake.wake()
        self._thread.join(timeout=2.0)
        if self._thread.is_alive():
            log.error("side channels at %s: the service thread did not stop; its socket is "
                      "kept until exit", self.endpoint)
            return
        self._wake.close()
        close_monitor(self._sock, self._monitor)  # never blocks, whatever it holds
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.close()
        self._ctx.term()
        self._finalizer()


def _decode_total(frames, checksum, where):
    """``_decode`` for the service thread: anything unpickling raises, ``BaseException``
    included (a pickle's ``__reduce__`` may call ``sys.exit``), is a ``ProtocolError``."""
    try:
        return _decode(frames, checksum, where)
    except ProtocolError:
        raise
    except BaseException as exc:
        raise ProtocolError(f"{where}: a side-channel message does not decode: "
                            f"{exc!r}") from exc


def _remove_socket_file(owner_pid, path):
    if os.getpid() == owner_pid:  # a forked child exiting: the file is its parent's
        unlink_quietly(path)
