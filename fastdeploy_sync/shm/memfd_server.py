"""The sealed memfds of this process, handed over a unix socket (``SCM_RIGHTS``) to
processes of its uid that cannot open ``/proc/<pid>/fd/<n>`` of it.

Why: a memfd has no name; a process attaching to a ``shm.sealed`` anchor opens the memfd
through ``/proc/<creator pid>/fd/<n>``, which names the creator only in the creator's pid
namespace. A rank in another one (a container sharing ``/dev/shm`` and the ipc directory,
not the pids) asks the creator instead: the descriptor itself crosses a unix-domain
socket, whatever the pid namespaces.

Server (the creator's side): one per process, started by the first ``serve()`` and
stopped, its socket file removed, by the ``withdraw()`` of its last memfd, and at exit (a
``weakref.finalize``). It listens on ``socket_path(token)`` in the private ipc directory
(``envs.ipc_dir()``, mode 0700, checked as for the engine's sockets), the socket file
itself mode 0600; ``token`` is a random 63-bit number the creator writes into the anchor,
so two creators in different pid namespaces (which may share a pid) never share a path.
A killed process leaves its file behind, and no later process has its random name: a
starting server removes such files (``_sweep_stale``: nobody listens, older than
``STALE_AFTER_S``), as ``fastdeploy-sync clean`` does. One daemon thread polls the
listening socket (and a pipe that stops it), accepts one
connection at a time and answers it within ``PEER_TIMEOUT_S``: it reads the peer's
credentials (``SO_PEERCRED``) and closes a peer of another uid before sending anything;
then it reads one request of exactly ``REQUEST_BYTES`` (a magic word and an anchor name,
NUL-padded) and answers ``OK`` with a duplicate of that anchor's memfd, or ``NO`` if this
process serves no memfd of that name. A peer that sends nothing, garbage or leaves midway
costs the server at most ``PEER_TIMEOUT_S``; every error is caught per connection. The
thread takes the module lock only to duplicate a descriptor: nothing here touches the
engine's put path.

Client (the attacher's side): ``fetch()`` connects (checking the directory and that the
socket is ours), checks the server's uid too, sends the request and receives one
descriptor, all within ``FETCH_TIMEOUT_S``. What it receives is checked by the caller
(``shm.sealed``) exactly as a descriptor opened through ``/proc``: nothing here trusts it.

Fork: a forked child never serves and never removes the parent's socket file: it closes
its inherited copies of the listening socket, the stop pipe and the duplicated memfds
(``os.register_at_fork``) and starts a server of its own if it creates sealed memory.
"""

import errno
import logging
import os
import select
import socket
import stat
import struct
import threading
import time
import weakref

from .. import envs, names
from ..logs import RateLimitedLog
from ..wire.endpoints import (
    check_ipc_endpoint,
    ipc_listener_alive,
    private_dir,
    secure_socket_file,
    unlink_quietly,
)

__all__ = ["serve", "withdraw", "fetch", "socket_path", "served", "request", "REQUEST_BYTES",
           "PEER_TIMEOUT_S", "FETCH_TIMEOUT_S"]

log = logging.getLogger(__name__)

# A request: this magic, then the anchor's name (UTF-8), NUL-padded to REQUEST_BYTES.
REQUEST_BYTES = 256
_MAGIC = b"FDSYMFD1"
_OK, _NO = b"OK", b"NO"
# The server gives one peer at most this long (its request, the answer).
PEER_TIMEOUT_S = 1.0
# A client waits this long at most: one peer ahead of it in the server's queue, then its own.
FETCH_TIMEOUT_S = 3 * PEER_TIMEOUT_S
# How long the thread sleeps in poll between checks (it is woken at once to stop).
_POLL_MS = 1000
_BACKLOG = 16
# A server's socket file nobody listens on is a killed process's once it is this old (a
# live server binds, then listens: in between, a probe is refused too).
STALE_AFTER_S = 60.0
# struct ucred: pid, uid, gid
_UCRED = struct.Struct("iII")

# Reentrant: a SealedSegment's __del__ (withdraw) may run from a garbage collection that
# an allocation under the lock triggered, in the same thread.
_LOCK = threading.RLock()
_SERVER = None  # the running server of this process, or None


def socket_path(token: int) -> str:
    """The socket file of the server whose anchor token is ``token``."""
    return os.path.join(envs.ipc_dir(), names.memfd_socket(token))


def serve(name: str, fd: int, ino: int) -> int:
    """Serve memfd ``fd`` (inode ``ino``) to whoever of this uid asks for anchor ``name``;
    returns the token to record in the anchor, or 0 if no server could be started here
    (the private ipc directory unusable, its path too long: logged; attaching through
    ``/proc`` still works). Keeps a duplicate of ``fd`` until ``withdraw``. Never blocks
    beyond creating a socket and a thread."""
    global _SERVER
    with _LOCK:
        if _SERVER is None:
            try:
                _SERVER = _Server()
            except OSError as exc:
                log.warning("sealed memory %s: cannot serve its descriptor to processes in "
                            "other pid namespaces (%s); only processes that can open "
                            "/proc/%d/fd can attach to it", name, exc, os.getpid())
                return 0
        _SERVER.add(name, fd, ino)
        return _SERVER.token


