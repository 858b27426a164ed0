"""Named POSIX shared memory and semaphores, attached without any resource tracker.

Why not ``multiprocessing.shared_memory``: in Python 3.11, ``SharedMemory(name=...)``
registers the segment with the *attaching* process's resource tracker, which unlinks it
when that process exits, so a worker exiting would destroy a segment its peers still
use. ``posix_ipc`` + ``mmap`` gives us the plain POSIX calls and leaves the lifetime
policy to us: the creator unlinks at close, and a crashed creator's leftovers are
reclaimed by the next creator of the same name (see ``tp_group.py``).

Trust: names in ``/dev/shm`` are a namespace shared by every user of the node, so a
segment is created exclusively (``O_CREAT|O_EXCL``) with mode 0600, and an existing one is
mapped (or unlinked as stale) only after ``os.fstat`` on its fd shows it is owned by our
effective uid: another user could otherwise pre-create a group's segment and steer its
ranks. Semaphores have no fd in ``posix_ipc``; their owner is read from their file
``/dev/shm/sem.NAME`` before opening (``open_semaphore``).
"""

import errno
import logging
import mmap
import os
import stat

import posix_ipc

__all__ = ["Segment", "SegmentInUse", "create_exclusive", "create_reclaiming",
           "create_fresh_semaphore", "pid_alive", "reclaim_stale", "segment_owner",
           "unlink_segment",
           "unlink_semaphore", "create_semaphore", "open_semaphore", "check_semaphore_owner"]

_MODE = 0o600
_SHM_DIR = "/dev/shm"

log = logging.getLogger(__name__)


class Segment:
    """A mapped shared-memory segment. ``view`` is a memoryview of int64 slots.

    Reading or writing one slot through ``view`` costs ~40 ns (numpy scalar indexing
    costs ~2-3x that), which matters on the per-step hot path.
    """

    def __init__(self, name: str, mapping: mmap.mmap):
        self.name = name
        self._mmap = mapping
        self.view = memoryview(mapping).cast("q")

    @classmethod
    def create(cls, name: str, size: int) -> "Segment":
        """Create a new zero-filled segment, mode 0600; ``FileExistsError`` if the name exists
        (whoever owns it: never opened, never unlinked here)."""
        return cls._map(name, create_exclusive(name, size), size)

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
        except BaseException:
            shm.close_fd()
            raise
        return cls._map(name, shm, size)

    @classmethod
    def _map(cls, name, shm, size):
        try:
            if size == 0:
                return cls(name, mmap.mmap(-1, 8))  # placeholder: reads as "not ready"
            return cls(name, mmap.mmap(shm.fd, size))
        finally:
            shm.close_fd()

    @property
    def size(self) -> int:
        return self.view.nbytes

    def close(self) -> None:
        """Unmap. Idempotent. Every view derived from ``view`` must be released first."""
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
    """Remove a segment name; True if it existed. Mappings stay valid until unmapped."""
    try:
        posix_ipc.unlink_shared_memory(name)
        return True
    except posix_ipc.ExistentialError:
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

    Reads the owner of ``/dev/shm/sem.NAME`` (glibc's file for a named semaphore); a
    semaphore swapped between this check and ``sem_open`` would need write access to
    ``/dev/shm`` names we just created, which sticky ``/dev/shm`` does not give others."""
    try:
        st = os.stat(_sem_file(name))
    except FileNotFoundError:
        return False
    _check_owner(st, f"semaphore {name}", _sem_file(name))
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


def unlink_semaphore(name: str) -> bool:
    try:
        posix_ipc.unlink_semaphore(name)
        return True
    except posix_ipc.ExistentialError:
        return False


def pid_alive(pid: int) -> bool:
    """True if ``pid`` is a running (not zombie) process on this machine."""
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
    uid owns the segment (see ``Segment.attach``). Never blocks."""
    try:
        seg = Segment.attach(name)
    except FileNotFoundError:
        return 0
    try:
        return seg.view[owner_slot] if seg.size > owner_slot * 8 else 0
    finally:
        seg.close()


class SegmentInUse(FileExistsError):
    """``create_reclaiming`` found the name held by a live process (``owner``, its pid;
    0 when another creator won a race for a freshly reclaimed name)."""

    def __init__(self, name: str, owner: int):
        super().__init__(f"{name} is owned by live process {owner}" if owner else
                         f"{name} was created concurrently by another process")
        self.owner = owner


def create_reclaiming(name: str, size: int, owner_slot: int) -> "Segment":
    """``Segment.create``, but a leftover of a crashed creator (the pid at int64 slot
    ``owner_slot`` has exited) is reclaimed first. Raises ``SegmentInUse`` (a
    ``FileExistsError``) if a live process owns the name, and ``PermissionError`` if
    another user does; the caller turns either into its own error. Never blocks."""
    try:
        return Segment.create(name, size)
    except FileExistsError:
        owner = reclaim_stale(name, owner_slot)
        if owner:
            raise SegmentInUse(name, owner) from None
    try:
        return Segment.create(name, size)
    except FileExistsError:
        raise SegmentInUse(name, 0) from None


def create_fresh_semaphore(name: str, initial_value: int = 0) -> None:
    """Create semaphore ``name`` (mode 0600), first removing a leftover of ours (a crashed
    run's would carry a stale count); another user's raises ``PermissionError``."""
    if check_semaphore_owner(name):
        unlink_semaphore(name)
    create_semaphore(name, initial_value).close()


def reclaim_stale(name: str, owner_slot: int) -> int:
    """Unlink segment ``name`` unless the process whose pid it holds at int64 slot
    ``owner_slot`` is alive. Returns that live pid (nothing was touched), or 0 (reclaimed).

    Used by creators that find their name taken: a crashed run's leftover is reclaimed, a
    live owner is reported to the caller, who raises its own error. A segment of another
    uid raises ``PermissionError`` and is left alone (its pid slot is not to be trusted)."""
    owner = segment_owner(name, owner_slot)
    if owner and owner != os.getpid() and pid_alive(owner):
        return owner
    unlink_segment(name)
    log.warning("reclaimed stale shared memory %s left by exited process %s",
                name, owner or "unknown")
    return 0
