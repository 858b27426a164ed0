"""This node's processes that use the drop-in, as ``fastdeploy-sync status`` lists them.

A process that took the swap (``install``: FastDeploy's class replaced) or holds an
``EngineWorkerQueue`` whose role is decided keeps one record in the private ipc directory
(``FD_SYNC_IPC_DIR``, under ``dropin/``): its pid, command line, the run it belongs to
(``fastdeploy-sync run`` sets ``FD_SYNC_RUN`` to the command's pid), whether it took the
swap, and each live queue's address, name, role, client id and DP group. A record is two
files, ``<pid>-<token>.json`` (replaced whole, so a reader never sees half of one) and
``<pid>-<token>.lock``, which the process holds locked (``lockf``) for its life: a record
whose lock is free belongs to a process that exited, whatever its pid says now (pids are
reused, and a container sharing the directory sees other pids). The process removes both at
exit; a killed one's are removed by the next process that writes a record, or by
``fastdeploy-sync clean`` (``prune``).

Under ``fastdeploy-sync run`` a process that takes the swap also says so, once, on stderr.

Writing a record is off every step's path: at the swap and when a queue's role is decided
(``Role``). It never raises: a record that cannot be written is logged once, and the queue
works without it. A forked child keeps nothing of its parent's record: it writes its own
when it takes a role.
"""

import atexit
import errno
import fcntl
import json
import logging
import os
import secrets
import sys
import threading
import weakref
from typing import Optional

from .. import envs, names
from ..wire.endpoints import private_dir

__all__ = ["Role", "took_dropin", "scan", "prune", "RUN_ENV", "records_dir"]

log = logging.getLogger(__name__)

RUN_ENV = "FD_SYNC_RUN"
_SUFFIX_JSON, _SUFFIX_LOCK = ".json", ".lock"


def records_dir() -> str:
    """Where the records live (computed; created by the first process that writes one)."""
    return names.dropin_records(envs.ipc_dir())


def _command_line() -> list:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            words = f.read().split(b"\0")
        return [os.fsdecode(w) for w in words if w]
    except OSError:
        return [sys.executable] + sys.argv


class _Record:
    """This process's record (one per process; see the module docstring)."""

    def __init__(self):
        self.lock = threading.Lock()
        self._reset()

    def _reset(self):
        self.pid = None  # the pid the files were made for; None: none made yet
        self.stem = None
        self.lock_fd = None
        self.swapped = False
        self.queues = []  # weak references to the queues with a decided role
        self.failed = False

    def after_fork_in_child(self):
        self.lock = threading.Lock()  # another thread may have held it at fork
        if self.lock_fd is not None:
            try:
                os.close(self.lock_fd)  # the parent's lockf lock is the parent's: not ours
            except OSError:
                pass
        swapped = self.swapped  # the child runs the swapped code it inherited
        self._reset()
        self.swapped = swapped

    def _open(self, directory):
        private_dir(envs.ipc_dir())
        private_dir(directory)
        _prune(directory)
        stem = os.path.join(directory, f"{os.getpid()}-{secrets.token_hex(4)}")
        fd = os.open(stem + _SUFFIX_LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                     0o600)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            os.unlink(stem + _SUFFIX_LOCK)
            raise
        self.pid, self.stem, self.lock_fd = os.getpid(), stem, fd

    def write(self) -> None:
        """Write the record as it stands now. Caller holds ``self.lock``."""
        if self.failed:
            return
        try:
            if self.pid != os.getpid():
                self._open(records_dir())
            queues = []
            alive = []
            for ref in self.queues:
                queue = ref()
                if queue is not None and queue.role is not None:
                    alive.append(ref)
                    # getattr: a role may be set before the rest of the queue is
                    queues.append({"address": str(getattr(queue, "address", None)),
                                   "name": getattr(queue, "name", None), "role": queue.role,
                                   "client_id": getattr(queue, "client_id", None),
                                   "dp_id": getattr(queue, "local_data_parallel_id", None)})
            self.queues = alive
            record = {"pid": self.pid, "argv": _command_line(),
                      "run": os.environ.get(RUN_ENV), "swapped": self.swapped,
                      "queues": queues}
            tmp = self.stem + ".tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            os.replace(tmp, self.stem + _SUFFIX_JSON)
        except (OSError, ValueError, TypeError) as exc:
            self.failed = True
            log.warning("fastdeploy_sync: pid %d: cannot record this process for "
                        "'fastdeploy-sync status' in %s (%s); the drop-in works without it",
                        os.getpid(), records_dir(), exc)

    def remove(self) -> None:
        """At exit: remove this process's files (never a parent's: a forked child exiting
        runs the parent's exit handlers too)."""
        with self.lock:
            if self.pid != os.getpid() or self.stem is None:
                return
            for suffix in (_SUFFIX_JSON, _SUFFIX_LOCK, ".tmp"):
                try:
                    os.unlink(self.stem + suffix)
                except OSError:
                    pass
            os.close(self.lock_fd)
            self._reset()


