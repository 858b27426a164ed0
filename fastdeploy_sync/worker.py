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
"""

import collections
import logging
import os
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from . import codec, envs
from .errors import ClosedError, EngineRejectedError, PrefetchError, ProtocolError
from .ack_board import AckBoard
from .step_profiler import StepProfiler
from .tp_group import ShmTPGroup, SoloGroup
from .transport import WakePipe, default_endpoint, ipc_path, new_socket, validate_name

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
    if isinstance(coordinator, str):
        raise ValueError(f"coordinator={coordinator!r}: expected 'shm', 'paddle' or a "
                         f"paddle.distributed group")
    return PaddleTPGroup(tp_size, tp_rank, group=coordinator)


class TaskClient:
    """One TP rank's end of the task channel.

    ``TaskClient(name, tp_size, tp_rank, *, dp_id=0, endpoint=None, async_prefetch=None)``
    connects to the engine's endpoint (derived from name and dp_id when ``endpoint`` is
    None, exactly as ``TaskQueue`` does). The engine may start before or after the
    workers: nothing is lost either way.

    Ranks other than 0 block in the constructor until rank 0 of the group exists
    (``FD_SYNC_ATTACH_TIMEOUT`` seconds, then ``TimeoutError``).

    ``async_prefetch=None`` reads ``DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM`` (``0``, the
    default: background prefetch thread; ``1``: synchronous polling, no thread).

    ``coordinator`` says how the TP ranks agree on each step: ``"shm"`` (node-local
    shared memory, the default), ``"paddle"`` (ranks on several nodes: one
    paddle.distributed all-reduce per step over the default group; see
    ``paddle_group``), or a paddle.distributed group object (the TP ranks' group).
    ``None`` reads ``FD_SYNC_TP_COORDINATOR`` (default ``shm``). Ignored at tp_size=1.

    ``profile=None`` reads ``FD_SYNC_PROFILE`` (default ``0``). When on, ``profiler`` is a
    ``StepProfiler`` timing ``exist_tasks``/``barrier``/``get_tasks`` of every step (they
    are wrapped on this instance); when off, ``profiler`` is None and nothing is timed.

    Threading: call the step methods from one thread (the event loop). Use as a context
    manager, or call ``close()``.

    Decoded numpy arrays alias the received message and are read-only; copy before writing.
    """

    def __init__(self, name: str, tp_size: int, tp_rank: int, *, dp_id: int = 0,
                 endpoint: str = None, async_prefetch: bool = None, coordinator=None,
                 profile: bool = None):
        validate_name(name, dp_id)
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size={tp_size!r}: expected an int >= 1")
        if not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank!r}: expected an int in [0, {tp_size})")
        self.name, self.tp_size, self.tp_rank, self.dp_id = name, tp_size, tp_rank, dp_id
        self.async_prefetch = (envs.async_task_comm_enabled() if async_prefetch is None
                               else bool(async_prefetch))
        self.endpoint = endpoint or default_endpoint(name, dp_id)
        profile = envs.profile_enabled() if profile is None else bool(profile)
        self.profiler = StepProfiler() if profile else None
        # Lock invariant: _slot holds (seq, tasks) for seqs (_taken, _received], in order;
        # _received only grows and is written, with _slot, under _lock by the receiver.
        self._lock = threading.Lock()
        self._slot = collections.deque()
        self._received = 0
        self._taken = 0  # event loop only
        self._error = None  # the prefetch thread's failure, re-raised by every call
        self._engine_instance = 0  # the engine's id, from the first batch (receiver only)
        self._closed = False
        self._counters = collections.Counter()

        # Node-local engine (ipc): acknowledge through its ack board (a store, no send).
        # Attached by the receiver on the first batch, when the engine surely exists.
        self._board = None
        self._board_wanted = ipc_path(self.endpoint) is not None
        self._group = _make_group(name, dp_id, tp_size, tp_rank, coordinator)
        self._ctx = zmq.Context(io_threads=1)
        try:
            self._data = new_socket(self._ctx, zmq.DEALER)
            # HELLO tells the engine where this rank (re)starts. The first one is sent at
            # once (a DEALER queues it until the connection is up, so a worker may start
            # before the engine); the monitor re-sends it on every *re*connection.
            self._monitor = self._data.get_monitor_socket(zmq.EVENT_CONNECTED)
            self._connections = 0
            self._data.connect(self.endpoint)
            self._ack = new_socket(self._ctx, zmq.DEALER)
            self._ack.connect(self.endpoint)
        except BaseException:
            self._ctx.destroy(linger=0)
            self._group.close()
            raise
        self._thread = None
        if not self.async_prefetch:
            self._send_hello()
        else:
            self._wake = WakePipe()
            self._thread = threading.Thread(target=self._prefetch_main, daemon=True,
                                            name=f"fdsync-prefetch-{name}-r{tp_rank}")
            self._thread.start()
        if profile:
            self.profiler.attach(self)

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
            self._group.latch(self._group.gen + 1, taken, upto)
        return True

    def barrier(self, timeout: float = None) -> None:
        """Block until every rank of the group has reached this step's barrier.

        Node-local shared memory: spins ~50 µs, then blocks on a semaphore (no CPU).
        ``timeout`` in seconds (None = forever) raises ``BarrierTimeoutError`` naming the
        missing ranks, early if one of them exited. A no-op at tp_size=1.
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

        Raises ``ProtocolError`` if this rank's history disagrees with rank 0's decision
        (e.g. ``get_tasks()`` was called on some ranks of an earlier step but not others).
        """
        if self._error is not None:
            self._raise_error()
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

    def sync_step(self, timeout: float = None) -> list:
        """``exist_tasks()`` on rank 0, ``barrier(timeout)``, ``get_tasks()``: the batches this
        step takes, identical on every rank (``[]`` if none). Blocks only in the barrier."""
        if self.tp_rank == 0:
            self.exist_tasks()
        self.barrier(timeout)
        return self.get_tasks()[0]

    def stats(self) -> dict:
        """Counters (``garbage_frames``, ``duplicates``...) and watermarks, for logs and tests."""
        with self._lock:
            out = dict(self._counters)
            out.update(received=self._received, taken=self._taken, held=len(self._slot))
        return out

    def prefetch_cpu_seconds(self) -> float:
        """CPU time the prefetch thread has used so far (user + system), from its own
        thread clock; None in sync mode or where the platform has no per-thread clock.
        A thread blocked in poll, as it should be while idle, adds nothing here."""
        if self._thread is None or not hasattr(time, "pthread_getcpuclockid"):
            return None
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))
        except (OSError, TypeError):  # the thread has exited (or never started)
            return None

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the prefetch thread, close every socket, release the shared memory. Idempotent.

        Blocks at most ~5 s for the prefetch thread (it is normally blocked in poll and
        wakes at once)."""
        if self._closed:
            return
        self._closed = True
        profile_dir = envs.profile_dir() if self.profiler is not None else None
        if profile_dir:
            self._dump_profile(profile_dir)
        if self._thread is not None:
            self._wake.wake()
            self._thread.join(timeout=5.0)
            if self._thread.is_alive():
                log.error("TaskClient %s rank %d: prefetch thread did not stop within 5 s",
                          self.name, self.tp_rank)
            self._wake.close()
        if self._error is None:  # the one check every step call already makes
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

    # -- receiving (the data socket's owner: prefetch thread, or event loop in sync mode) ---

    def _prefetch_main(self):
        poller = zmq.Poller()
        poller.register(self._data, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake.r, zmq.POLLIN)
        try:
            self._send_hello()
            while not self._closed:
                poller.poll()  # blocks with the GIL released: no CPU when idle
                if self._closed:
                    return
                self._receive_available()
        except BaseException as exc:  # never silent: re-raised on the event loop
            self._error = exc
            log.error("TaskClient %s rank %d: prefetch thread failed; the next step call "
                      "raises PrefetchError", self.name, self.tp_rank, exc_info=exc)
            self._group.wake()  # a barrier wait in progress raises it now

    def _receive_now(self):
        """Sync mode: receive what has arrived, on the calling (event loop) thread.

        A failure is raised as is, and latched like a prefetch thread's: every later call
        raises ``PrefetchError``, so nothing can step past a batch this rank lost.
        (After ``close()`` the step calls raise ``ClosedError`` before reaching this.)"""
        try:
            self._receive_available()
        except BaseException as exc:
            self._error = exc
            raise

    def _receive_available(self):
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            if event["event"] == zmq.EVENT_CONNECTED:
                self._connections += 1
                if self._connections > 1:
                    self._send_hello()
        while True:
            try:
                frames = self._data.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._on_message(frames)

    def _send_hello(self):
        # seq: the first batch this rank does not hold; aux: what it has taken (an
        # implicit acknowledgement, in case an ACK was lost with a broken connection);
        # then the name and the id of the engine it has received from (0: none yet).
        header = codec.pack_header(codec.HELLO, self.tp_rank, self.tp_size,
                                   seq=self._received + 1, aux=self._taken)
        self._data.send_multipart([header, self.name.encode(),
                                   self._engine_instance.to_bytes(8, "little")])

    def _on_message(self, frames):
        try:
            header = codec.unpack_header(frames[0].buffer)
        except ProtocolError as exc:
            self._counters["garbage_frames"] += 1
            log.warning("TaskClient %s rank %d: dropped an undecodable message: %s",
                        self.name, self.tp_rank, exc)
            return
        if header.kind == codec.DATA:
            if header.aux != self._engine_instance:
                if self._engine_instance:
                    raise EngineRejectedError(
                        f"rank {self.tp_rank}: the engine of {self.name!r} restarted mid-stream "
                        f"(a batch from another engine instance arrived); restart the worker "
                        f"group together with its engine")
                self._engine_instance = header.aux
            seq = header.seq
            if seq <= self._received:
                self._counters["duplicates"] += 1  # replayed after a reconnect
                return
            if seq != self._received + 1:
                raise ProtocolError(f"rank {self.tp_rank} received seq {seq} after "
                                    f"{self._received}: a batch was lost in transport")
            tasks = codec.decode_payload(frames[1:])
            if self._board_wanted:
                self._board_wanted = False
                self._board = AckBoard.attach(self.name, self.dp_id, self.tp_size)
            with self._lock:
                self._slot.append((seq, tasks))
                self._received = seq
            self._group.publish_received(seq)  # after the slot: whoever sees it can take it
        elif header.kind == codec.ERROR:
            raise EngineRejectedError(bytes(frames[1].buffer).decode("utf-8", "replace")
                                      if len(frames) > 1 else "the engine rejected this worker")
        else:
            self._counters["garbage_frames"] += 1
            log.warning("TaskClient %s rank %d: dropped unexpected message kind %d",
                        self.name, self.tp_rank, header.kind)

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
            board.publish(self.tp_rank, to_seq)
        else:
            self._ack.send(codec.pack_header(codec.ACK, self.tp_rank, self.tp_size, seq=to_seq),
                           zmq.NOBLOCK)
        return [tasks for _, tasks in items]

    def _check_error(self):
        if self._error is not None:
            self._raise_error()

    def _raise_error(self):
        if isinstance(self._error, ClosedError):
            raise ClosedError(str(self._error))
        where = "the prefetch thread" if self.async_prefetch else "an earlier receive"
        raise PrefetchError(f"TaskClient {self.name} rank {self.tp_rank}: {where} failed: "
                            f"{self._error!r}") from self._error
