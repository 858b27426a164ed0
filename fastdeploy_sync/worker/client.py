"""Worker side: ``TaskClient``, one per TP rank, used from the worker's event loop.

The step, every rank, every iteration of the event loop::

    if tp_rank == 0: client.exist_tasks()     # latches "this step takes up to seq N"
    client.barrier()                         # all ranks; node-local shared memory
    tasks, read_finished = client.get_tasks() # the same batches on every rank

or ``tasks = client.sync_step()``. ``tp.protocol`` says why the decision is indexed by the
barrier generation.

Async mode (default): a background thread receives (``background``, ``receiver``); a
node-local engine's batches are read from the worker group's ring, decoded ahead by a
prefetch thread (``ring_prefetch``). The event loop's ``exist_tasks()`` is then a few
shared-memory reads: no socket, no lock. Sync mode
(``DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM=1``): the same protocol with the event loop
receiving itself, in ``exist_tasks()``, ``num_tasks()`` and while it waits in ``barrier()``
(ranks other than 0 must keep receiving while they wait, or rank 0 would never see every
rank holding a batch); a background thread only pings and watches the engine.

A client is made of collaborators with one idea each: the local slot of held batches
(``slot``), the sockets and what is sent on them (``connection``), what is received and by
whom (``receiver``, ``background``), the ring (``ring_prefetch``), the judgement of the
engine (``engine_watch``), the error slot and the fault protocol between ranks
(``faults``), acknowledgements (``acks``) and rank 0's idle wait (``idle_wait``). This
module is the step API over them, and their wiring and closing.

Any thread may call ``close()``: a step call blocked in the barrier or in
``wait_for_tasks()`` is woken and raises ``ClosedError``, and nothing (semaphore, socket,
mapping) is freed while a thread may still use it.

In a child forked from a rank's process the client is the parent's (its group words, ring,
ack board and connection): every call raises ``ForkedProcessError`` and ``close()`` does
nothing, so the child never says goodbye, arrives at a barrier or acknowledges for its
parent (``forks.refuse_in_child``).
"""

import collections
import logging
import os
import secrets
import threading
from typing import Any, Optional

from .. import envs
from ..errors import ClosedError, EngineGoneError, EngineRejectedError, EngineUnreachableError
from ..forks import refuse_in_child
from ..tp.protocol import WaitHooks
from ..wire.auth import ClientAuth
from ..wire.endpoints import check_ipc_endpoint, default_endpoint, ipc_path, validate_name
from ..wire.liveness import Heartbeat
from ..wire.sockets import CLIENT_FDS, ensure_free_fds
from .background import stop_threads, threads_cpu_seconds
from .idle_wait import IdleWait
from .parts import assemble
from .step_profiler import StepProfiler

__all__ = ["TaskClient"]

log = logging.getLogger(__name__)

# The longest rank 0's check waits for a peer that is receiving a batch rank 0 holds
# (TPGroup.wait_peers); the wait ends as soon as the peer arrives at the barrier.
_PEER_WAIT_S = 0.005
# How long close() waits for each background thread (normally blocked, woken at once).
_JOIN_S = 5.0


