"""Large batches copied once per node: out-of-band buffers in node-local shared memory.

Why: over ``ipc://`` every rank receives its own copy of every batch (the engine's
ZeroMQ I/O thread writes it into one unix socket per rank, each worker reads it into its
own message buffer), so a 64 MiB batch to a TP=4 group moves 256 MiB through the kernel
and takes hundreds of ms. A node-local engine instead writes the batch's out-of-band
buffers (the numpy arrays) once into a shared-memory segment; the DATA message carries
the pickle body and a small *reference* frame (segment name, data size, the buffers'
offsets); every rank maps the same bytes read-only and decodes zero-copy. Batches below
``FD_SYNC_SHM_PAYLOAD_MIN_KB`` of out-of-band bytes (default 1 MiB) keep the socket
path: for them a segment's create/map/unlink costs more than the copies it saves
(measured to TP=4 on 2 cores, scripts/bench_large_batches.py: 256 KiB 0.85x the socket
path's speed, 1 MiB 1.1x, 4 MiB 1.3x, 64 MiB 3.4x, 1 GiB to TP=2 5.8x).
``tcp://`` endpoints never use it (ranks on other nodes cannot map this node's memory).

Costs, 64 MiB on these 2-core VMs: the engine's ``put_tasks()`` blocks ~30-35 ms for the
one copy (``pwrite`` into fresh tmpfs pages; copying into a fresh mapping instead took
~65 ms, every page faulting) plus ~4 ms for the checksum of the caller's buffers; each
rank's prefetch thread spends ~10 ms mapping and verifying (GIL released for both).

Names: ``/fdsync.NAME.dpN.b<K>.<engine-pid>`` (``K`` counts the engine's shared
batches), created exclusively with mode 0600. A worker maps only names with its own
queue's prefix, owned by its own uid, whose size matches the reference; then the
payload checksum (``codec.payload_checksum`` over body, offsets and the shared bytes,
computed once by the engine) is verified before anything is unpickled, as for the socket
path.

Lifetime of the memory:
  * the engine unlinks a batch's name as soon as it is no longer retained: every rank
    consumed it (every rank mapped it when it received it), the group was retired, or
    the queue closed; a weakref finalizer unlinks what is left at interpreter exit, and
    the next engine of the same name and dp_id reclaims what a killed engine left
    (``reclaim_stale``: names whose pid is not alive);
  * a name unlinked while mapped stays valid until unmapped: decoded arrays are
    read-only views of the mapping and keep it alive, so an array a rank still holds
    after the engine unlinked the name (after more batches, after close) stays valid and
    unchanged. The memory returns to the system when the name is gone and the last view
    of it, in every process, is garbage.
Writing into a decoded array raises (read-only); ``arr.copy()`` first.
"""

import logging
import mmap
import os
import re
import stat
import struct

import posix_ipc

from .errors import GroupLostError, ProtocolError
from .shm import create_exclusive, pid_alive

__all__ = ["SharedPayload", "MappedPayload", "payload_prefix", "payload_name", "pack_ref",
           "unpack_ref", "map_payload", "reclaim_stale", "REF_MAGIC"]

log = logging.getLogger(__name__)

_SHM_DIR = "/dev/shm"

# The reference frame: magic, layout version, data size, number of (start, length) pairs,
# name length (24 bytes, so the int64 pairs that follow are aligned); then the pairs and
# the name (ascii). A few hundred bytes for a typical batch.
REF_MAGIC = b"FDSH"
_REF_VERSION = 1
_REF = struct.Struct("<4sIQII")
_MAX_NAME = 255  # NAME_MAX of /dev/shm
_MAX_PAIRS = 1 << 16  # codec.MAX_BUFFERS


def payload_prefix(name: str, dp_id: int) -> str:
    """The name prefix of every shared batch of queue ``name``/``dp_id``."""
    return f"/fdsync.{name}.dp{dp_id}.b"


