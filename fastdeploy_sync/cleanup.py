"""Names left behind by processes that exited without closing: find them, remove them.

A ``TaskQueue``, ``TaskClient`` or FastDeploy drop-in object removes its names when it is
closed or garbage-collected, and at normal interpreter exit (weakref finalizers). A
process killed by SIGKILL, or by SIGTERM's default action, runs none of that and leaves
the names ``names`` lists (segments and semaphores in ``/dev/shm``, socket files in the
private ipc directory).

The next run of the same name reclaims them; ``scan()`` and ``remove()`` (behind
``fastdeploy-sync clean``) do it on request. Both only ever touch names owned by this
process's effective uid, and never a name whose owner is alive:

  * a segment's owner is alive according to ``owner_alive()`` (the one place that decides
    it here): the owner lock its creator holds for its life (``shm.segment.owner_alive``),
    not the pid it recorded, which another process may have reused or which may belong to
    another pid namespace sharing ``/dev/shm`` (a sidecar container). A large batch's own
    segment carries no lock: it lives while the engine of its queue holds the queue's ack
    board's owner lock (its creator's pid is in its name, for people only). A segment
    nobody holds whose owner is not written yet is taken as being created while it is
    younger than ``CREATING_GRACE_S``;
  * a semaphore lives and dies with its segment (a semaphore without one is left by a
    killed run: its creator makes the segment first and unlinks it first);
  * a socket file is in use while a process accepts connections on it (a sealed-memory
    server's, ``fdsync-memfd.*.ipc``, belongs to a process, not a queue: only a scan of
    every name, without a queue name, lists it).

Another user's names are reported, never opened or removed, and nothing is judged through
a symlink (``lstat``; a symlink among the names, whoever planted it, is "not ours"). A name
this process may not check or remove (an unprivileged user) is left alone with a one-line
note; one such name never stops the others. A name is checked again just before it is
removed, but a process of the same name can still start in between and reclaim it first:
run ``clean`` while nothing of that name is starting.

Also here: ``install_signal_cleanup()``, for a process that wants SIGTERM to remove its
names too (a library must not take over signals by default, so nothing installs it).
"""

import os
import signal
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable, Optional

from . import envs, names
from .shm.segment import owner_alive as lock_owner_alive
from .shm.segment import segment_owner, unlink_segment
from .shm.semaphores import unlink_semaphore
from .wire.endpoints import check_private_dir, ipc_listener_alive, unlink_quietly, validate_name

__all__ = ["Leftover", "scan", "remove", "owner_alive", "install_signal_cleanup",
           "CREATING_GRACE_S"]

_SHM_DIR = names.SHM_DIR

# A segment whose owner slot is still 0 is between its creator's create and its first
# write (microseconds), or was left by a creator killed right there. Leave it alone for
# this long after its last change.
CREATING_GRACE_S = 60.0


@dataclass
class Leftover:
    """One name found by ``scan()``.

    ``state`` is ``"stale"`` (its owner exited: ``remove()`` may take it), ``"in use"`` (a
    live owner, or being created), or ``"not ours"`` (another uid owns it; never touched).
    ``why`` says how that was decided, for people. ``name`` is None for a name of a
    process rather than of a queue (a sealed-memory server's socket)."""
    path: str
    kind: str
    name: str
    dp_id: int
    state: str
    why: str

    @property
    def stale(self) -> bool:
        return self.state == "stale"


def owner_alive(path: str, pid: int, locked: bool = True) -> bool:
    """Whether the process that owns shared-memory file ``path`` (of our uid) is alive.
    Never blocks. A pid proves nothing either way (reused by an unrelated process, or from
    another pid namespace sharing ``/dev/shm``): only locks do.

    The one place ``scan()`` and ``remove()`` decide it for segments, and so for their
    semaphores. A segment with an owner lock (``locked``: every kind but a large batch's
    own segment) is alive while some process holds that lock. Nobody holding it and
    ``pid`` 0 (not written yet): alive while the file changed within ``CREATING_GRACE_S``
    (being created), stale after. A large batch's own segment (``locked=False``) is alive
    while the engine of its queue holds its ack board's owner lock (an engine reclaims its
    dead predecessors' batches when it starts)."""
    if not locked:
        return _queue_engine_alive(path)
    try:
        if lock_owner_alive("/" + os.path.basename(path)):
            return True
    except FileNotFoundError:
        return False
    if pid != 0:
        return False
    try:
        return time.time() - os.stat(path).st_mtime < CREATING_GRACE_S
    except FileNotFoundError:
        return False


def _queue_engine_alive(path: str) -> bool:
    """True while a live engine holds the ack board of the queue a large batch's file
    ``path`` belongs to. Another user's board, which we may not open, counts as alive:
    never remove on a guess."""
    parsed = names.parse_shm_entry(os.path.basename(path))
    if parsed is None:
        return False
    try:
        return lock_owner_alive(names.ack_board(parsed.name, parsed.dp_id))
    except FileNotFoundError:
        return False
    except PermissionError:
        return True


