"""Named POSIX shared memory and semaphores, attached without any resource tracker.

Why not ``multiprocessing.shared_memory``: in Python 3.11, ``SharedMemory(name=...)``
registers the segment with the *attaching* process's resource tracker, which unlinks it
when that process exits, so a worker exiting would destroy a segment its peers still
use. ``posix_ipc`` + ``mmap`` gives us the plain POSIX calls and leaves the lifetime
policy to us: the creator unlinks at close, and a crashed creator's leftovers are
reclaimed by the next creator of the same name (see ``tp_group.py``).

Ownership: a lock, not a pid. Whether the creator of a name is still alive decides
whether a leftover may be reclaimed, so it must survive pid reuse (an unrelated process may
hold a dead owner's pid) and pid namespaces (containers sharing ``/dev/shm`` with
``--ipc=host`` see each other's files, not each other's pids). The creator therefore holds an
open-file-description lock (``F_OFD_SETLK``) on one byte of the segment's file for its whole
life (``OWNER_LOCK``, past the end of the data: a lock may cover bytes a file does not have);
the kernel drops it when the owner's last descriptor closes, which death does. Whoever finds
the name taken probes that lock (``owner_alive``) or tries to take it without waiting
(``reclaim_stale``): held means a live owner in any pid namespace of the node, free means a
leftover. The pid written into the segment is kept for messages only. Other bytes past
``OWNER_LOCK`` serve the same purpose for parts of a segment (``tp_group``: one per rank).
Descriptors are close-on-exec, and a forked child closes its inherited copies at once
(``forget_in_child``, run by ``os.register_at_fork``), so neither keeps a dead owner's lock
alive.

Trust: names in ``/dev/shm`` are a namespace shared by every user of the node, so a
segment is created exclusively (``O_CREAT|O_EXCL``) with mode 0600, and an existing one is
mapped (or unlinked as stale) only after ``os.fstat`` on its fd shows it is owned by our
effective uid: another user could otherwise pre-create a group's segment and steer its
ranks. Semaphores have no fd in ``posix_ipc``; their owner is read from their file
``/dev/shm/sem.NAME`` before opening (``open_semaphore``).

Waiting on a semaphore: ``sem_wait``, the one place the package does it (see there for
signals: posix_ipc turns EINTR into ``SignalError`` and replaces whatever a Python signal
handler raised during the wait by it).
"""

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import signal
import stat
import struct
import threading
import time
import weakref

import posix_ipc

__all__ = ["Segment", "SegmentInUse", "OWNER_LOCK", "create_exclusive", "create_reclaiming",
           "create_fresh_semaphore", "owner_alive", "pid_alive", "reclaim_stale",
           "segment_owner", "unlink_segment", "unlink_semaphore", "create_semaphore",
           "open_semaphore", "check_semaphore_owner", "sem_wait", "forget_in_child",
           "owner_lock_held"]

_MODE = 0o600
_SHM_DIR = "/dev/shm"

# The byte whose lock the creator of a segment holds for its life (see the module
# docstring); bytes after it are free for callers' own liveness locks (Segment.try_lock).
OWNER_LOCK = 1 << 40
# struct flock on Linux (x86-64 and aarch64): l_type, l_whence, l_start, l_len, l_pid.
_FLOCK = struct.Struct("hhxxxxqqixxxx")
# madvise(2) advice values (Linux 5.14+; not in Python 3.11's mmap module)
_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23
# A creator waits this long at most for a reclaimer that is probing its brand-new name.
_CREATE_LOCK_WAIT_S = 1.0

log = logging.getLogger(__name__)

# Every Segment holding a descriptor, so that a forked child can close its copies.
_WITH_FDS = weakref.WeakSet()


def _ofd(fd: int, cmd: int, kind: int, offset: int) -> int:
    """One OFD lock call on the byte at ``offset``; returns the l_type the kernel reports."""
    return _FLOCK.unpack(fcntl.fcntl(fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, offset, 1, 0)))[0]


def _try_lock(fd: int, offset: int) -> bool:
    """Take the write lock on byte ``offset`` without waiting: True if taken, False if
    another open file description holds it."""
    try:
        _ofd(fd, fcntl.F_OFD_SETLK, fcntl.F_WRLCK, offset)
        return True
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def _lock_held(fd: int, offset: int) -> bool:
    """True if another open file description holds a lock on byte ``offset`` (our own
    locks do not count). Takes nothing. Never blocks."""
    return _ofd(fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, offset) != fcntl.F_UNLCK


