"""Who owns a name in ``/dev/shm``: locks the owner holds, files of our own uid.

Ownership is a lock, not a pid. Whether the creator of a name is still alive decides
whether a leftover may be reclaimed, so it must survive pid reuse (an unrelated process may
hold a dead owner's pid) and pid namespaces (containers sharing ``/dev/shm`` with
``--ipc=host`` see each other's files, not each other's pids). The creator therefore holds
an open-file-description lock (``F_OFD_SETLK``) on one byte of the segment's file for its
whole life (``OWNER_LOCK``, past the end of the data: a lock may cover bytes a file does
not have); the kernel drops it when the owner's last descriptor closes, which death does.
Whoever finds the name taken probes that lock (``lock_held``) or tries to take it without
waiting (``try_lock``): held means a live owner in any pid namespace of the node, free
means a leftover. A pid written into a segment is for messages only. Other bytes past
``OWNER_LOCK`` serve the same purpose for parts of a segment (the TP group: one per rank).
Descriptors are close-on-exec, and a forked child closes its inherited copies at once
(``on_fork``, run by ``os.register_at_fork``), so neither keeps a dead owner's lock alive.

Trust: names in ``/dev/shm`` are a namespace shared by every user of the node, so a name
is created exclusively with mode 0600 (``MODE``), and an existing one is used, or removed
as stale, only once ``check_owner`` / ``is_own_file`` showed it is a regular file of our
effective uid: another user could otherwise pre-create a group's segment and steer its
ranks.
"""

import errno
import fcntl
import os
import stat
import struct
import weakref

import posix_ipc

__all__ = ["OWNER_LOCK", "MODE", "try_lock", "lock_held", "unlock", "owner_lock_held",
           "same_file", "is_own_file", "check_owner", "remove_name", "on_fork", "pid_alive"]

# Every name this package creates: read and write for its owner only.
MODE = 0o600

# The byte whose lock the creator of a segment holds for its life (see the module
# docstring); bytes after it are free for callers' own liveness locks (Segment.try_lock).
OWNER_LOCK = 1 << 40
# struct flock on Linux (x86-64 and aarch64): l_type, l_whence, l_start, l_len, l_pid.
_FLOCK = struct.Struct("hhxxxxqqixxxx")


def unlock(fd: int, offset: int) -> None:
    """Drop this open file description's lock on byte ``offset`` (nothing if it holds none)."""
    _ofd(fd, fcntl.F_OFD_SETLK, fcntl.F_UNLCK, offset)


def _ofd(fd: int, cmd: int, kind: int, offset: int) -> int:
    """One OFD lock call on the byte at ``offset``; returns the l_type the kernel reports."""
    return _FLOCK.unpack(fcntl.fcntl(fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, offset, 1, 0)))[0]


def try_lock(fd: int, offset: int) -> bool:
    """Take the write lock on byte ``offset`` without waiting: True if taken, False if
    another open file description holds it."""
    try:
        _ofd(fd, fcntl.F_OFD_SETLK, fcntl.F_WRLCK, offset)
        return True
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def lock_held(fd: int, offset: int) -> bool:
    """True if another open file description holds a lock on byte ``offset`` (our own
    locks do not count). Takes nothing. Never blocks."""
    return _ofd(fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, offset) != fcntl.F_UNLCK


def owner_lock_held(fd: int) -> bool:
    """True if another open file description holds the owner lock (``OWNER_LOCK``) of the
    segment open as ``fd``: its creator (``Segment.create``) is alive. Never blocks."""
    return lock_held(fd, OWNER_LOCK)


def same_file(path: str, fd: int) -> bool:
    """True if ``path`` still names the file open as ``fd`` (not unlinked or replaced)."""
    try:
        a, b = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


# Objects whose ownership a forked child must not inherit (see ``on_fork``).
_OWNERS: weakref.WeakSet = weakref.WeakSet()


def on_fork(owner) -> None:
    """Register ``owner``: in a process forked from this one, ``owner.after_fork_in_child()``
    runs at once (``os.register_at_fork``), before the child's own code. An owner closes
    there the descriptors whose locks prove its ownership (an OFD lock or ``flock``
    belongs to the open file description, which the child's copy shares: a child that
    outlives a killed parent would keep a dead owner's name alive for good) and stops
    removing names (the parent's, not the child's). Weakly held; never blocks."""
    _OWNERS.add(owner)


def _after_fork_in_child():
    for owner in list(_OWNERS):
        try:
            owner.after_fork_in_child()
        except Exception:  # a child must start whatever one owner's state is
            pass


def close_quietly(fd: int) -> None:
    """Close ``fd`` if it is one (>= 0), ignoring the error of one already closed: for an
    inherited copy closed in a forked child, or a descriptor closed by a finalizer."""
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass


def is_own_file(path: str) -> bool:
    """True if ``path`` is a regular file (not a symlink) owned by this process's uid."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def check_owner(st, what: str, path: str) -> None:
    """``PermissionError`` (saying what to do) unless ``st`` (an ``os.stat_result``) shows
    a file of this process's effective uid; ``what`` and ``path`` name it in the message."""
    uid = os.geteuid()
    if st.st_uid != uid:
        raise PermissionError(
            errno.EPERM, f"{what} is owned by uid {st.st_uid}, not by this process's uid {uid} "
            f"(mode {oct(stat.S_IMODE(st.st_mode))}): another user created it, so it is neither "
            f"used nor removed. Remove it as its owner or root (rm {path}), or use another "
            f"name/dp_id")


def remove_name(remove, name: str, what: str) -> bool:
    """``remove(name)`` (``posix_ipc.unlink_shared_memory`` or ``unlink_semaphore``): True if
    the name was removed, False if it was gone already; ``PermissionError`` naming ``what``
    when this process may not remove it. The caller has checked that the name is ours."""
    try:
        remove(name)
        return True
    except posix_ipc.ExistentialError:
        return False
    except posix_ipc.PermissionsError as exc:
        raise PermissionError(errno.EPERM, f"may not remove {what} {name}: {exc}") from None


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


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