def scan(name: Optional[str] = None, dp_id: Optional[int] = None) -> list:
    """Every fastdeploy_sync name in ``/dev/shm`` and in the ipc directory
    (``envs.ipc_dir()``), optionally only queue ``name`` (and DP group ``dp_id``), each with
    its state. Reads only: opens segments of our uid read-only to find their owner, probes
    socket files with a connect (at most 1 s each). ``ValueError`` for an invalid name."""
    if name is not None:
        validate_name(name, 0 if dp_id is None else dp_id)
    found = []
    segments = {}
    try:
        entries = sorted(os.listdir(_SHM_DIR))
    except FileNotFoundError:
        entries = []
    parsed = [(entry, names.parse_shm_entry(entry)) for entry in entries]
    for entry, m in parsed:
        if m is not None and not m.semaphore and _wanted(m, name, dp_id):
            item = _judged(_segment, entry, m)
            segments[entry] = item
            found.append(item)
    for entry, m in parsed:
        if m is not None and m.semaphore and _wanted(m, name, dp_id):
            found.append(_judged(_semaphore, entry, m, segments))
    found.extend(_sockets(name, dp_id))
    return found


def _judged(judge: Callable[..., Leftover], entry: str, m: names.Parsed, *args: Any) -> Leftover:
    """``judge(entry, m, *args)``, or, when a check this process may not make fails (a
    file it may not open, a socket it may not probe...), the name kept ("in use") with
    why: never removed on a guess, and one name never stops the scan."""
    try:
        return judge(entry, m, *args)
    except OSError as exc:
        path = entry if os.path.isabs(entry) else f"{_SHM_DIR}/{entry}"  # a socket file
        return Leftover(path, m.kind, m.name, m.dp_id, "in use",
                        f"could not check it ({exc.strerror or exc}): left alone")


def remove(items: Iterable[Leftover]) -> list:
    """Remove the stale ones among ``items`` (from ``scan()``), each checked again first;
    returns the ``Leftover``s removed. Never blocks beyond a 1 s socket probe each; a name
    that vanished meanwhile is skipped."""
    removed = []
    for item in items:
        if not item.stale:
            continue
        try:
            again = _recheck(item)
            if again is None or not again.stale:
                continue
            if item.kind in names.SEMAPHORE_KINDS:
                gone = unlink_semaphore("/" + os.path.basename(item.path)[len("sem."):])
            elif item.path.startswith(_SHM_DIR + "/"):
                gone = unlink_segment("/" + os.path.basename(item.path))
            else:
                unlink_quietly(item.path)
                gone = True
        except OSError as exc:  # e.g. an unprivileged user and a name it may not remove
            item.why = f"{item.why}; could not remove it ({exc.strerror or exc}): left alone"
            continue
        if gone:
            removed.append(item)
    return removed


def describe(item: Leftover) -> str:
    """One line for people: path, what it is, and why it is stale or kept."""
    what = names.KINDS.get(item.kind, item.kind)
    if item.name is None:  # a process's, not one queue's (a sealed-memory server)
        return f"{item.path}  ({what}: {item.why})"
    return f"{item.path}  ({what} of {item.name!r} dp {item.dp_id}: {item.why})"


def _wanted(m: names.Parsed, name: Optional[str], dp_id: Optional[int]) -> bool:
    return (name is None or m.name == name) and (dp_id is None or m.dp_id == dp_id)


def _not_ours(st: os.stat_result) -> str:
    return f"owned by uid {st.st_uid}, not {os.geteuid()}: left alone"


def _ours(item: Leftover, is_type: Callable[[int], bool]) -> bool:
    """True if ``item.path`` is a file of our uid and of the type ``is_type`` accepts
    (``stat.S_ISREG``, ``stat.S_ISSOCK``); else sets ``item.state`` ("gone" or "not ours",
    with why) and returns False. Never follows a symlink."""
    try:
        st = os.lstat(item.path)
    except FileNotFoundError:
        item.state, item.why = "gone", "removed meanwhile"
        return False
    if st.st_uid != os.geteuid():
        item.state, item.why = "not ours", _not_ours(st)
        return False
    if stat.S_ISLNK(st.st_mode):
        item.state, item.why = "not ours", "a symlink: never followed, left alone"
        return False
    if not is_type(st.st_mode):
        wanted = "socket" if is_type is stat.S_ISSOCK else "regular file"
        item.state, item.why = "not ours", f"not a {wanted}: left alone"
        return False
    return True