def owner_lock_held(fd: int) -> bool:
    """True if another open file description holds the owner lock (``OWNER_LOCK``) of the
    segment open as ``fd``: its creator (``Segment.create``) is alive. Never blocks."""
    return _lock_held(fd, OWNER_LOCK)


def _open_lock_fd(name: str, shm_fd: int) -> int:
    """A descriptor of segment ``name`` of its own (its own open file description) for the
    locks. Not a dup of the mapping's descriptor: ``mmap`` keeps a dup of that one, which
    would hold the locks as long as the mapping lives. ``FileNotFoundError`` if the name
    no longer names the file open as ``shm_fd`` (unlinked or replaced meanwhile)."""
    fd = os.open(f"{_SHM_DIR}{name}", os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    a, b = os.fstat(fd), os.fstat(shm_fd)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        os.close(fd)
        raise FileNotFoundError(f"shared memory {name} was replaced while it was opened")
    return fd


def _same_file(path: str, fd: int) -> bool:
    """True if ``path`` still names the file open as ``fd`` (not unlinked or replaced)."""
    try:
        a, b = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


# Objects whose ownership a forked child must not inherit (see ``forget_in_child``).
_OWNERS = weakref.WeakSet()


def forget_in_child(owner) -> None:
    """Register ``owner``: in a process forked from this one, ``owner._forget_in_child()``
    runs at once (``os.register_at_fork``), before the child's own code. An owner closes
    there the descriptors whose locks prove its ownership (an OFD lock or ``flock``
    belongs to the open file description, which the child's copy shares: a child that
    outlives a killed parent would keep a dead owner's name alive for good) and stops
    removing names (the parent's, not the child's). Weakly held; never blocks."""
    _OWNERS.add(owner)


def _forget_inherited():
    for owner in list(_OWNERS):
        try:
            owner._forget_in_child()
        except Exception:  # a child must start whatever one owner's state is
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited)


