"""FastDeploy's engine<->worker task queue, reproduced for benchmarks (``FDManagerQueue``).

This module is the *baseline* the benchmarks (``fastdeploy-sync profile --modes fd-manager``,
``scripts/benchmarks/bench_sync.py``) compare against. It reproduces the calls, and therefore the cost
profile, of FastDeploy's ``EngineWorkerQueue`` as shipped in

    PaddlePaddle/FastDeploy  fastdeploy/inter_communicator/engine_worker_queue.py
                             commit 0070bd672ed1b2d71be4bc1d3c1c3585770f5c14
    with the worker loop of  fastdeploy/worker/worker_process.py ``event_loop_normal``
                             commit 0009064e6f6ed105cfa5d39c4a52021251e275a2

minus its two eager ``llm_logger.debug(f"...tasks={tasks}")`` lines (they format the whole
batch on every put and get even with debug logging off; leaving them out makes the baseline
faster, never slower, than what FastDeploy ships). The code is written for this project; only
the protocol and the sequence of manager calls are FastDeploy's:

* a manager process hosts a plain ``list`` of pending batches, a ``threading.Lock``, a
  per-rank read-flag list, integer ``Value`` flags and a ``threading.Barrier`` (FastDeploy's
  ``worker_process_tp_barrier``); every operation on them from another process is a
  synchronous request/response over the manager's socket (one *round trip*, "RT" below),
  arguments and results pickled each way;
* on a single node (FastDeploy: ``address[0] == "0.0.0.0"``; here ``single_node=True``, the
  default) the "tasks exist" flag is *not* a manager ``Value`` but a shared-memory int
  (FastDeploy's ``IPCSignal`` ``exist_tasks_intra_signal``): reading or setting it costs no
  round trip. The worker loop's own flag (``exist_task_signal``, which rank 0 sets for the
  group and the last reader clears) is shared memory too. Across nodes both go through the
  manager (``exist_tasks_inter_signal``, ``read_finish_flag``).

Round trips per call, counted as manager requests (``tp`` = ``tp_size``; a manager-side
error such as the ``IndexError`` that ends a proxy iteration is still one round trip;
``tests/integration/test_fd_baseline.py`` counts them):

=====================  ==============================  ===================================
call                   single node (default)           across nodes (``single_node=False``)
=====================  ==============================  ===================================
``exist_tasks()``      0 (shared-memory read)          1
``num_tasks()``        3: acquire, ``len``, release    3
``put_tasks()``        ``tp + 6``: acquire, ``sum``    ``tp + 7`` (the exist flag is a
                       over the read flags (``tp``     ``Value``)
                       ``__getitem__`` + the one that
                       raises), clear the list, reset
                       the flags, append, release;
                       plus ``tp + 3`` per 1 ms poll
                       while a rank has not read
``get_tasks()``        ``tp + 9``, or ``tp + 10`` for  ``tp + 9``, or ``tp + 11`` for the
                       the last reader: acquire; copy  last reader (it also clears the
                       the list (``len`` hint, one     exist ``Value``)
                       ``__getitem__`` for the batch,
                       one that raises); set own read
                       flag; ``numpy.sum`` of the flags
                       (``len`` twice, ``tp + 1``
                       ``__getitem__``); the last
                       reader clears the list; release
``barrier()``          1 per rank, held open on the    1
                       manager until all ranks arrive
=====================  ==============================  ===================================

Per step of FastDeploy's worker loop (``FDManagerSteps`` in ``loops.py`` makes these calls):
rank 0 checks ``exist_tasks()`` (0 RT) and, if a batch waits, sets the group's
``exist_task_signal`` (0 RT); every rank passes the TP barrier (1 RT here: FastDeploy uses
this manager barrier on XPU and with the overlap scheduler, ``paddle.distributed.barrier``
otherwise); every rank then tests ``exist_task_signal == EXIST or read_finish_flag.get()``:
a step without a batch costs each rank that 1 RT for ``read_finish_flag``, a step with one
costs ``get_tasks()``'s ``tp + 9``/``tp + 10``, and the last reader clears the signal (0 RT).

The module must stay importable without paddle (and without a GPU); it needs numpy and
posix_ipc (through ``fastdeploy_sync.shm``).
"""

