"""Names left behind by processes that exited without closing: find them, remove them.

A ``TaskQueue``, ``TaskClient`` or FastDeploy drop-in object removes its names when it is
closed or garbage-collected, and at normal interpreter exit (weakref finalizers). A
process killed by SIGKILL, or by SIGTERM's default action, runs none of that and leaves:

  ``/dev/shm/fdsync.NAME.dpN``            a TP group's segment (rank 0 created it)
  ``/dev/shm/sem.fdsync.NAME.dpN.w<R>``   its per-rank barrier semaphores
  ``/dev/shm/fdsync.NAME.dpN.acks``       the engine's ack board
  ``/dev/shm/fdsync.NAME.dpN.fd``         the drop-in's group board (+ ``sem.….fd.lock``)
  ``/dev/shm/fdsync.NAME.dpN.b<K>.<pid>`` a large batch the engine ``pid`` shared
  ``/dev/shm/fdsync.NAME.dpN.bp<K>.<pid>`` the pool the engine ``pid`` writes them into
  ``/dev/shm/fdsync.NAME.dpN.br<E>.<pid>`` worker group ``E``'s ring of the engine ``pid``
                                          (+ ``sem.….br<E>.<pid>.w<R>``: its wake-ups)
  ``IPC_DIR/fdsync-NAME-dpN.ipc``         the engine's socket file (``.put.ipc``: its
                                          producer endpoint; ``.side.ipc``: the drop-in
                                          server's side channels)

The next run of the same name reclaims them; ``scan()`` and ``remove()`` (behind
``fastdeploy-sync clean``) do it on request. Both only ever touch names owned by this
process's effective uid, and never a name whose owner is alive:

  * a segment's owner is alive according to ``owner_alive()`` (the one place that decides
    it here): the owner lock its creator holds for its life (``shm.owner_alive``), not the
    pid it recorded, which another process may have reused or which may belong to another
    pid namespace sharing ``/dev/shm`` (a sidecar container); a shared batch or pool (its
    creator's pid is in its name, for people only) while the engine of its queue holds
    the queue's ack board's owner lock, or, for a pool, the pool's own ``flock``; a
    segment nobody holds whose owner is not written yet is taken as being created while
    it is younger than ``CREATING_GRACE_S``;
  * a semaphore lives and dies with its group segment (a semaphore without one is left by
    a killed run: its creator makes the segment first and unlinks it first);
  * a socket file is in use while a process accepts connections on it.

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
import re
import signal
import stat
import time
from dataclasses import dataclass

from . import envs
from .ack_board import B_OWNER_PID
from . import payload_shm, shm
from .shm import segment_owner, unlink_segment, unlink_semaphore
from .tp_group import H_OWNER_PID
from .transport import check_private_dir, ipc_listener_alive, unlink_quietly, validate_name

__all__ = ["Leftover", "scan", "remove", "owner_alive", "install_signal_cleanup",
           "CREATING_GRACE_S"]

_SHM_DIR = "/dev/shm"

# A segment whose owner slot is still 0 is between its creator's create and its first
# write (microseconds), or was left by a creator killed right there. Leave it alone for
# this long after its last change.
CREATING_GRACE_S = 60.0

# fdsync.NAME.dpN[.acks|.fd|.b<K>.<pid>|.bp<K>.<pid>|.br<E>.<pid>]; NAME may contain dots:
# the greedy NAME takes the last ".dpN" that a known suffix follows.
_SEGMENT_RE = re.compile(r"\Afdsync\.(?P<name>.+)\.dp(?P<dp>\d+)"
                         r"(?P<kind>|\.acks|\.fd|\.b(?P<ring>r)?p?\d+\.(?P<pid>\d+))\Z")
_SEMAPHORE_RE = re.compile(r"\Asem\.fdsync\.(?P<name>.+)\.dp(?P<dp>\d+)"
                           r"(?P<kind>\.w\d+|\.fd\.lock|(?P<ring>\.br\d+\.\d+)\.w\d+)\Z")
_SOCKET_RE = re.compile(r"\Afdsync-(?P<name>.+)-dp(?P<dp>\d+)(?P<kind>|\.put|\.side)\.ipc\Z")

_KINDS = {"": "TP group segment", ".acks": "engine ack board", ".fd": "drop-in group board",
          ".put": "engine producer socket", "socket": "engine socket",
          ".side": "drop-in side channels socket",
          "payload": "shared batch", "semaphore": "barrier semaphore",
          ".fd.lock": "drop-in board lock", "ring": "worker group's batch ring",
          "ring semaphore": "ring wake-up semaphore"}
# int64 slot of the owner pid in each segment kind (payload segments carry it in the name)
# (the drop-in board's slot 1 is fastdeploy.py's _B_OWNER_PID: that module sits above this one)
_OWNER_SLOT = {"": H_OWNER_PID, ".acks": B_OWNER_PID, ".fd": 1}


@dataclass
class Leftover:
    """One name found by ``scan()``.

    ``state`` is ``"stale"`` (its owner exited: ``remove()`` may take it), ``"in use"`` (a
    live owner, or being created), or ``"not ours"`` (another uid owns it; never touched).
    ``why`` says how that was decided, for people."""
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
    semaphores. A segment with an owner lock (``locked``: TP group, ack board, drop-in
    board) is alive while some process holds that lock. Nobody holding it and ``pid`` 0
    (not written yet): alive while the file changed within ``CREATING_GRACE_S`` (being
    created), stale after. A shared batch, pool or ring (``locked=False``: ``path`` is
    ``.../fdsync.NAME.dpN.b...``): alive while the engine of queue NAME/dpN holds its ack
    board's owner lock (an engine reclaims its dead predecessors' batches when it starts),
    or the pool's own ``flock`` (``payload_shm.pool_locked``)."""
    if not locked:
        return _queue_engine_alive(path) or payload_shm.pool_locked(path)
    try:
        if shm.owner_alive("/" + os.path.basename(path)):
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
    """True while a live engine holds the ack board of the queue a shared batch or pool
    file ``path`` belongs to (its name without the ``.b...`` suffix). Another user's
    board, which we may not open, counts as alive: never remove on a guess."""
    m = _SEGMENT_RE.match(os.path.basename(path))
    if m is None:
        return False
    try:
        return shm.owner_alive(f"/fdsync.{m['name']}.dp{m['dp']}.acks")
    except FileNotFoundError:
        return False
    except PermissionError:
        return True


