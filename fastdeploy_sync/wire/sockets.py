"""ZeroMQ sockets and the process resources they need, shared by the engine and worker sides.

Topology: the engine binds one ROUTER socket; every worker rank connects DEALER sockets to
it (batches, acknowledgements, heartbeats). A ZeroMQ socket is not thread-safe, so each
socket has exactly one owning thread at a time.

Here: the options every socket shares (``new_socket``), a socket's monitor
(``open_monitor``, ``close_monitor``), receiving what a socket holds
without blocking (``recv_nowait``, ``monitor_event_nowait``: the one place that turns
ZeroMQ's ``Again`` into "nothing waiting"; ``receive_available``, ``monitor_events`` for a
loop with a budget), waking a polling thread (``WakePipe``), a poll whose answer another
thread can read without the GIL changing hands (``ReadinessPoll``), and the process limits
libzmq needs headroom in (file descriptors, heap memory).
"""

import ctypes
import errno
import itertools
import logging
import os
import resource
import select
import threading

import zmq
from zmq.utils.monitor import recv_monitor_message

__all__ = ["new_socket", "open_monitor", "close_monitor", "recv_nowait", "monitor_event_nowait",
           "receive_available", "monitor_events", "WakePipe", "ReadinessPoll", "ensure_free_fds",
           "FdLimitHold", "anon_rss_bytes", "trim_heap", "ENGINE_FDS", "CLIENT_FDS"]

log = logging.getLogger(__name__)


# File descriptors our objects need (a Context's reaper and I/O thread, each socket, each
# socket monitor, a WakePipe, each connection; counted in docs/failure-model.md): the
# constants keep about twice what an object was counted to use; the engine adds 2 per rank
# for the ranks' two connections.
CLIENT_FDS = 32
ENGINE_FDS = 32

_MONITOR_IDS = itertools.count()


def ensure_free_fds(count: int, who: str) -> None:
    """Raise ``OSError(errno.EMFILE, ...)`` unless ``count`` more file descriptors can be
    opened now; never blocks, never leaves an fd open. ``who`` names the caller in the
    message (e.g. ``"TaskClient rank 1 of 'llm' dp_id=0"``). Typical counts: ``CLIENT_FDS``
    for a TaskClient, ``ENGINE_FDS + 2 * tp_size`` for a TaskQueue.

    Call it before creating a ``zmq.Context``: libzmq aborts the whole process (SIGABRT,
    ``Too many open files (src/epoll.cpp:38)``) when its I/O thread cannot create an fd,
    instead of raising. We probe by opening ``/dev/null`` once and duplicating it up to
    ``count`` times, then closing all of them (the probe itself fails with EMFILE, which
    Python turns into an exception; nothing else in the process is affected).
    """
    opened = []
    try:
        base = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        base = None
    try:
        if base is not None:
            opened.append(base)
            while len(opened) < count:
                opened.append(os.dup(base))
    except OSError as exc:
        if exc.errno not in (errno.EMFILE, errno.ENFILE):
            raise
    finally:
        available = len(opened)
        for fd in opened:
            os.close(fd)
    if available < count:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        raise OSError(
            errno.EMFILE,
            f"{who} needs about {count} free file descriptors, {available} are available "
            f"(ulimit -n is {soft}, hard limit {hard}): raise ulimit -n (e.g. 'ulimit -n 65536' "
            f"in the launching shell) or close files/sockets this process does not need")


