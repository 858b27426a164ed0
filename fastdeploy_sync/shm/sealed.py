"""Shared memory nobody can shrink: a sealed memfd, found through a named anchor segment.

Why: arrays a rank keeps after the take are views of shared memory, and a file in
``/dev/shm`` can be truncated by any process of this user at any time; every page past
the new end then kills whoever touches it with SIGBUS, however carefully it checked the
size before. A check cannot close that window; a seal can. Linux lets only a memfd
(``memfd_create`` with ``MFD_ALLOW_SEALING``) be sealed (a tmpfs file in ``/dev/shm``
refuses ``F_ADD_SEALS``), and ``F_SEAL_SHRINK`` makes every ``ftruncate`` that would
shrink it fail with ``EPERM``, for every process and every descriptor, for the file's
life. So the memory is a memfd sealed with ``SEALS``, and mappings of it stay whole as
long as they exist.

A memfd has no name, so it is found through an *anchor*: a one-page owned ``Segment``
(``shm.segment``: created exclusively, mode 0600, its owner lock held for the creator's
life, reclaimed like every other segment) holding the creator's pid (``OWNER_PID``), the
memfd's descriptor number in the creator, its inode, device and size, and the token of
the creator's descriptor server (``shm.memfd_server``). A process attaching opens
``/proc/<pid>/fd/<n>`` (a new open file description of the very memfd; the kernel allows
it to a process of the same uid that may read the creator's state). ``/proc/<pid>``
names the creator only in the creator's pid namespace; when that open fails or finds
another file (a process in another pid namespace: a container that shares ``/dev/shm``
and the ipc directory, not the pids), the attacher asks the creator's server for the
descriptor instead, over a unix socket in the private ipc directory (``SCM_RIGHTS``).
Either way it maps the memfd only after checking on the descriptor it holds that it is the
recorded inode, of its own uid, of the recorded size, and sealed against shrinking: what
it maps can never shrink, whoever wrote the anchor or answered on the socket. The anchor
itself is read with ``pread``, never through a mapping, so a truncated anchor reads as
"not ready", never as a SIGBUS.

What remains: a process that can neither open ``/proc/<pid>/fd/<n>`` nor reach the
creator's socket (another ipc directory, another uid, a creator that could not start its
server, or one that is gone) cannot attach: ``attach`` raises ``SealedUnreachable``
naming both attempts (docs/failure-model.md).
"""

import errno
import fcntl
import mmap
import os

from ..errors import ProtocolError
from . import memfd_server
from .header import SegmentHeader
from .ownership import close_quietly, on_fork
from .segment import OWNER_PID, Segment, map_shared, populate, reserve

__all__ = ["SealedSegment", "SealedUnreachable", "SEALS", "open_sealed", "read_sealed"]

# Shrinking and growing refused, and no seal may be added later (F_SEAL_WRITE or
# F_SEAL_FUTURE_WRITE added by another process would stop the writer, or new readers).
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

_MAGIC = int.from_bytes(b"FDSYSEAL", "little")
# Anchor words (word OWNER_PID, 1, holds the creator's pid): READY and MAGIC written last.
# SERVER: the token of the creator's descriptor server (memfd_server), 0 if none.
_A_MAGIC, _A_FD, _A_INO, _A_DEV, _A_SIZE, _A_READY, _A_SERVER = 0, 2, 3, 4, 5, 6, 7
# The anchor is written with pwrite (system calls, each ordered by the kernel), READY and
# MAGIC last; read with pread: SegmentHeader's check, not its mapped-memory publish.
_ANCHOR = SegmentHeader(_MAGIC, _A_READY)
_A_WORDS = 8
_ANCHOR_BYTES = mmap.PAGESIZE


class SealedUnreachable(ProtocolError):
    """The anchor names a memfd this process cannot open or must not map (another pid
    namespace, the creator gone, or a file that is not the recorded sealed memfd)."""