def _segment(entry: str, m: names.Parsed) -> Leftover:
    path = f"{_SHM_DIR}/{entry}"
    item = Leftover(path, m.kind, m.name, m.dp_id, "in use", "")
    if not _ours(item, stat.S_ISREG):
        return item
    if m.pid is not None:
        owner = m.pid
    else:
        try:
            owner = segment_owner("/" + entry)
        except (PermissionError, FileNotFoundError) as exc:
            item.state, item.why = "not ours", str(exc)
            return item
    try:
        alive = owner_alive(path, owner, locked=m.locked)
    except PermissionError as exc:
        item.state, item.why = "not ours", str(exc)
        return item
    if m.pid is not None:
        lock = "its lock" if m.locked else "its queue's engine lock"
        item.why = (f"owner (engine pid {owner} where it started) holds {lock}" if alive else
                    f"owner (engine pid {owner} where it started) exited: nobody holds {lock}")
    elif owner == 0:
        item.why = "owner not written yet: being created" if alive else "owner never written"
    else:
        item.why = (f"owner (pid {owner} where it started) holds its lock" if alive else
                    f"owner (pid {owner} where it started) exited: nobody holds its lock")
    if not alive:
        item.state = "stale"
    return item


def _semaphore(entry: str, m: names.Parsed, segments: dict) -> Leftover:
    path = f"{_SHM_DIR}/{entry}"
    item = Leftover(path, m.kind, m.name, m.dp_id, "in use", "")
    if not _ours(item, stat.S_ISREG):  # lstat: a symlink planted here is never followed
        return item
    seg = segments.get(m.segment)
    if seg is None:
        item.state, item.why = "stale", f"its segment {m.segment} is gone"
    elif seg.state == "stale":
        item.state, item.why = "stale", f"its segment's {seg.why}"
    elif seg.state == "not ours":
        item.state, item.why = "not ours", f"its segment is {seg.why}"
    else:
        item.why = f"its segment's {seg.why}"
    return item


def _sockets(name: Optional[str], dp_id: Optional[int]) -> list:
    directory = envs.ipc_dir()
    try:
        check_private_dir(directory)
        entries = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    except PermissionError as exc:
        # Not our private directory: what is in it is not ours to judge or remove.
        return [Leftover(directory, "directory", name or "*", dp_id or 0, "not ours", str(exc))]
    found = []
    for entry in entries:
        m = names.parse_socket_entry(entry)
        if m is not None and _wanted(m, name, dp_id):
            found.append(_judged(_socket, os.path.join(directory, entry), m))
    return found


def _socket(path: str, m: names.Parsed) -> Leftover:
    item = Leftover(path, m.kind, m.name, m.dp_id, "in use", "")
    if not _ours(item, stat.S_ISSOCK):
        return item
    if ipc_listener_alive(path):
        item.why = "a process listens on it"
    else:
        item.state, item.why = "stale", "nobody listens on it"
    return item


def _recheck(item: Leftover) -> Optional[Leftover]:
    """``item`` scanned again (None if it is gone)."""
    base = os.path.basename(item.path)
    if item.kind in names.SEMAPHORE_KINDS:
        m = names.parse_shm_entry(base)
        segments = {}
        if os.path.lexists(f"{_SHM_DIR}/{m.segment}"):
            segments[m.segment] = _segment(m.segment, names.parse_shm_entry(m.segment))
        if not os.path.lexists(item.path):
            return None
        again = _semaphore(base, m, segments)
        return None if again.state == "gone" else again
    if item.path.startswith(_SHM_DIR + "/"):
        again = _segment(base, names.parse_shm_entry(base))
    else:
        again = _socket(item.path, names.parse_socket_entry(base))
    return None if again.state == "gone" else again


# -- SIGTERM: leave through normal interpreter shutdown -------------------------------------

def install_signal_cleanup(signals: Iterable[int] = (signal.SIGTERM,)) -> Callable[[], None]:
    """Make the given signals (default SIGTERM; add ``signal.SIGINT`` if wanted) end this
    process through normal interpreter shutdown, so that every ``TaskQueue``,
    ``TaskClient`` and drop-in object removes its shared memory and socket files (their
    ``close()`` runs when ``with`` blocks unwind, their finalizers at exit).

    Call it from the main thread (Python runs signal handlers there only), once your own
    handlers, if any, are installed: a handler installed before is chained (called first;
    if it returns, the process then exits). On the signal, the handler raises
    ``SystemExit(128 + signum)`` in the main thread: ``finally`` blocks and ``with`` exits
    run, then atexit. A main thread blocked in a C call that does not return to Python
    (a long native computation) delays the exit until it returns.

    Returns a function that restores the previous handlers. Nothing in fastdeploy_sync
    installs this by itself."""
    previous: dict = {}

    def handler(signum: int, frame: Optional[FrameType]) -> None:
        before = previous.get(signum)
        if callable(before):
            before(signum, frame)
        raise SystemExit(128 + signum)

    for signum in signals:
        previous[signum] = signal.signal(signum, handler)

    def restore() -> None:
        for signum, before in previous.items():
            signal.signal(signum, before if before is not None else signal.SIG_DFL)

    return restore