def anon_rss_bytes() -> int:
    """This process's resident memory that is not file- or shared-memory-backed (resident
    minus shared pages, ``/proc/self/statm``): what its heaps hold. 0 where it cannot be
    read. One small file read: for a guard that asks a few times a second."""
    try:
        with open("/proc/self/statm", "rb") as f:
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def trim_heap() -> None:
    """Return the heaps' free memory to the system (glibc ``malloc_trim(0)``, every arena):
    after libzmq freed what a peer made it buffer, glibc keeps those pages otherwise (a
    process that had buffered 1.5 GiB kept it). Takes milliseconds for a large heap; call
    it after such an event, not routinely. Does nothing where it is missing."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class FdLimitHold:
    """While any hold is open, this process's soft limit of open files (``RLIMIT_NOFILE``)
    is raised to its hard limit (capped by the kernel's ``fs.nr_open``); when the last one
    is released the application's own soft limit is put back.

    Why raise: libzmq aborts the whole process (SIGABRT, "Too many open files") when its
    I/O thread cannot create a descriptor, so an engine takes what it may have while it
    serves instead of dying at the common default of 1024 when many peers connect at once.
    Why give it back: the limit is the application's, and every child it starts inherits
    it (a ``subprocess`` or ``spawn`` child reads it at exec).

    Contract: ``FdLimitHold(who)`` raises the limit if no other hold of this process is
    open (logged, naming ``who``); ``release()`` (idempotent) of the last open hold puts
    back the soft limit the process had before the first, unless the application changed
    the limit meanwhile (its own then stays). Children started while a hold is open inherit
    the raised limit, except forked ones: in a child made by ``os.fork`` (or a
    ``multiprocessing`` fork) the application's soft limit is put back at once
    (``os.register_at_fork``), and holds inherited there release nothing. Never raises,
    never blocks (a process-wide lock around two system calls); a limit the kernel refuses
    to change is left as it is. A hold that is never released keeps the limit raised
    until the process exits. Descriptors above 1023 do not fit ``select.select``."""

    _lock = threading.Lock()
    _holders = 0
    # while held: (the application's soft limit, the soft limit set), or None when nothing
    # was raised
    _restore = None

    def __init__(self, who: str):
        self._pid = os.getpid()
        with FdLimitHold._lock:
            if FdLimitHold._holders == 0:
                before, after = _raise_soft_fd_limit()
                if after != before:
                    FdLimitHold._restore = (before, after)
                    log.info("%s: raised the soft limit of open files from %d to the hard limit "
                             "%d while it is open (many peers may connect at once)", who,
                             before, after)
            FdLimitHold._holders += 1
        self._held = True

    def release(self) -> None:
        """Give the hold up; the last one of the process puts the application's soft limit
        back (see the class docstring). Idempotent."""
        with FdLimitHold._lock:
            if not self._held:
                return
            self._held = False
            if os.getpid() != self._pid:
                return  # inherited across fork: the child's limit was put back at fork
            FdLimitHold._holders -= 1
            if FdLimitHold._holders == 0:
                _restore_soft_fd_limit()

    @staticmethod
    def _after_fork_in_child() -> None:
        # another thread may have held the lock at fork; no hold of the parent's is the
        # child's
        FdLimitHold._lock = threading.Lock()
        FdLimitHold._holders = 0
        _restore_soft_fd_limit()


def _restore_soft_fd_limit() -> None:
    """Put back the soft limit ``FdLimitHold._restore`` says the application had, if the
    limit is still the one we set (else the application changed it: its own stays)."""
    restore, FdLimitHold._restore = FdLimitHold._restore, None
    if restore is None:
        return
    before, raised = restore
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != raised:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (before, hard))
    except (OSError, ValueError):
        pass


def _raise_soft_fd_limit() -> tuple:
    """Raise this process's soft limit of open files to its hard limit (capped by
    ``fs.nr_open``); returns ``(before, after)``. Never lowers it; never raises."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if target == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return soft, target
        except (OSError, ValueError):
            pass
    return soft, soft


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=FdLimitHold._after_fork_in_child)


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


def open_monitor(sock: zmq.Socket, events: int) -> zmq.Socket:
    """Attach a monitor to ``sock`` for ``events``: the PAIR socket its events arrive on,
    owned by ``sock``'s owner. Stop it with ``close_monitor``, never ``disable_monitor``.

    The PAIR's queue is unbounded, unlike ``Socket.get_monitor_socket``'s (1 000 + 1 000
    messages): libzmq's I/O thread writes every event with a blocking send while holding
    the socket's monitor lock, so a full queue stops that thread, and with it every
    connection of the context, until the events are read, and makes stopping the monitor
    (which takes that lock) wait as long: an engine whose loop could not read for a burst
    of a thousand connections never served nor closed again. An event costs a few hundred
    bytes, less than the connection it reports, and the owner reads them every pass."""
    # a fresh name each time: a stopped monitor's inproc name is freed only once libzmq's
    # reaper has closed it
    addr = f"inproc://fdsync-monitor-{os.getpid()}-{next(_MONITOR_IDS)}"
    sock.monitor(addr, events)
    pair = sock.context.socket(zmq.PAIR)
    try:
        pair.setsockopt(zmq.LINGER, 0)
        pair.setsockopt(zmq.RCVHWM, 0)  # before connect: the pipe's bound is set then
        pair.connect(addr)
    except BaseException:
        pair.close(linger=0)
        sock.monitor(None, 0)
        raise
    return pair