def payload_name(name: str, dp_id: int, number: int, pid: int = None) -> str:
    return f"{payload_prefix(name, dp_id)}{number}.{os.getpid() if pid is None else pid}"


def _name_re(name: str, dp_id: int):
    return re.compile(re.escape(payload_prefix(name, dp_id).lstrip("/")) + r"(\d+)\.(\d+)")


class SharedPayload:
    """The engine's handle on one shared batch: ``name`` and ``size``.

    The engine writes with ``write()`` (``pwrite`` into the segment's file: on the 2-core
    VMs here twice as fast as copying into a fresh mapping, whose every page faults) and
    never maps it, except to decode it again (``map()``)."""

    def __init__(self, name: str, size: int, fd: int):
        self.name, self.size = name, size
        self._fd = fd
        self._released = False

    @classmethod
    def create(cls, name: str, size: int) -> "SharedPayload":
        """Create segment ``name`` of ``size`` (> 0) zero-filled bytes, exclusively, mode
        0600. ``FileExistsError`` if the name exists (never opened nor unlinked here)."""
        if size <= 0:
            raise ValueError(f"shared batch {name}: size {size}, expected > 0")
        shm = create_exclusive(name, size)
        fd = os.dup(shm.fd)  # a plain fd we own; posix_ipc's object can go
        shm.close_fd()
        return cls(name, size, fd)

    def write(self, offset: int, data) -> None:
        """Copy ``data`` (bytes-like) to ``offset``. Blocks for the copy (GIL released)."""
        view = memoryview(data).cast("B")
        if offset < 0 or offset + view.nbytes > self.size:
            raise ValueError(f"shared batch {self.name}: write of {view.nbytes} bytes at "
                             f"{offset} outside its {self.size} bytes")
        done = 0
        while done < view.nbytes:  # one write() moves at most ~2 GiB
            done += os.pwrite(self._fd, view[done:], offset + done)

    def seal(self) -> None:
        """Writing is done: close the file descriptor (the name keeps the memory)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def map(self) -> memoryview:
        """A read-only, zero-copy view of the whole batch (for decoding it again on the
        engine); it keeps its mapping alive after ``release()``."""
        mapping = map_payload(self.name, self.size, self.name)
        return mapping.view

    def release(self) -> None:
        """Unlink the name. Idempotent; never raises for a name already gone. Mappings
        (the ranks' decoded arrays, a ``LostBatch``'s) stay valid until they are garbage."""
        self.seal()
        if not self._released:
            self._released = True
            _unlink(self.name)


def _unlink(name: str) -> bool:
    try:
        posix_ipc.unlink_shared_memory(name)
        return True
    except posix_ipc.ExistentialError:
        return False


def pack_ref(name: str, size: int, offsets: bytes) -> bytes:
    """The reference frame for a shared batch (``offsets``: codec's int64 pairs)."""
    raw = name.encode("ascii")
    return _REF.pack(REF_MAGIC, _REF_VERSION, size, len(offsets) // 16, len(raw)) + offsets + raw


def unpack_ref(frame):
    """``(name, size, offsets)`` from a reference frame, checked by arithmetic only;
    ``offsets`` is a memoryview of the frame. ``ProtocolError`` for anything malformed."""
    buf = memoryview(frame).cast("B")
    if buf.nbytes < _REF.size:
        raise ProtocolError(f"shared-memory reference of {buf.nbytes} bytes, shorter than "
                            f"its {_REF.size}-byte header")
    magic, version, size, pairs, name_len = _REF.unpack_from(buf)
    if magic != REF_MAGIC or version != _REF_VERSION:
        raise ProtocolError(f"shared-memory reference with magic {bytes(magic)!r} version "
                            f"{version}, expected {REF_MAGIC!r} version {_REF_VERSION}")
    if not 0 < pairs <= _MAX_PAIRS or not 0 < name_len <= _MAX_NAME:
        raise ProtocolError(f"shared-memory reference lists {pairs} buffers and a "
                            f"{name_len}-byte name")
    end = _REF.size + pairs * 16
    if buf.nbytes != end + name_len:
        raise ProtocolError(f"shared-memory reference of {buf.nbytes} bytes, its header "
                            f"says {end + name_len}")
    try:
        name = bytes(buf[end:]).decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("shared-memory reference names a non-ascii segment") from None
    return name, size, buf[_REF.size:end]


class MappedPayload:
    """A worker's read-only mapping of one shared batch (``view``: a read-only memoryview).
    Decoded arrays are slices of ``view`` and keep the mapping alive; it is unmapped when
    the last of them is garbage."""

    __slots__ = ("name", "view")

    def __init__(self, name, view):
        self.name, self.view = name, view


def map_payload(name: str, size: int, prefix: str) -> MappedPayload:
    """Map shared batch ``name`` read-only, zero-copy. Never blocks beyond the system calls.

    Refuses (``ProtocolError``), before mapping anything: a name outside ``prefix`` (the
    queue's own batches; a reference cannot point a rank at another segment), a segment
    owned by another uid (another user could otherwise feed it batches), one whose size is
    not ``size``. A name that no longer exists raises ``GroupLostError``: the engine
    releases a batch no rank has mapped only when it retires the group or closes.
    """
    if not name.startswith(prefix) or "/" in name[1:]:
        raise ProtocolError(f"shared-memory reference to {name!r}, outside this queue's "
                            f"batches ({prefix}*)")
    try:
        shm = posix_ipc.SharedMemory(name, read_only=True)
    except posix_ipc.ExistentialError:
        raise GroupLostError(
            f"shared batch {name} is gone before this rank mapped it: the engine retired "
            f"this worker group or closed the queue; restart the group") from None
    except posix_ipc.PermissionsError as exc:
        raise ProtocolError(f"shared batch {name}: this process (uid {os.geteuid()}) may "
                            f"not open it: another user created it") from exc
    try:
        st = os.fstat(shm.fd)  # the object we opened, not a name that may be swapped
        if st.st_uid != os.geteuid():
            raise ProtocolError(
                f"shared batch {name} is owned by uid {st.st_uid}, not by this process's uid "
                f"{os.geteuid()} (mode {oct(stat.S_IMODE(st.st_mode))}): not mapped")
        if st.st_size != size or size <= 0:
            raise ProtocolError(f"shared batch {name} holds {st.st_size} bytes, its "
                                f"reference says {size}")
        mapping = mmap.mmap(shm.fd, size, access=mmap.ACCESS_READ)
    finally:
        shm.close_fd()  # the mapping does not need the fd
    return MappedPayload(name, memoryview(mapping))


def reclaim_stale(name: str, dp_id: int) -> list:
    """Unlink the shared batches of queue ``name``/``dp_id`` left by engines that are no
    longer running (their pid, the last part of the name, is not alive) or by an earlier
    engine of this very process (called before this engine creates any). Segments of
    other uids and of other live processes are left alone. Returns the names removed."""
    pattern = _name_re(name, dp_id)
    me = os.getpid()
    removed = []
    try:
        entries = os.listdir(_SHM_DIR)
    except OSError:
        return removed
    for entry in entries:
        match = pattern.fullmatch(entry)
        if match is None:
            continue
        pid = int(match.group(2))
        if pid != me and pid_alive(pid):
            continue
        try:
            st = os.lstat(f"{_SHM_DIR}/{entry}")
        except FileNotFoundError:
            continue
        if st.st_uid != os.geteuid():
            continue  # not ours to judge, nor to remove
        if _unlink("/" + entry):
            removed.append("/" + entry)
    if removed:
        log.warning("reclaimed %d shared batch(es) of %s dp_id=%d left by exited engine(s): %s",
                    len(removed), name, dp_id, ", ".join(removed[:8]))
    return removed
