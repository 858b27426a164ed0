"""FastDeploy-style engine<->worker task queue on ``multiprocessing.managers`` (benchmark baseline).

This module is the *baseline* the benchmarks compare against.  It deliberately keeps the
design, and therefore the cost profile, of a FastDeploy-style engine/worker queue:

* a manager process hosts a plain ``list`` of pending batches, a ``threading.Lock``, a
  per-rank read-flag list, a few integer ``Value`` flags and a ``threading.Barrier``;
* every operation on those objects from an engine or worker process is a synchronous
  request/response over the manager's socket (one *round trip*, "RT" below), with the
  arguments and results pickled each way.

Nothing here is optimised on purpose: the point is to pay the same round trips a
FastDeploy-style worker pays, so that a comparison measures the design, not a strawman.
Round trips per call (``tp`` = ``tp_size``; counted as manager requests; a manager-side
error such as the ``IndexError`` that ends a proxy iteration is still one round trip):

* ``num_tasks()``      3:          acquire, ``len``, release.
* ``exist_tasks()``    1:          read the "tasks exist" flag.
* ``get_tasks()``      ``tp + 9`` if this rank is not the last reader, ``tp + 12`` if it is
                       (13 at tp=1, where the one rank is always last; 17/20 at tp=8):
                       acquire; copy the list (``len`` hint, one ``__getitem__`` for the pending
                       batch, one that raises ``IndexError``); set own read flag; sum all flags
                       (``numpy.sum`` on a sequence proxy: ``len`` twice, then ``tp + 1``
                       ``__getitem__``); when every rank has now read: clear the list, clear the
                       "tasks exist" flag and the read-finish flag; release.
* ``put_tasks()``      ``tp + 7`` when the previous batch is already read by every rank, plus
                       ``tp + 3`` for every 1 ms poll while it is not.
* ``barrier()``        1 per rank, held open on the manager until all ``tp`` ranks arrive.

The module must stay importable without paddle (and without a GPU); it only needs numpy.
"""

from __future__ import annotations

import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.managers import (
    AcquirerProxy,
    BarrierProxy,
    BaseManager,
    ListProxy,
    Value,
    ValueProxy,
)
from typing import Any, List, Optional, Tuple

import numpy as np

__all__ = ["FDManagerQueue"]

# How long put_tasks() sleeps between polls of the read flags.  A FastDeploy-style engine
# polls every millisecond with the lock released in between; keeping the same period keeps
# the baseline's put latency (and its load on the manager) comparable.
_PUT_POLL_INTERVAL_S = 0.001

# First/maximum pause between connection attempts.  The worker processes usually start
# before (or while) the engine brings the manager up, so refused connections are expected
# for a short while; the pause doubles up to the cap so a slow start does not hammer it.
_CONNECT_RETRY_FIRST_S = 0.01
_CONNECT_RETRY_MAX_S = 0.25


# --------------------------------------------------------------------------------------
# Manager-side state.
#
# The shared objects must live in the *manager* process.  They are created there by
# ``_init_server_state`` (passed as the manager's initializer) and handed out by
# module-level getter functions.  Module-level functions (instead of closures over ``self``)
# are what makes the manager start under the "spawn" start method too: the registry,
# callables included, is pickled into the new process, and only top-level functions
# pickle by reference.
# --------------------------------------------------------------------------------------

_server_state: Optional[dict] = None


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
        "exist_tasks_signal": Value("i", 0),
        "connected_client_counter": Value("i", 0),
        "barrier": threading.Barrier(tp_size),
    }


def _state(name: str) -> Any:
    if _server_state is None:  # pragma: no cover - the initializer always runs first
        raise RuntimeError("FDManagerQueue manager state is not initialised")
    return _server_state[name]


def _get_tasks() -> list:
    return _state("tasks")


def _get_client_read_flag() -> list:
    return _state("client_read_flag")


def _get_lock() -> threading.Lock:
    return _state("lock")


def _get_read_finish_flag() -> Any:
    return _state("read_finish_flag")


def _get_exist_tasks_signal() -> Any:
    return _state("exist_tasks_signal")


def _get_connected_client_counter() -> Any:
    return _state("connected_client_counter")


def _get_barrier() -> threading.Barrier:
    return _state("barrier")


class _FDQueueManager(BaseManager):
    """Manager class for the queue.

    Registered once, at import, with callables: a client ignores the callables (it only
    uses the type ids to ask the remote manager for proxies), so server and clients can
    share this one class even inside a single process.  Registering client-style
    (``callable=None``) on the same class would clobber the server's registry.
    """


