"""Named POSIX shared memory, attached without any resource tracker: ``Segment``, the one
way this package creates, attaches, owns and reclaims a segment.

Why not ``multiprocessing.shared_memory``: in Python 3.11, ``SharedMemory(name=...)``
registers the segment with the *attaching* process's resource tracker, which unlinks it
when that process exits, so a worker exiting would destroy a segment its peers still
use. ``posix_ipc`` + ``mmap`` gives us the plain POSIX calls and leaves the lifetime
policy to us: the creator unlinks at close, and a crashed creator's leftovers are
reclaimed by the next creator of the same name (``create_reclaiming``).

Ownership (``ownership``): the creator holds the segment's owner lock for its life;
whoever finds the name taken asks that lock, never a pid. Trust: a segment is created
exclusively (``O_CREAT|O_EXCL``) with mode 0600, and an existing one is mapped (or
unlinked as stale) only after ``os.fstat`` on its descriptor shows it is owned by our
effective uid.
"""

import errno
import logging
import mmap
import os
import struct
import time
import weakref
from typing import Optional

import posix_ipc

from ..names import shm_path
from .ownership import (
    MODE,
    OWNER_LOCK,
    check_owner,
    close_quietly,
    is_own_file,
    lock_held,
    on_fork,
    remove_name,
    same_file,
    try_lock,
    unlock,
)
from .semaphores import unlink_semaphore

__all__ = ["Segment", "SegmentInUse", "SegmentNotReady", "OWNER_PID", "create_exclusive",
           "create_reclaiming", "attach_when_ready", "open_checked", "owner_alive",
           "populate", "reclaim_stale", "reserve", "segment_owner", "unlink_segment"]

# The int64 word of every owned segment (``Segment.create``) holding its creator's pid, as
# that process saw it (in its own pid namespace): for messages only, never a proof of life.
OWNER_PID = 1

# madvise(2) advice values (Linux 5.14+; not in Python 3.11's mmap module)
_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
# A creator waits this long at most for a reclaimer that is probing its brand-new name.
_CREATE_LOCK_WAIT_S = 1.0

log = logging.getLogger(__name__)

# Every Segment holding a descriptor, so that a forked child can close its copies.
_WITH_FDS: weakref.WeakSet = weakref.WeakSet()


