"""FastDeploy drop-in: ``EngineWorkerQueue`` with FastDeploy's signature, over TaskQueue/TaskClient.

Adopting the library is one import::

    # from fastdeploy.inter_communicator.engine_worker_queue import EngineWorkerQueue
    from fastdeploy_sync.fastdeploy import EngineWorkerQueue

The task path keeps FastDeploy's calls and meaning (``put_tasks``, ``get_tasks``,
``exist_tasks``, ``num_tasks``, ``set_exist_tasks``, ``clear_data``, ``get_server_port``,
``cleanup``, ``read_finish_flag``, ``connected_client_counter``,
``worker_process_tp_barrier``); underneath every DP group is one ``TaskQueue`` (engine)
and one ``TaskClient`` per TP rank (workers), with the prefetch thread, sequence numbers,
heartbeats and CURVE of the core. This module holds no protocol of its own: it maps
FastDeploy's roles and names onto the core, derives ``all_client_read`` and carries
``clear_data()`` as an ordinary batch.

Roles (FastDeploy's constructor arguments do not say which side a client is on):
  * ``is_server=True``: the engine's server. One ``TaskQueue`` per local DP group
    (``local_data_parallel_size`` of them), each with ``num_client`` TP ranks.
  * ``is_server=False`` in the process that built the server for the same address: the
    engine's producer (FastDeploy's ``client_id=0`` instance in ``start_queue_service``);
    it puts into the server's queue of group ``local_data_parallel_id`` directly.
  * ``is_server=False`` anywhere else: TP rank ``client_id`` of DP group
    ``local_data_parallel_id``, a ``TaskClient`` (``external_barrier=True`` on one node).
  * ``is_server=False`` with ``role="engine"`` (or ``FD_SYNC_QUEUE_ROLE=engine`` in that
    process's environment) in another process of the server's node (FastDeploy's
    per-DP-rank engine processes): a ``TaskProducer`` on the server's queue of group
    ``local_data_parallel_id``, through its node-local producer endpoint. FastDeploy's
    arguments for such a client are the same as a TP rank 0's, so the role must be said:
    without it the client is taken for a worker. Give it the server's ``max_inflight``.
  ``role="engine"`` / ``role="worker"`` overrides the guess.
  The TP ranks of one DP group may share a node (coordination through node-local shared
  memory) or span nodes (through paddle.distributed; see "Across nodes" below); the
  engine may be elsewhere.

Addresses. ``address[0] == "0.0.0.0"`` means one node (FastDeploy's convention): group i
is served on the private ``ipc://`` endpoint of name ``fdq<port>`` and dp_id i (no TCP
port is bound; with port 0 the server reserves a free port number by holding a bound,
unlistening TCP socket on 127.0.0.1 so that two servers never share a name). Any other
host means workers on other machines: group i is served on ``tcp://host:(port + i)``,
so a server with ``local_data_parallel_size=d`` uses ports port..port+d-1 (with port 0,
a free port P is picked first and names the queue, ``fdqP``, as the workers, who know
only the port, derive it; group i binds P + i, which may fail: give a port then).
A unix socket path (FastDeploy's ``FD_ENGINE_TASK_QUEUE_WITH_SHM=1``:
``/dev/shm/fd_task_queue_<port>.sock`` on the engine and the workers) also means one
node: the queue is named ``fdq<port>`` from the number in the file name (so the path and
``("0.0.0.0", port)`` name the same queue), ``fdq-<file name>`` without one; nothing is
created at the path itself (a socket in a world-writable directory could be taken over
by another user: the private ipc directory serves it). Every DP group has its own
endpoint, TP-group shared memory and ack board: groups sharing one address never see
each other's batches or flags.

Security. ``authkey`` is accepted for FastDeploy's signature and not used: ``tcp://``
endpoints authenticate with the library's CURVE keys (``keys_dir=`` or
``FD_SYNC_KEYS_DIR``, made by ``fastdeploy-sync keys DIR``; see ``auth``) and refuse to
start without them unless ``FD_SYNC_INSECURE_TCP=1``; ``ipc://`` endpoints live in a
private 0700 directory. A shared password would add nothing to CURVE and would be one
more secret on the command line.

Step consistency with FastDeploy's own TP barrier (``event_loop_normal``): rank 0's
``exist_tasks()`` latches "take (from, to]" for its next ``get_tasks()`` call number;
the caller's barrier orders that before every rank's call of that number; every rank's
j-th ``get_tasks()`` takes decision j (see ``TaskClient``, ``external_barrier``). So every
rank takes the same batches at the same step provided every rank calls ``get_tasks()``
the same number of times, which FastDeploy's loop does (all ranks call it iff the signal
rank 0 set before the barrier is set). Our ``barrier()`` is not required. The caller's
contract, as in FastDeploy's loop: rank 0 calls ``exist_tasks()`` or ``num_tasks()``
every step before the barrier (either latches; a decision any rank began reading is never
re-latched, so a later ``num_tasks()`` that only reads is harmless), and each step has a second sync point after the signal is read (the model
step's TP collective, or the idle branch's barrier); without the latter rank 0 can set
the next step's signal before a slow rank read this step's, and the loop races on its own
signal. A rank that then calls ``get_tasks()`` more often than rank 0 announced raises
``ProtocolError`` naming the rule and the fix (see ``_GroupBoard.last_reader``).

Across nodes. With an address other than ``0.0.0.0`` and paddle.distributed initialised,
the workers find out with one all_gather at construction whether their TP group's ranks
share a node (``FD_SYNC_TP_COORDINATOR=auto``, the default; ``shm``/``paddle`` force it).
A spanning group follows FastDeploy's ``nnode > 1`` loop: ``read_finish_flag.get()`` is
the step's one paddle all-reduce and returns 1 on every rank iff the group takes a batch
this step (see ``_ReadFinishFlag``, ``_PaddleBoard``).

Pipelining. The engine side's ``exist_tasks()`` is "``put_tasks()`` would wait"
(``num_tasks() >= max_inflight``): FastDeploy's meaning at the default ``max_inflight=1``;
a server built with ``max_inflight=k`` lets FastDeploy's unchanged engine loop put k
batches ahead. The worker loop already takes a list of batches per ``get_tasks()`` in put
order (the last ``bsz`` is the newest allocation), so FastDeploy's scheduler, which
allocates at put time, stays right.

Losing the worker group. The engine side's ``exist_tasks()``/``put_tasks()``/
``num_tasks()`` raise ``GroupLostError`` (ranks, why, ``.unfinished`` batches) within the
heartbeat bound when the group is lost, until a new group is connected (``_GroupWatch``).

Where FastDeploy's semantics are not kept (each would break step consistency or
security, or is not part of the task path):
  * A rank cannot re-read the current batch: ``get_tasks()`` is a take, not a peek; a
    rank calling it more often than its peers gets ``ProtocolError`` (at TP > 1, on its
    next call) instead of diverging.
  * ``exist_tasks()`` is derived, not a stored flag: on the engine, "``max_inflight``
    batches are not yet taken by every rank"; on worker rank 0, "every rank holds a batch
    not yet taken" (a flag read). ``set_exist_tasks(True)`` therefore changes nothing, and
    ``set_exist_tasks(False)`` with batches pending raises ``ValueError`` (use
    ``clear_data()``).
  * ``clear_data()`` on the engine retires the pending batches consistently (below); on
    a worker it drops nothing, since one rank cannot drop without its peers (FastDeploy's
    workers call it after a weight update, after the engine paused and cleared).
  * ``put_tasks()`` does not convert multimodal numpy inputs to paddle tensors
    (FastDeploy's ``to_tensor``/``to_numpy``): arrays travel zero-copy as numpy and are
    read-only on the worker.
  * Only the task path is served: FastDeploy's cache-info, RDMA-connect, finished-request
    and disaggregation channels of the same class raise ``AttributeError`` naming this.

``clear_data()`` (engine side) puts a clear marker through the queue as an ordinary
batch (it may exceed the one-batch bound by one: the marker never waits for room).
Every rank takes the marker in the same ``get_tasks()`` call and drops the batches taken
with it, before it, in that call; batches a rank already took in an earlier call, and
batches put after ``clear_data()``, are delivered. So every rank drops exactly the same
batches, and nothing cleared is ever returned; the engine's ``exist_tasks()`` stays True
until the workers took the marker. ``cleared`` counts, per worker, the batches dropped.
"""

