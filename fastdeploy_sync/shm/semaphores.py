"""Named POSIX semaphores: created 0600 by their owner, owner-checked on open, and waited on
in one place (``sem_wait``) that survives signals.

Semaphores have no descriptor in ``posix_ipc``: their owner is read from their file
``/dev/shm/sem.NAME`` (glibc's) before they are opened or removed (``check_semaphore_owner``),
never through a symlink.

Waiting: ``sem_wait`` is the one place the package waits on a semaphore (see there for
signals: posix_ipc turns EINTR into ``SignalError`` and replaces whatever a Python signal
handler raised during the wait by it).
"""

import ctypes
import errno
import os
import signal
import stat
import threading
import time
from typing import Any

import posix_ipc

from ..names import semaphore_path as _sem_file
from .ownership import MODE, check_owner, is_own_file, remove_name

__all__ = ["create_semaphore", "create_fresh_semaphore", "open_semaphore",
           "check_semaphore_owner", "unlink_semaphore", "sem_wait", "SIGNAL_SLICE_S"]

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
    check_owner(st, f"semaphore {name}", path)
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
        sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=MODE, initial_value=initial_value)
    except posix_ipc.ExistentialError as exc:
        raise FileExistsError(f"semaphore {name} exists") from exc
    try:
        os.chmod(_sem_file(name), MODE)
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


# The main thread waits at most this long at a time with signals blocked (sem_wait), so a
# signal's Python handler runs at most this late.
SIGNAL_SLICE_S = 0.1
# Signals the kernel raises for the faulting thread itself, and those no handler can take:
# never blocked.
_SYNCHRONOUS = {"SIGKILL", "SIGSTOP", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP",
                "SIGSYS", "SIGABRT"}


class _SignalMask:
    """``pthread_sigmask`` through ctypes (a direct C call: ``signal.pthread_sigmask`` is
    far slower to restore a mask, which it returns as a set of ``signal.Signals`` members)
    of the signals that have a Python handler: those whose handler posix_ipc would run
    inside its wait. Signals taken by C handlers (``faulthandler.register``, a native
    library's) are left alone: they interrupt the wait, which is resumed, and their
    handler runs in the waiting thread as it would without us (moved to another thread,
    ``faulthandler`` would read this thread's frames while it runs, which crashes the
    process). ``load()`` is None where libc is not reachable: waits are then not masked
    (``SignalError`` is still retried).

    Which signals have Python handlers is read again at most every ``_REREAD_S``
    (``signal.getsignal`` of every signal is too slow to ask at every wait).

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
    mask: Any = _MASK if threading.current_thread() is threading.main_thread() else None
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
    if not is_own_file(_sem_file(name)):
        return False
    return remove_name(posix_ipc.unlink_semaphore, name, "semaphore")


def create_fresh_semaphore(name: str, initial_value: int = 0) -> "posix_ipc.Semaphore":
    """Create semaphore ``name`` (mode 0600) and return it open, first removing a leftover of
    ours (a crashed run's would carry a stale count); another user's raises
    ``PermissionError``."""
    if check_semaphore_owner(name):
        unlink_semaphore(name)
    return create_semaphore(name, initial_value)
