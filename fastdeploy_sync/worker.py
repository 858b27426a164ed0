"""Worker side: ``TaskClient``, one per TP rank, used from the worker's event loop.

Async mode (default): a background prefetch thread owns the data socket. It blocks in
``zmq.Poller.poll()`` with the GIL released while nothing arrives, decodes each batch
(numpy arrays zero-copy, see ``codec``) into a lock-guarded local slot, and publishes
"I hold up to seq N" to the group's shared memory. The event loop's ``exist_tasks()``
is then a few shared-memory reads: no socket, no lock.

Sync mode (``DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM=1``): no thread; the same protocol
runs with the event loop receiving from the socket itself, in ``exist_tasks()``,
``num_tasks()`` and while it waits in ``barrier()`` (ranks other than 0 must keep
receiving while they wait, or rank 0 would never see every rank holding a batch).

The step, every rank, every iteration of the event loop::

    if tp_rank == 0: client.exist_tasks()     # latches "this step takes up to seq N"
    client.barrier()                         # all ranks; node-local shared memory
    tasks, read_finished = client.get_tasks() # the same batches on every rank

or ``tasks = client.sync_step()``. See ``tp_group`` for why the decision is indexed by the
barrier generation.

Liveness (see ``liveness``): the thread that owns a socket it otherwise blocks on pings the
engine every heartbeat interval (the prefetch thread; in sync mode a heartbeat thread
with its own socket, so that a long model step never looks like a dead worker). What it
learns is left in ``_error``, the one slot every step call already reads, so liveness
adds nothing to the step's critical path. Errors about the engine are raised only where
a step starts (``exist_tasks``, ``barrier``, ``num_tasks``), never by ``get_tasks()`` once
the group's decision is made: every rank takes what the group decided, or none does.
"""

import collections
import logging
import os
import secrets
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from . import codec, envs, payload_shm
from .ack_board import EPOCH_SHIFT, AckBoard
from .auth import HANDSHAKE_FAILED_EVENTS, ClientAuth, handshake_failure_message
from .errors import (AuthenticationError, ClosedError, EngineClosedError, EngineGoneError, EngineRejectedError,
                     GroupLostError, PrefetchError, ProtocolError)
from .liveness import Heartbeat
from .logs import RateLimitedLog
from .step_profiler import StepProfiler
from .tp_group import ShmTPGroup, SoloGroup
from .transport import (CLIENT_FDS, WakePipe, check_ipc_endpoint, default_endpoint,
                        ensure_free_fds, ipc_path, new_socket, validate_name)

__all__ = ["TaskClient"]

log = logging.getLogger(__name__)


def _make_group(name, dp_id, tp_size, tp_rank, coordinator):
    if tp_size == 1:
        return SoloGroup()
    if coordinator is None:
        coordinator = envs.tp_coordinator()
    if coordinator == "shm":
        return ShmTPGroup(name, dp_id, tp_size, tp_rank)
    from .paddle_group import PaddleTPGroup  # imports paddle: only when asked for

    if coordinator == "paddle":
        return PaddleTPGroup(tp_size, tp_rank)
    if isinstance(coordinator, PaddleTPGroup):  # built by the caller (its own options)
        return coordinator
    if isinstance(coordinator, str):
        raise ValueError(f"coordinator={coordinator!r}: expected 'shm', 'paddle' or a "
                         f"paddle.distributed group")
    return PaddleTPGroup(tp_size, tp_rank, group=coordinator)


# Engine-side errors a rank publishes to its group when it stops at one (tp_group FAULT);
# GroupLostError before EngineRejectedError, its base class.
_FAULT_CODES = ((EngineGoneError, 1), (GroupLostError, 2), (EngineRejectedError, 3),
                (EngineClosedError, 4))