def withdraw(name: str, ino: int, stop: bool = True) -> None:
    """Stop serving anchor ``name``'s memfd (if it is still inode ``ino``: a newer memfd of
    the same name stays) and close the duplicate. With ``stop`` and nothing left to serve,
    stop the server and remove its socket file; blocks at most ~``PEER_TIMEOUT_S`` (the
    thread finishing the peer it answers). ``stop=False`` never blocks (for ``__del__``;
    the server then stays, serving nothing, until the next ``withdraw`` or exit)."""
    global _SERVER
    with _LOCK:
        server = _SERVER
        if server is None:
            return
        server.remove(name, ino)
        if not stop or server.serving():
            return
        _SERVER = None
    server.stop()


def served():
    """What this process's server serves, or None if none runs: a dict with ``token``,
    ``path`` (its socket file) and ``memfds`` (``{anchor name: inode}``). For tests and
    diagnostics."""
    with _LOCK:
        if _SERVER is None:
            return None
        return dict(token=_SERVER.token, path=_SERVER.path,
                    memfds={name: ino for name, (_, ino) in _SERVER.memfds.items()})


def request(name: str) -> bytes:
    """The request for anchor ``name``'s memfd, as ``fetch`` sends it (``REQUEST_BYTES``).
    ``OSError`` if the name does not fit."""
    raw = name.encode()
    if len(raw) > REQUEST_BYTES - len(_MAGIC):
        raise OSError(f"anchor name {name!r} is too long to ask for")
    return (_MAGIC + raw).ljust(REQUEST_BYTES, b"\0")


def _peer_uid(sock) -> tuple:
    pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                _UCRED.size))
    return pid, uid


def fetch(name: str, token: int) -> int:
    """A descriptor of the memfd that the server ``token`` serves for anchor ``name``,
    close-on-exec, received over its socket; the caller checks what it is. ``OSError``
    saying why not (no server recorded, no socket, not ours, another uid listening, a
    refusal, a timeout). Blocks at most ``FETCH_TIMEOUT_S``."""
    if token <= 0:
        raise OSError("its creator serves no socket (it could not start one: see its log)")
    path = socket_path(token)
    check_ipc_endpoint(path)  # a private directory of ours, a socket of ours (or none)
    deadline = time.monotonic() + FETCH_TIMEOUT_S
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(FETCH_TIMEOUT_S)
        sock.connect(path)
        pid, uid = _peer_uid(sock)
        if uid != os.geteuid():
            raise PermissionError(f"{path} is served by uid {uid} (pid {pid}), not by this "
                                  f"process's uid {os.geteuid()}: not asked")
        sock.sendall(request(name))
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        msg, fds, _, _ = socket.recv_fds(sock, len(_OK), 1, socket.MSG_CMSG_CLOEXEC)
    except TimeoutError:
        raise OSError(f"{path} did not answer within {FETCH_TIMEOUT_S:g} s") from None
    finally:
        sock.close()
    if msg == _OK and len(fds) == 1:
        return fds[0]
    for fd in fds:
        os.close(fd)
    if msg == _NO:
        raise OSError(f"{path} refused: its process no longer serves {name} (closed)")
    raise OSError(f"{path} answered {msg!r} with {len(fds)} descriptor(s)")