_FDQueueManager.register("get_tasks", callable=_get_tasks, proxytype=ListProxy)
_FDQueueManager.register("get_client_read_flag", callable=_get_client_read_flag, proxytype=ListProxy)
_FDQueueManager.register("get_lock", callable=_get_lock, proxytype=AcquirerProxy)
_FDQueueManager.register("get_read_finish_flag", callable=_get_read_finish_flag, proxytype=ValueProxy)
_FDQueueManager.register("get_exist_tasks_signal", callable=_get_exist_tasks_signal, proxytype=ValueProxy)
_FDQueueManager.register(
    "get_connected_client_counter", callable=_get_connected_client_counter, proxytype=ValueProxy
)
_FDQueueManager.register("get_barrier", callable=_get_barrier, proxytype=BarrierProxy)


class FDManagerQueue:
    """FastDeploy-style engine<->worker task queue (one batch in flight at a time).

    One instance is the *server* (``is_server=True``, normally owned by the engine): it
    starts a manager in a separate process (``BaseManager.start()``, using the default
    multiprocessing start method) hosting the shared objects.  Every worker rank builds a
    *client* (``is_server=False``) with the server's :attr:`address`, its ``tp_rank`` and the
    same ``tp_size`` and ``authkey``.  The server instance can also call every method (the
    engine uses it for :meth:`put_tasks`); its rank for :meth:`get_tasks` is ``tp_rank``.

    Protocol: the engine puts one batch; every rank of the group calls :meth:`get_tasks`
    once for it; the last rank to read clears it, and only then can the next batch be put.
    A rank that calls :meth:`get_tasks` twice for the same batch gets it twice, exactly like
    FastDeploy - callers keep the ranks in step (rank 0 decides, :meth:`barrier`, all read),
    see :meth:`set_read_finish_flag`.

    Thread-safety: an instance may be used from several threads (the manager proxies keep one
    connection per thread), but a single rank is expected to be one thread.

    Raises ``TimeoutError`` (client) when the manager cannot be reached within
    ``connect_timeout`` seconds, ``multiprocessing.AuthenticationError`` on a wrong
    ``authkey`` (not retried), ``ValueError`` on a bad ``tp_size``/``tp_rank`` or a
    ``tp_size`` that differs from the server's.
    """

    def __init__(
        self,
        address: Tuple[str, int] = ("127.0.0.1", 0),
        authkey: bytes = b"fdsync",
        is_server: bool = False,
        tp_size: int = 1,
        tp_rank: int = 0,
        connect_timeout: float = 10.0,
    ) -> None:
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
        self.is_server = is_server
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self._authkey = authkey
        self._closed = False
        self._manager = _FDQueueManager(address=tuple(address), authkey=authkey)

        if is_server:
            self._manager.start(initializer=_init_server_state, initargs=(tp_size,))
        else:
            self._connect(connect_timeout)

        try:
            self._attach_proxies()
            if not is_server:
                # Same registration bookkeeping a FastDeploy-style worker does on connect
                # (4 RTs, once); also verifies the group size, which would otherwise only
                # show up later as put_tasks() waiting forever for a rank that cannot exist.
                if len(self._client_read_flag) != tp_size:
                    raise ValueError(
                        f"tp_size={tp_size} does not match the server's tp_size="
                        f"{len(self._client_read_flag)}"
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

    def _connect(self, connect_timeout: float) -> None:
        """Connect to the manager, retrying refused/unreachable connections until the deadline."""
        deadline = time.monotonic() + connect_timeout
        pause = _CONNECT_RETRY_FIRST_S
        last_error: Optional[BaseException] = None
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

    def _attach_proxies(self) -> None:
        # One proxy per shared object, created once: creating a proxy costs round trips
        # of its own, so (as in FastDeploy) it is done at construction, not per call.
        m = self._manager
        self._tasks = m.get_tasks()
        self._client_read_flag = m.get_client_read_flag()
        self._lock = m.get_lock()
        self._read_finish_flag = m.get_read_finish_flag()
        self._exist_tasks_signal = m.get_exist_tasks_signal()
        self._connected_client_counter = m.get_connected_client_counter()
        self._barrier = m.get_barrier()

    _PROXY_ATTRS = (
        "_tasks",
        "_client_read_flag",
        "_lock",
        "_read_finish_flag",
        "_exist_tasks_signal",
        "_connected_client_counter",
        "_barrier",
    )

    @property
    def address(self) -> Tuple[str, int]:
        """The manager's ``(host, port)``; on a server started with port 0, the port actually bound."""
        return tuple(self._manager.address)

    def close(self) -> None:
        """Release this instance; idempotent, never blocks for long.

        Client: drops its proxies (each sends a decref to the manager); the manager and
        the other ranks are unaffected.  Server: also shuts the manager process down
        (``BaseManager.shutdown()``: asks it to stop, waits up to ~1 s, then terminates it);
        clients still connected get connection errors on their next call.
        """
        if self._closed:
            return
        self._closed = True
        # Dropping the proxies first lets their decrefs reach a still-running manager
        # instead of failing against a dead one.
        for name in self._PROXY_ATTRS:
            if hasattr(self, name):
                setattr(self, name, None)
        if self.is_server and getattr(self._manager, "_process", None) is not None:
            self._manager.shutdown()

    def __enter__(self) -> "FDManagerQueue":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("FDManagerQueue is closed")

    # ------------------------------------------------------------------ engine side

    def put_tasks(self, tasks: Any, timeout: Optional[float] = None) -> None:
        """Publish one batch ``tasks`` to every rank (engine side).

        Blocks while the previous batch has not yet been read by all ``tp_size`` ranks
        (the last reader empties the list, so this is "wait until the list is empty"),
        polling every 1 ms with the lock released in between.  ``timeout=None`` waits
        forever; otherwise raises ``TimeoutError`` once ``timeout`` seconds have passed
        without the previous batch being fully read (or without obtaining the lock), and
        the batch is then *not* published.  ``tasks`` is stored as one element: every rank's
        :meth:`get_tasks` returns ``[tasks]``.  It must be picklable.
        """
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        self._acquire(deadline, timeout)
        held = True
        try:
            # sum() walks the proxy item by item (tp + 1 RTs per check): the cost FastDeploy pays.
            while sum(self._client_read_flag) < self.tp_size:
                # Release while sleeping so the ranks can take the lock to read.
                self._lock.release()
                held = False
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"put_tasks timed out after {timeout}s: the previous batch has not been "
                        f"read by all {self.tp_size} rank(s) (read flags "
                        f"{self._client_read_flag[:]})"
                    )
                time.sleep(_PUT_POLL_INTERVAL_S)
                self._acquire(deadline, timeout)
                held = True
            # Replace, do not accumulate: everybody has read the old batch.
            self._tasks[:] = []
            self._client_read_flag[:] = [0] * self.tp_size
            self._tasks.append(tasks)
            self._exist_tasks_signal.set(1)
        finally:
            if held:
                self._lock.release()

    def _acquire(self, deadline: Optional[float], timeout: Optional[float]) -> None:
        """Take the manager lock (1 RT), raising TimeoutError if it is not free before ``deadline``."""
        if deadline is None:
            self._lock.acquire()
            return
        if not self._lock.acquire(True, max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"put_tasks timed out after {timeout}s waiting for the queue lock")

    # ------------------------------------------------------------------ worker side

    def get_tasks(self) -> Tuple[List[Any], bool]:
        """Take this rank's copy of the pending batch (worker side).

        Returns ``(tasks, all_client_read)``: ``tasks`` is ``[batch]`` (the object given to
        :meth:`put_tasks`) or ``[]`` when nothing is pending; ``all_client_read`` is True for
        the rank whose read completed the set (it also cleared the list and reset the
        "tasks exist" and read-finish flags, which unblocks the next ``put_tasks``).

        Does not wait for tasks: only blocks while another process holds the queue lock,
        which is held only for the length of one put/get/num_tasks critical section; there
        is no timeout (as in FastDeploy).  Calling it twice for one batch returns it twice.
        """
        self._check_open()
        tasks: List[Any] = []
        self._lock.acquire()
        try:
            # extend() over a proxy: len hint, then one __getitem__ per item until IndexError.
            tasks.extend(self._tasks)
            self._client_read_flag[self.tp_rank] = 1
            # numpy walks the proxy as a sequence (len + tp + 1 RTs), like FastDeploy's check.
            all_client_read = bool(np.sum(self._client_read_flag) == self.tp_size)
            if all_client_read:
                self._tasks[:] = []
                self._exist_tasks_signal.set(0)
                # The rank-0 broadcast flag (see set_read_finish_flag) is reset by the last
                # reader, after everybody has consumed it.
                self._read_finish_flag.set(0)
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

    def exist_tasks(self) -> bool:
        """True while a batch is published and not yet read by every rank (1 RT, no lock, non-blocking)."""
        self._check_open()
        return self._exist_tasks_signal.get() == 1

    def set_read_finish_flag(self, flag: bool = True) -> None:
        """Set the shared read-finish flag (1 RT, non-blocking).

        FastDeploy-style workers use it to broadcast rank 0's decision: rank 0 sets it when
        it sees tasks, all ranks pass a :meth:`barrier`, then every rank that sees it set
        (:meth:`get_read_finish_flag`) calls :meth:`get_tasks`; the last reader clears it.
        """
        self._check_open()
        self._read_finish_flag.set(1 if flag else 0)

    def get_read_finish_flag(self) -> bool:
        """Read the shared read-finish flag (1 RT, non-blocking); see :meth:`set_read_finish_flag`."""
        self._check_open()
        return self._read_finish_flag.get() == 1

    def barrier(self, timeout: Optional[float] = None) -> None:
        """Wait until all ``tp_size`` ranks have called ``barrier()`` (1 RT held open on the manager).

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
                f"barrier (tp_rank={self.tp_rank}, tp_size={self.tp_size}) timed out after "
                f"{timeout}s or was broken by another rank's timeout"
            ) from exc