def scan(name: str = None, dp_id: int = None) -> list:
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
    for entry in entries:
        m = _SEGMENT_RE.match(entry)
        if m and _wanted(m, name, dp_id):
            item = _judged(_segment, entry, m)
            segments[entry] = item
            found.append(item)
    for entry in entries:
        m = _SEMAPHORE_RE.match(entry)
        if m and _wanted(m, name, dp_id):
            found.append(_judged(_semaphore, entry, m, segments))
    found.extend(_sockets(name, dp_id))
    return found


def _judged(judge, entry, m, *args) -> Leftover:
    """``judge(entry, m, *args)``, or, when a check this process may not make fails (a
    file it may not open, a socket it may not probe...), the name kept ("in use") with
    why: never removed on a guess, and one name never stops the scan."""
    try:
        return judge(entry, m, *args)
    except OSError as exc:
        if os.path.isabs(entry):  # a socket file
            path, kind = entry, m["kind"] or "socket"
        else:
            path = f"{_SHM_DIR}/{entry}"
            kind = ("semaphore" if entry.startswith("sem.") else
                    "payload" if m.groupdict().get("pid") else m["kind"])
        return Leftover(path, kind, m["name"], int(m["dp"]), "in use",
                        f"could not check it ({exc.strerror or exc}): left alone")


def remove(items) -> list:
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
            if item.kind in ("semaphore", ".fd.lock", "ring semaphore"):
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
    return f"{item.path}  ({_KINDS.get(item.kind, item.kind)} of {item.name!r} dp {item.dp_id}: {item.why})"


def _wanted(m, name, dp_id) -> bool:
    return (name is None or m["name"] == name) and (dp_id is None or int(m["dp"]) == dp_id)


def _not_ours(st) -> str:
    return f"owned by uid {st.st_uid}, not {os.geteuid()}: left alone"