class _Server:
    """One listening socket, its thread, and the duplicated memfds it hands out."""

    def __init__(self):
        _sweep_stale(private_dir(envs.ipc_dir()))
        self.memfds = {}  # anchor name -> (duplicated memfd, inode)
        self.token, self.path, self._listener = _bound_listener()
        try:
            self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
        except BaseException:
            self._listener.close()
            unlink_quietly(self.path)
            raise
        self._log = RateLimitedLog(log)  # the thread's only
        # at exit: remove the socket file and stop the thread (the memfds die with us)
        self._finalizer = weakref.finalize(self, _shut, self.path, self._wake_w)
        self._thread = threading.Thread(target=self._run, name="fdsync-memfd-server",
                                        daemon=True)
        try:
            self._thread.start()
        except BaseException:
            self._finalizer()
            os.close(self._wake_r)
            self._listener.close()
            raise

    def add(self, name, fd, ino):
        dup = os.dup(fd)
        old = self.memfds.get(name)
        self.memfds[name] = (dup, ino)
        if old is not None:  # a name's earlier memfd never withdrawn (closed without it)
            os.close(old[0])

    def remove(self, name, ino):
        entry = self.memfds.get(name)
        if entry is not None and entry[1] == ino:
            del self.memfds[name]
            os.close(entry[0])

    def serving(self) -> bool:
        return bool(self.memfds)

    def stop(self):
        """Remove the socket file, wake the thread and wait for it (bounded), close what
        is left. The thread closes the listening socket as it leaves."""
        self._finalizer()  # unlink, then close the pipe's write end: the thread sees POLLHUP
        self._thread.join(timeout=PEER_TIMEOUT_S + _POLL_MS / 1000)
        with _LOCK:
            for fd, _ in self.memfds.values():
                os.close(fd)
            self.memfds.clear()

    def after_fork_in_child(self):
        """In a forked child: close every inherited descriptor (the listening socket, the
        pipe, the memfds); never unlink the parent's socket file. No thread runs here."""
        self._finalizer.detach()
        for fd in (self._wake_r, self._wake_w, *(fd for fd, _ in self.memfds.values())):
            try:
                os.close(fd)
            except OSError:
                pass
        self.memfds.clear()
        try:
            self._listener.close()
        except OSError:
            pass

    def _run(self):
        poller = select.poll()
        poller.register(self._listener.fileno(), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        try:
            while True:
                events = poller.poll(_POLL_MS)
                if any(fd == self._wake_r for fd, _ in events):
                    return  # the write end closed: stop
                if events:
                    self._accept_one()
        except Exception:  # poll itself failed: nothing left to serve with
            log.exception("sealed-memory server %s stopped", self.path)
        finally:
            self._listener.close()
            os.close(self._wake_r)

    def _accept_one(self):
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return  # the peer left before we accepted
        except OSError as exc:  # EMFILE...: let the next poll retry, not spin
            self._log.log("accept", logging.WARNING, "sealed-memory server %s: accept "
                          "failed (%s)", self.path, exc)
            time.sleep(0.1)
            return
        try:
            self._answer(conn)
        except Exception as exc:  # any peer: garbage, silence, a reset
            self._log.log("peer", logging.INFO, "sealed-memory server %s: a peer was not "
                          "answered (%s: %s)", self.path, type(exc).__name__, exc)
        finally:
            conn.close()

    def _answer(self, conn):
        conn.settimeout(PEER_TIMEOUT_S)
        pid, uid = _peer_uid(conn)
        if uid != os.geteuid():
            self._log.log(("uid", uid), logging.WARNING, "sealed-memory server %s: refused "
                          "pid %d of uid %d (not this process's uid %d): nothing sent",
                          self.path, pid, uid, os.geteuid())
            return
        raw = _recv_request(conn)
        if raw is None or not raw.startswith(_MAGIC):
            raise ValueError(f"not a request ({len(raw or b'')} bytes)")
        name = raw[len(_MAGIC):].rstrip(b"\0").decode("utf-8", "replace")
        with _LOCK:
            entry = self.memfds.get(name)
            dup = os.dup(entry[0]) if entry is not None else -1
        if dup < 0:
            conn.sendall(_NO)
            return
        try:
            socket.send_fds(conn, [_OK], [dup])
        finally:
            os.close(dup)


def _recv_request(conn):
    """Exactly ``REQUEST_BYTES`` within ``PEER_TIMEOUT_S`` in all, or None (the peer left)."""
    deadline = time.monotonic() + PEER_TIMEOUT_S
    buf = bytearray()
    while len(buf) < REQUEST_BYTES:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no full request within {PEER_TIMEOUT_S:g} s")
        conn.settimeout(left)
        chunk = conn.recv(REQUEST_BYTES - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _bound_listener():
    """``(token, path, listening socket)``: a fresh random token's path, bound, 0600,
    non-blocking. ``OSError`` if none can be bound (``ValueError`` for a path too long
    is turned into one)."""
    for _ in range(3):
        token = int.from_bytes(os.urandom(8), "little") >> 1 or 1
        path = socket_path(token)
        if len(path.encode()) > 107:
            raise OSError(f"{path} is longer than a unix socket path may be (107 bytes): "
                          f"set FD_SYNC_IPC_DIR to a shorter directory")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(path)
        except FileExistsError:
            sock.close()
            continue
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:  # a stale file of the same token
                continue
            raise
        try:
            secure_socket_file(path)
            sock.listen(_BACKLOG)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            unlink_quietly(path)
            raise
        return token, path, sock
    raise OSError("no free socket path for the sealed-memory server")


def _sweep_stale(directory: str) -> int:
    """Remove the socket files of servers of killed processes (their names are random, so
    no later process would ever reclaim them): sockets of our uid named as a server's,
    older than ``STALE_AFTER_S``, that nobody listens on. Returns how many; never raises.
    Blocks at most 1 s per such file (``ipc_listener_alive``)."""
    removed = 0
    try:
        entries = os.listdir(directory)
    except OSError:
        return 0
    now = time.time()
    for entry in entries:
        parsed = names.parse_socket_entry(entry)
        if parsed is None or parsed.kind != "memfd":
            continue
        path = os.path.join(directory, entry)
        try:
            st = os.lstat(path)
            if (stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid()
                    and now - st.st_mtime > STALE_AFTER_S and not ipc_listener_alive(path)):
                unlink_quietly(path)
                removed += 1
        except OSError:  # gone meanwhile, or not ours to probe: left alone
            continue
    return removed


def _shut(path, wake_w):
    """Remove the socket file, then close the stop pipe's write end (the thread leaves)."""
    unlink_quietly(path)
    try:
        os.close(wake_w)
    except OSError:
        pass


def _after_fork_in_child():
    global _LOCK, _SERVER
    _LOCK = threading.RLock()  # another thread may have held it at fork
    server, _SERVER = _SERVER, None
    if server is not None:
        server.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