_RECORD = _Record()
os.register_at_fork(after_in_child=_RECORD.after_fork_in_child)
atexit.register(_RECORD.remove)


def took_dropin() -> None:
    """This process swapped FastDeploy's class for the drop-in: record it, and under
    ``fastdeploy-sync run`` say so on stderr (once per process)."""
    with _RECORD.lock:
        if _RECORD.swapped and _RECORD.pid == os.getpid():
            return
        first = not _RECORD.swapped
        _RECORD.swapped = True
        _RECORD.write()
    if first and os.environ.get(RUN_ENV):
        command = " ".join(_command_line())
        print(f"fastdeploy_sync: pid {os.getpid()} took the FastDeploy drop-in "
              f"(fastdeploy.inter_communicator.EngineWorkerQueue is fastdeploy_sync's): "
              f"{command[:300]}", file=sys.stderr, flush=True)


class Role:
    """The ``role`` attribute of ``EngineWorkerQueue``: a plain value (``None``, "server",
    "engine", "worker") whose every decided value updates this process's record. Reading
    it is an instance-dictionary lookup and a call; set once per queue."""

    def __set_name__(self, owner, name):
        self._key = "_" + name + "_value"

    def __get__(self, queue, owner=None):
        if queue is None:
            return self
        return queue.__dict__.get(self._key)

    def __set__(self, queue, value):
        queue.__dict__[self._key] = value
        if value is None:
            return
        with _RECORD.lock:
            if _RECORD.pid != os.getpid():
                _RECORD.queues = []  # a forked child's list is its parent's
            if not any(ref() is queue for ref in _RECORD.queues):
                _RECORD.queues.append(weakref.ref(queue))
            _RECORD.write()


def _held(lock_path) -> bool:
    """Whether a live process holds ``lock_path`` (False for a missing file)."""
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EAGAIN, errno.EACCES)
    else:
        return False  # closing fd drops the lock we just took
    finally:
        os.close(fd)


def _stems(directory):
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted({os.path.join(directory, e[:-len(_SUFFIX_LOCK)])
                   for e in entries if e.endswith(_SUFFIX_LOCK)})


def _prune(directory, dry_run: bool = False) -> int:
    """Remove the records of processes that exited (their lock is free); how many."""
    count = 0
    for stem in _stems(directory):
        if stem != _RECORD.stem and not _held(stem + _SUFFIX_LOCK):
            count += 1
            for suffix in () if dry_run else (_SUFFIX_JSON, ".tmp", _SUFFIX_LOCK):
                try:
                    os.unlink(stem + suffix)
                except OSError:
                    pass
    return count


def prune(directory: Optional[str] = None, dry_run: bool = False) -> int:
    """Remove the records of processes that exited without removing theirs (killed); how
    many (``dry_run``: how many would be). ``fastdeploy-sync clean``; a process writing its
    first record does the same. Never blocks."""
    return _prune(directory or records_dir(), dry_run)


def scan(directory: Optional[str] = None) -> list:
    """The records of the live processes (dicts: ``pid``, ``argv``, ``run``, ``swapped``,
    ``queues``), by pid; this process's own record is read as the others. Reads only;
    never blocks; a record being replaced or unreadable is skipped."""
    directory = directory or records_dir()
    records = []
    for stem in _stems(directory):
        if stem != _RECORD.stem and not _held(stem + _SUFFIX_LOCK):
            continue
        try:
            with open(stem + _SUFFIX_JSON, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("pid"), int):
            records.append(record)
    return sorted(records, key=lambda r: r["pid"])
