"""The engine's end of one DP group: FastDeploy's engine-side task path over a ``TaskQueue``
(the server's process) or a ``TaskProducer`` (another engine process of the node).

FastDeploy's bound is one batch at a time (``max_inflight``, more if the server says so); the
queue underneath holds ``2 * max_inflight + 2`` so that ``clear_data()`` can retire what is
pending with a marker and let the engine put again at once, as FastDeploy's does: cleared
batches and their marker travel on, every rank drops them alike, and they no longer count
for ``num_tasks()``; ``exist_tasks()`` reads True until every rank drained them, as
FastDeploy's flag stays set after its ``clear_data()`` until the workers' next read.
"""

import threading
import time

from ..engine.rank_link import CONNECTED
from .clear import Clear

__all__ = ["EngineSide", "queue_capacity"]

# put_tasks() waits for room (FastDeploy: 1 ms sleeps); we start finer and back off to it.
_PUT_POLL_MIN_S = 50e-6
_PUT_POLL_MAX_S = 1e-3
# Enqueueing once room was seen: the queue has room, so this only bounds another
# process's puts into the same DP group taking it meanwhile.
_ENQUEUE_TIMEOUT_S = 5.0


def queue_capacity(max_inflight: int) -> int:
    """The ``TaskQueue`` bound for FastDeploy's ``max_inflight``: the visible batches, as
    many cleared ones (one ``clear_data()``'s worth) and a clear marker, plus one."""
    return 2 * max_inflight + 2


class EngineSide:
    """One DP group's engine side, shared by every engine-side ``EngineWorkerQueue`` of this
    process that puts into it (the server and its clients, or one producer).

    Lock invariant (``_lock``): checking for room and enqueueing happen together, and
    ``_last_seq`` / ``_cleared_upto`` change only with them: two threads putting never
    exceed ``max_inflight`` batches in flight, and a ``clear_data()`` marker always finds
    room. Waiting for room happens outside the lock, as FastDeploy's put releases its lock
    while it sleeps."""

    def __init__(self, queue, max_inflight, watch, where):
        self._q = queue  # TaskQueue or TaskProducer
        self.max_inflight = max_inflight
        self._capacity = queue_capacity(max_inflight)
        self._watch = watch  # GroupWatch: raises GroupLostError while the group is lost
        self._where = where  # callable: names the queue in messages
        self._lock = threading.Lock()
        self._last_seq = 0  # the queue's seq of the last batch (or marker) put from here
        self._cleared_upto = 0  # the seq of the last clear marker
        self._flag_off_at = None  # set_exist_tasks(False): _last_seq then

    @property
    def queue(self):
        return self._q

    def _visible(self, n) -> int:
        """Batches in flight that ``clear_data()`` has not retired (``n``: all in flight)."""
        if self._cleared_upto:
            return max(0, min(n, self._last_seq - self._cleared_upto))
        return n

    def _room(self, n) -> bool:
        return self._visible(n) < self.max_inflight and n < self._capacity - 1

    def put_tasks(self, tasks, timeout=None) -> None:
        """Enqueue one batch; blocks while ``max_inflight`` batches are not yet taken by
        every rank (polls from ``_PUT_POLL_MIN_S``, doubling to FastDeploy's own sleep,
        ``_PUT_POLL_MAX_S``). ``timeout`` (seconds,
        None = forever) raises ``TimeoutError`` with nothing enqueued; ``GroupLostError``
        (nothing enqueued) when the worker group is lost, at once or while it waits."""
        q = self._q
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = _PUT_POLL_MIN_S
        self._watch.check()
        while True:
            with self._lock:
                if self._room(q.num_tasks()):
                    self._last_seq = q.put_tasks(tasks, timeout=_ENQUEUE_TIMEOUT_S)
                    self._flag_off_at = None
                    return
            self._watch.check()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"put_tasks timed out after {timeout} s: {self.num_tasks()} "
                                   f"batch(es) not yet taken by every rank ({q.ranks()})")
            time.sleep(pause)
            pause = min(pause * 2, _PUT_POLL_MAX_S)

    def num_tasks(self) -> int:
        """Batches put and not yet taken by every rank, those a ``clear_data()`` retired
        excepted (at most ``max_inflight``)."""
        self._watch.check()
        return self._visible(self._q.num_tasks())

    def exist_tasks(self) -> bool:
        """``put_tasks()`` would wait, or batches ``clear_data()`` retired are not yet
        drained by every rank (FastDeploy's ``clear_data()`` leaves its flag set until
        the workers' next read); False after ``set_exist_tasks(False)`` until the next
        put."""
        self._watch.check()
        n = self._q.num_tasks()
        if self._flag_off_at is not None and self._flag_off_at == self._last_seq:
            return False
        return not self._room(n) or n > self._visible(n)

    def set_exist_tasks(self, flag) -> None:
        """``False``: ``exist_tasks()`` reads False until the next put (FastDeploy clears
        its flag; the batch is still delivered). ``True``: the flag follows the queue
        again."""
        self._flag_off_at = None if flag else self._last_seq

    def clear_data(self) -> None:
        """Retire what is pending (see the module docstring): one marker, which always finds
        room; nothing when nothing is pending (a second call adds nothing). Never waits
        for the workers."""
        q = self._q
        with self._lock:
            if self._visible(q.num_tasks()) == 0:
                return
            self._last_seq = self._cleared_upto = q.put_tasks(
                Clear(self._last_seq), timeout=_ENQUEUE_TIMEOUT_S)

    def connected(self) -> int:
        """TP ranks of this group connected now."""
        return sum(1 for r in self._q.ranks() if r["state"] == CONNECTED)