from __future__ import annotations

import functools
import os
import re
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.managers import (  # type: ignore[attr-defined]
    AcquirerProxy,  # this, BarrierProxy and Value: defined there, missing from typeshed
    BarrierProxy,
    BaseManager,
    ListProxy,
    Value,
    ValueProxy,
)
from typing import Any, cast

import numpy as np

from ..shm.segment import Segment, unlink_segment

__all__ = ["FDManagerQueue", "remove_stale_flags"]

# How long put_tasks() sleeps between polls of the read flags: FastDeploy's 1 ms, with the
# lock released in between (the same put latency and the same load on the manager).
_PUT_POLL_INTERVAL_S = 0.001

# First/maximum pause between connection attempts.  The worker processes usually start
# before (or while) the engine brings the manager up, so refused connections are expected
# for a short while; the pause doubles up to the cap so a slow start does not hammer it.
_CONNECT_RETRY_FIRST_S = 0.01
_CONNECT_RETRY_MAX_S = 0.25

# The single-node flags: one shared-memory segment per queue, named after the manager's
# port as FastDeploy names its IPCSignal (``exist_tasks_intra_signal.{port}``), so a client
# finds it from the address alone.  Two int64 slots:
_EXIST_TASKS = 0  # the queue's "tasks exist" flag (FastDeploy: exist_tasks_intra_signal)
_EXIST_TASK_SIGNAL = 1  # the worker loop's group flag (FastDeploy: exist_task_signal)
_SIGNAL_SLOTS = 2


def _signal_name(port: int) -> str:
    return f"/fdsync-fdq-exist-{port}"


_SIGNAL_RE = re.compile(r"fdsync-fdq-exist-\d+")


def remove_stale_flags() -> None:
    """Unlink the flags segments of servers that are gone (a profile run that killed its
    engine at the exit bound left one per run; a new server and the profile runner call
    this). Whatever their port: a live server holds
    its segment's owner lock, and ``unlink_segment`` leaves a locked segment alone."""
    try:
        entries = os.listdir("/dev/shm")
    except OSError:
        return
    for entry in entries:
        if _SIGNAL_RE.fullmatch(entry):
            unlink_segment("/" + entry)


# --------------------------------------------------------------------------------------
# Manager-side state.
#
# The shared objects must live in the *manager* process.  They are created there by
# ``_init_server_state`` (passed as the manager's initializer) and handed out by
# module-level getter functions.  Module-level functions (instead of closures over ``self``,
# as FastDeploy registers them) are what makes the manager start under the "spawn" start
# method too: the registry, callables included, is pickled into the new process, and only
# top-level functions pickle by reference.
# --------------------------------------------------------------------------------------

_server_state: dict | None = None


def _init_server_state(tp_size: int) -> None:
    """Build the shared objects; runs once, inside the manager process, before it serves."""
    global _server_state
    _server_state = {
        "tasks": [],
        # Every rank starts as "has read": there is no previous batch to wait for, so the
        # first put_tasks() must not block.
        "client_read_flag": [1] * tp_size,
        "lock": threading.Lock(),
        "read_finish_flag": Value("i", 0),
        "exist_tasks_inter_signal": Value("i", 0),
        "connected_client_counter": Value("i", 0),
        "barrier": threading.Barrier(tp_size),
    }


def _state(name: str) -> Any:
    if _server_state is None:  # pragma: no cover - the initializer always runs first
        raise RuntimeError("FDManagerQueue manager state is not initialised")
    return _server_state[name]


class _FDQueueManager(BaseManager):
    """Manager class for the queue.

    Registered once, at import, with callables: a client ignores the callables (it only
    uses the type ids to ask the remote manager for proxies), so server and clients can
    share this one class even inside a single process.  Registering client-style
    (``callable=None``) on the same class would clobber the server's registry.
    """