def _ours(item: Leftover, is_type) -> bool:
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


def _segment(entry, m) -> Leftover:
    path = f"{_SHM_DIR}/{entry}"
    kind = "ring" if m["ring"] else "payload" if m["pid"] else m["kind"]
    item = Leftover(path, kind, m["name"], int(m["dp"]), "in use", "")
    if not _ours(item, stat.S_ISREG):
        return item
    if m["pid"]:
        owner = int(m["pid"])
    else:
        try:
            owner = segment_owner("/" + entry, _OWNER_SLOT[m["kind"]])
        except (PermissionError, FileNotFoundError) as exc:
            item.state, item.why = "not ours", str(exc)
            return item
    try:
        alive = owner_alive(path, owner, locked=not m["pid"])
    except PermissionError as exc:
        item.state, item.why = "not ours", str(exc)
        return item
    if m["pid"]:
        lock = "its queue's engine lock" + (" or the pool's lock" if m["kind"].startswith(".bp")
                                            else "")
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


def _semaphore(entry, m, segments) -> Leftover:
    path = f"{_SHM_DIR}/{entry}"
    kind = (".fd.lock" if m["kind"] == ".fd.lock" else "ring semaphore" if m["ring"] else
            "semaphore")
    segment = (f"fdsync.{m['name']}.dp{m['dp']}" + (".fd" if kind == ".fd.lock" else "")
               + (m["ring"] or ""))
    item = Leftover(path, kind, m["name"], int(m["dp"]), "in use", "")
    if not _ours(item, stat.S_ISREG):  # lstat: a symlink planted here is never followed
        return item
    seg = segments.get(segment)
    if seg is None:
        item.state, item.why = "stale", f"its segment {segment} is gone"
    elif seg.state == "stale":
        item.state, item.why = "stale", f"its segment's {seg.why}"
    elif seg.state == "not ours":
        item.state, item.why = "not ours", f"its segment is {seg.why}"
    else:
        item.why = f"its segment's {seg.why}"
    return item


def _sockets(name, dp_id) -> list:
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
        m = _SOCKET_RE.match(entry)
        if m and _wanted(m, name, dp_id):
            found.append(_judged(_socket, os.path.join(directory, entry), m))
    return found


def _socket(path, m) -> Leftover:
    kind = m["kind"] or "socket"
    item = Leftover(path, kind, m["name"], int(m["dp"]), "in use", "")
    if not _ours(item, stat.S_ISSOCK):
        return item
    if ipc_listener_alive(path):
        item.why = "a process listens on it"
    else:
        item.state, item.why = "stale", "nobody listens on it"
    return item


def _recheck(item):
    """``item`` scanned again (None if it is gone)."""
    base = os.path.basename(item.path)
    if item.kind in ("semaphore", ".fd.lock", "ring semaphore"):
        m = _SEMAPHORE_RE.match(base)
        seg_entry = (f"fdsync.{m['name']}.dp{m['dp']}" + (".fd" if item.kind == ".fd.lock" else "")
                     + (m["ring"] or ""))
        segments = {}
        if os.path.lexists(f"{_SHM_DIR}/{seg_entry}"):
            segments[seg_entry] = _segment(seg_entry, _SEGMENT_RE.match(seg_entry))
        if not os.path.lexists(item.path):
            return None
        again = _semaphore(base, m, segments)
        return None if again.state == "gone" else again
    if item.path.startswith(_SHM_DIR + "/"):
        again = _segment(base, _SEGMENT_RE.match(base))
    else:
        again = _socket(item.path, _SOCKET_RE.match(base))
    return None if again.state == "gone" else again


# -- SIGTERM: leave through normal interpreter shutdown -------------------------------------

def install_signal_cleanup(signals=(signal.SIGTERM,)):
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
    previous = {}

    def handler(signum, frame):
        before = previous.get(signum)
        if callable(before):
            before(signum, frame)
        raise SystemExit(128 + signum)

    for signum in signals:
        previous[signum] = signal.signal(signum, handler)

    def restore():
        for signum, before in previous.items():
            signal.signal(signum, before if before is not None else signal.SIG_DFL)

    return restore
