"""Where the engine listens and how a peer may reach it: endpoint names and their socket files.

Endpoints: ``endpoint=None`` means a node-local ``ipc://`` file derived from the queue's
name and dp_id (nothing to start or configure); ``tcp://host:port`` is used as given (and
needs CURVE keys, see ``wire.auth``).

Trust: an ipc socket file lives in a per-user directory (``envs.ipc_dir()``, mode 0700,
owned by us, never a symlink) because whoever can create the socket file first receives
the users' prompts and feeds pickles to the workers. The engine claims the path
(``claim_ipc_path``: refuses another user's file, reclaims a stale one of ours) and makes
the socket 0600 after bind (``secure_socket_file``); workers check the directory and the
socket's owner before connecting (``check_ipc_endpoint``).
"""

import errno
import os
import re
import socket
import stat

from .. import envs, names
from ..errors import EndpointInUseError

__all__ = ["validate_name", "default_endpoint", "ipc_path", "private_dir", "check_private_dir",
           "claim_ipc_path", "ipc_listener_alive", "secure_socket_file", "check_ipc_endpoint",
           "listener_address", "close_listeners", "unlink_quietly", "MAX_DP_ID"]

# \A and \Z, not ^ and $: "$" also matches before a trailing newline ("llm\n").
# No leading dot: "." and ".." must never become path components.
_NAME_RE = re.compile(r"\A[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}\Z")
MAX_DP_ID = 4095
_UNIX_PATH_MAX = 107


def validate_name(name: str, dp_id: int) -> None:
    """Check a queue name and data-parallel id; ``ValueError`` saying what is allowed.

    Both become parts of file names (``/dev/shm``, the ipc socket file), so: ``name`` is
    1-64 characters from ``[A-Za-z0-9_.-]`` not starting with ``.``; ``dp_id`` is a plain
    ``int`` (not ``bool``, not a numpy integer) in ``0..MAX_DP_ID`` (4095).
    """
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"name={name!r}: use 1-64 characters from [A-Za-z0-9_.-], "
                         f"not starting with '.' (it becomes part of file names)")
    if type(dp_id) is not int:  # noqa: E721 -- bool and numpy ints are refused on purpose
        raise ValueError(f"dp_id={dp_id!r} ({type(dp_id).__name__}): expected a plain int "
                         f"in 0..{MAX_DP_ID}")
    if not 0 <= dp_id <= MAX_DP_ID:
        raise ValueError(f"dp_id={dp_id}: expected an int in 0..{MAX_DP_ID}")


def default_endpoint(name: str, dp_id: int, kind: str = "") -> str:
    """The node-local ``ipc://`` endpoint of (name, dp_id), in the private ``envs.ipc_dir()``.
    ``kind="put"``: the queue's producer endpoint (``TaskProducer``), always node-local.

    Creates that directory (mode 0700) if needed and checks it (``private_dir``):
    ``PermissionError`` if it belongs to another user, is writable by group/other or is a
    symlink; ``ValueError`` if the socket path is too long for a unix socket.
    """
    validate_name(name, dp_id)
    directory = envs.ipc_dir()
    path = os.path.join(directory, names.socket_file(name, dp_id, kind))
    if len(path.encode()) > _UNIX_PATH_MAX:
        raise ValueError(f"ipc path {path!r} is longer than {_UNIX_PATH_MAX} bytes: "
                         f"set FD_SYNC_IPC_DIR to a shorter directory or use a shorter name")
    private_dir(directory)
    return "ipc://" + path


def ipc_path(endpoint: str):
    """The socket file of an ``ipc://`` endpoint, or None for other transports."""
    return endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None


def _mode(st) -> str:
    return oct(stat.S_IMODE(st.st_mode))


def check_private_dir(path: str) -> None:
    """Raise ``PermissionError`` unless ``path`` is a real directory (not a symlink) owned by
    this process's effective uid and not writable by group or other. Never blocks.

    ``FileNotFoundError`` if it does not exist. Why: whoever can create files in the
    directory of an ipc socket can bind the socket first and feed pickles to the workers.
    """
    st = os.lstat(path)
    uid = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        raise PermissionError(
            errno.EPERM, f"{path} is a symlink (owner uid {st.st_uid}); fastdeploy_sync keeps "
            f"its ipc sockets only in a real directory of its own: remove the link, or set "
            f"FD_SYNC_IPC_DIR to a directory you own with mode 0700", path)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(
            errno.ENOTDIR, f"{path} is not a directory (owner uid {st.st_uid}, mode "
            f"{_mode(st)}): remove it or set FD_SYNC_IPC_DIR to a directory you own", path)
    if st.st_uid != uid:
        raise PermissionError(
            errno.EPERM, f"{path} is owned by uid {st.st_uid} (mode {_mode(st)}), not by this "
            f"process's uid {uid}: another user may have created it to intercept the engine's "
            f"socket. Remove it (as root or its owner) or set FD_SYNC_IPC_DIR to a directory "
            f"you own with mode 0700", path)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            errno.EPERM, f"{path} (owner uid {st.st_uid}) has mode {_mode(st)}: writable by "
            f"group or other, so another user could bind the engine's socket first. Run "
            f"'chmod 700 {path}' or set FD_SYNC_IPC_DIR to a directory with mode 0700", path)