import hashlib
import logging
import os
import re
import socket
import threading
import time
import weakref

from . import envs
from .engine import TaskProducer, TaskQueue
from .errors import ClosedError, GroupLostError, ProtocolError, TaskSyncError
from .liveness import CONNECTED, DISCONNECTED
from .shm import (Segment, SegmentInUse, create_fresh_semaphore, create_reclaiming,
                  open_semaphore, unlink_segment, unlink_semaphore)
from .tp_group import group_shm_name
from .worker import TaskClient

__all__ = ["EngineWorkerQueue"]

log = logging.getLogger(__name__)

SINGLE_NODE_HOST = "0.0.0.0"
# put_tasks() waits for room (FastDeploy: 1 ms sleeps); we start finer and back off to it.
_PUT_POLL_MIN_S = 50e-6
_PUT_POLL_MAX_S = 1e-3

# Servers built in this process, by (host, port): the engine's client instance puts
# through the server's TaskQueue directly.
_SERVERS = {}
_SERVERS_LOCK = threading.Lock()


class _Clear:
    """The marker ``clear_data()`` puts: every rank drops what it takes with it."""

    __slots__ = ("clear_id",)

    def __init__(self, clear_id=0):
        self.clear_id = clear_id

    def __reduce__(self):
        return _Clear, (self.clear_id,)

    def __repr__(self):
        return f"_Clear({self.clear_id})"


# -- the group board: all_client_read and read_finish_flag across a TP group -----------------

_B_MAGIC, _B_OWNER_PID, _B_READY, _B_FLAG, _B_NEXT_CALL, _B_SEALED = range(6)
_B_RING = 8  # calls in flight at once: the caller's barrier bounds the skew to one
_B_RING_BASE = 8
_B_MAGIC_VALUE = 0x46445359_4E434657  # "FDSYNCFW"
_B_CALLS_BASE = _B_RING_BASE + 2 * _B_RING  # then one slot per rank: its get_tasks() calls
_LOCK_TIMEOUT_S = 5.0