class TaskClient:
    """One TP rank's end of the task channel.

    ``TaskClient(name, tp_size, tp_rank, *, dp_id=0, endpoint=None, async_prefetch=None)``
    connects to the engine's endpoint (derived from name and dp_id when ``endpoint`` is
    None, exactly as ``TaskQueue`` does). The engine may start before or after the
    workers: nothing is lost either way.

    Ranks other than 0 block in the constructor until rank 0 of the group exists
    (``FD_SYNC_ATTACH_TIMEOUT`` seconds, then ``TimeoutError``).

    ``async_prefetch=None`` reads ``DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM`` (``0``, the
    default: background prefetch thread; ``1``: synchronous polling, no prefetch thread).

    ``coordinator`` says how the TP ranks agree on each step: ``"shm"`` (node-local
    shared memory, the default), ``"paddle"`` (ranks on several nodes: one
    paddle.distributed all-reduce per step over the default group; see
    ``tp.paddle_group``), or a paddle.distributed group object (the TP ranks' group).
    ``None`` reads ``FD_SYNC_TP_COORDINATOR`` (default ``shm``). Ignored at tp_size=1.

    ``heartbeat``: a ``wire.liveness.Heartbeat`` (None: ``FD_SYNC_HEARTBEAT_INTERVAL`` /
    ``FD_SYNC_HEARTBEAT_TIMEOUT`` / ``FD_SYNC_STALL_TIMEOUT``, default 1 s / 3 s / 300 s).
    Once the engine has welcomed this rank, the next step call raises ``EngineGoneError``
    when the connection to it is lost and not re-established to the same engine within the
    timeout, or when it was silent for ``stall_timeout`` on a live connection
    (``worker.engine_watch``); a long GIL hold in this process or the engine's is neither.

    ``connect_timeout`` (seconds; None: ``FD_SYNC_CONNECT_TIMEOUT``, default 15): the engine
    may start after the workers, but if none has welcomed this rank this long after
    construction, the next step call raises ``EngineUnreachableError`` (a
    ``ConnectionError``) naming the endpoint and what to check.

    ``profile=None`` reads ``FD_SYNC_PROFILE`` (default ``0``). When on, ``profiler`` is a
    ``StepProfiler`` timing ``exist_tasks``/``barrier``/``get_tasks`` of every step (they
    are wrapped on this instance); when off, ``profiler`` is None and nothing is timed.

    Errors from the engine side, raised by ``exist_tasks``/``barrier``/``num_tasks``/
    ``sync_step`` on every rank (``get_tasks`` still takes what the group decided):

    * ``EngineClosedError``: the engine called ``TaskQueue.close()`` and this rank has
      taken everything it was sent (raised as is, in both modes);
    * ``EngineGoneError`` (engine silent for the heartbeat timeout, or restarted),
      ``GroupLostError`` (the engine retired this group) and ``EngineRejectedError``:
      in async mode wrapped in ``PrefetchError`` (``__cause__`` holds them), as every
      failure of the prefetch thread; in sync mode the first call raises them as is and
      later calls raise ``PrefetchError``.

    Security: a ``tcp://`` endpoint uses ZeroMQ CURVE with the keys in ``keys_dir`` (None:
    ``FD_SYNC_KEYS_DIR``): this worker pins the engine's public key, so it never talks to
    (or unpickles anything from) another process that holds the port; a failed handshake
    raises ``AuthenticationError`` from the next step call. Without keys the constructor
    raises ``AuthenticationError``, unless ``insecure_tcp=True`` / ``FD_SYNC_INSECURE_TCP=1``.
    An ``ipc://`` endpoint must sit in a directory private to this user (checked before
    connecting: ``PermissionError`` otherwise).

    Threading: call the step methods from one thread (the event loop). ``close()`` may be
    called from any thread (a shutdown or signal-handling thread): a step call blocked
    meanwhile raises ``ClosedError``. Use as a context manager, or call ``close()``.

    ``external_barrier=True``: the caller's loop orders the ranks with its own TP barrier
    (FastDeploy's ``paddle.distributed.barrier``), not ``barrier()``. Rank 0's
    ``exist_tasks()`` then latches its decision for its *next* ``get_tasks()`` call number
    j (its calls so far + 1) and every rank's j-th ``get_tasks()`` takes decision j. This
    is consistent as long as every rank calls ``get_tasks()`` the same number of times,
    each j-th call after a barrier that rank 0 passed after latching j (FastDeploy's loop:
    every rank calls it iff the flag rank 0 set before the barrier is set). That contract is
    the caller's: a rank that calls it more often than its peers is off by one call from
    then on; ``get_tasks()`` raises ``ProtocolError`` only if that makes it disagree with
    rank 0 about what was taken (``fastdeploy.EngineWorkerQueue`` checks the call counts
    of every rank). At tp_size=1 it changes nothing.

    Decoded numpy arrays alias the received message and are read-only; copy before writing.
    """

    def __init__(self, name: str, tp_size: int, tp_rank: int, *, dp_id: int = 0,
                 endpoint: Optional[str] = None, async_prefetch: Optional[bool] = None,
                 coordinator: Any = None, profile: Optional[bool] = None,
                 heartbeat: Optional[Heartbeat] = None, keys_dir: Optional[str] = None,
                 insecure_tcp: Optional[bool] = None, external_barrier: bool = False,
                 connect_timeout: Optional[float] = None) -> None:
        validate_name(name, dp_id)
        if type(tp_size) is not int or tp_size < 1:
            raise ValueError(f"tp_size={tp_size!r}: expected an int >= 1")
        if type(tp_rank) is not int or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank!r}: expected an int in [0, {tp_size})")
        self.name, self.tp_size, self.tp_rank, self.dp_id = name, tp_size, tp_rank, dp_id
        self.async_prefetch = (envs.async_task_comm_enabled() if async_prefetch is None
                               else bool(async_prefetch))
        self.endpoint = endpoint or default_endpoint(name, dp_id)
        self.heartbeat = heartbeat or Heartbeat()
        self.connect_timeout = (envs.connect_timeout_s() if connect_timeout is None
                                else float(connect_timeout))
        if not self.connect_timeout > 0:
            raise ValueError(f"connect_timeout={connect_timeout!r}: expected seconds > 0")
        # This process's claim on its rank: the engine refuses another worker id for the
        # same rank while this one is alive, and accepts this one back after a reconnect.
        self.worker_id = secrets.randbits(63) | 1
        profile = envs.profile_enabled() if profile is None else bool(profile)
        self.profiler = StepProfiler() if profile else None
        # external_barrier: the caller orders the ranks with its own barrier, so decisions
        # are indexed by this rank's get_tasks() call count instead of our barrier's
        # generation (see the class docstring).
        self.external_barrier = bool(external_barrier)
        self._calls = 0  # get_tasks() calls so far (event loop only)
        self._peers_welcomed = False  # event loop: every rank attached the ring (all_welcomed)
        self._closed = False
        self._closing = threading.Event()  # set at the start of close(): threads stop
        self._counters: collections.Counter = collections.Counter()
        path = ipc_path(self.endpoint)
        if path is not None:
            check_ipc_endpoint(path)  # never connect to a socket another user could own
        auth = ClientAuth.load(self.endpoint, keys_dir, insecure_tcp)
        # libzmq aborts the process when it runs out of fds: fail here, cleanly, instead
        ensure_free_fds(CLIENT_FDS, f"TaskClient rank {tp_rank} of {name!r} dp_id={dp_id}")
        p = assemble(self, coordinator, auth, path is not None, self._closing, self._counters)
        self._slot, self._group, self._watch, self._faults = p.slot, p.group, p.watch, p.faults
        self._ring, self._conn, self._acks, self._receiver = (p.ring, p.connection, p.acks,
                                                              p.receiver)
        self._taker, self._background = p.taker, p.background
        self.incarnation = p.group.incarnation
        # What the step calls read: the background thread's poll result for the data socket
        # (one check instead of two: "sync mode, or a batch woke the background thread";
        # sync mode receives at every step call: a buffer whose [3] is always true), the
        # barrier's call and its hooks bound once, rank 0's peer wait.
        self._data_ready = p.receiver.revents if self.async_prefetch else (1, 1, 1, 1)
        self._group_barrier = p.group.barrier
        self._spans_nodes = p.group.spans_nodes
        self._hooks = WaitHooks(
            service=None if self.async_prefetch else p.receiver.receive_in_wait,
            check=p.faults.barrier_check,
            on_wait=p.receiver.drain if self.async_prefetch and not self._spans_nodes else None)
        self._waits_for_peers = tp_rank == 0 and not self.external_barrier
        self._engine_split = p.group.engine_split
        if not self.async_prefetch:
            self._receiver.send_hello()  # the event loop owns the data socket
        self._background.start(self.async_prefetch)
        if self.profiler is not None:
            self.profiler.attach(self)
        # after attach: wait_for_tasks' checks are the (timed) step calls
        self._idle = IdleWait(self.exist_tasks, self.async_prefetch, self._ring, self._slot,
                              self._group, self._faults, self._receiver, self._conn)
        who = f"TaskClient rank {tp_rank} of {name!r} dp_id={dp_id}"
        self._fork_guard = refuse_in_child(self, who, idle={"close": None})

    # -- step API (event loop thread) --------------------------------------------------------

    def exist_tasks(self) -> bool:
        """True when every rank of the group holds at least one batch not yet taken.

        On rank 0 a True result latches "the next barrier's step takes up to seq N" for
        the whole group; calling it again before the barrier may raise N. On other ranks
        it only reports. Async mode: a few shared-memory reads, no socket, no lock; only
        when the background thread was woken by a batch it has not handled yet (it waits
        for the GIL this thread holds) does it receive that batch itself, as sync mode
        would (``Receiver.drain``). Sync mode: first receives whatever has arrived.

        Waits only on rank 0 of a node-local group, and only while it holds a batch that a
        peer is still receiving: until that peer holds it too or arrives at the barrier
        without it, at most ``_PEER_WAIT_S`` (``TPGroup.wait_peers``). The barrier would
        have waited for that peer just as long; waiting before the decision lets the step
        take the batch instead of the next one.

        With ``coordinator="paddle"`` (ranks on several nodes) it can only speak for rank 0;
        the barrier's all-reduce then takes what every rank holds (see ``tp.paddle_group``).
        """
        faults = self._faults
        if faults.error is not None:
            faults.raise_error()
        if self._acks.unsent:
            self._acks.resend()
        if self._data_ready[3]:  # sync: always; async: a batch woke the background thread
            self._receiver.receive_now() if not self.async_prefetch else self._receiver.drain()
        taken = self._slot.taken
        published = self._ring.published()
        if published >= 0:
            # the ring says what every rank of the node can take: no rank's thread needs to
            # have run (batches that travelled over the socket: once every rank received them)
            if published <= taken:
                return False  # nothing published this rank has not taken: one read
            group = self._group
            if (ring := self._ring.reader) is None:
                return False  # closed by another thread meanwhile: the next call raises
            if not self._peers_welcomed:
                if not group.all_welcomed(self._watch.engine):
                    return False  # a peer has not attached the ring yet
                self._peers_welcomed = True  # for good: the engine is this client's for life
            upto = ring.ready_upto(taken, group.min_received)
            if upto <= taken:
                return False
        else:
            received = self._slot.received
            if received <= taken:  # this rank holds nothing new: no shared memory read
                return False
            group = self._group
            upto = group.min_received()
            if upto < received and self._waits_for_peers:
                # a peer is still receiving what this rank holds: take it this step
                upto = group.wait_peers(received, _PEER_WAIT_S)
            if upto <= taken:
                return False
        if self.tp_rank == 0:
            split = self._engine_split(self._watch.engine)
            if split:
                self._faults.raise_engine_split(self._watch.engine, split)
            index = self._calls + 1 if self.external_barrier else group.gen + 1
            group.latch(index, taken, upto)
        return True

    def wait_for_tasks(self, timeout: float) -> bool:
        """Rank 0's idle wait: block until ``exist_tasks()`` would return True, then latch
        exactly as it does and return True; return False once ``timeout`` seconds passed.

        For an idle loop that would otherwise poll ``exist_tasks()`` every millisecond::

            if tp_rank == 0: client.wait_for_tasks(0.1)   # or exist_tasks(): both work
            client.barrier()
            tasks, _ = client.get_tasks()

        Blocks with the GIL released and no CPU (``worker.idle_wait`` says what wakes it).
        Without a wake-up it re-checks after 10 ms, backing off to every 100 ms while
        nothing comes.

        Raises what ``exist_tasks()`` raises, promptly when the engine side fails or
        closes while it waits (``EngineClosedError`` once this rank has taken everything
        it was sent). Returns False early if a peer rank stopped at an engine error (the
        next ``barrier()`` raises it).

        Sync mode (``DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM=1``): receives from the socket
        itself while it waits (polls it with the GIL released), then waits for the other
        ranks as above; an error found by the heartbeat thread is seen within 50 ms.
        ``coordinator="paddle"``: waits for this rank's own receipt only (the others' are
        known at the barrier, as for ``exist_tasks()``), polling it every millisecond.

        Rank 0 only (the other ranks wait in ``barrier()``): raises ``RuntimeError`` on
        others. ``timeout`` is in seconds, ``0`` is ``exist_tasks()``.
        """
        if self.tp_rank != 0:
            raise RuntimeError(f"TaskClient {self.name} rank {self.tp_rank}: wait_for_tasks() "
                               f"is rank 0's; the other ranks wait in barrier()")
        return self._idle.wait(timeout)

    def barrier(self, timeout: Optional[float] = None) -> None:
        """Block until every rank of the group has reached this step's barrier.

        Node-local shared memory: spins (up to ``FD_SYNC_BARRIER_SPIN_US``) only while the
        partners have recently arrived within that window, else blocks on a semaphore at once
        (no CPU; see ``tp.spin``).
        ``timeout`` in seconds (None = forever) raises ``BarrierTimeoutError`` naming the
        missing ranks, early if one of them exited or closed its client. A no-op at
        tp_size=1. A rank that has not arrived and stopped at an engine-side error makes it
        raise the same kind of error at once, instead of waiting for the timeout. What this
        rank itself learns while it waits (after arriving) is raised by the next step call,
        once every rank arrived: otherwise a peer arriving later would take the step alone.
        Raises ``ClosedError`` when ``close()`` runs meanwhile in another thread.
        """
        faults = self._faults
        if faults.error is not None:
            faults.raise_error()
        if self._acks.unsent:
            self._acks.resend()
        if self.async_prefetch:
            if self._data_ready[3]:  # a batch woke the background thread: take it first
                self._receiver.drain()
        else:
            self._receiver.receive_now()
        ring = self._ring.reader
        if ring is not None and self._spans_nodes:
            # across nodes every rank offers what it can take: the ring's part is a read
            self._group.publish_received(ring.ready_upto(self._slot.taken, self._own_received))
        self._group_barrier(timeout, self._hooks)

    def get_tasks(self) -> tuple[list, bool]:
        """Take this step's batches: ``(tasks, read_finished)``. Never blocks.

        ``tasks`` is the list of objects passed to ``put_tasks``, in put order: exactly the
        batches rank 0 latched for the barrier this rank last passed (``[]`` if none), so
        every rank takes the same list at the same step. ``read_finished`` is True once
        every rank of the group has taken everything this rank has taken; it is True on at
        least one rank of a step and never before every rank has taken the set.

        It raises nothing the engine side learned (those wait for the next step's
        ``exist_tasks``/``barrier``): the batches were latched only once every rank held
        them, so every rank can take them. Raises ``ClosedError`` after ``close()``, and
        ``ProtocolError`` if this rank's history disagrees with rank 0's decision (e.g.
        ``get_tasks()`` was called on some ranks of an earlier step but not others).
        """
        if self._closed:
            raise ClosedError(f"TaskClient {self.name} rank {self.tp_rank} is closed")
        group = self._group
        if self.external_barrier:
            self._calls += 1
            decision = group.decision(self._calls)
        else:
            decision = group.decision(group.gen)
        slot = self._slot
        tasks = []
        if decision is not None and decision[1] > slot.taken:
            tasks = self._taker.take(*decision)
        return tasks, group.all_consumed(slot.taken)

    def num_tasks(self) -> int:
        """Batches this rank holds (or can read from the ring) and has not taken. Never
        blocks."""
        faults = self._faults
        if faults.error is not None:
            faults.raise_error()
        if not self.async_prefetch:
            self._receiver.receive_now()
        published, taken = self._ring.published(), self._slot.taken
        if published >= 0:
            if published <= taken:
                return 0  # nothing published this rank has not taken: one read
            ring = self._ring.reader  # None: closed by another thread meanwhile
            return ring.ready_upto(taken, self._own_received) - taken if ring else 0
        return self._slot.received - taken

    def _own_received(self) -> int:
        return self._slot.received

    def ready_count(self) -> int:
        """Batches every rank of the group holds that this rank has not taken: what a step
        latched now would take (rank 0's view; with ``coordinator="paddle"`` this rank's
        own count, as ``exist_tasks()``). Shared-memory reads: never blocks, receives
        nothing, latches nothing, raises nothing."""
        ring = self._ring.reader
        taken = self._slot.taken
        if ring is not None:
            return ring.ready_upto(taken, self._group.min_received) - taken
        return max(0, min(self._slot.received, self._group.min_received()) - taken)

    def step_size(self) -> int:
        """After ``barrier()``: how many batches this step's ``get_tasks()`` takes (0:
        none), as every rank of the group computes it. A read; never blocks. (For a caller
        that must tell its ranks whether to call ``get_tasks()``, e.g. the FastDeploy
        drop-in's flag across nodes.) Meaningless with ``external_barrier=True``."""
        decision = self._group.decision(self._group.gen)
        taken = self._slot.taken
        if decision is None or decision[1] <= taken:
            return 0
        return decision[1] - taken

    def sync_step(self, timeout: Optional[float] = None) -> list:
        """``exist_tasks()`` on rank 0, ``barrier(timeout)``, ``get_tasks()``: the batches this
        step takes, identical on every rank (``[]`` if none). Blocks only in the barrier."""
        if self.tp_rank == 0:
            self.exist_tasks()
        self.barrier(timeout)
        return self.get_tasks()[0]

    def stats(self) -> dict:
        """Counters (``garbage_frames``, ``duplicates``, ``stale``, ``pongs``...), watermarks
        (``received``: the highest seq up to which this rank can take every batch, from
        the ring or received over the socket; ``taken``), and the ids this rank is bound
        to, for logs and tests."""
        ring = self._ring.reader
        received, held = self._slot.snapshot()
        out = dict(self._counters)
        taken = self._slot.taken
        if ring is not None:
            received = max(received, ring.ready_upto(taken, self._own_received))
        out.update(received=received, taken=taken, held=held,
                   ring=ring.name if ring is not None else None)
        engine = self._watch.engine
        out.update(worker=f"{self.worker_id:016x}", group=f"{self.incarnation:016x}",
                   engine=f"{engine:016x}" if engine else None,
                   engine_silent_s=round(self._watch.silent_s(), 3))
        return out

    def prefetch_cpu_seconds(self) -> Optional[float]:
        """CPU time the background threads of async mode (the socket's receiver and the
        ring's prefetch thread) have used so far (user + system), from their own thread
        clocks; None in sync mode or where the platform has no per-thread clock. A thread
        blocked in poll or on its semaphore, as it should be while idle, adds nothing."""
        if not self.async_prefetch:
            return None
        return threads_cpu_seconds((self._background.thread, self._ring.thread))

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Say goodbye to the engine, stop the background threads, close every socket,
        leave the group and remove the shared memory it owns. Idempotent; any thread.

        A step call that another thread is blocked in (``barrier()``,
        ``wait_for_tasks()``) is woken and raises ``ClosedError``; later step calls raise
        ``ClosedError``. Peers of this rank waiting in the barrier raise
        ``BarrierTimeoutError`` ("closed its client") at once.

        The engine is told (a ``BYE`` carrying the highest seq this rank took) when it
        welcomed this rank and is not known to be gone, so it need not wait for a timeout.

        Releases every descriptor, socket, semaphore and mapping before it returns (a mapping
        still viewed, by arrays or a TP group's reader, goes with its last view). Blocks at
        most ~5 s per background thread, ~1 s for a thread in the group, ~2 s for another
        thread's step call to let go of a socket, 0.2 s for the goodbye; what a bound leaves
        in use is kept until exit, never freed under its user (logged)."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        prior = self._faults.close()  # before waking anyone: a woken step call raises this
        if self.profiler is not None and (profile_dir := envs.profile_dir()):
            self._dump_profile(self.profiler, profile_dir)
        self._background.stop()
        self._ring.stop()
        stopped = stop_threads((self._background.thread, self._ring.thread), _JOIN_S)
        if not stopped:
            log.error("TaskClient %s rank %d: background thread did not stop within 5 s; its "
                      "sockets are kept open until exit", self.name, self.tp_rank)
        else:
            self._receiver.wake.close()
        # Leave the group: wakes a barrier or wait_for_tasks() of another thread and frees
        # the semaphores once it left; the mapping stays while anything can read it, and
        # a post from a thread that did not stop is dropped, not made on a freed semaphore.
        self._group.close()
        # BYE to the engine, if it welcomed us and is not known to be gone or closed: it
        # then retires this rank's group at once instead of after the heartbeat timeout.
        watch = self._watch
        say_bye = watch.bound and watch.close_seq is None and not isinstance(
            prior, (EngineGoneError, EngineRejectedError, EngineUnreachableError))
        self._conn.close(stopped, self._slot.taken if say_bye else None)
        self._acks.close()
        if stopped:  # the shared memory it reads: unmapped now, or with the last array
            self._ring.close()
        _unwire(self)

    def __enter__(self) -> "TaskClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _dump_profile(self, profiler: StepProfiler, directory: str) -> None:
        path = os.path.join(directory, f"fdsync-profile-{self.name}-dp{self.dp_id}-"
                                       f"r{self.tp_rank}-{os.getpid()}.json")
        try:
            profiler.dump(path)
        except OSError as exc:  # a profile must never break the worker's shutdown
            log.error("TaskClient %s rank %d: could not write the step profile to %s: %s",
                      self.name, self.tp_rank, path, exc)


def _unwire(client: TaskClient) -> None:
    """At the end of ``close()``: remove what refers back to ``client``, the profiler's
    wrappers (attributes of the instance) and the idle wait's check (its bound
    ``exist_tasks``); both raise ``ClosedError`` as before. Nothing of the client then refers
    to it, so a closed client is freed, with whatever a bound of ``close()`` kept (a TP
    group's mapping a thread might still read), as soon as its caller lets go of it, not at
    a garbage collection."""
    for attr in ("exist_tasks", "barrier", "get_tasks"):
        client.__dict__.pop(attr, None)
    client._idle.closed(client._faults.raise_error)