def private_dir(path: str) -> str:
    """Create ``path`` with mode 0700 if absent (its parent must exist), then
    ``check_private_dir`` it; returns ``path``. ``PermissionError`` as in
    ``check_private_dir``. Never blocks."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    else:
        # mkdir's mode is masked by the umask; a umask like 0o277 would leave us without
        # write permission. Never more than 0700 in between, so no window for others.
        os.chmod(path, 0o700)
    check_private_dir(path)
    return path


def _check_own_socket(path: str, st) -> None:
    uid = os.geteuid()
    if st.st_uid != uid:
        raise PermissionError(
            errno.EPERM, f"ipc socket {path} is owned by uid {st.st_uid}, not by this process's "
            f"uid {uid}: another user's process holds this endpoint. Do not connect to it; "
            f"remove it (as root or its owner) or use another FD_SYNC_IPC_DIR", path)
    if not stat.S_ISSOCK(st.st_mode):
        raise PermissionError(
            errno.EPERM, f"{path} is not a socket (mode {_mode(st)}): remove it, or use "
            f"another name or FD_SYNC_IPC_DIR", path)


def claim_ipc_path(path: str) -> None:
    """Make ``path`` free to bind, or raise ``EndpointInUseError`` if a live engine owns it.

    The directory must pass ``check_private_dir`` and an existing file must be a socket
    owned by us, else ``PermissionError`` (another user's file is never unlinked).
    libzmq would silently take over a path that another process is listening on, and it
    leaves the file behind after close, so a leftover file is the normal case after a
    crash. We tell the two apart by connecting (at most 1 s): a live listener accepts (or,
    its backlog full, answers EAGAIN), a stale file refuses. No pid is involved, so a reused
    pid or another pid namespace cannot fool it: only a socket a live process listens on
    connects.
    """
    check_private_dir(os.path.dirname(path) or ".")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    _check_own_socket(path, st)
    if not ipc_listener_alive(path):
        unlink_quietly(path)  # stale: left by a crashed or killed engine
        return
    raise EndpointInUseError(
        f"ipc://{path} is in use by a live TaskQueue; pick another name or dp_id, "
        f"or stop the other engine first")


def ipc_listener_alive(path: str) -> bool:
    """True if a process listens on the unix socket ``path`` (a connect is accepted, or its
    backlog is full: EAGAIN), False if the file is a leftover (connection refused) or gone.
    Blocks at most 1 s.

    libzmq leaves the socket file behind when its owner exits, so the file's existence says
    nothing; only a listener accepting says the owner is alive. Other errors propagate."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            return True  # a live listener whose backlog is full (it is busy)
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return False
        raise
    finally:
        probe.close()
    return True


def secure_socket_file(path: str) -> None:
    """Called by the engine right after ``bind``: make the socket file mode 0600.

    ``PermissionError`` if ``path`` is not a socket owned by us. The private directory
    already keeps others out; this keeps them out even if the directory is loosened later.
    """
    _check_own_socket(path, os.lstat(path))
    os.chmod(path, 0o600)


def check_ipc_endpoint(path: str) -> None:
    """Called by a worker before connecting to ``ipc://path``. Never blocks.

    ``PermissionError`` if the socket's directory fails ``check_private_dir``, or if the
    socket file exists and is not a socket owned by us (someone else bound it). A missing
    directory or file is fine: the engine may not have started yet, and once the directory
    is ours nobody else can create the file in it.
    """
    try:
        check_private_dir(os.path.dirname(path) or ".")
    except FileNotFoundError:
        return
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    _check_own_socket(path, st)


def listener_address(endpoint: str):
    """What ``getsockname()`` of the socket that listens on a bound ``endpoint`` returns
    (``ZMQ_LAST_ENDPOINT``: ``ipc://PATH`` or ``tcp://HOST:PORT``), for
    ``close_listeners``; None for other transports."""
    path = ipc_path(endpoint)
    if path is not None:
        return path
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        return (host.strip("[]"), int(port))
    return None


def close_listeners(addresses) -> int:
    """Close every listening socket of this process bound to one of ``addresses`` (from
    ``listener_address``); returns how many. For a forked child: libzmq's listening
    descriptors are inherited like any other, and a child that outlives a killed engine
    would keep its endpoint accepting connections for good (the next engine of the same
    name would find it "in use"). Reads ``/proc/self/fd``; never blocks."""
    wanted = set(addresses)
    closed = 0
    try:
        fds = [int(entry) for entry in os.listdir("/proc/self/fd")]
    except OSError:
        return 0
    for fd in fds:
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if (sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                    and _bound_address(sock) in wanted):
                sock.close()
                closed += 1
                continue
        except OSError:
            pass
        sock.detach()  # not ours to close
    return closed


def _bound_address(sock):
    name = sock.getsockname()
    if sock.family == socket.AF_UNIX:
        return name.decode(errors="replace") if isinstance(name, bytes) else name
    return (name[0], name[1])


def unlink_quietly(path) -> None:
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