class _GroupBoard:
    """Node-local shared memory of one TP group for what FastDeploy decides by a lock.

    ``all_client_read`` must be True on exactly one rank per ``get_tasks()`` call (the last
    reader): that needs an atomic read-modify-write, which plain stores and loads cannot
    give (two ranks finishing together would both see "everyone is done"). A POSIX
    semaphore used as a mutex guards a ring of per-call counters; uncontended it costs two
    futex operations without a syscall, ~1 µs. A rank that dies holding it makes the others
    raise ``TimeoutError`` after 5 s instead of hanging.

    Rank 0 creates the segment and semaphore (reclaiming a crashed run's leftovers) and
    unlinks them at close; other ranks attach, waiting up to ``timeout`` seconds.
    """

    def __init__(self, name, dp_id, tp_size, tp_rank, timeout):
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.shm_name = group_shm_name(name, dp_id) + ".fd"
        self.sem_name = self.shm_name + ".lock"
        self._owner = tp_rank == 0
        self._size = (_B_CALLS_BASE + tp_size) * 8
        if self._owner:
            self._seg = self._create()
        else:
            self._seg = self._attach(timeout)
        try:
            self._sem = open_semaphore(self.sem_name)
        except BaseException:
            self._seg.close()
            raise
        self._view = self._seg.view
        self._finalizer = weakref.finalize(self, _release_board, self._seg, self._sem,
                                           self._owner, self.shm_name, self.sem_name)

    def _create(self):
        try:
            seg = create_reclaiming(self.shm_name, self._size, _B_OWNER_PID)
        except SegmentInUse as exc:
            raise TaskSyncError(f"{exc}: another rank 0 of this address and DP group is "
                                f"running") from None
        create_fresh_semaphore(self.sem_name, initial_value=1)
        v = seg.view
        v[_B_MAGIC], v[_B_OWNER_PID] = _B_MAGIC_VALUE, os.getpid()
        v[_B_READY] = 1  # last: an attacher that sees READY sees the rest
        return seg

    def _attach(self, timeout):
        deadline = time.monotonic() + timeout
        while True:
            try:
                seg = Segment.attach(self.shm_name)
            except FileNotFoundError:
                seg = None
            if seg is not None:
                if (seg.size == self._size and seg.view[_B_READY] == 1
                        and seg.view[_B_MAGIC] == _B_MAGIC_VALUE):
                    return seg
                seg.close()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"rank {self.tp_rank}: {self.shm_name} not created by rank 0 "
                                   f"within {timeout:.1f} s: is rank 0 of this DP group running?")
            time.sleep(0.01)

    def _lock(self):
        try:
            self._sem.acquire(_LOCK_TIMEOUT_S)
        except Exception as exc:  # posix_ipc.BusyError
            raise TimeoutError(f"rank {self.tp_rank}: {self.sem_name} held for "
                               f"{_LOCK_TIMEOUT_S:g} s: a rank died inside get_tasks(); "
                               f"restart the worker group") from exc

    def latch_unless_read(self, call, latch):
        """Rank 0: run ``latch()`` (which writes decision ``call``) unless some rank has
        already begun reading decision ``call``; return its result, or None when refused.

        A decision, once any rank may have read it, never changes: rank 0 may check for
        tasks again after the caller's barrier (FastDeploy logs ``num_tasks()`` there),
        and re-latching then would let a slow rank read a larger decision than a fast
        one. Readers mark the call under the same lock (``last_reader``) before they
        read, so either the latch is seen by every reader or it does not happen."""
        self._lock()
        try:
            if self._view[_B_SEALED] >= call:
                return None
            return latch()
        finally:
            self._sem.release()

    def last_reader(self, call):
        """Count this rank's ``call``-th ``get_tasks()`` (call it before reading the
        decision: it also marks decision ``call`` as read, see ``latch_unless_read``);
        True on exactly one rank per call, the last to count it. Blocks only on a peer
        inside the same few stores.

        Also checks the caller's contract: when a rank makes call j, rank 0's last
        ``exist_tasks()`` announced a call >= j (it runs before the caller's barrier), and
        every other rank has made call j-1 or j. A rank that calls more often than its
        peers raises ``ProtocolError`` on its next call, instead of the group drifting a
        call apart (and later hanging in the caller's barrier). A rank that calls less
        often is caught only when the call counts show it (a peer raises)."""
        slot = _B_RING_BASE + 2 * (call % _B_RING)
        self._lock()
        try:
            v = self._view
            v[_B_CALLS_BASE + self.tp_rank] = call
            calls = [v[_B_CALLS_BASE + r] for r in range(self.tp_size)]
            if call > v[_B_NEXT_CALL]:
                raise ProtocolError(
                    f"TP rank {self.tp_rank} of {self.shm_name}: get_tasks() call {call}, but "
                    f"rank 0 has not checked for tasks for it (its last exist_tasks() or "
                    f"num_tasks() was for call {v[_B_NEXT_CALL]}; the ranks have made {calls} "
                    f"calls). Fix the worker loop: TP rank 0 must call exist_tasks() or "
                    f"num_tasks() (on this queue) every step, before the TP barrier, and set "
                    f"the signal the other ranks read from that result only")
            if max(calls) > call or min(calls) < call - 1:
                raise ProtocolError(
                    f"TP rank {self.tp_rank} of {self.shm_name}: get_tasks() call {call} while "
                    f"the ranks have made {calls} calls: every rank must call get_tasks() at "
                    f"the same steps. Fix the worker loop: every rank calls it iff the signal "
                    f"TP rank 0 set before the TP barrier is set, exactly once per step, and "
                    f"each step has a second sync point after the signal is read (the model "
                    f"step's collective or the idle branch's barrier), so that rank 0 cannot "
                    f"set the next step's signal before every rank read this one")
            if v[_B_SEALED] < call:
                v[_B_SEALED] = call
            if v[slot] != call:
                v[slot], v[slot + 1] = call, 0
            v[slot + 1] += 1
            return v[slot + 1] == self.tp_size
        finally:
            self._sem.release()

    def announce(self, next_call):
        """Rank 0, in ``exist_tasks()``: the call number its next ``get_tasks()`` will have,
        i.e. the highest any rank may make this step (one store)."""
        self._view[_B_NEXT_CALL] = next_call

    def get_flag(self):
        return self._view[_B_FLAG]

    def set_flag(self, value):
        self._view[_B_FLAG] = value

    def close(self):
        self._view = None
        self._finalizer()


_SOCK_PORT_RE = re.compile(r"(\d+)\.sock\Z")
_NAME_UNSAFE_RE = re.compile(r"[^A-Za-z0-9_.-]")


def _parse_address(address):
    """``(host, port, path_name)`` of a FastDeploy queue address: a ``(host, port)`` pair,
    or a unix socket path (FastDeploy's ``FD_ENGINE_TASK_QUEUE_WITH_SHM``:
    ``/dev/shm/fd_task_queue_<port>.sock``), which is node-local by construction. For a
    path, ``host`` is the one-node host, ``port`` the number in ``<port>.sock`` (0 if
    none) and ``path_name`` the file name, safe as a queue name; for a pair it is ''.
    ``ValueError`` for anything else. Nothing is created at the path: the queue's own
    private ipc endpoint serves it (see the module docstring)."""
    if isinstance(address, (str, bytes, os.PathLike)):
        path = os.fsdecode(address)
        base = os.path.basename(path)
        if not base:
            raise ValueError(f"address={address!r}: a unix socket path needs a file name")
        match = _SOCK_PORT_RE.search(base)
        return (SINGLE_NODE_HOST, int(match.group(1)) if match else 0,
                _NAME_UNSAFE_RE.sub("_", base)[:48])
    try:
        host, port = address
        return str(host), int(port), ""
    except (TypeError, ValueError):
        raise ValueError(f"address={address!r}: expected (host, port) or a unix socket "
                         f"path, as FastDeploy passes") from None


