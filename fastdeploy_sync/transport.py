"""ZeroMQ plumbing shared by the engine and worker sides.

Topology: the engine binds one ROUTER socket; every worker rank connects two DEALER
sockets to it, one owned by its prefetch thread (receives batches) and one owned by the
event loop (sends acknowledgements). A ZeroMQ socket is not thread-safe, so each socket
has exactly one owning thread for its whole life.

Endpoints: ``endpoint=None`` means a node-local ``ipc://`` file derived from the queue's
name and dp_id (nothing to start or configure); ``tcp://host:port`` is used as given.
"""

import errno
import os
import re
import socket

import zmq

from . import envs
from .errors import EndpointInUseError

__all__ = [
    "validate_name",
    "default_endpoint",
    "ipc_path",
    "claim_ipc_path",
    "unlink_quietly",
    "new_socket",
    "WakePipe",
]

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_UNIX_PATH_MAX = 107


def validate_name(name: str, dp_id: int) -> None:
    """Names become file and shared-memory names, so keep them to a safe alphabet."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"name={name!r}: use 1-64 characters from [A-Za-z0-9_.-]")
    if not isinstance(dp_id, int) or dp_id < 0:
        raise ValueError(f"dp_id={dp_id!r}: expected an int >= 0")


def default_endpoint(name: str, dp_id: int) -> str:
    path = os.path.join(envs.ipc_dir(), f"fdsync-{name}-dp{dp_id}.ipc")
    if len(path.encode()) > _UNIX_PATH_MAX:
        raise ValueError(f"ipc path {path!r} is longer than {_UNIX_PATH_MAX} bytes: "
                         f"set FD_SYNC_IPC_DIR to a shorter directory or use a shorter name")
    return "ipc://" + path


def ipc_path(endpoint: str):
    """The socket file of an ``ipc://`` endpoint, or None for other transports."""
    return endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None


def claim_ipc_path(path: str) -> None:
    """Make ``path`` free to bind, or raise ``EndpointInUseError`` if a live engine owns it.

    libzmq would silently take over a path that another process is listening on, and it
    leaves the file behind after close, so a leftover file is the normal case after a
    crash. We tell the two apart by connecting: a live listener accepts, a stale file
    refuses.
    """
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise
        unlink_quietly(path)  # stale: left by a crashed or killed engine
        return
    finally:
        probe.close()
    raise EndpointInUseError(
        f"ipc://{path} is in use by a live TaskQueue; pick another name or dp_id, "
        f"or stop the other engine first")


def unlink_quietly(path) -> None:
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def new_socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    """A socket with the options every fastdeploy_sync socket shares.

    Unlimited high-water marks: the engine bounds the number of batches in flight itself
    (``max_inflight``), and a ZeroMQ HWM would instead drop (ROUTER) or block silently.
    Linger 0: ``close()`` must never hang on a peer that went away.
    """
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


class WakePipe:
    """A self-pipe that any thread can write to, to wake a thread blocked in ``zmq.Poller``.

    Writing is thread-safe (one ``os.write`` of one byte) and never blocks: if the pipe is
    full the reader has wake-ups pending already.
    """

    def __init__(self):
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        os.set_blocking(self.w, False)

    def wake(self) -> None:
        try:
            os.write(self.w, b"\0")
        except BlockingIOError:
            pass
        except OSError as exc:  # closed during shutdown
            if exc.errno != errno.EBADF:
                raise

    def drain(self) -> None:
        try:
            while os.read(self.r, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        for fd in (self.r, self.w):
            try:
                os.close(fd)
            except OSError:
                pass
