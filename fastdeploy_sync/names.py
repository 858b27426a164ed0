"""Every name this library puts on a node, made and read back in one place.

In ``/dev/shm`` (``SHM_DIR``), for queue NAME and data-parallel group N::

    fdsync.NAME.dpN                a TP group's segment (its rank 0 created it)
    sem.fdsync.NAME.dpN.w<R>       its per-rank barrier semaphores
    fdsync.NAME.dpN.acks           the engine's ack board
    fdsync.NAME.dpN.fd             the FastDeploy drop-in's group board
    sem.fdsync.NAME.dpN.fd.lock    its lock
    fdsync.NAME.dpN.b<K>.<pid>     a large batch of its own, shared by the engine ``pid``
    fdsync.NAME.dpN.bp<K>.<pid>    the pool the engine ``pid`` writes large batches into
    fdsync.NAME.dpN.br<E>.<pid>    worker group ``E``'s batch ring of the engine ``pid``
    sem.fdsync.NAME.dpN.br<E>.<pid>.w<R>   the ring's wake-up semaphores

In the private ipc directory (``envs.ipc_dir()``)::

    fdsync-NAME-dpN.ipc            the engine's socket file
    fdsync-NAME-dpN.put.ipc        its producer endpoint
    fdsync-NAME-dpN.side.ipc       the drop-in server's side channels
    dropin/<pid>-<token>.json      a process that uses the drop-in (``fastdeploy.processes``)
    dropin/<pid>-<token>.lock      held locked by that process while it lives
    fdsync-memfd.T.ipc             a process's sealed-memory server (``shm.memfd_server``;
                                   T: the random token its anchors record, 16 hex digits)

A sealed-memory server belongs to a process, not to one queue: its ``Parsed`` has no
queue name (None) and dp_id 0.

A shared-memory name is what ``posix_ipc`` takes (a leading ``/``, no directory); its file
is ``SHM_DIR`` + the name, and a semaphore's file is ``SHM_DIR/sem.`` + the name without
its ``/`` (glibc's layout). NAME may contain dots: parsing takes the last ``.dpN`` that a
known suffix follows.

``parse_shm_entry`` and ``parse_socket_entry`` read a directory entry back (for
``cleanup`` and ``fastdeploy-sync status``); the ``kind`` they return is one of
``KINDS``' keys.
"""

import os
import re
from typing import Optional

__all__ = ["SHM_DIR", "KINDS", "Parsed", "group_segment", "group_semaphore", "ack_board",
           "dropin_board", "dropin_board_lock", "payload_prefix", "batch_segment", "pool",
           "ring", "ring_semaphore", "socket_file", "dropin_records", "memfd_socket",
           "shm_path", "semaphore_path",
           "parse_shm_entry", "parse_socket_entry", "is_payload_of", "is_ring_semaphore_of",
           "ring_of_semaphore"]

SHM_DIR = "/dev/shm"

# What each kind of name is, for people (``fastdeploy-sync clean``).
KINDS = {"": "TP group segment", ".acks": "engine ack board", ".fd": "drop-in group board",
         ".put": "engine producer socket", "socket": "engine socket",
         ".side": "drop-in side channels socket", "payload": "shared batch",
         "semaphore": "barrier semaphore", ".fd.lock": "drop-in board lock",
         "ring": "worker group's batch ring", "ring semaphore": "ring wake-up semaphore",
         "memfd": "sealed-memory server socket"}
SEMAPHORE_KINDS = ("semaphore", ".fd.lock", "ring semaphore")


def group_segment(name: str, dp_id: int) -> str:
    """The TP group's segment of queue ``name``, DP group ``dp_id``."""
    return f"/fdsync.{name}.dp{dp_id}"


def group_semaphore(name: str, dp_id: int, rank: int) -> str:
    """Rank ``rank``'s barrier semaphore in that group."""
    return f"{group_segment(name, dp_id)}.w{rank}"


def ack_board(name: str, dp_id: int) -> str:
    return f"{group_segment(name, dp_id)}.acks"


def dropin_board(name: str, dp_id: int) -> str:
    return f"{group_segment(name, dp_id)}.fd"


def dropin_board_lock(name: str, dp_id: int) -> str:
    """The drop-in board's lock (a semaphore)."""
    return f"{dropin_board(name, dp_id)}.lock"


def payload_prefix(name: str, dp_id: int) -> str:
    """The prefix of every large batch, pool and ring of the queue (what a rank may map)."""
    return f"{group_segment(name, dp_id)}.b"


def _pid(pid):
    return os.getpid() if pid is None else pid


def batch_segment(name: str, dp_id: int, number: int, pid: Optional[int] = None) -> str:
    """A large batch's own segment, the ``number``-th of engine ``pid`` (default: this
    process)."""
    return f"{payload_prefix(name, dp_id)}{number}.{_pid(pid)}"


def pool(name: str, dp_id: int, number: int, pid: Optional[int] = None) -> str:
    """The ``number``-th large-batch pool of engine ``pid`` (default: this process)."""
    return f"{payload_prefix(name, dp_id)}p{number}.{_pid(pid)}"


def ring(name: str, dp_id: int, epoch: int, pid: Optional[int] = None) -> str:
    """The batch ring of worker group ``epoch`` of engine ``pid`` (default: this process)."""
    return f"{payload_prefix(name, dp_id)}r{epoch}.{_pid(pid)}"