class Segment:
    """A mapped shared-memory segment. ``view`` is a memoryview of int64 slots.

    Reading or writing one slot through ``view`` costs ~40 ns (numpy scalar indexing
    costs ~2-3x that), which matters on the per-step hot path.

    Each Segment keeps one private descriptor of the segment's file for its locks
    (``try_lock``, ``lock_held``); ``close()`` releases it with the mapping.
    """

    def __init__(self, name: str, mapping: mmap.mmap, fd: int = -1, created: bool = False):
        self.name = name
        self._mmap = mapping
        self.view = memoryview(mapping).cast("q")
        self._fd = fd
        self._created = created  # made by Segment.create: this process is its owner
        if fd >= 0:
            _WITH_FDS.add(self)
            forget_in_child(self)

    @classmethod
    def create(cls, name: str, size: int) -> "Segment":
        """Create a new zero-filled segment, mode 0600, and hold its owner lock
        (``OWNER_LOCK``) until ``close()``; ``FileExistsError`` if the name exists (whoever
        owns it: never opened, never unlinked here). Blocks at most ~1 s, only while
        another process probes the brand-new name (then it may find the name taken)."""
        deadline = time.monotonic() + _CREATE_LOCK_WAIT_S
        while True:
            shm = create_exclusive(name, size)
            try:
                fd = _open_lock_fd(name, shm.fd)  # close-on-exec
            except FileNotFoundError:  # a reclaimer removed our brand-new name already
                shm.close_fd()
                if time.monotonic() > deadline:
                    raise SegmentInUse(name, 0) from None
                continue
            except BaseException:
                shm.close_fd()
                unlink_segment(name)
                raise
            try:
                # A reclaimer that opened the name between our create and this lock takes
                # our new file for a stale one: it holds the lock for a moment and unlinks.
                while not _try_lock(fd, OWNER_LOCK):
                    if time.monotonic() > deadline:
                        raise SegmentInUse(name, 0)
                    time.sleep(0.001)
                if os.fstat(fd).st_nlink:
                    return cls._map(name, shm, size, fd, created=True)
            except BaseException:
                os.close(fd)
                shm.close_fd()
                raise
            os.close(fd)  # unlinked under us: create the name again
            shm.close_fd()
            if time.monotonic() > deadline:
                raise SegmentInUse(name, 0)

    @classmethod
    def attach(cls, name: str) -> "Segment":
        """Map an existing segment at its current size; ``FileNotFoundError`` if absent,
        ``PermissionError`` (nothing mapped) if it is owned by another uid or we may not open it.

        The size may be 0 (or smaller than expected) while the creator is between
        ``shm_open`` and ``ftruncate``: callers check ``size`` and a ready word.
        """
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError as exc:
            raise FileNotFoundError(f"shared memory {name} does not exist") from exc
        except posix_ipc.PermissionsError as exc:
            raise PermissionError(
                errno.EACCES, f"shared memory {name} exists but this process (uid "
                f"{os.geteuid()}) may not open it: another user created it. Remove it as its "
                f"owner or root (rm {_SHM_DIR}{name}) or use another name/dp_id") from exc
        try:
            st = os.fstat(shm.fd)  # the object we opened, not a name that may be swapped
            _check_owner(st, f"shared memory {name}", f"{_SHM_DIR}{name}")
            size = st.st_size
            fd = _open_lock_fd(name, shm.fd)
        except BaseException:
            shm.close_fd()
            raise
        return cls._map(name, shm, size, fd)

    @classmethod
    def _map(cls, name, shm, size, fd, created=False):
        try:
            if size == 0:
                mapping = mmap.mmap(-1, 8)  # placeholder: reads as "not ready"
            else:
                mapping = mmap.mmap(shm.fd, size)
        except BaseException:
            os.close(fd)
            raise
        finally:
            shm.close_fd()
        return cls(name, mapping, fd, created)

    @property
    def size(self) -> int:
        return self.view.nbytes

    def try_lock(self, offset: int) -> bool:
        """Take the write lock on byte ``offset`` of the file without waiting (True), or
        return False if another open file description (any process, or another Segment
        of this one) holds it. Held until ``unlock`` or ``close()``. Never blocks."""
        return self._fd >= 0 and _try_lock(self._fd, offset)

    def unlock(self, offset: int) -> None:
        if self._fd >= 0:
            _ofd(self._fd, fcntl.F_OFD_SETLK, fcntl.F_UNLCK, offset)

    def lock_held(self, offset: int) -> bool:
        """True if another open file description holds a lock on byte ``offset``: its
        holder is alive (on this node, in any pid namespace). Never blocks."""
        return self._fd >= 0 and _lock_held(self._fd, offset)

    def owner_alive(self) -> bool:
        """True if the creator of this segment still holds ``OWNER_LOCK`` (False for our
        own: a Segment made by ``create`` is its owner)."""
        return self.lock_held(OWNER_LOCK)

    def unlink_if_mine(self) -> bool:
        """Remove the segment's name if it still names this very segment (not a newer one
        of the same name); True if removed. Call it while holding the owner lock (the
        creator, or a reclaimer that took it), so nobody else can swap the name between
        the check and the unlink."""
        if self._fd < 0 or not _same_file(f"{_SHM_DIR}{self.name}", self._fd):
            return False
        return _unlink_name(self.name)

    def reserve(self) -> None:
        """Allocate every page of the segment's file now (``posix_fallocate``; tmpfs
        supports it): a full ``/dev/shm`` is an ``OSError(ENOSPC)`` here, never a SIGBUS
        when the memory is first touched. Creators call it before publishing the segment."""
        if self._fd < 0:
            raise ValueError(f"shared memory {self.name}: no descriptor to reserve with")
        os.posix_fallocate(self._fd, 0, self.size)

    def truncated(self) -> bool:
        """True if the segment's file is now shorter than this mapping (another process of
        this uid truncated it): touching the missing pages would be a SIGBUS. One
        ``fstat``; False once the descriptor was released (nothing to ask)."""
        return self._fd >= 0 and os.fstat(self._fd).st_size < self.size

    def populate(self, write: bool) -> None:
        """Map every page in now (``MADV_POPULATE_WRITE`` or ``_READ``, Linux 5.14+), so
        that no later write (or read) of the segment takes a page fault: for segments
        whose pages are touched on a latency-sensitive path. Best effort: a kernel without
        it leaves the pages to fault in on first use."""
        advice = _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ
        try:
            self._mmap.madvise(advice)
        except (OSError, ValueError):
            pass

    def release_locks(self) -> None:
        """Close the descriptor, which drops every lock this Segment holds; the mapping
        stays. Idempotent."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            _WITH_FDS.discard(self)
            os.close(fd)

    def _forget_in_child(self):
        """In a forked child: close the inherited descriptor (the parent keeps its locks)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self):
        # garbage without close(): the descriptor (and its locks) must not outlive us
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        """Drop the locks and unmap. Idempotent. Every view derived from ``view`` must be
        released first."""
        self.release_locks()
        if self._mmap is None:
            return
        self.view.release()
        self._mmap.close()
        self._mmap = None