def _release_board(seg, sem, owner, shm_name, sem_name):
    try:
        sem.close()
    except Exception:  # already closed
        pass
    seg.close()
    if owner:
        unlink_segment(shm_name)
        unlink_semaphore(sem_name)


class _PaddleBoard:
    """A TP group across nodes (``coordinator="paddle"``): nothing is shared but the
    collective in ``read_finish_flag.get()``, which decides each step for every rank
    (see ``_ReadFinishFlag``). ``all_client_read`` is True on exactly one rank per call,
    TP rank ``tp_size - 1``: all FastDeploy's loop does with it is reset the flag, which
    here is derived afresh at every ``get()`` (knowing the last reader would cost a
    second collective per step)."""

    def __init__(self, tp_size, tp_rank):
        self._last = tp_rank == tp_size - 1

    def last_reader(self, call):
        return self._last

    def latch_unless_read(self, call, latch):
        return latch()  # the next collective decides: no reader can see a change

    def announce(self, next_call):
        pass

    def set_flag(self, value):
        pass

    def close(self):
        pass


class _SoloBoard:
    """TP=1: the only reader is always the last."""

    def __init__(self):
        self._flag = 0

    def last_reader(self, call):
        return True

    def latch_unless_read(self, call, latch):
        return latch()

    def announce(self, next_call):
        pass

    def get_flag(self):
        return self._flag

    def set_flag(self, value):
        self._flag = value

    def close(self):
        pass


# -- the engine side's view of the worker group ----------------------------------------------

_WATCH_EVERY_S = 0.1


class _GroupWatch:
    """Engine side, one per DP group: makes ``exist_tasks()``/``put_tasks()``/``num_tasks()``
    raise ``GroupLostError`` while the worker group the queue served is lost, so that
    FastDeploy's ``while exist_tasks(): sleep(0.001)`` fails loudly instead of spinning.

    Built on the queue's public API only: ``stats()`` (``TaskQueue``) or ``status()``
    (``TaskProducer``, one round trip) every 100 ms while the group is fine (a clock read
    per call otherwise), on every call while it is lost. The group counts as lost when the
    engine retired it (``groups_retired`` grew: a rank's connection gone and not back
    within the heartbeat timeout, a rank's BYE, or ``FD_SYNC_STALL_TIMEOUT`` of silence;
    see ``liveness``), or when a rank has been disconnected for longer than the heartbeat
    timeout whatever the engine decided. It stays lost until a new group has every rank
    connected: batches put meanwhile wait for that group (``put_tasks()`` raises instead
    of waiting). With a ``TaskQueue`` the retirement's ``GroupLost`` event (its
    ``unfinished`` batches) is taken from ``group_events`` and attached to the error."""

    def __init__(self, queue, where, timeout):
        # where(): names the queue in messages (a callable: the port may be known later)
        self._q, self._where, self._timeout = queue, where, timeout
        self._lock = threading.Lock()
        self._next = 0.0
        self._lost = None  # the GroupLostError raised while the group is lost
        self._retired = self._stats().get("groups_retired", 0)

    def _stats(self):
        q = self._q
        return q.stats() if isinstance(q, TaskQueue) else q.status()

    def check(self):
        """Raise ``GroupLostError`` if the group is lost (see the class docstring)."""
        now = time.monotonic()
        if self._lost is None and now < self._next:
            return
        with self._lock:
            self._next = now + _WATCH_EVERY_S
            stats = self._stats()
            ranks = stats.get("ranks") or []
            retired = stats.get("groups_retired", 0)
            if retired > self._retired:
                self._retired = retired
                self._lost = self._error(self._retire_reason(ranks), ranks, self._event())
            elif self._lost is None:
                gone = [r for r in ranks if r["state"] == DISCONNECTED and r["since"]
                        and time.time() - r["since"] > self._timeout]
                if gone:
                    self._lost = self._error(
                        f"rank(s) {[r['rank'] for r in gone]} disconnected for more than the "
                        f"heartbeat timeout ({self._timeout:g} s)", ranks, None)
            if self._lost is not None:
                if stats.get("group") is not None and ranks and all(
                        r["state"] == CONNECTED for r in ranks):
                    log.warning("%s: a new worker group is connected; serving it",
                                self._where())
                    self._lost = None
                    return
                raise self._lost

    def _event(self):
        event = None
        events = getattr(self._q, "group_events", None)
        while events is not None:
            try:
                event = events.get_nowait()
            except Exception:  # queue.Empty
                break
        return event

    @staticmethod
    def _retire_reason(ranks):
        why = [f"rank {r['rank']}: {r['reason']}" for r in ranks if r.get("reason")]
        return "the engine retired the worker group (" + ("; ".join(why) or "see its log") + ")"

    def _error(self, reason, ranks, event):
        states = ", ".join(f"rank {r['rank']} {r['state']}"
                           + (f" ({r['reason']})" if r.get("reason") else "") for r in ranks)
        if event is not None:
            reason = event.reason
        unfinished = list(event.unfinished) if event is not None else []
        err = GroupLostError(
            f"{self._where()}: the TP worker group is lost: {reason}. Ranks: {states}. "
            f"{len(unfinished)} batch(es) it did not finish are in this error's .unfinished "
            f"(re-queue their requests). To recover: restart every TP rank of this DP "
            f"group; once all of them are connected (num_connected_clients()) "
            f"exist_tasks()/put_tasks() work again and batches put then reach the new group")
        err.unfinished, err.event = unfinished, event
        return err


# -- FastDeploy's attribute objects ----------------------------------------------------------