def close_monitor(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    """Stop ``sock``'s monitor and close its PAIR (``open_monitor``), whatever the PAIR
    still holds; idempotent. Never blocks: libzmq's I/O thread holds the monitor's lock
    only while it queues an event, which never waits on an unbounded queue."""
    if not sock.closed:
        sock.monitor(None, 0)
    monitor.close(linger=0)


def recv_nowait(sock: zmq.Socket, copy: bool = True):
    """The next message waiting on ``sock`` (a list of frames), or None when none is
    waiting; never blocks. The calling thread must own the socket (a ZeroMQ socket is not
    thread-safe). A plain call, not a generator: a worker's step call receives through it
    (``while (frames := recv_nowait(sock)) is not None``)."""
    try:
        return sock.recv_multipart(zmq.NOBLOCK, copy=copy)
    except zmq.Again:
        return None


def monitor_event_nowait(monitor: zmq.Socket):
    """The next event waiting on a socket monitor (a ``zmq.utils.monitor`` dict: ``event``,
    ``value``, ``endpoint``), or None when none is waiting; never blocks."""
    try:
        return recv_monitor_message(monitor, zmq.NOBLOCK)
    except zmq.Again:
        return None


def receive_available(sock: zmq.Socket, budget: int, copy: bool = True):
    """Yield at most ``budget`` of the messages waiting on ``sock``, one at a time, never
    blocking (``recv_nowait``). The next message is received only when the caller asks for
    it, so a caller that stops early (``break``, an exception) leaves the rest on the
    socket."""
    for _ in range(budget):
        frames = recv_nowait(sock, copy)
        if frames is None:
            return
        yield frames


def monitor_events(monitor: zmq.Socket, budget: int):
    """Yield at most ``budget`` of the events waiting on a socket monitor, as
    ``receive_available`` yields messages."""
    for _ in range(budget):
        event = monitor_event_nowait(monitor)
        if event is None:
            return
        yield event

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


class _PollFD(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


def _libc_poll():
    """libc's poll(2) through ctypes (which releases the GIL around the call), or None."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.poll
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.POINTER(_PollFD), ctypes.c_ulong, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_POLL = _libc_poll()


class ReadinessPoll:
    """An OS-level ``poll()`` of some file descriptors (ZeroMQ sockets' ``zmq.FD``, a
    pipe) whose result another thread can read *without the GIL changing hands*.

    Why: a thread blocked in ``select.poll`` (or ``zmq.Poller``) that is woken by data must
    get the GIL before anything of the wake-up is visible, and a thread holding the GIL (a
    pure-Python model step) keeps it for up to the interpreter's 5 ms switch interval. Here
    the call is libc's ``poll`` through ctypes, and the kernel writes each descriptor's
    ``revents`` into an array this object owns before the call returns: ``ready(i)`` reads
    it (one memoryview read, no system call, never releases the GIL), so another thread
    can see that the waiter was woken and act on it while the waiter still waits for the
    GIL.

    ``wait(timeout_ms)`` clears the results, then blocks (GIL released) until a descriptor
    is readable or the timeout passes; one thread waits, any thread may read ``ready``.
    Where ctypes or libc's poll is missing it falls back to ``select.poll`` and ``ready``
    says False (nobody is told early)."""

    def __init__(self, fds):
        self._n = len(fds)
        self._fds = (_PollFD * self._n)()
        for i, fd in enumerate(fds):
            self._fds[i].fd = fd
            self._fds[i].events = select.POLLIN
        # int16 view: entry i's revents is short 4 * i + 3 (int fd, short events, revents)
        self._shorts = memoryview(self._fds).cast("B").cast("h")
        #: ``wait()`` calls so far. A reader that handled the wake-up ``ready`` reports can
        #: note this number, and the waiter learn that it was handled (``Receiver.drain``).
        self.polls = 0
        self._fallback = None
        if _POLL is None:
            self._fallback = select.poll()
            for fd in fds:
                self._fallback.register(fd, select.POLLIN)

    @property
    def revents(self) -> memoryview:
        """The results as int16s: descriptor ``i``'s is ``revents[4 * i + 3]`` (for the
        hottest callers, which cannot afford a method call)."""
        return self._shorts

    def ready(self, i: int) -> bool:
        """True if descriptor ``i`` was readable when the last ``wait`` returned (and the
        waiter has not cleared it by waiting again)."""
        return bool(self._shorts[4 * i + 3])

    def ready_other_than(self, i: int) -> bool:
        """True if a descriptor other than ``i`` was readable when the last ``wait``
        returned."""
        shorts = self._shorts
        return any(shorts[4 * j + 3] for j in range(self._n) if j != i)

    def wait(self, timeout_ms: float) -> None:
        """Block (GIL released) until a descriptor is readable or ``timeout_ms`` passed.
        Counts the calls first (``polls``): which wake-up ``ready`` describes."""
        self.polls += 1
        if self._fallback is not None:
            self._fallback.poll(timeout_ms)
            return
        for i in range(self._n):
            self._fds[i].revents = 0
        if _POLL(self._fds, self._n, max(0, int(timeout_ms + 0.999))) < 0:
            err = ctypes.get_errno()
            if err not in (errno.EINTR, errno.EAGAIN):
                raise OSError(err, os.strerror(err))