def create_exclusive(name: str, size: int) -> "posix_ipc.SharedMemory":
    """Create shared memory ``name`` of ``size`` zero-filled bytes, exclusively, mode 0600
    exactly (whatever the umask); the caller maps it and closes its fd.
    ``FileExistsError`` if the name exists (whoever owns it: never opened, never unlinked
    here); on any later failure the new name is removed again."""
    try:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=_MODE, size=size)
    except posix_ipc.ExistentialError as exc:
        raise FileExistsError(f"shared memory {name} exists") from exc
    try:
        os.fchmod(shm.fd, _MODE)  # the umask only ever narrows it, but be exact
    except BaseException:
        shm.close_fd()
        unlink_segment(name)
        raise
    return shm


def unlink_segment(name: str) -> bool:
    """Remove a segment name; True if it existed and was removed. Mappings stay valid
    until unmapped. Never blocks.

    A segment whose owner lock (``OWNER_LOCK``) another live process holds is left alone
    (False): whoever calls this after closing its own segment cannot remove a newer owner's
    segment that reclaimed the name in between. This process's own segments (made by
    ``Segment.create``, open or closed) and unlocked leftovers are removed, under the owner
    lock, and only if the name still names the file that was checked. A name that is not
    a regular file of this uid (another user's, a symlink) is never removed (False)."""
    path = f"{_SHM_DIR}{name}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:  # a symlink, or a file we may not open
        return _is_own_file(path) and _unlink_name(name)
    try:
        if _try_lock(fd, OWNER_LOCK) or _created_here(name, fd):
            return _same_file(path, fd) and _unlink_name(name)
        return False  # a live owner elsewhere holds it
    finally:
        os.close(fd)


def _unlink_name(name: str) -> bool:
    try:
        posix_ipc.unlink_shared_memory(name)
        return True
    except posix_ipc.ExistentialError:
        return False
    except posix_ipc.PermissionsError as exc:
        raise PermissionError(errno.EPERM, f"may not remove shared memory {name}: {exc}") from None