class _ReadFinishFlag:
    """FastDeploy's ``read_finish_flag`` (a manager ``Value``): ``get()`` / ``set(v)``.

    One node (``coordinator == "shm"``): shared by the TP group (node-local shared memory).
    FastDeploy's loop reads it on every rank every step the signal is not set; in sync
    mode (no prefetch thread) ``get()`` also receives what arrived, which keeps ranks
    other than 0 receiving while the loop idles (without it rank 0 would never see every
    rank holding a batch).

    Across nodes (``coordinator == "paddle"``, FastDeploy's ``nnode > 1`` loop, where rank
    0 sets the flag instead of its node-local signal): ``get()`` is the step's one
    paddle.distributed all-reduce (``TaskClient.barrier()``): it returns 1 on every rank
    iff the group takes a batch this step: what rank 0's check latched, as far as every
    rank already holds it. ``set()`` changes nothing (rank 0's ``set(1)`` follows its
    check, which latched; the last reader's ``set(0)`` is implied). Every rank must call
    ``get()`` exactly once per step, as that loop does; a rank calling it more or less
    often than its peers hangs in the collective until gloo's 30 s timeout, then raises
    ``BarrierTimeoutError`` naming the ranks and nodes. Blocks until every rank joined."""

    def __init__(self, owner):
        self._owner = owner

    def get(self):
        owner = self._owner
        if owner.coordinator == "paddle":
            return owner._paddle_step()
        if not owner._client.async_prefetch:
            owner._client.num_tasks()  # receives: see the class docstring
        return int(owner._board.get_flag())

    def set(self, value):
        self._owner._board.set_flag(int(value))  # across nodes: nothing to set, see get()

    value = property(get, set)


class _ConnectedCounter:
    """FastDeploy's ``connected_client_counter``: ``get()`` = TP ranks of this DP group
    connected to the engine now (engine side only)."""

    def __init__(self, owner):
        self._owner = owner

    def get(self):
        return self._owner.num_connected_clients()


class _TPBarrier:
    """FastDeploy's ``worker_process_tp_barrier``: ``wait(timeout=None)`` is the TP group's
    node-local shared-memory barrier (``TaskClient.barrier``), which also raises engine-side
    errors while waiting."""

    def __init__(self, owner):
        self._owner = owner

    def wait(self, timeout=None):
        self._owner._require_worker("worker_process_tp_barrier")
        self._owner._client.barrier(timeout)


# -- the drop-in -----------------------------------------------------------------------------