def _open_lock_fd(name: str, shm_fd: int) -> int:
    """A descriptor of segment ``name`` of its own (its own open file description) for the
    locks. Not a dup of the mapping's descriptor: ``mmap`` keeps a dup of that one, which
    would hold the locks as long as the mapping lives. ``FileNotFoundError`` if the name
    no longer names the file open as ``shm_fd`` (unlinked or replaced meanwhile)."""
    fd = os.open(shm_path(name), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    a, b = os.fstat(fd), os.fstat(shm_fd)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        os.close(fd)
        raise FileNotFoundError(f"shared memory {name} was replaced while it was opened")
    return fd


class Segment:
    """A mapped shared-memory segment. ``view`` is a memoryview of int64 slots.

    A slot is read and written through ``view`` (not numpy, whose scalar indexing costs
    several times more: docs/performance.md), which matters on the per-step hot path.

    Each Segment keeps one private descriptor of the segment's file for its locks
    (``try_lock``, ``lock_held``); ``close()`` releases it with the mapping.
    """

    def __init__(self, name: str, mapping: mmap.mmap, fd: int = -1, created: bool = False):
        self.name = name
        self._mmap: Optional[mmap.mmap] = mapping
        self.view = memoryview(mapping).cast("q")
        self._fd = fd
        self._created = created  # made by Segment.create: this process is its owner
        if fd >= 0:
            _WITH_FDS.add(self)
            on_fork(self)

    @classmethod
    def create(cls, name: str, size: int, record_owner: bool = True) -> "Segment":
        """Create a new zero-filled segment, mode 0600, and hold its owner lock
        (``OWNER_LOCK``) until ``close()``; ``FileExistsError`` if the name exists (whoever
        owns it: never opened, never unlinked here). With ``record_owner`` this process's
        pid is written at word ``OWNER_PID`` (for messages: ``segment_owner``), before any
        other process can see the segment ready. Blocks at most ~1 s, only while another
        process probes the brand-new name (then it may find the name taken)."""
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
                while not try_lock(fd, OWNER_LOCK):
                    if time.monotonic() > deadline:
                        raise SegmentInUse(name, 0)
                    time.sleep(0.001)
                if os.fstat(fd).st_nlink:
                    seg = cls._map(name, shm, size, fd, created=True)
                    if record_owner and seg.size > OWNER_PID * 8:
                        seg.view[OWNER_PID] = os.getpid()
                    return seg
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
        shm, st = open_checked(name)
        try:
            fd = _open_lock_fd(name, shm.fd)
        except BaseException:
            shm.close_fd()
            raise
        return cls._map(name, shm, st.st_size, fd)

    @classmethod
    def _map(cls, name, shm, size, fd, created=False):
        try:
            if size == 0:
                mapping = mmap.mmap(-1, 8)  # placeholder: reads as "not ready"
            else:
                mapping = map_shared(shm.fd, size)
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
        return self._fd >= 0 and try_lock(self._fd, offset)

    def unlock(self, offset: int) -> None:
        if self._fd >= 0:
            unlock(self._fd, offset)

    def lock_held(self, offset: int) -> bool:
        """True if another open file description holds a lock on byte ``offset``: its
        holder is alive (on this node, in any pid namespace). Never blocks."""
        return self._fd >= 0 and lock_held(self._fd, offset)

    def owner_alive(self) -> bool:
        """True if the creator of this segment still holds ``OWNER_LOCK`` (False for our
        own: a Segment made by ``create`` is its owner)."""
        return self.lock_held(OWNER_LOCK)

    def is_current(self) -> bool:
        """True if the segment's name still names this very segment (not unlinked, nor
        replaced by a newer one of the same name). Never blocks."""
        return self._fd >= 0 and same_file(shm_path(self.name), self._fd)

    def unlink_if_mine(self) -> bool:
        """Remove the segment's name if it still names this very segment (not a newer one
        of the same name); True if removed. Call it while holding the owner lock (the
        creator, or a reclaimer that took it), so nobody else can swap the name between
        the check and the unlink."""
        return self.is_current() and _unlink_name(self.name)

    def reserve(self) -> None:
        """Allocate every page of the segment's file now (``posix_fallocate``; tmpfs
        supports it): a full ``/dev/shm`` is an ``OSError(ENOSPC)`` here, never a SIGBUS
        when the memory is first touched. Creators call it before publishing the segment."""
        if self._fd < 0:
            raise ValueError(f"shared memory {self.name}: no descriptor to reserve with")
        reserve(self._fd, self.size)

    def truncated(self) -> bool:
        """True if the segment's file is now shorter than this mapping (another process of
        this uid truncated it): touching the missing pages would be a SIGBUS. One
        ``fstat``; False once the descriptor was released (nothing to ask)."""
        return self._fd >= 0 and os.fstat(self._fd).st_size < self.size

    def populate(self, write: bool) -> None:
        """Map every page in now (``MADV_POPULATE_WRITE`` or ``_READ``, Linux 5.14+), so
        that no later write (or read) of the segment takes a page fault: for segments
        whose pages are touched on a latency-sensitive path. Best effort: a kernel without
        it leaves the pages to fault in on first use; nothing once closed (as ``populate``
        on a closed mapping)."""
        if self._mmap is not None:
            populate(self._mmap, write)

    def read_words(self, first: int, count: int) -> tuple:
        """Words ``[first, first + count)`` of the segment's file, read with ``pread``
        (not through the mapping): a file truncated meanwhile reads as zeros past its end,
        never as a SIGBUS. ``ValueError`` once the descriptor was released. Never blocks."""
        if self._fd < 0:
            raise ValueError(f"shared memory {self.name}: no descriptor to read with")
        raw = os.pread(self._fd, count * 8, first * 8).ljust(count * 8, b"\0")
        return struct.unpack(f"<{count}q", raw)

    def write_words(self, first: int, values) -> None:
        """Write ``values`` from word ``first`` on with ``pwrite`` (not through the
        mapping: a truncated file grows back instead of a SIGBUS). Never blocks."""
        if self._fd < 0:
            raise ValueError(f"shared memory {self.name}: no descriptor to write with")
        os.pwrite(self._fd, struct.pack(f"<{len(values)}q", *values), first * 8)

    def release_locks(self) -> None:
        """Close the descriptor, which drops every lock this Segment holds; the mapping
        stays. Idempotent."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            _WITH_FDS.discard(self)
            os.close(fd)

    def after_fork_in_child(self):
        """In a forked child: close the inherited descriptor (the parent keeps its locks)."""
        fd, self._fd = self._fd, -1
        close_quietly(fd)

    def __del__(self):
        # garbage without close(): the descriptor (and its locks) must not outlive us
        close_quietly(getattr(self, "_fd", -1))

    def close(self) -> None:
        """Drop the locks and unmap. Idempotent. Every view derived from ``view`` must be
        released first."""
        self.release_locks()
        if self._mmap is None:
            return
        self.view.release()
        self._mmap.close()
        self._mmap = None


def map_shared(fd: int, length: int, *, offset: int = 0, writable: bool = True,
               populate: bool = False) -> mmap.mmap:
    """The one way this package maps shared memory: ``length`` bytes of ``fd`` from
    ``offset`` (a multiple of ``mmap.ALLOCATIONGRANULARITY``), ``MAP_SHARED``, read-write
    or read-only (``writable``); ``populate``: every page mapped in by the call
    (``MAP_POPULATE``, Linux; elsewhere pages fault in on first use). The mapping does not
    need ``fd`` afterwards. ``OSError`` as ``mmap.mmap``. Never blocks beyond the kernel's
    work."""
    flags = mmap.MAP_SHARED | (_MAP_POPULATE if populate else 0)
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, length, flags=flags, prot=prot, offset=offset)


def populate(mapping: mmap.mmap, write: bool) -> None:
    """Map every page of ``mapping`` in now (``MADV_POPULATE_WRITE`` or ``_READ``, Linux
    5.14+). Best effort: a kernel without it leaves the pages to fault in on first use."""
    try:
        mapping.madvise(_MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ)
    except (OSError, ValueError):
        pass


def open_checked(name: str, read_only: bool = False):
    """Open existing segment ``name`` and check its owner: ``(posix_ipc.SharedMemory,
    os.stat_result)``, the stat of the very object opened (not of a name that may have been
    swapped meanwhile); the caller maps it and closes its descriptor. ``FileNotFoundError``
    if there is no such segment, ``PermissionError`` (nothing left open) if it is another
    uid's or may not be opened. Never blocks."""
    try:
        shm = posix_ipc.SharedMemory(name, read_only=read_only)
    except posix_ipc.ExistentialError as exc:
        raise FileNotFoundError(f"shared memory {name} does not exist") from exc
    except posix_ipc.PermissionsError as exc:
        raise PermissionError(
            errno.EACCES, f"shared memory {name} exists but this process (uid "
            f"{os.geteuid()}) may not open it: another user created it. Remove it as its "
            f"owner or root (rm {shm_path(name)}) or use another name/dp_id") from exc
    try:
        st = os.fstat(shm.fd)
        check_owner(st, f"shared memory {name}", shm_path(name))
    except BaseException:
        shm.close_fd()
        raise
    return shm, st


def reserve(fd: int, size: int) -> None:
    """Allocate every page of the file open as ``fd`` now (``posix_fallocate``; tmpfs
    supports it; elsewhere every page is written): a full ``/dev/shm`` is an
    ``OSError(ENOSPC)`` here, never a SIGBUS when the memory is first touched."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        page = bytes(mmap.PAGESIZE)
        for offset in range(0, size, mmap.PAGESIZE):
            os.pwrite(fd, page[:min(mmap.PAGESIZE, size - offset)], offset)


def create_exclusive(name: str, size: int) -> "posix_ipc.SharedMemory":
    """Create shared memory ``name`` of ``size`` zero-filled bytes, exclusively, mode 0600
    exactly (whatever the umask); the caller maps it and closes its fd.
    ``FileExistsError`` if the name exists (whoever owns it: never opened, never unlinked
    here); on any later failure the new name is removed again."""
    try:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=MODE, size=size)
    except posix_ipc.ExistentialError as exc:
        raise FileExistsError(f"shared memory {name} exists") from exc
    try:
        os.fchmod(shm.fd, MODE)  # the umask only ever narrows it, but be exact
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
    path = shm_path(name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:  # a symlink, or a file we may not open
        return is_own_file(path) and _unlink_name(name)
    try:
        if try_lock(fd, OWNER_LOCK) or _created_here(name, fd):
            return same_file(path, fd) and _unlink_name(name)
        return False  # a live owner elsewhere holds it
    finally:
        os.close(fd)


def _unlink_name(name: str) -> bool:
    return remove_name(posix_ipc.unlink_shared_memory, name, "shared memory")


def _created_here(name: str, fd: int) -> bool:
    """True if a Segment this process created (and still has open) maps the file ``fd``."""
    st = os.fstat(fd)
    for seg in list(_WITH_FDS):
        if seg.name == name and seg._created and seg._fd >= 0:
            mine = os.fstat(seg._fd)
            if (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino):
                return True
    return False


def segment_owner(name: str) -> int:
    """The pid its creator recorded in segment ``name`` (word ``OWNER_PID``); 0 if the
    segment does not exist or is too small to hold it (being created). ``PermissionError``
    if another uid owns the segment (see ``Segment.attach``). Never blocks. The pid is as
    its creator saw it (in its own pid namespace): for messages; ``owner_alive`` says
    whether it lives."""
    try:
        seg = Segment.attach(name)
    except FileNotFoundError:
        return 0
    try:
        return _recorded_owner(seg)
    finally:
        seg.close()


def _recorded_owner(seg) -> int:
    return seg.view[OWNER_PID] if seg.size > OWNER_PID * 8 else 0


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


def create_reclaiming(name: str, size: int, semaphores=None) -> "Segment":
    """``Segment.create`` (the caller then owns the name: it holds the owner lock until
    ``close()``), but a leftover of an exited creator (nobody holds its owner lock) is
    reclaimed first (``reclaim_stale``, with ``semaphores``). Raises ``SegmentInUse`` (a
    ``FileExistsError``) if a live process owns the name, and ``PermissionError`` if
    another user does; the caller turns either into its own error. Blocks at most ~1 s
    (see ``Segment.create``)."""
    try:
        return Segment.create(name, size)
    except SegmentInUse:
        raise
    except FileExistsError:
        owner = reclaim_stale(name, semaphores)
        if owner:
            raise SegmentInUse(name, max(owner, 0)) from None
    try:
        return Segment.create(name, size)
    except SegmentInUse:
        raise
    except FileExistsError:
        raise SegmentInUse(name, 0) from None


def reclaim_stale(name: str, semaphores=None) -> int:
    """Unlink segment ``name`` unless its creator is alive (holds its owner lock: see
    ``owner_alive``). Returns the live owner's recorded pid (nothing was touched; -1 if it
    recorded none yet), or 0 (reclaimed, or there was nothing to reclaim). The one way
    this package removes another process's leftover segment.

    ``semaphores``: a callable given the leftover ``Segment`` that returns the names of the
    semaphores that live and die with it; they are unlinked first, while the name (held
    under its owner lock) keeps a new creator from making semaphores of the same names.

    The unlink happens while holding the owner lock and only if the name still names the
    file that was locked, so a live owner (which holds the lock) is never unlinked, nor a
    newer segment of the same name; a creator caught between its create and its lock finds
    its file unlinked and creates it again (``Segment.create``). A segment of another uid
    raises ``PermissionError`` and is left alone. Never blocks."""
    try:
        seg = Segment.attach(name)
    except FileNotFoundError:
        return 0
    try:
        owner = _recorded_owner(seg)
        if not seg.try_lock(OWNER_LOCK):
            return owner or -1
        for sem_name in (semaphores(seg) if semaphores is not None else ()):
            unlink_semaphore(sem_name)
        if seg.unlink_if_mine():
            log.warning("reclaimed stale shared memory %s left by exited process %s",
                        name, owner or "unknown")
        return 0
    finally:
        seg.close()


class SegmentNotReady(TimeoutError):
    """``attach_when_ready`` gave up: ``why`` says what the segment lacked last."""

    def __init__(self, name: str, why: str):
        super().__init__(f"shared memory {name} not ready: {why}")
        self.why = why


def attach_when_ready(name: str, usable, timeout: float, poll_s: float = 0.01) -> "Segment":
    """Attach segment ``name`` once ``usable(segment)`` accepts it (returns None; else a
    short reason why not), trying again every ``poll_s`` seconds while there is none or
    it is not usable: for a segment another process creates (its creator may start after
    us, or be replacing a leftover). Blocks at most ``timeout`` seconds, then raises
    ``SegmentNotReady`` with the last reason. What ``usable`` raises ends the wait (the
    segment is closed first); a segment it rejects is closed before the next try."""
    deadline = time.monotonic() + timeout
    why = "it does not exist: not made yet, or removed by its creator"
    while True:
        try:
            seg = Segment.attach(name)
        except FileNotFoundError:
            seg = None
        if seg is not None:
            try:
                why = usable(seg)
            except BaseException:
                seg.close()
                raise
            if why is None:
                return seg
            seg.close()
        if time.monotonic() >= deadline:
            raise SegmentNotReady(name, why)
        time.sleep(poll_s)