# get_<name> hands out the shared object <name>; functools.partial of a top-level function
# pickles by reference, as the "spawn" start method needs (see above).
for _name, _proxy in (("tasks", ListProxy), ("client_read_flag", ListProxy),
                      ("lock", AcquirerProxy), ("read_finish_flag", ValueProxy),
                      ("exist_tasks_inter_signal", ValueProxy),
                      ("connected_client_counter", ValueProxy), ("barrier", BarrierProxy)):
    _FDQueueManager.register(f"get_{_name}", callable=functools.partial(_state, _name),
                             proxytype=_proxy)


class FDManagerQueue:
    """FastDeploy's ``EngineWorkerQueue`` task path (one batch in flight at a time).

    One instance is the *server* (``is_server=True``, normally owned by the engine): it
    starts a manager in a separate process (``BaseManager.start()``, default start method)
    hosting the shared objects and, with ``single_node``, creates the shared-memory flags.
    Every worker rank builds a *client* (``is_server=False``) with the server's
    :attr:`address`, its ``tp_rank`` and the same ``tp_size``, ``authkey`` and
    ``single_node``.  The server instance can call every method too (the engine uses it for
    :meth:`put_tasks`, as FastDeploy's engine uses a client with ``client_id=0``).

    Protocol (FastDeploy's): the engine puts one batch; every rank calls :meth:`get_tasks`
    once for it; the rank whose read completes the set (the *last reader*, the only one that
    gets ``all_client_read=True``) empties the list and clears the "tasks exist" flag; the
    next :meth:`put_tasks` waits until every rank has read.  A rank that calls
    :meth:`get_tasks` twice for one batch gets it twice and a rank that calls it early gets
    ``[]``: callers keep the ranks in step, as FastDeploy's loop does (rank 0 checks
    :meth:`exist_tasks` and sets the group flag, :meth:`barrier`, every rank that sees the
    flag reads, the last reader clears the flag): see :meth:`set_exist_task_signal` and
    :meth:`set_read_finish_flag`.

    Thread-safety: an instance may be used from several threads (the manager proxies keep one
    connection per thread), but a single rank is expected to be one thread.

    Raises ``TimeoutError`` (client) when the manager, or with ``single_node`` its flags
    segment, cannot be reached within ``connect_timeout`` seconds,
    ``multiprocessing.AuthenticationError`` on a wrong ``authkey`` (not retried),
    ``ValueError`` on a bad ``tp_size``/``tp_rank`` or a ``tp_size`` that differs from the
    server's.
    """

    def __init__(
        self,
        address: tuple[str, int] = ("127.0.0.1", 0),
        authkey: bytes = b"fdsync",
        is_server: bool = False,
        tp_size: int = 1,
        tp_rank: int = 0,
        connect_timeout: float = 10.0,
        single_node: bool = True,
    ) -> None:
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
        self.is_server = is_server
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.single_node = single_node
        self._authkey = authkey
        self._closed = False
        self._segment: Segment | None = None
        self._signals: Any = None  # an int64 array over the segment, on a single node
        host, port = address
        self._manager = _FDQueueManager(address=(host, port), authkey=authkey)

        if is_server:
            self._manager.start(initializer=_init_server_state, initargs=(tp_size,))
        deadline = time.monotonic() + connect_timeout
        try:
            if not is_server:
                self._connect(deadline, connect_timeout)
            self._attach_proxies()
            if single_node:
                self._open_signals(deadline, connect_timeout)
            if not is_server:
                # FastDeploy's client asserts the group size on connect; a mismatch would
                # otherwise only show up as put_tasks() waiting forever for a rank that
                # cannot exist.  Then the same registration bookkeeping (4 RTs, once).
                if len(self._client_read_flag) != tp_size:
                    raise ValueError(
                        f"tp_size={tp_size} does not match the server's tp_size="
                        f"{len(self._client_read_flag)} at {self.address!r}"
                    )
                self._lock.acquire()
                try:
                    self._connected_client_counter.set(self._connected_client_counter.get() + 1)
                finally:
                    self._lock.release()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ setup / teardown

    def _connect(self, deadline: float, connect_timeout: float) -> None:
        """Connect to the manager, retrying refused/unreachable connections until the deadline."""
        pause = _CONNECT_RETRY_FIRST_S
        last_error: BaseException | None = None
        while True:
            try:
                self._manager.connect()
                return
            except AuthenticationError:
                # A wrong key will not fix itself: fail now rather than after the timeout.
                raise
            except (OSError, EOFError) as exc:  # refused, reset, unreachable, half-open
                last_error = exc
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"FDManagerQueue client (tp_rank={self.tp_rank}) could not connect to the "
                    f"queue manager at {self._manager.address!r} within {connect_timeout:.3g}s; "
                    f"is the server running? last error: {last_error!r}"
                ) from last_error
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, _CONNECT_RETRY_MAX_S)

    def _open_signals(self, deadline: float, connect_timeout: float) -> None:
        """Server: create the single-node flags segment (replacing a leftover of the same
        name, as FastDeploy's IPCSignal does).  Client: attach to it; the server creates it
        right after its manager is up, so a client that connected may have to wait briefly."""
        name = _signal_name(self.address[1])
        size = _SIGNAL_SLOTS * 8
        if self.is_server:
            remove_stale_flags()
            unlink_segment(name)
            self._segment = Segment.create(name, size)
        else:
            while True:
                try:
                    seg = Segment.attach(name)
                    if seg.size >= size:
                        self._segment = seg
                        break
                    seg.close()  # the server is between shm_open and ftruncate
                except FileNotFoundError:
                    pass
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"FDManagerQueue client (tp_rank={self.tp_rank}): the queue's shared-"
                        f"memory flags {name} did not appear within {connect_timeout:.3g}s; the "
                        f"server at {self.address!r} must be on this machine with "
                        f"single_node=True (or pass single_node=False on every instance)"
                    )
                time.sleep(_CONNECT_RETRY_FIRST_S)
        # Read and written through numpy, as FastDeploy's IPCSignal.value is (a numpy scalar
        # index costs ~2-3x a memoryview's; the point is to pay what FastDeploy pays).
        self._signals = np.frombuffer(self._segment.view, dtype=np.int64, count=_SIGNAL_SLOTS)

    def _attach_proxies(self) -> None:
        # One proxy per shared object, created once: creating a proxy costs round trips
        # of its own, so (as in FastDeploy) it is done at construction, not per call.
        m: Any = self._manager  # the get_* methods are registered at run time
        self._tasks = m.get_tasks()
        self._client_read_flag = m.get_client_read_flag()
        self._lock = m.get_lock()
        self._read_finish_flag = m.get_read_finish_flag()
        self._exist_tasks_inter_signal = m.get_exist_tasks_inter_signal()
        self._connected_client_counter = m.get_connected_client_counter()
        self._barrier = m.get_barrier()

    _PROXY_ATTRS = (
        "_tasks",
        "_client_read_flag",
        "_lock",
        "_read_finish_flag",
        "_exist_tasks_inter_signal",
        "_connected_client_counter",
        "_barrier",
    )

    @property
    def address(self) -> tuple[str, int]:
        """The manager's ``(host, port)``; on a server started with port 0, the port actually bound."""
        host, port = cast(tuple, self._manager.address)
        return host, port

    def close(self) -> None:
        """Release this instance; idempotent, never blocks for long.

        Client: drops its proxies (each sends a decref to the manager) and unmaps the flags;
        the manager and the other ranks are unaffected.  Server: also unlinks the flags
        segment and shuts the manager process down (``BaseManager.shutdown()``: asks it to
        stop, waits up to ~1 s, then terminates it); clients still connected get connection
        errors on their next manager call.
        """
        if self._closed:
            return
        self._closed = True
        # Dropping the proxies first lets their decrefs reach a still-running manager
        # instead of failing against a dead one.
        for name in self._PROXY_ATTRS:
            if hasattr(self, name):
                setattr(self, name, None)
        self._signals = None  # the numpy view must go before the segment can unmap
        if self._segment is not None:
            if self.is_server:
                unlink_segment(self._segment.name)
            self._segment.close()
            self._segment = None
        if self.is_server and getattr(self._manager, "_process", None) is not None:
            self._manager.shutdown()

    def __enter__(self) -> FDManagerQueue:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("FDManagerQueue is closed")

    # ------------------------------------------------------------------ flags

    def exist_tasks(self) -> bool:
        """True from :meth:`put_tasks` until the last reader's :meth:`get_tasks`; never blocks.

        Single node: a shared-memory read (0 RT).  Otherwise the manager ``Value`` (1 RT)."""
        self._check_open()
        if self.single_node:
            return self._signals[_EXIST_TASKS] == 1
        return self._exist_tasks_inter_signal.get() == 1

    def set_exist_tasks(self, flag: bool) -> None:
        """Set the "tasks exist" flag (0 RT on a single node, else 1); never blocks."""
        self._check_open()
        value = 1 if flag else 0
        if self.single_node:
            self._signals[_EXIST_TASKS] = value
        else:
            self._exist_tasks_inter_signal.set(value)

    def exist_task_signal(self) -> bool:
        """The worker loop's group flag (FastDeploy's ``exist_task_signal``, single node
        only): rank 0 sets it when :meth:`exist_tasks`, every rank reads after the barrier,
        the last reader clears it.  A shared-memory read (0 RT), never blocks."""
        self._check_open()
        return self._require_signals()[_EXIST_TASK_SIGNAL] == 1

    def set_exist_task_signal(self, flag: bool) -> None:
        """Set or clear the worker loop's group flag (0 RT); see :meth:`exist_task_signal`."""
        self._check_open()
        self._require_signals()[_EXIST_TASK_SIGNAL] = 1 if flag else 0

    def _require_signals(self) -> np.ndarray:
        if self._signals is None:
            raise RuntimeError(
                "exist_task_signal is a single-node flag: this FDManagerQueue was built with "
                "single_node=False; use set_read_finish_flag/get_read_finish_flag instead"
            )
        return self._signals

    def set_read_finish_flag(self, flag: bool = True) -> None:
        """Set the manager's read-finish flag (1 RT, non-blocking): the group flag across
        nodes (FastDeploy's loop with ``nnode > 1``; the last reader clears it)."""
        self._check_open()
        self._read_finish_flag.set(1 if flag else 0)

    def get_read_finish_flag(self) -> bool:
        """Read the manager's read-finish flag (1 RT, non-blocking).  FastDeploy's single-node
        loop reads it on every step on which :meth:`exist_task_signal` is clear."""
        self._check_open()
        return self._read_finish_flag.get() == 1

    # ------------------------------------------------------------------ engine side

    def put_tasks(self, tasks: Any, timeout: float | None = None) -> None:
        """Publish one batch ``tasks`` to every rank (engine side); ``tp + 6`` RT (single node).

        Blocks while the previous batch has not been read by all ``tp_size`` ranks, polling
        every 1 ms with the lock released in between (``tp + 3`` RT per poll).
        ``timeout=None`` waits forever, as FastDeploy does; otherwise raises ``TimeoutError``
        once ``timeout`` seconds have passed without the previous batch being fully read (or
        without obtaining the lock), and the batch is then *not* published.  ``tasks`` is
        stored as one element: every rank's :meth:`get_tasks` returns ``[tasks]``.  It must
        be picklable.
        """
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        self._acquire(deadline, timeout)
        held = True
        try:
            # sum() walks the proxy item by item (tp + 1 RTs per check), as FastDeploy's does.
            while sum(self._client_read_flag) < self.tp_size:
                # Release while sleeping so the ranks can take the lock to read.
                self._lock.release()
                held = False
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"put_tasks timed out after {timeout}s: the previous batch has not been "
                        f"read by all {self.tp_size} rank(s) of the queue at {self.address!r} "
                        f"(read flags {self._client_read_flag[:]}); is every rank's loop running?"
                    )
                time.sleep(_PUT_POLL_INTERVAL_S)
                self._acquire(deadline, timeout)
                held = True
            # Replace, do not accumulate: everybody has read the old batch.
            self._tasks[:] = []
            self._client_read_flag[:] = [0] * self.tp_size
            self._tasks.append(tasks)
            self.set_exist_tasks(True)
        finally:
            if held:
                self._lock.release()

    def _acquire(self, deadline: float | None, timeout: float | None) -> None:
        """Take the manager lock (1 RT), raising TimeoutError if it is not free before ``deadline``."""
        if deadline is None:
            self._lock.acquire()
            return
        if not self._lock.acquire(True, max(0.0, deadline - time.monotonic())):
            raise TimeoutError(
                f"put_tasks timed out after {timeout}s waiting for the queue lock at "
                f"{self.address!r}"
            )

    # ------------------------------------------------------------------ worker side

    def get_tasks(self) -> tuple[list[Any], bool]:
        """Take this rank's copy of the pending batch (worker side); ``tp + 9`` RT, ``tp + 10``
        for the last reader (single node).

        Returns ``(tasks, all_client_read)``: ``tasks`` is ``[batch]`` (the object given to
        :meth:`put_tasks`) or ``[]`` when nothing is pending; ``all_client_read`` is True for
        exactly one rank per batch, the one whose read completed the set (it also emptied
        the list and cleared the "tasks exist" flag, which unblocks the next ``put_tasks``).
        It is also True for a read while nothing was put since the last full set (every
        flag is still set), as in FastDeploy.

        Does not wait for tasks: only blocks while another process holds the queue lock,
        which is held only for one put/get/num_tasks critical section; there is no timeout
        (as in FastDeploy).  It does not touch the group flags: the caller clears
        :meth:`set_exist_task_signal` (or the read-finish flag) when it was the last reader.
        """
        self._check_open()
        tasks: list[Any] = []
        self._lock.acquire()
        try:
            # extend() over a proxy: len hint, then one __getitem__ per item until IndexError.
            tasks.extend(self._tasks)
            self._client_read_flag[self.tp_rank] = 1
            # numpy walks the proxy as a sequence (len twice, tp + 1 __getitem__).
            all_client_read = bool(np.sum(self._client_read_flag) == self.tp_size)
            if all_client_read:
                self._tasks[:] = []
                self.set_exist_tasks(False)
        finally:
            self._lock.release()
        return tasks, all_client_read

    def num_tasks(self) -> int:
        """Number of pending batches (0 or 1): acquire, len, release - 3 RTs; blocks only on the lock."""
        self._check_open()
        self._lock.acquire()
        try:
            return len(self._tasks)
        finally:
            self._lock.release()

    def barrier(self, timeout: float | None = None) -> None:
        """Wait until all ``tp_size`` ranks have called ``barrier()`` (1 RT held open on the
        manager; FastDeploy's ``worker_process_tp_barrier``).

        ``timeout=None`` waits forever.  Otherwise raises ``TimeoutError`` if the group is not
        complete within ``timeout`` seconds.  As with ``threading.Barrier`` (which this wraps),
        a timeout *breaks* the barrier: ranks already waiting, and every later call, also get
        ``TimeoutError`` (broken barrier) - the group must be torn down and rebuilt.
        """
        self._check_open()
        try:
            self._barrier.wait(timeout)
        except threading.BrokenBarrierError as exc:
            raise TimeoutError(
                f"barrier (tp_rank={self.tp_rank}, tp_size={self.tp_size}) at {self.address!r} "
                f"timed out after {timeout}s or was broken by another rank's timeout"
            ) from exc