class EngineWorkerQueue:
    """FastDeploy's ``EngineWorkerQueue`` task path; see the module docstring for roles,
    addresses, security and the differences from FastDeploy.

    ``EngineWorkerQueue(address=("0.0.0.0", 5000), authkey=b"secret_key", is_server=False,
    num_client=1, client_id=-1, local_data_parallel_size=1, local_data_parallel_id=0)``:
    FastDeploy's signature and defaults. Keyword-only extras:

    * ``max_inflight`` (server, default 1): batches put and not yet taken by every rank
      before ``put_tasks()`` blocks. 1 is FastDeploy's one batch at a time; more lets the
      engine put while workers are still taking (our pipelined window).
    * ``connect_timeout`` (worker, default ``FD_SYNC_CONNECT_TIMEOUT`` or 15 s, FastDeploy's
      5 retries x 3 s): how long the constructor waits for the engine to welcome this rank
      before raising ``ConnectionError``.
    * ``name`` (default ``fdq<port>``): the queue name the endpoints and shared memory are
      derived from; engine and workers must agree (the default does).
    * ``role``: ``None`` (guess, see the module docstring), ``"engine"`` or ``"worker"``.
    * ``keys_dir``: CURVE keys for ``tcp://`` (None: ``FD_SYNC_KEYS_DIR``).

    The constructor blocks: a worker until the engine welcomed it (or ``ConnectionError``),
    ranks other than 0 also until their rank 0 exists (``FD_SYNC_ATTACH_TIMEOUT``).
    Threading: the engine side is thread-safe; a worker is used from its event loop thread.
    """

    def __init__(self, address=("0.0.0.0", 5000), authkey: bytes = b"secret_key",
                 is_server: bool = False, num_client: int = 1, client_id: int = -1,
                 local_data_parallel_size: int = 1, local_data_parallel_id: int = 0, *,
                 max_inflight: int = 1, connect_timeout: float = None, name: str = None,
                 role: str = None, keys_dir: str = None):
        host, port, path_name = _parse_address(address)
        # A path (FastDeploy's FD_ENGINE_TASK_QUEUE_WITH_SHM) stays the path: both sides
        # of FastDeploy pass the same string, and it is the key of _SERVERS.
        self.address = os.fspath(address) if path_name else (host, port)
        self._host, self._port, self._path_name = host, port, path_name
        self.authkey = authkey  # not used: see the module docstring (Security)
        self.is_server = bool(is_server)
        self.num_client = num_client
        self.client_id = client_id
        self.local_data_parallel_size = local_data_parallel_size
        self.local_data_parallel_id = local_data_parallel_id
        self.is_single_node = host == SINGLE_NODE_HOST or bool(path_name)
        if type(max_inflight) is not int or max_inflight < 1:
            raise ValueError(f"max_inflight={max_inflight!r}: expected an int >= 1")
        self.max_inflight = max_inflight
        self.cleared = 0  # worker: batches dropped by clear_data() markers
        self._closed = False
        self._server = None  # engine side: the server instance whose queues we use
        self._producer = None  # engine side in another process: a TaskProducer
        self._watches = []  # server: one _GroupWatch per DP group (a producer: its own)
        self._client = None  # worker side
        self._board = None
        self.coordinator = None  # worker: "shm" (one node) or "paddle" (across nodes)
        self._reserved = None  # single node, port 0: the socket holding our port number
        self._queues = []
        self._clear_lock = threading.Lock()
        self._last_put_was_clear = False
        self.read_finish_flag = _ReadFinishFlag(self)
        self.connected_client_counter = _ConnectedCounter(self)
        self.worker_process_tp_barrier = _TPBarrier(self)
        if role not in (None, "engine", "worker"):
            raise ValueError(f"role={role!r}: expected None, 'engine' or 'worker'")
        if not 0 <= local_data_parallel_id < max(1, local_data_parallel_size) and is_server:
            raise ValueError(f"local_data_parallel_id={local_data_parallel_id} is not in "
                             f"[0, {local_data_parallel_size})")

        if self.is_server:
            self.role = "server"
            self._start_server(name, keys_dir)
            return
        if role is None:
            with _SERVERS_LOCK:
                role = "engine" if self.address in _SERVERS else envs.queue_role()
        self.role = role
        if role == "engine":
            with _SERVERS_LOCK:
                server = _SERVERS.get(self.address)
            if server is None:
                # another process of the node owns the server: put through its queue's
                # producer endpoint
                self._name = name or self._default_name()
                wait = envs.connect_timeout_s() if connect_timeout is None else connect_timeout
                self._producer = TaskProducer(self._name, dp_id=local_data_parallel_id,
                                              timeout=float(wait))
                self._watches = [_GroupWatch(self._producer, self._where,
                                             envs.heartbeat_timeout_s())]
                return
            if not 0 <= local_data_parallel_id < len(server._queues):
                raise ValueError(f"local_data_parallel_id={local_data_parallel_id}: the server "
                                 f"at {self.address} serves {len(server._queues)} DP group(s)")
            self._server = server
            self.max_inflight = server.max_inflight
            return
        if not (type(client_id) is int and 0 <= client_id < num_client):
            raise ValueError(f"client_id={client_id!r}, num_client={num_client!r}: a worker "
                             f"needs 0 <= client_id < num_client (its TP rank)")
        self._start_worker(name, keys_dir, connect_timeout)

    # -- construction ------------------------------------------------------------------------

    def _default_name(self, port=None) -> str:
        """The queue name both sides derive from the address (workers know nothing else):
        ``fdq<port>``, or for a path address without a port number in it, ``fdq-<file
        name>``."""
        if self._path_name and self._port == 0:
            return f"fdq-{self._path_name}"
        return f"fdq{self._port if port is None else port}"

    def _start_server(self, name, keys_dir):
        host, port = self._host, self._port
        dp = self.local_data_parallel_size
        if type(dp) is not int or dp < 1:
            raise ValueError(f"local_data_parallel_size={dp!r}: expected an int >= 1")
        try:
            if self.is_single_node and port == 0 and not self._path_name:
                # No TCP port is bound for ipc; hold one so the number (and so the name)
                # is ours alone on this node while the server lives.
                self._reserved = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                self._reserved.bind(("127.0.0.1", 0))
                port = self._reserved.getsockname()[1]
            elif port == 0:
                # the name is derived from the port (workers only know the port): learn a
                # free one first; group i then binds port + i
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                    probe.bind((host, 0))
                    port = probe.getsockname()[1]
            self._name = name or self._default_name(port)
            for i in range(dp):
                if self.is_single_node:
                    endpoint = None
                else:
                    endpoint = f"tcp://{host}:{port + i}"
                # +1: room for a clear_data() marker, which never waits for room; the
                # FastDeploy bound itself is enforced in put_tasks().
                q = TaskQueue(self._name, self.num_client, dp_id=i, endpoint=endpoint,
                              max_inflight=self.max_inflight + 1, keys_dir=keys_dir)
                self._queues.append(q)
                self._watches.append(_GroupWatch(q, lambda i=i: self._where(i),
                                                 q.heartbeat.timeout))
        except BaseException:
            self._close_server(0.0)
            raise
        if not self._path_name:
            self.address, self._port = (host, port), port
        self._server = self
        with _SERVERS_LOCK:
            _SERVERS[self.address] = self
        log.info("EngineWorkerQueue server started at %s: %d DP group(s) x %d TP rank(s) (%s)",
                 self.address, dp, self.num_client,
                 ", ".join(q.endpoint for q in self._queues))

    def _start_worker(self, name, keys_dir, connect_timeout):
        host, port = self._host, self._port
        dp_id = self.local_data_parallel_id
        self._name = name or self._default_name()
        endpoint = None if self.is_single_node else f"tcp://{host}:{port + dp_id}"
        timeout = envs.connect_timeout_s() if connect_timeout is None else float(connect_timeout)
        group = self._choose_coordinator(endpoint or self._name)
        self.coordinator = "shm" if group == "shm" else "paddle"
        if self.coordinator == "paddle":
            from .paddle_group import PaddleTPGroup

            # all_client_read is _PaddleBoard's: the step's collective needs the offer only
            group = PaddleTPGroup(self.num_client, self.client_id,
                                  group=None if group == "paddle" else group,
                                  track_consumed=False)
        self._client = TaskClient(self._name, self.num_client, self.client_id, dp_id=dp_id,
                                  endpoint=endpoint, external_barrier=group == "shm",
                                  coordinator=group, keys_dir=keys_dir)
        try:
            if self.num_client == 1:
                self._board = _SoloBoard()
            elif self.coordinator == "paddle":
                self._board = _PaddleBoard(self.num_client, self.client_id)
            else:
                self._board = _GroupBoard(self._name, dp_id, self.num_client, self.client_id,
                                          envs.attach_timeout_s())
            self._wait_welcome(timeout)
        except BaseException:
            self._client.close()
            if self._board is not None:
                self._board.close()
            raise
        self._calls = 0
        log.info("Connected EngineWorkerQueue client_id: %d (DP group %d) to %s",
                 self.client_id, dp_id, self._client.endpoint)

    def _choose_coordinator(self, where):
        """How this TP group agrees on each step: ``"shm"`` (node-local shared memory), or
        the paddle.distributed group of its ranks (``"paddle"``: the whole world).

        ``FD_SYNC_TP_COORDINATOR`` (default ``auto``): ``shm`` and ``paddle`` force it;
        ``auto`` picks shm at TP=1, for FastDeploy's one-node address ``0.0.0.0`` and when
        this process has not initialised paddle.distributed (then the ranks cannot be
        coordinated across nodes anyway); otherwise every rank of the paddle world tells
        the others its node (``paddle_group.locate_tp_group``, one all_gather at
        construction) and a group whose ranks do not all share a node uses paddle."""
        choice = envs.tp_coordinator(allow_auto=True)
        if self.num_client == 1 or choice == "shm" or (choice == "auto" and self.is_single_node):
            return "shm"
        from . import paddle_group  # imports paddle only inside its functions

        if not paddle_group.paddle_initialized():
            if choice == "paddle":
                raise RuntimeError(f"EngineWorkerQueue rank {self.client_id}: "
                                   f"FD_SYNC_TP_COORDINATOR=paddle needs paddle.distributed "
                                   f"initialised (init_parallel_env()) before the queue")
            return "shm"
        digest = hashlib.blake2b(f"{where}|{self.local_data_parallel_id}".encode(),
                                 digest_size=8).digest()
        key = int.from_bytes(digest, "big") >> 1
        group, spans = paddle_group.locate_tp_group(key, self.num_client, self.client_id,
                                                    force=choice == "paddle")
        log.info("EngineWorkerQueue rank %d (DP group %d): TP ranks %s; coordinating "
                 "through %s%s", self.client_id, self.local_data_parallel_id,
                 "span nodes" if spans else "share this node",
                 "paddle.distributed" if group else "node-local shared memory",
                 " (FD_SYNC_TP_COORDINATOR=paddle)" if group and not spans else "")
        return group or "shm"

    def _paddle_step(self):
        """Across nodes: the step's collective (see ``_ReadFinishFlag``)."""
        self._require_worker("read_finish_flag")
        self._client.barrier()
        return 1 if self._client.step_size() else 0

    def _wait_welcome(self, timeout):
        """Fail fast when the server is absent, as FastDeploy's ``_connect_with_retry``."""
        deadline = time.monotonic() + timeout
        client = self._client
        while client.stats()["engine"] is None:
            # sync mode: the event loop receives the WELCOME; both modes: raises what the
            # engine answered instead (a wrong name, a taken rank...) rather than waiting
            client.num_tasks()
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"EngineWorkerQueue rank {self.client_id} (DP group "
                    f"{self.local_data_parallel_id}) cannot connect to {client.endpoint} "
                    f"(address {self.address}) within {timeout:g} s: is the engine's server "
                    f"(is_server=True) running with this address? (FD_SYNC_CONNECT_TIMEOUT "
                    f"sets the wait)")
            time.sleep(0.005)

    # -- role checks -------------------------------------------------------------------------

    def _queue(self):
        if self._closed:
            raise ClosedError(f"EngineWorkerQueue{self.address} is cleaned up")
        if self._producer is not None:
            return self._producer
        if self._server is None:
            return None
        if self._server._closed:
            raise ClosedError(f"EngineWorkerQueue{self.address}: its server is cleaned up")
        return self._server._queues[self.local_data_parallel_id]

    def _where(self, dp_id=None):
        dp_id = self.local_data_parallel_id if dp_id is None else dp_id
        return f"EngineWorkerQueue{self.address} DP group {dp_id}"

    def _watch(self):
        """Raise GroupLostError if this engine side's worker group is lost."""
        if self._producer is not None:
            self._watches[0].check()
        else:
            self._server._watches[self.local_data_parallel_id].check()

    def _require_worker(self, what):
        if self._closed:
            raise ClosedError(f"EngineWorkerQueue{self.address} is cleaned up")
        if self._client is None:
            raise RuntimeError(f"{what} is a worker-side call: this EngineWorkerQueue is the "
                               f"engine's ({self.role})")

    # -- FastDeploy's task path --------------------------------------------------------------

    def get_server_port(self) -> int:
        """The port the server serves (the real one when built with port 0). Server only:
        ``RuntimeError`` elsewhere, as FastDeploy."""
        if not self.is_server:
            raise RuntimeError("Only the server instance can provide the port.")
        return self._port

    def put_tasks(self, tasks, timeout: float = None) -> None:
        """Engine side: enqueue one batch (typically ``(requests, real_bsz)``) for every TP
        rank of this DP group.

        Blocks, as FastDeploy, while ``max_inflight`` batches are not yet taken by every
        rank (it polls: 50 µs doubling to FastDeploy's 1 ms). ``timeout`` (seconds, None =
        forever) raises ``TimeoutError`` with nothing enqueued. Raises ``GroupLostError``
        (nothing enqueued), at once or while it waits, when the worker group is lost (see
        ``exist_tasks``). Numpy arrays travel zero-copy; see ``TaskQueue.put_tasks`` for
        the other errors."""
        q = self._queue()
        if q is None:
            raise RuntimeError("put_tasks is an engine-side call: this EngineWorkerQueue is "
                               f"TP rank {self.client_id} of a worker group")
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = _PUT_POLL_MIN_S
        self._watch()
        while q.num_tasks() >= self.max_inflight:
            self._watch()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"put_tasks timed out after {timeout} s: {q.num_tasks()} "
                                   f"batch(es) not yet taken by every rank ({q.ranks()})")
            time.sleep(pause)
            pause = min(pause * 2, _PUT_POLL_MAX_S)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        q.put_tasks(tasks, timeout=remaining)
        (self._server or self)._last_put_was_clear = False

    def get_tasks(self):
        """Worker side: ``(tasks, all_client_read)``. Never blocks on the engine.

        ``tasks``: the batches rank 0's last ``exist_tasks()`` latched for this call, in put
        order, identical on every rank (``[]`` if none). ``all_client_read``: True on
        exactly one rank per call, the last of the group to make it (FastDeploy's last
        reader, which resets the loop's signal). Batches cleared by ``clear_data()`` are
        dropped here, on every rank alike (``cleared`` counts them).

        Differs from FastDeploy: a take, not a peek (see the module docstring). Raises
        ``ProtocolError`` if this rank's calls disagree with rank 0's decisions."""
        self._require_worker("get_tasks")
        call = self._calls + 1
        # count (and mark decision `call` read) before reading it: see latch_unless_read
        last = self._board.last_reader(call)
        tasks, _ = self._client.get_tasks()
        self._calls = call
        if tasks:
            kept = []
            for t in tasks:
                if isinstance(t, _Clear):
                    self.cleared += len(kept)
                    kept = []
                else:
                    kept.append(t)
            tasks = kept
        return tasks, bool(last)

    def exist_tasks(self) -> bool:
        """Engine side: True while ``max_inflight`` batches are not yet taken by every rank,
        i.e. while ``put_tasks()`` would wait. FastDeploy's engine waits
        ``while exist_tasks(): sleep(0.001)`` before each put; with ``max_inflight=1`` this
        is FastDeploy's meaning ("the workers have not read the last batch"), with more it
        lets that loop put up to ``max_inflight`` batches ahead of the workers (see the
        module docstring, "Pipelining"). Raises ``GroupLostError`` when the worker group is
        lost (retired by the engine, or a rank disconnected for longer than the heartbeat
        timeout) until a new group has every rank connected; the error names the ranks,
        why, and carries the batches the group did not finish (``.unfinished``).

        Worker side: True when every rank of the group holds a batch not yet taken; on
        rank 0 it also latches what the group's next ``get_tasks()`` takes. A flag read in
        async mode; never blocks. Raises engine-side errors (``EngineClosedError``,
        ``PrefetchError``...) as ``TaskClient.exist_tasks``."""
        q = self._queue()
        if q is not None:
            self._watch()
            return q.num_tasks() >= self.max_inflight
        self._require_worker("exist_tasks")
        if self.client_id == 0:
            return bool(self._check())
        return self._client.exist_tasks()

    def _check(self) -> int:
        """TP rank 0's check, whichever way the loop asks (``exist_tasks()`` or
        ``num_tasks() > 0``): announce the next ``get_tasks()`` call and, if every rank
        holds a batch not yet taken, latch it for that call, unless a rank has already
        begun reading it. Returns what the group's next call takes (0: nothing), or None
        when that call's decision was already read (then nothing was latched)."""
        client, call = self._client, self._calls + 1
        self._board.announce(call)
        if client.num_tasks() == 0:  # rank 0 holds nothing new (sync mode: receives first)
            return 0
        latched = self._board.latch_unless_read(call, client.exist_tasks)
        if latched is None:
            return None
        return client.ready_count() if latched else 0

    def set_exist_tasks(self, flag) -> None:
        """Accepted for FastDeploy's API; the flag is derived here (module docstring).
        ``True`` changes nothing; ``False`` with batches pending on the engine raises
        ``ValueError`` (drop them with ``clear_data()``)."""
        if flag:
            return
        q = self._queue()
        if q is not None and q.num_tasks():
            raise ValueError("set_exist_tasks(False) with batches pending: the flag follows "
                             "the queue here; use clear_data() to drop them")

    def num_tasks(self) -> int:
        """Engine side: batches not yet taken by every rank (at most ``max_inflight``);
        raises ``GroupLostError`` as ``exist_tasks()``.

        Worker side, TP rank 0: the batches every rank holds and the group's next
        ``get_tasks()`` takes, and, like ``exist_tasks()``, it latches them for that call,
        so ``if num_tasks() > 0:`` (FastDeploy 2.x's check) works exactly as
        ``if exist_tasks():``. A caller that only reads it (a log line after the barrier)
        changes nothing: once any rank has begun reading a call's decision it is never
        re-latched, and the value it returns is then this rank's own count.
        Other ranks: batches this rank holds and has not taken (a read).
        Never blocks; raises engine-side errors as ``exist_tasks()``."""
        q = self._queue()
        if q is not None:
            self._watch()
            return q.num_tasks()
        self._require_worker("num_tasks")
        if self.client_id == 0:
            latched = self._check()
            return self._client.num_tasks() if latched is None else latched
        return self._client.num_tasks()

    def clear_data(self) -> None:
        """Engine side: retire what is pending, consistently on every rank (module
        docstring): puts a clear marker, which never waits for room. Does not wait for the
        workers. A second call with nothing put in between adds nothing.

        Worker side: drops nothing (one rank cannot drop without its peers)."""
        q = self._queue()
        if q is None:
            self._require_worker("clear_data")
            log.debug("EngineWorkerQueue rank %d: clear_data() on a worker drops nothing; the "
                      "engine's clear_data() retires pending batches", self.client_id)
            return
        server = self._server or self  # who remembers the last put (a producer: itself)
        with server._clear_lock:
            if server._last_put_was_clear or q.num_tasks() == 0:
                return
            q.put_tasks(_Clear(), timeout=5.0)  # room reserved: returns at once
            server._last_put_was_clear = True

    @property
    def task_queues(self) -> list:
        """The server's ``TaskQueue`` per local DP group (index = ``local_data_parallel_id``),
        for what the core offers beyond FastDeploy's calls: ``stats()``, ``status()``,
        ``group_events``, and metrics (``fastdeploy_sync.metrics.register(registry,
        *server.task_queues)``). An engine client in the server's process sees its server's;
        an empty list on a worker or an engine client of another process (its server's
        process exports them)."""
        server = self._server
        return list(server._queues) if server is not None else []

    def num_connected_clients(self) -> int:
        """Engine side: TP ranks of this DP group connected now (FastDeploy logs its
        ``connected_client_counter``). ``RuntimeError`` on a worker, which cannot know."""
        q = self._queue()
        if q is None:
            raise RuntimeError("the connected-client count is known on the engine side only")
        return sum(1 for r in q.ranks() if r["state"] == CONNECTED)

    def cleanup(self, timeout: float = 0.0) -> None:
        """Server: close every DP group's queue (workers take what they were sent, then raise
        ``EngineClosedError``), release the endpoints. ``timeout``: how long to wait for the
        workers to take what is pending first (FastDeploy's shutdown does not wait).
        Worker: close the client and the group's shared memory. Engine-side client: nothing
        to release. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.is_server:
            self._close_server(timeout)
        if self._client is not None:
            self._client.close()
        if self._producer is not None:
            self._producer.close()
        if self._board is not None:
            self._board.close()

    def _close_server(self, timeout):
        self._closed = True
        with _SERVERS_LOCK:
            if _SERVERS.get(self.address) is self:
                del _SERVERS[self.address]
        for q in self._queues:
            q.close(timeout=timeout)
        if self._reserved is not None:
            self._reserved.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cleanup()

    def __getattr__(self, attr):
        # Only called for attributes not found: FastDeploy's other channels.
        if attr.startswith("_"):
            raise AttributeError(attr)
        raise AttributeError(
            f"EngineWorkerQueue.{attr}: fastdeploy_sync's drop-in serves FastDeploy's task "
            f"path only (put_tasks, get_tasks, exist_tasks, num_tasks, clear_data, ...); keep "
            f"FastDeploy's own queue for the other channels")

    def __repr__(self):
        return (f"EngineWorkerQueue(address={self.address}, role={self.role}, "
                f"num_client={self.num_client}, client_id={self.client_id}, "
                f"dp={self.local_data_parallel_id})")