def ring_semaphore(ring_name: str, rank: int) -> str:
    """The semaphore the engine posts for ``rank`` after each publication into the ring."""
    return f"{ring_name}.w{rank}"


def socket_file(name: str, dp_id: int, kind: str = "") -> str:
    """The file name (no directory) of an engine's ipc socket; ``kind``: ``""`` (the
    workers'), ``"put"`` (producers), ``"side"`` (the drop-in's side channels)."""
    return f"fdsync-{name}-dp{dp_id}{'.' + kind if kind else ''}.ipc"


def dropin_records(ipc_dir: str) -> str:
    """The directory, in the private ipc directory ``ipc_dir``, of the records of the
    processes that use the FastDeploy drop-in (``fastdeploy-sync status``)."""
    return os.path.join(ipc_dir, "dropin")


def memfd_socket(token: int) -> str:
    """The file name (no directory) of the sealed-memory server whose anchors record
    ``token`` (a positive 63-bit number)."""
    return f"fdsync-memfd.{token:016x}.ipc"


def shm_path(shm_name: str) -> str:
    """The file of shared-memory name ``shm_name``."""
    return SHM_DIR + shm_name


def semaphore_path(sem_name: str) -> str:
    """The file of semaphore ``sem_name`` (glibc's layout)."""
    return f"{SHM_DIR}/sem.{sem_name.lstrip('/')}"


class Parsed:
    """A name read back: ``kind`` (a key of ``KINDS``), queue ``name``, ``dp_id``, ``pid``
    (the creating engine's, for names that carry one; else None), for a semaphore
    ``segment`` (the ``SHM_DIR`` entry of the segment it belongs to), and ``locked``: a
    segment whose creator holds its owner lock for its life (every one but a large
    batch's own segment, which lives as long as its queue's engine)."""

    __slots__ = ("kind", "name", "dp_id", "pid", "segment", "locked")

    def __init__(self, kind, name, dp_id, pid=None, segment=None, locked=True):
        self.kind, self.name, self.dp_id, self.pid = kind, name, dp_id, pid
        self.segment, self.locked = segment, locked

    @property
    def semaphore(self) -> bool:
        return self.kind in SEMAPHORE_KINDS


_SEGMENT_RE = re.compile(r"\Afdsync\.(?P<name>.+)\.dp(?P<dp>\d+)"
                         r"(?P<kind>|\.acks|\.fd|\.b(?P<ring>r)?(?P<pool>p)?\d+\.(?P<pid>\d+))\Z")
_SEMAPHORE_RE = re.compile(r"\Asem\.fdsync\.(?P<name>.+)\.dp(?P<dp>\d+)"
                           r"(?P<kind>\.w\d+|\.fd\.lock|(?P<ring>\.br\d+\.\d+)\.w\d+)\Z")
_SOCKET_RE = re.compile(r"\Afdsync-(?P<name>.+)-dp(?P<dp>\d+)(?P<kind>|\.put|\.side)\.ipc\Z")
_MEMFD_SOCKET_RE = re.compile(r"\Afdsync-memfd\.[0-9a-f]{16}\.ipc\Z")


def parse_shm_entry(entry: str):
    """A ``Parsed`` for an entry of ``SHM_DIR`` this library makes (a segment or a
    semaphore), None for anything else."""
    m = _SEGMENT_RE.match(entry)
    if m is not None:
        pid = m["pid"]
        kind = "ring" if m["ring"] else "payload" if pid else m["kind"]
        own_batch = kind == "payload" and not m["pool"]
        return Parsed(kind, m["name"], int(m["dp"]), int(pid) if pid else None,
                      locked=not own_batch)
    m = _SEMAPHORE_RE.match(entry)
    if m is None:
        return None
    kind = (".fd.lock" if m["kind"] == ".fd.lock" else "ring semaphore" if m["ring"] else
            "semaphore")
    segment = (f"fdsync.{m['name']}.dp{m['dp']}" + (".fd" if kind == ".fd.lock" else "")
               + (m["ring"] or ""))
    return Parsed(kind, m["name"], int(m["dp"]), segment=segment)


def parse_socket_entry(entry: str):
    """A ``Parsed`` for an entry of the ipc directory this library makes, else None (a
    sealed-memory server's: kind ``"memfd"``, no queue name)."""
    if _MEMFD_SOCKET_RE.match(entry):
        return Parsed("memfd", None, 0)
    m = _SOCKET_RE.match(entry)
    if m is None:
        return None
    return Parsed(m["kind"] or "socket", m["name"], int(m["dp"]))


def is_payload_of(entry: str, name: str, dp_id: int) -> bool:
    """True if ``SHM_DIR`` entry ``entry`` is a large batch, pool or ring of queue
    ``name``/``dp_id`` (of any engine pid)."""
    parsed = parse_shm_entry(entry)
    return (parsed is not None and parsed.kind in ("payload", "ring") and parsed.name == name
            and parsed.dp_id == dp_id)


def is_ring_semaphore_of(entry: str, name: str, dp_id: int) -> bool:
    """True if ``SHM_DIR`` entry ``entry`` is a ring semaphore of queue ``name``/``dp_id``."""
    parsed = parse_shm_entry(entry)
    return (parsed is not None and parsed.kind == "ring semaphore" and parsed.name == name
            and parsed.dp_id == dp_id)


def ring_of_semaphore(entry: str) -> str:
    """The ring (a shared-memory name) a ring semaphore's ``SHM_DIR`` entry belongs to."""
    return "/" + parse_shm_entry(entry).segment