class SealedSegment:
    """A mapped sealed memfd and its anchor. ``view`` is a memoryview of int64 words, as
    ``Segment.view``; ``name`` is the anchor's.

    The creator keeps the memfd's descriptor open, and serves it (``shm.memfd_server``),
    until ``release_locks()`` (whoever attaches opens it through that descriptor or
    receives it from the server); a process that attached keeps none (the mapping holds
    the memory). The mapping itself stays until ``close()``."""

    def __init__(self, anchor, fd: int, mapping, size: int):
        self.name = anchor.name
        self._anchor = anchor
        self._fd = fd  # the memfd (creator only; -1 in a process that attached)
        self._ino = os.fstat(fd).st_ino if fd >= 0 else 0  # what memfd_server serves
        self._mmap = mapping
        self.size = size
        self.view = memoryview(mapping).cast("q")
        if fd >= 0:
            on_fork(self)

    @classmethod
    def create(cls, name: str, size: int) -> "SealedSegment":
        """Create anchor ``name`` (``Segment.create``: exclusive, mode 0600, owner-locked
        until ``release_locks()``/``close()``) and a zero-filled memfd of ``size`` bytes,
        every page reserved (``posix_fallocate``: no room is an ``OSError`` here, never a
        SIGBUS later), sealed with ``SEALS``, mapped, and served to this uid's processes in
        other pid namespaces (``shm.memfd_server``, started with the first one; a server
        that cannot start is logged, not raised). ``FileExistsError`` if the name exists;
        ``OSError`` with nothing left behind otherwise. Never blocks beyond
        ``Segment.create``'s ~1 s."""
        anchor = Segment.create(name, _ANCHOR_BYTES)
        fd, mapping, ino = -1, None, 0
        try:
            fd = os.memfd_create(name.lstrip("/"), os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, size)
            reserve(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            mapping = map_shared(fd, size)
            st = os.fstat(fd)
            ino = st.st_ino
            token = memfd_server.serve(name, fd, ino)
            # the pointer, then READY and MAGIC: an attacher that finds both finds the
            # pointer (and checks what it opens anyway: open_memfd)
            anchor.write_words(_A_FD, (fd, ino, st.st_dev, size))
            anchor.write_words(_A_SERVER, (token,))
            anchor.write_words(_A_READY, (1,))
            anchor.write_words(_A_MAGIC, (_MAGIC,))
        except BaseException:
            if ino:
                memfd_server.withdraw(name, ino)
            if mapping is not None:
                mapping.close()
            if fd >= 0:
                os.close(fd)
            anchor.unlink_if_mine()
            anchor.close()
            raise
        return cls(anchor, fd, mapping, size)

    @classmethod
    def attach(cls, name: str) -> "SealedSegment":
        """Map the sealed memfd that anchor ``name`` names. ``FileNotFoundError`` if there
        is no anchor; ``PermissionError`` if another uid owns it; ``SealedUnreachable``
        (nothing mapped) if the anchor is not ready or its memfd cannot be opened from
        this process or is not the recorded sealed file. Never blocks, except when
        ``/proc`` does not reach the creator: then the creator's socket, at most
        ``memfd_server.FETCH_TIMEOUT_S`` (3 s)."""
        fd = open_sealed(name, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mapping = map_shared(fd, size)
        finally:
            os.close(fd)  # the mapping holds the memory
        return cls(_Detached(name), -1, mapping, size)

    def populate(self, write: bool) -> None:
        """As ``Segment.populate``: every page mapped in now, best effort."""
        populate(self._mmap, write)

    def unlink_if_mine(self) -> bool:
        """Remove the anchor's name if it is still this one (creator)."""
        return self._anchor.unlink_if_mine()

    def release_locks(self) -> None:
        """Drop the anchor's lock and (creator) stop serving the memfd and close its
        descriptor: nobody can attach any more; the mapping stays. The last one of the
        process stops its server (at most ~1 s: the peer it answers). Idempotent."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            memfd_server.withdraw(self.name, self._ino)
            os.close(fd)
        self._anchor.release_locks()

    def after_fork_in_child(self):
        """In a forked child: close the inherited memfd descriptor (the parent's). The
        parent's server is the server module's to forget (``memfd_server``)."""
        fd, self._fd = self._fd, -1
        close_quietly(fd)

    def __del__(self):
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            try:
                memfd_server.withdraw(self.name, self._ino, stop=False)  # never blocks
                os.close(fd)
            except Exception:  # interpreter shutdown: the module may be gone
                pass

    def close(self) -> None:
        """Drop the locks and unmap. Idempotent. Every view derived from ``view`` must be
        released first."""
        self.release_locks()
        self._anchor.close()
        if self._mmap is None:
            return
        self.view.release()
        self._mmap.close()
        self._mmap = None


class _Detached:
    """The anchor of a ``SealedSegment`` that attached: read once and closed."""

    def __init__(self, name):
        self.name = name

    def unlink_if_mine(self) -> bool:
        return False

    def release_locks(self) -> None:
        pass

    def close(self) -> None:
        pass


def open_memfd(anchor, flags: int) -> int:
    """A new descriptor (``flags``: ``O_RDWR`` or ``O_RDONLY``) of the sealed memfd that
    ``anchor`` (an attached ``Segment``) names, checked (``_check``): the recorded inode
    and size, this uid, sealed with at least ``F_SEAL_SHRINK``. Opened through
    ``/proc/<pid>/fd/<n>`` or, when that fails or finds another file, received from the
    creator's server (``memfd_server.fetch``: at most ``FETCH_TIMEOUT_S``).
    ``SealedUnreachable`` naming both attempts when neither gives the recorded memfd."""
    words = anchor.read_words(0, _A_WORDS)
    if not _ANCHOR.ready(words):
        raise SealedUnreachable(f"shared memory {anchor.name} is not a ready sealed-memory "
                                f"anchor")
    pid, number = words[OWNER_PID], words[_A_FD]
    path = f"/proc/{pid}/fd/{number}"
    try:
        return _check(_open_proc(path, flags), anchor.name, path, words)
    except SealedUnreachable as exc:
        first = str(exc)
    where = memfd_server.socket_path(words[_A_SERVER]) if words[_A_SERVER] > 0 else \
        "its creator's socket"
    try:
        fd = memfd_server.fetch(anchor.name, words[_A_SERVER])
        if flags & os.O_ACCMODE != os.O_RDWR:  # the creator's is read-write: reopen as asked
            fd = _reopen(fd, flags)
        return _check(fd, anchor.name, where, words)
    except (OSError, SealedUnreachable) as exc:
        second = str(exc)
    raise SealedUnreachable(
        f"shared memory {anchor.name}: cannot reach its memory: {first}; nor through "
        f"{where}: {second}. Its creator (pid {pid} in its own pid namespace) is gone, or "
        f"this process shares neither its pid namespace nor its ipc directory "
        f"(FD_SYNC_IPC_DIR; containers: share the ipc directory, or run them in one pid "
        f"namespace, e.g. --pid=host or --pid=container:<engine>), or runs as another "
        f"uid. Or start the engine with FD_SYNC_SHM_RING_KB=0 and FD_SYNC_SHM_POOL_MB=0: "
        f"batches then travel over the socket") from None


def _open_proc(path: str, flags: int) -> int:
    """``path`` (``/proc/<pid>/fd/<n>``) opened; ``SealedUnreachable`` saying why not."""
    try:
        return os.open(path, flags | os.O_CLOEXEC)
    except OSError as exc:
        raise SealedUnreachable(
            f"{path} does not open ({os.strerror(exc.errno) if exc.errno else exc}: another "
            f"pid namespace, a creator gone, or one made non-dumpable)") from None


def _reopen(fd: int, flags: int) -> int:
    """A new open file description of ``fd`` with ``flags``; ``fd`` is closed."""
    try:
        return os.open(f"/proc/self/fd/{fd}", flags | os.O_CLOEXEC)
    finally:
        os.close(fd)


def _check(fd: int, name: str, where: str, words) -> int:
    """``fd`` if it is the memfd the anchor ``words`` record (inode, device, size), of this
    uid and sealed against shrinking; else closed, and ``SealedUnreachable``."""
    ino, dev, size = words[_A_INO], words[_A_DEV], words[_A_SIZE]
    try:
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if ((st.st_ino, st.st_dev, st.st_size) != (ino, dev, size) or st.st_uid != os.geteuid()
                or not seals & fcntl.F_SEAL_SHRINK):
            raise SealedUnreachable(
                f"{where} is not the sealed memory {name} records (inode {st.st_ino}, "
                f"{st.st_size} bytes, uid {st.st_uid}, seals {seals:#x}; expected inode "
                f"{ino}, {size} bytes, uid {os.geteuid()}, F_SEAL_SHRINK): its creator is "
                f"gone and the pid was reused, or another process wrote the anchor")
    except OSError as exc:  # F_GET_SEALS on a file that is no memfd
        os.close(fd)
        if exc.errno in (errno.EINVAL, errno.EBADF):
            raise SealedUnreachable(f"{where} is not a memfd") from None
        raise
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_sealed(name: str, flags: int) -> int:
    """A new descriptor (``flags``: ``O_RDWR`` or ``O_RDONLY``) of the sealed memfd that
    anchor ``name`` names, checked (``open_memfd``); the anchor is read once and closed.
    ``FileNotFoundError`` if there is no anchor, ``PermissionError`` if another uid owns
    it, ``SealedUnreachable`` as ``open_memfd``. Never blocks, but for the creator's socket
    when ``/proc`` does not reach it (at most ``memfd_server.FETCH_TIMEOUT_S``)."""
    anchor = Segment.attach(name)
    try:
        return open_memfd(anchor, flags)
    finally:
        anchor.close()  # read once: nothing here depends on it any more


def read_sealed(name: str, nbytes: int):
    """The first ``nbytes`` of the sealed memory anchor ``name`` names, read with
    ``pread`` (nothing mapped), or None if there is none this process can open. Blocks
    only as ``open_sealed``."""
    try:
        fd = open_sealed(name, os.O_RDONLY)
    except (SealedUnreachable, OSError):  # none, another uid's, unreachable
        return None
    try:
        return os.pread(fd, nbytes, 0)
    finally:
        os.close(fd)