def _is_own_file(path: str) -> bool:
    """True if ``path`` is a regular file (not a symlink) owned by this process's uid."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def _created_here(name: str, fd: int) -> bool:
    """True if a Segment this process created (and still has open) maps the file ``fd``."""
    st = os.fstat(fd)
    for seg in list(_WITH_FDS):
        if seg.name == name and seg._created and seg._fd >= 0:
            mine = os.fstat(seg._fd)
            if (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino):
                return True
    return False


def _check_owner(st, what: str, path: str) -> None:
    uid = os.geteuid()
    if st.st_uid != uid:
        raise PermissionError(
            errno.EPERM, f"{what} is owned by uid {st.st_uid}, not by this process's uid {uid} "
            f"(mode {oct(stat.S_IMODE(st.st_mode))}): another user created it, so it is neither "
            f"used nor removed. Remove it as its owner or root (rm {path}), or use another "
            f"name/dp_id")


def _sem_file(name: str) -> str:
    return f"{_SHM_DIR}/sem.{name.lstrip('/')}"


def check_semaphore_owner(name: str) -> bool:
    """True if semaphore ``name`` exists and is ours, False if it does not exist;
    ``PermissionError`` naming its owner uid if another user owns it. Never blocks.

    Reads the owner of ``/dev/shm/sem.NAME`` (glibc's file for a named semaphore) without
    following a symlink: a symlink, or anything else that is not a regular file, is refused
    as another user's would be (``PermissionError``). A semaphore swapped between this check
    and ``sem_open`` would need write access to ``/dev/shm`` names we just created, which
    sticky ``/dev/shm`` does not give others."""
    path = _sem_file(name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    _check_owner(st, f"semaphore {name}", path)
    if not stat.S_ISREG(st.st_mode):
        raise PermissionError(
            errno.EPERM, f"semaphore {name}: {path} is not a regular file (mode "
            f"{oct(st.st_mode)}): neither used nor removed. Remove it as its owner or root, "
            f"or use another name/dp_id")
    return True


def create_semaphore(name: str, initial_value: int = 0) -> "posix_ipc.Semaphore":
    """Create semaphore ``name`` exclusively with mode 0600; ``FileExistsError`` if it exists
    (check its owner with ``check_semaphore_owner`` before unlinking a leftover)."""
    try:
        sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=_MODE, initial_value=initial_value)
    except posix_ipc.ExistentialError as exc:
        raise FileExistsError(f"semaphore {name} exists") from exc
    try:
        os.chmod(_sem_file(name), _MODE)
    except FileNotFoundError:
        pass  # not glibc's layout: the mode passed to sem_open stands
    return sem


def open_semaphore(name: str) -> "posix_ipc.Semaphore":
    """Open existing semaphore ``name`` after checking it is ours: ``FileNotFoundError`` if
    absent, ``PermissionError`` naming its owner uid if another user created it."""
    check_semaphore_owner(name)
    try:
        return posix_ipc.Semaphore(name)
    except posix_ipc.ExistentialError as exc:
        raise FileNotFoundError(f"semaphore {name} does not exist") from exc
    except posix_ipc.PermissionsError as exc:
        raise PermissionError(errno.EACCES, f"semaphore {name}: another user owns it "
                              f"(rm {_sem_file(name)} as its owner or root)") from exc


# -- waiting on a semaphore: signals ---------------------------------------------------------

# The main thread waits at most this long at a time with signals blocked (sem_wait), so a
# signal's Python handler runs at most this late.
SIGNAL_SLICE_S = 0.1
# Signals the kernel raises for the faulting thread itself, and those no handler can take:
# never blocked.
_SYNCHRONOUS = {"SIGKILL", "SIGSTOP", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP",
                "SIGSYS", "SIGABRT"}


class _SignalMask:
    """``pthread_sigmask`` through ctypes (~0.4 µs a call; ``signal.pthread_sigmask``
    costs ~50 µs to restore a mask, which it returns as a set of ``signal.Signals``
    members) of the signals that have a Python handler: those whose handler posix_ipc
    would run inside its wait. Signals taken by C handlers (``faulthandler.register``,
    a native library's) are left alone: they interrupt the wait, which is resumed, and
    their handler runs in the waiting thread as it would without us (moved to another
    thread, ``faulthandler`` would read this thread's frames while it runs: measured,
    it crashed the process far more often). ``load()`` is None where libc is not
    reachable: waits are then not masked (``SignalError`` is still retried).

    Which signals have Python handlers is read again at most every ``_REREAD_S``
    (``signal.getsignal`` of every signal costs ~20 µs).

    Used as ``call(SIG_BLOCK, blocked, saved)`` ... ``call(SIG_SETMASK, saved, None)``,
    both direct calls of the C function: CPython runs a pending Python handler only
    between bytecodes at a function's entry, a backward jump or after a call returns,
    never before a C function starts, so a handler that raises can end the wait only
    after the mask was blocked and the ``finally`` that restores it is armed, or after
    it was restored (a Python helper around the restore would let a handler raise at
    the helper's entry and leave the signals blocked)."""

    _REREAD_S = 0.5

    def __init__(self, libc):
        self._bits = ctypes.sizeof(ctypes.c_ulong) * 8
        self.set_type = ctypes.c_ulong * (1024 // self._bits)  # glibc's sigset_t: 1024 bits
        skip = {getattr(signal, n) for n in _SYNCHRONOUS if hasattr(signal, n)}
        self._candidates = sorted(s for s in signal.valid_signals()
                                  if s not in skip and 0 < s <= 1024)
        self._read_at = float("-inf")
        self._blocked = None
        self.call = libc.pthread_sigmask
        self.call.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        self.call.restype = ctypes.c_int

    @classmethod
    def load(cls):
        try:
            return cls(ctypes.CDLL(None, use_errno=True))
        except (OSError, AttributeError):
            return None

    def blocked(self):
        """A reference to the set of signals with a Python handler now (within
        ``_REREAD_S``), or None when there are none."""
        now = time.monotonic()
        if now - self._read_at >= self._REREAD_S:
            self._read_at = now
            handled = self.set_type()
            found = False
            for signum in self._candidates:
                if callable(signal.getsignal(signum)):
                    handled[(signum - 1) // self._bits] |= 1 << ((signum - 1) % self._bits)
                    found = True
            self._blocked = ctypes.byref(handled) if found else None
        return self._blocked


_MASK = _SignalMask.load()
_SIG_BLOCK, _SIG_SETMASK = signal.SIG_BLOCK, signal.SIG_SETMASK


def sem_wait(sem: "posix_ipc.Semaphore", timeout) -> bool:
    """Acquire ``sem``, waiting at most ``timeout`` seconds (None: forever; 0 or less: only
    if it is free now). True if acquired, False if the time ran out. The GIL is released
    while it waits. Every semaphore wait of the package goes through here.

    Signals (PEP 475): a wait interrupted by a signal (EINTR, posix_ipc's ``SignalError``)
    is resumed with the time that remains, on the monotonic clock, so a handled signal
    neither ends nor stretches the wait. In the main thread, which runs Python signal
    handlers, the signals that have one are blocked for the wait, in slices of at most
    ``SIGNAL_SLICE_S`` (0.1 s), and unblocked between them: posix_ipc runs pending Python
    handlers inside its wait and then raises its own ``SignalError`` in place of whatever
    they raised (``SystemExit`` from ``install_signal_cleanup``, for one). Unblocked, a
    signal that came meanwhile is delivered and its handler runs in Python, at most one
    slice late, so what it raises propagates from here as from anywhere; the thread's
    signal mask is always left as it was found. Signals with C handlers
    (``faulthandler``) interrupt the wait, which resumes (see ``_SignalMask``).

    Raises what a signal handler raises, and ``posix_ipc.ExistentialError`` if the
    semaphore was removed under the wait."""
    if timeout is not None and timeout <= 0:
        try:
            sem.acquire(0)  # sem_trywait: never interrupted
            return True
        except posix_ipc.BusyError:
            return False
    deadline = None if timeout is None else time.monotonic() + timeout
    mask = _MASK if threading.current_thread() is threading.main_thread() else None
    blocked = saved = None
    while True:
        wait = None
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0:
                return False
        if mask is not None:
            blocked = mask.blocked()
            if blocked is not None:
                wait = SIGNAL_SLICE_S if wait is None else min(wait, SIGNAL_SLICE_S)
                if saved is None:
                    saved = ctypes.byref(mask.set_type())
        try:
            if blocked is not None:
                mask.call(_SIG_BLOCK, blocked, saved)  # see _SignalMask
            sem.acquire(wait)
            return True
        except posix_ipc.BusyError:
            if wait is None:
                raise  # not reachable: a wait without timeout does not time out
        except posix_ipc.SignalError:
            pass  # EINTR: resume with what remains
        finally:
            if blocked is not None:
                mask.call(_SIG_SETMASK, saved, None)  # pending handlers run after this call


def unlink_semaphore(name: str) -> bool:
    """Remove semaphore ``name``; True if removed. Only a regular file of this uid: another
    user's, a symlink or anything else is left alone (False). Never blocks."""
    if not _is_own_file(_sem_file(name)):
        return False
    try:
        posix_ipc.unlink_semaphore(name)
        return True
    except posix_ipc.ExistentialError:
        return False
    except posix_ipc.PermissionsError as exc:
        raise PermissionError(errno.EPERM, f"may not remove semaphore {name}: {exc}") from None


def pid_alive(pid: int) -> bool:
    """True if ``pid`` is a running (not zombie) process in this process's pid namespace.

    For messages and for names that embed their creator's pid; not a proof of ownership
    (pids are reused, and other pid namespaces have their own): see ``owner_alive``."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # state is the field after the parenthesised command name
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def segment_owner(name: str, owner_slot: int) -> int:
    """The pid recorded at int64 slot ``owner_slot`` of segment ``name``; 0 if the segment
    does not exist or is too small to hold it (being created). ``PermissionError`` if another
    uid owns the segment (see ``Segment.attach``). Never blocks. The pid is as its creator
    saw it (in its own pid namespace): for messages; ``owner_alive`` says whether it lives."""
    try:
        seg = Segment.attach(name)
    except FileNotFoundError:
        return 0
    try:
        return seg.view[owner_slot] if seg.size > owner_slot * 8 else 0
    finally:
        seg.close()


def owner_alive(name: str) -> bool:
    """Is the process that created shared-memory segment ``name`` alive? The one question a
    cleaner asks before removing a name.

    True while its creator holds the segment's owner lock (``Segment.create`` /
    ``create_reclaiming`` take it for the creator's life): that is alive on this node, in
    any pid namespace, whatever pid it had; a reused pid proves nothing either way. False
    for a leftover of a process that exited (or a name being created this very moment: a
    creator locks its new name within microseconds; remove leftovers with
    ``reclaim_stale``, which is safe against that). ``FileNotFoundError`` if there is no
    such segment, ``PermissionError`` if another user owns it. Never blocks.

    Segments created without the lock (``create_exclusive`` alone) read as not alive."""
    seg = Segment.attach(name)
    try:
        return seg.owner_alive()
    finally:
        seg.close()


class SegmentInUse(FileExistsError):
    """``create_reclaiming`` found the name held by a live process (``owner``, the pid it
    recorded, in its own pid namespace; 0 when unknown, e.g. another creator won a race for
    a freshly reclaimed name)."""

    def __init__(self, name: str, owner: int):
        super().__init__(f"{name} is owned by live process {owner}" if owner else
                         f"{name} was created concurrently by another process")
        self.owner = owner


def create_reclaiming(name: str, size: int, owner_slot: int) -> "Segment":
    """``Segment.create`` (the caller then owns the name: it holds the owner lock until
    ``close()``), but a leftover of an exited creator (nobody holds its owner lock) is
    reclaimed first. Raises ``SegmentInUse`` (a ``FileExistsError``) if a live process owns
    the name, and ``PermissionError`` if another user does; the caller turns either into its
    own error. ``owner_slot``: the int64 slot where creators record their pid, read for the
    messages only. Blocks at most ~1 s (see ``Segment.create``)."""
    try:
        return Segment.create(name, size)
    except SegmentInUse:
        raise
    except FileExistsError:
        owner = _reclaim(name, owner_slot)
        if owner is not None:
            raise SegmentInUse(name, owner) from None
    try:
        return Segment.create(name, size)
    except SegmentInUse:
        raise
    except FileExistsError:
        raise SegmentInUse(name, 0) from None


def create_fresh_semaphore(name: str, initial_value: int = 0) -> None:
    """Create semaphore ``name`` (mode 0600), first removing a leftover of ours (a crashed
    run's would carry a stale count); another user's raises ``PermissionError``."""
    if check_semaphore_owner(name):
        unlink_semaphore(name)
    create_semaphore(name, initial_value).close()


def _reclaim(name: str, owner_slot: int):
    """Unlink segment ``name`` if nobody holds its owner lock: None (reclaimed, or already
    gone). Else nothing is touched and the recorded owner pid is returned (0 if unknown).

    The unlink happens while holding the owner lock and only if the name still names the
    file we locked, so a live owner (which holds the lock) is never unlinked, nor a newer
    segment of the same name; a creator caught between its create and its lock finds its
    file unlinked and creates it again (``Segment.create``)."""
    try:
        seg = Segment.attach(name)
    except FileNotFoundError:
        return None
    try:
        owner = seg.view[owner_slot] if seg.size > owner_slot * 8 else 0
        if not seg.try_lock(OWNER_LOCK):
            return owner
        if seg.unlink_if_mine():
            log.warning("reclaimed stale shared memory %s left by exited process %s",
                        name, owner or "unknown")
        return None
    finally:
        seg.close()


def reclaim_stale(name: str, owner_slot: int) -> int:
    """Unlink segment ``name`` unless its creator is alive (holds its owner lock: see
    ``owner_alive``). Returns the live owner's recorded pid (nothing was touched; -1 if it
    recorded none yet), or 0 (reclaimed, or there was nothing to reclaim).

    Used by creators that find their name taken, and by cleaners: a crashed run's leftover
    is reclaimed, a live owner is reported to the caller, who raises its own error. A
    segment of another uid raises ``PermissionError`` and is left alone. Never blocks."""
    owner = _reclaim(name, owner_slot)
    if owner is None:
        return 0
    return owner or -1