_FAULT_CLASSES = {code: cls for cls, code in _FAULT_CODES}


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
    ``paddle_group``), or a paddle.distributed group object (the TP ranks' group).
    ``None`` reads ``FD_SYNC_TP_COORDINATOR`` (default ``shm``). Ignored at tp_size=1.

    ``heartbeat``: a ``liveness.Heartbeat`` (None: ``FD_SYNC_HEARTBEAT_INTERVAL`` /
    ``FD_SYNC_HEARTBEAT_TIMEOUT``, default 1 s / 3 s). Once the engine has welcomed this
    rank, hearing nothing from it for the timeout makes the next step call raise
    ``EngineGoneError``.

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

    Threading: call the step methods from one thread (the event loop). Use as a context
    manager, or call ``close()``.

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
                 endpoint: str = None, async_prefetch: bool = None, coordinator=None,
                 profile: bool = None, heartbeat: Heartbeat = None, keys_dir: str = None,
                 insecure_tcp: bool = None, external_barrier: bool = False):
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
        # This process's claim on its rank: the engine refuses another worker id for the
        # same rank while this one is alive, and accepts this one back after a reconnect.
        self.worker_id = secrets.randbits(63) | 1
        profile = envs.profile_enabled() if profile is None else bool(profile)
        self.profiler = StepProfiler() if profile else None
        # Lock invariant: _slot holds (seq, tasks) for seqs (_taken, _received], in order;
        # _received only grows and is written, with _slot, under _lock by the receiver.
        self._lock = threading.Lock()
        self._slot = collections.deque()
        self._received = 0
        self._taken = 0  # event loop only
        # external_barrier: the caller orders the ranks with its own barrier, so decisions
        # are indexed by this rank's get_tasks() call count instead of our barrier's
        # generation (see the class docstring).
        self.external_barrier = bool(external_barrier)
        self._calls = 0  # get_tasks() calls so far (event loop only)
        # What the receiving side learned for the event loop: a failure, the engine's
        # CLOSE (EngineClosedError, deferred until everything sent was taken), or this
        # client's own close() (ClosedError). Every step call reads it first.
        self._error = None
        self._error_raised = False  # sync mode: the original error was raised once
        self._close_seq = None  # the engine's last seq, from its CLOSE message
        self._engine_instance = 0  # the engine that welcomed this rank (receiver only)
        self._epoch_tag = 0  # the group's ack board tag, from WELCOME
        self._bound = False  # welcomed once: from now on, silence means the engine is gone
        self._last_heard = time.monotonic()
        self._closed = False
        self._counters = collections.Counter()
        self._peer_log = RateLimitedLog(log)

        # Node-local engine (ipc): acknowledge through its ack board (a store, no send).
        # Attached by the receiver when the engine welcomes it: the engine exists then.
        self._board = None
        self._board_wanted = ipc_path(self.endpoint) is not None
        self._payload_reader = None  # shared-memory batches (_decode_shared), receiver only
        who = f"TaskClient rank {tp_rank} of {name!r} dp_id={dp_id}"
        path = ipc_path(self.endpoint)
        if path is not None:
            check_ipc_endpoint(path)  # never connect to a socket another user could own
        self._auth = ClientAuth.load(self.endpoint, keys_dir, insecure_tcp)
        # libzmq aborts the process when it runs out of fds: fail here, cleanly, instead
        ensure_free_fds(CLIENT_FDS, who)
        self._group = _make_group(name, dp_id, tp_size, tp_rank, coordinator)
        self.incarnation = self._group.incarnation
        self._ctx = zmq.Context(io_threads=1)
        self._hb_sock = None
        try:
            self._data = self._connect()
            # HELLO tells the engine where this rank (re)starts. The first one is sent at
            # once (a DEALER queues it until the connection is up, so a worker may start
            # before the engine); the monitor re-sends it on every *re*connection.
            self._monitor = self._data.get_monitor_socket(
                zmq.EVENT_CONNECTED | HANDSHAKE_FAILED_EVENTS)
            self._connections = 0
            self._ack = self._connect()
            if not self.async_prefetch:
                self._hb_sock = self._connect()
        except BaseException:
            self._ctx.destroy(linger=0)
            self._group.close()
            raise
        self._wake = WakePipe()
        self._thread = None
        if not self.async_prefetch:
            self._send_hello()
            target, role = self._heartbeat_main, "heartbeat"
        else:
            target, role = self._prefetch_main, "prefetch"
        self._thread = threading.Thread(target=target, daemon=True,
                                        name=f"fdsync-{role}-{name}-r{tp_rank}")
        self._thread.start()
        if profile:
            self.profiler.attach(self)

    def _connect(self) -> zmq.Socket:
        sock = new_socket(self._ctx, zmq.DEALER)
        # What the engine may make us allocate: one batch, plus room for the header.
        sock.setsockopt(zmq.MAXMSGSIZE, envs.max_message_bytes() + 4096)
        self.heartbeat.configure_socket(sock)
        if self._auth is not None:
            self._auth.apply(sock)
        sock.connect(self.endpoint)
        return sock

    # -- step API (event loop thread) --------------------------------------------------------

    def exist_tasks(self) -> bool:
        """True when every rank of the group holds at least one batch not yet taken.

        On rank 0 a True result latches "the next barrier's step takes up to seq N" for
        the whole group; calling it again before the barrier may raise N. On other ranks
        it only reports. Never blocks. Async mode: a few shared-memory reads, no socket,
        no lock. Sync mode: first receives whatever has arrived.

        With ``coordinator="paddle"`` (ranks on several nodes) it can only speak for rank 0;
        the barrier's all-reduce then takes what every rank holds (see ``paddle_group``).
        """
        if self._error is not None:
            self._raise_error()
        if not self.async_prefetch:
            self._receive_now()
        taken = self._taken
        if self._received <= taken:  # this rank holds nothing new: no shared memory read
            return False
        upto = self._group.min_received()
        if upto <= taken:
            return False
        if self.tp_rank == 0:
            index = self._calls + 1 if self.external_barrier else self._group.gen + 1
            self._group.latch(index, taken, upto)
        return True

    def wait_for_tasks(self, timeout: float) -> bool:
        """Rank 0's idle wait: block until ``exist_tasks()`` would return True, then latch
        exactly as it does and return True; return False once ``timeout`` seconds passed.

        For an idle loop that would otherwise poll ``exist_tasks()`` every millisecond::

            if tp_rank == 0: client.wait_for_tasks(0.1)   # or exist_tasks(): both work
            client.barrier()
            tasks, _ = client.get_tasks()

        Blocks with the GIL released and no CPU: the receiver of whichever rank completes
        the batch posts rank 0's semaphore (node-local group, ~30 µs wake-up; TP=1: a
        condition variable). Without a post it re-checks after 10 ms, backing off to every
        100 ms while nothing comes.

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
        deadline = time.monotonic() + timeout
        if self.exist_tasks():
            return True
        need = self._taken + 1
        if not self.async_prefetch:
            # this rank's own batch first: only this thread reads the socket
            poller = zmq.Poller()
            poller.register(self._data, zmq.POLLIN)
            poller.register(self._monitor, zmq.POLLIN)
            while self._received < need:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                # bounded: the heartbeat thread's findings wake no poll, only a semaphore
                poller.poll(min(remaining, 0.05) * 1000)
                if self.exist_tasks():  # receives, raises what the receivers learned
                    return True
        wait = getattr(self._group, "wait_received", None)

        def check():
            if self._error is not None:
                self._raise_error()
            if not self.async_prefetch:
                self._receive_now()  # CLOSE and errors keep arriving on our socket

        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return self.exist_tasks()
            if wait is None:  # paddle coordinator: min_received() is this rank's own
                time.sleep(min(remaining, 0.001))
            elif not wait(need, remaining, check):
                if self._group.peer_fault() is None:
                    return self.exist_tasks()  # timed out
                return self._after_peer_fault(deadline)
            if self.exist_tasks():
                return True

    def _after_peer_fault(self, deadline) -> bool:
        """A peer stopped at an engine-side error while rank 0 waited: raise the same kind
        of error, as ``barrier()`` would. An engine CLOSE is raised only once this rank's
        own CLOSE arrived (milliseconds later) and everything it was sent is taken; until
        then batches it still holds are offered as usual."""
        while True:
            self._check_error()
            if not self.async_prefetch:
                self._receive_now()
            if self.exist_tasks():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)

    def barrier(self, timeout: float = None) -> None:
        """Block until every rank of the group has reached this step's barrier.

        Node-local shared memory: spins (up to ``FD_SYNC_BARRIER_SPIN_US``) only while the
        partners have recently arrived within that window, else blocks on a semaphore at once
        (no CPU; see ``tp_group``).
        ``timeout`` in seconds (None = forever) raises ``BarrierTimeoutError`` naming the
        missing ranks, early if one of them exited. A no-op at tp_size=1. While waiting it
        also raises what the engine side learned (see the class docstring), so a rank
        whose peer stopped at an engine error does not wait for the timeout.
        """
        if self._error is not None:
            self._raise_error()
        if self.async_prefetch:
            self._group.barrier(timeout, check=self._check_error)
        else:
            self._receive_now()
            self._group.barrier(timeout, service=self._receive_now, check=self._check_error)

    def get_tasks(self):
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
        if self.external_barrier:
            self._calls += 1
            decision = self._group.decision(self._calls)
        else:
            decision = self._group.decision(self._group.gen)
        tasks = []
        if decision is not None and decision[1] > self._taken:
            tasks = self._take(*decision)
        return tasks, self._group.all_consumed(self._taken)

    def num_tasks(self) -> int:
        """Batches this rank holds and has not taken. Never blocks."""
        if self._error is not None:
            self._raise_error()
        if not self.async_prefetch:
            self._receive_now()
        return self._received - self._taken

    def ready_count(self) -> int:
        """Batches every rank of the group holds that this rank has not taken: what a step
        latched now would take (rank 0's view; with ``coordinator="paddle"`` this rank's
        own count, as ``exist_tasks()``). Shared-memory reads: never blocks, receives
        nothing, latches nothing, raises nothing."""
        return max(0, min(self._received, self._group.min_received()) - self._taken)

    def step_size(self) -> int:
        """After ``barrier()``: how many batches this step's ``get_tasks()`` takes (0:
        none), as every rank of the group computes it. A read; never blocks. (For a caller
        that must tell its ranks whether to call ``get_tasks()``, e.g. the FastDeploy
        drop-in's flag across nodes.) Meaningless with ``external_barrier=True``."""
        decision = self._group.decision(self._group.gen)
        if decision is None or decision[1] <= self._taken:
            return 0
        return decision[1] - self._taken

    def sync_step(self, timeout: float = None) -> list:
        """``exist_tasks()`` on rank 0, ``barrier(timeout)``, ``get_tasks()``: the batches this
        step takes, identical on every rank (``[]`` if none). Blocks only in the barrier."""
        if self.tp_rank == 0:
            self.exist_tasks()
        self.barrier(timeout)
        return self.get_tasks()[0]

    def stats(self) -> dict:
        """Counters (``garbage_frames``, ``duplicates``, ``stale``, ``pongs``...), watermarks,
        and the ids this rank is bound to, for logs and tests."""
        with self._lock:
            out = dict(self._counters)
            out.update(received=self._received, taken=self._taken, held=len(self._slot))
        out.update(worker=f"{self.worker_id:016x}", group=f"{self.incarnation:016x}",
                   engine=f"{self._engine_instance:016x}" if self._engine_instance else None,
                   engine_silent_s=round(time.monotonic() - self._last_heard, 3))
        return out

    def prefetch_cpu_seconds(self) -> float:
        """CPU time the prefetch thread has used so far (user + system), from its own
        thread clock; None in sync mode or where the platform has no per-thread clock.
        A thread blocked in poll, as it should be while idle, adds nothing here."""
        if not self.async_prefetch or not hasattr(time, "pthread_getcpuclockid"):
            return None
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))
        except (OSError, TypeError):  # the thread has exited (or never started)
            return None

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the background thread, close every socket, release the shared memory.
        Idempotent. Blocks at most ~5 s for the thread (it is normally blocked in poll and
        wakes at once)."""
        if self._closed:
            return
        self._closed = True
        profile_dir = envs.profile_dir() if self.profiler is not None else None
        if profile_dir:
            self._dump_profile(profile_dir)
        self._wake.wake()
        self._thread.join(timeout=5.0)
        if self._thread.is_alive():
            log.error("TaskClient %s rank %d: background thread did not stop within 5 s",
                      self.name, self.tp_rank)
        self._wake.close()
        self._error = ClosedError(f"TaskClient {self.name} rank {self.tp_rank} is closed")
        self._data.disable_monitor()
        self._ctx.destroy(linger=0)
        self._group.close()
        if self._board is not None:
            self._board.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _dump_profile(self, directory):
        path = os.path.join(directory, f"fdsync-profile-{self.name}-dp{self.dp_id}-"
                                       f"r{self.tp_rank}-{os.getpid()}.json")
        try:
            self.profiler.dump(path)
        except OSError as exc:  # a profile must never break the worker's shutdown
            log.error("TaskClient %s rank %d: could not write the step profile to %s: %s",
                      self.name, self.tp_rank, path, exc)

    # -- background threads ------------------------------------------------------------------

    def _prefetch_main(self):
        """Async mode: own the data socket; receive, decode, ping, watch the engine."""
        poller = zmq.Poller()
        poller.register(self._data, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake.r, zmq.POLLIN)
        interval = self.heartbeat.interval
        try:
            self._send_hello()
            next_ping = time.monotonic() + interval
            while not self._closed:
                wait_s = max(0.0, min(next_ping, self._silence_deadline()) - time.monotonic())
                poller.poll(wait_s * 1000)  # blocks with the GIL released: no CPU when idle
                if self._closed:
                    return
                self._receive_available()
                if self._close_seq is not None:
                    return  # the engine closed: nothing more will come, say nothing more
                now = time.monotonic()
                self._check_engine(now)
                if now >= next_ping:
                    next_ping = now + interval
                    self._send_ping(self._data)
        except BaseException as exc:  # never silent: re-raised on the event loop
            self._fail(exc)

    def _heartbeat_main(self):
        """Sync mode: the event loop owns the data socket; this thread only pings the
        engine on its own socket and watches for its silence, so a step longer than the
        heartbeat timeout is not taken for a dead worker."""
        poller = zmq.Poller()
        poller.register(self._hb_sock, zmq.POLLIN)
        poller.register(self._wake.r, zmq.POLLIN)
        interval = self.heartbeat.interval
        try:
            next_ping = time.monotonic()
            while not self._closed:
                wait_s = max(0.0, min(next_ping, self._silence_deadline()) - time.monotonic())
                poller.poll(wait_s * 1000)
                if self._closed:
                    return
                while True:
                    try:
                        frames = self._hb_sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_message(frames)
                if self._error is not None:
                    return  # the engine closed, or the event loop has something to raise
                # ping even before the event loop has read the WELCOME (a model may load
                # for minutes before the first step): the engine must hear this rank
                now = time.monotonic()
                self._check_engine(now)
                if now >= next_ping:
                    next_ping = now + interval
                    self._send_ping(self._hb_sock)
        except BaseException as exc:
            self._fail(exc)

    def _fail(self, exc):
        if self._closed:
            return
        if self._error is None or isinstance(self._error, EngineClosedError):
            self._error = exc
        log.error("TaskClient %s rank %d: %s; the next step call raises it", self.name,
                  self.tp_rank, exc, exc_info=not isinstance(exc, (EngineGoneError,
                                                                   EngineRejectedError)))
        self._group.wake()  # a barrier wait in progress raises it now

    def _silence_deadline(self) -> float:
        """When the engine's silence would become "gone" (wake up then to say so)."""
        if self._bound and self._close_seq is None:
            return self._last_heard + self.heartbeat.timeout + 0.001
        return float("inf")

    def _check_engine(self, now):
        if self._bound and self._close_seq is None:
            silent = now - self._last_heard
            if silent > self.heartbeat.timeout:
                raise EngineGoneError(
                    f"rank {self.tp_rank} of {self.name!r}: nothing heard from the engine at "
                    f"{self.endpoint} for {silent:.1f} s (heartbeat timeout "
                    f"{self.heartbeat.timeout:g} s): it died, hangs, or the network to it is "
                    f"down; restart the worker group once the engine is back "
                    f"(FD_SYNC_HEARTBEAT_TIMEOUT sets the bound)")

    # -- receiving (the data socket's owner: prefetch thread, or event loop in sync mode) ---

    def _receive_now(self):
        """Sync mode: receive what has arrived, on the calling (event loop) thread.

        A failure is raised as is, and latched: every later call raises
        ``PrefetchError``, so nothing can step past a batch this rank lost."""
        try:
            self._receive_available()
        except BaseException as exc:
            self._error = exc
            self._error_raised = True
            raise

    def _receive_available(self):
        if self._close_seq is not None:
            return  # the engine closed: a later engine on the endpoint is not ours
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            if event["event"] == zmq.EVENT_CONNECTED:
                self._connections += 1
                if self._connections > 1:
                    self._send_hello()
            elif event["event"] & HANDSHAKE_FAILED_EVENTS:
                # nothing was received from that peer: CURVE failed before any message
                raise AuthenticationError(
                    f"rank {self.tp_rank} of {self.name!r}: " + handshake_failure_message(
                        event["event"], self.endpoint, event["value"],
                        self._auth.keys_dir if self._auth else None))
        while True:
            try:
                frames = self._data.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._on_message(frames)
            if self._close_seq is not None:
                return

    def _header(self, kind, seq=0, aux=0):
        return codec.pack_header(kind, self.tp_rank, self.tp_size, seq=seq, aux=aux,
                                 engine=self._engine_instance, group=self.incarnation,
                                 worker=self.worker_id)

    def _send_hello(self):
        # seq: the first batch this rank does not hold; aux: what it has taken (an
        # implicit acknowledgement, in case an ACK was lost with a broken connection);
        # engine: the instance it is bound to (0: none yet), so a restarted engine knows
        # this worker holds another engine's batches.
        self._data.send_multipart([self._header(codec.HELLO, seq=self._received + 1,
                                                aux=self._taken), self.name.encode()])

    def _send_ping(self, sock):
        try:
            sock.send(self._header(codec.PING), zmq.NOBLOCK)
        except zmq.Again:  # not connected yet: the HELLO queued first will tell the engine
            pass

    def _on_message(self, frames):
        try:
            header = codec.unpack_header(frames[0].buffer)
        except ProtocolError as exc:
            self._garbage(exc)
            return
        if header.worker != self.worker_id or header.rank != self.tp_rank:
            self._counters["stale"] += 1  # addressed to another worker: not ours
            return
        kind = header.kind
        if kind == codec.ERROR:
            raise self._engine_error(header, frames)
        if header.engine != self._engine_instance:
            if kind == codec.WELCOME and not self._bound:
                self._engine_instance = header.engine
            else:
                self._counters["stale"] += 1  # from an engine this rank is not bound to
                return
        self._last_heard = time.monotonic()
        if kind == codec.DATA:
            self._on_data(header, frames)
        elif kind == codec.PONG:
            self._counters["pongs"] += 1
        elif kind == codec.WELCOME:
            self._epoch_tag = header.aux << EPOCH_SHIFT
            if self._board_wanted:
                self._board_wanted = False
                self._board = AckBoard.attach(self.name, self.dp_id, self.tp_size)
            self._bound = True
        elif kind == codec.CLOSE:
            self._close_seq = header.seq
            if self._error is None:
                self._error = EngineClosedError(
                    f"rank {self.tp_rank} of {self.name!r}: the engine at {self.endpoint} "
                    f"closed the queue; every batch it sent was taken")
            self._group.wake()
        else:
            self._garbage(ProtocolError(f"unexpected message kind {kind}"))

    def _on_data(self, header, frames):
        if not self._bound:
            self._garbage(ProtocolError("a batch before the engine's WELCOME"))
            return
        seq = header.seq
        if seq <= self._received:
            self._counters["duplicates"] += 1  # replayed after a reconnect
            return
        if seq != self._received + 1:
            raise ProtocolError(f"rank {self.tp_rank} received seq {seq} after "
                                f"{self._received}: a batch was lost in transport")
        if len(frames) == 3:  # header, body, shared-memory reference (payload_shm)
            tasks = self._decode_shared(frames[1], frames[2], header.check)
        else:
            tasks = codec.decode_payload(frames[1:], header.check)
        with self._lock:
            self._slot.append((seq, tasks))
            self._received = seq
        self._group.publish_received(seq)  # after the slot: whoever sees it can take it

    def _decode_shared(self, body, ref, check):
        """Decode a batch whose arrays the engine wrote into node-local shared memory
        (``payload_shm.PayloadReader``): checked as for the socket path before anything is
        mapped or unpickled, then decoded zero-copy from a read-only mapping. The arrays
        keep the mapping alive; when the last of a pool batch's arrays is freed, this
        rank tells the engine (one store into the pool's header), which only then may
        reuse that memory."""
        if ipc_path(self.endpoint) is None:
            raise ProtocolError(f"rank {self.tp_rank} of {self.name!r}: a shared-memory batch "
                                f"from {self.endpoint}, which is not node-local")
        if self._payload_reader is None:
            self._payload_reader = payload_shm.PayloadReader(self.name, self.dp_id,
                                                             self.tp_size, self.tp_rank)
        self._counters["shared_batches"] += 1
        return self._payload_reader.decode(body.buffer, ref.buffer, check)

    def _engine_error(self, header, frames):
        reason = (bytes(frames[1].buffer[:4096]).decode("utf-8", "replace") if len(frames) > 1
                  else "no reason given")
        msg = f"rank {self.tp_rank} of {self.name!r}, engine at {self.endpoint}: {reason}"
        if header.aux == codec.E_STALE_ENGINE:
            return EngineGoneError(msg)
        if header.aux == codec.E_GROUP_LOST:
            return GroupLostError(msg)
        return EngineRejectedError(msg)

    def _garbage(self, exc):
        self._counters["garbage_frames"] += 1
        self._peer_log.log("garbage", logging.WARNING,
                           "TaskClient %s rank %d: dropped a message (%d so far): %s",
                           self.name, self.tp_rank, self._counters["garbage_frames"], exc)

    # -- taking (event loop) ---------------------------------------------------------------

    def _take(self, from_seq: int, to_seq: int) -> list:
        if from_seq != self._taken:
            raise ProtocolError(
                f"rank {self.tp_rank} has taken up to seq {self._taken} but the group's step "
                f"takes ({from_seq}, {to_seq}]: get_tasks() must be called on every rank of a "
                f"step or on none")
        count = to_seq - from_seq
        with self._lock:
            if len(self._slot) < count:
                raise ProtocolError(f"rank {self.tp_rank} holds {len(self._slot)} batch(es) "
                                    f"but the step takes {count}")
            items = [self._slot.popleft() for _ in range(count)]
        if items[0][0] != from_seq + 1 or items[-1][0] != to_seq:
            raise ProtocolError(f"rank {self.tp_rank} slot holds seqs {items[0][0]}..{items[-1][0]}, "
                                f"the step takes ({from_seq}, {to_seq}]")
        self._taken = to_seq
        self._group.publish_consumed(to_seq)
        board = self._board
        if board is not None:
            board.publish(self.tp_rank, self._epoch_tag | to_seq)
        else:
            self._ack.send(self._header(codec.ACK, seq=to_seq), zmq.NOBLOCK)
        return [tasks for _, tasks in items]

    def _check_error(self):
        """The barrier's check while it blocks: our own error, then a peer's fault."""
        if self._error is not None:
            self._raise_error()
        fault = self._group.peer_fault()
        if fault is not None:
            rank, code = fault
            cls = _FAULT_CLASSES.get(code, EngineRejectedError)
            if cls is EngineClosedError and (self._close_seq is None
                                             or self._taken < self._close_seq):
                return  # our own CLOSE is on its way, or we still have batches to take
            self._error = cls(f"rank {self.tp_rank} of {self.name!r}: rank {rank} of the group "
                              f"stopped at {cls.__name__} about the engine at {self.endpoint} "
                              f"(its log says why), so this step cannot complete")
            self._raise_error()

    def _raise_error(self):
        """Raise what ``_error`` holds, in this client's terms; return (raise nothing) for
        an engine CLOSE while this rank still has batches it was sent to take. An
        engine-side error is first published to the group, so that peers blocked in the
        barrier raise the same kind of error instead of "rank N exited"."""
        err = self._error
        if isinstance(err, ClosedError):
            raise ClosedError(str(err))
        for cls, code in _FAULT_CODES:
            if isinstance(err, cls):
                if cls is EngineClosedError and self._taken < (self._close_seq or 0):
                    return
                self._group.publish_fault(code)
                break
        if isinstance(err, EngineClosedError):
            raise EngineClosedError(str(err))
        if not self.async_prefetch and not self._error_raised:
            self._error_raised = True
            raise err
        where = "the prefetch thread" if self.async_prefetch else "an earlier receive"
        raise PrefetchError(f"TaskClient {self.name} rank {self.tp_rank}: {where} failed: "
                            f"{err}") from err
