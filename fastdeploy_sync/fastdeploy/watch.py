"""The engine side's view of its worker group: ``GroupLostError`` instead of a silent spin."""

import logging
import threading
import time

from ..engine.queue import TaskQueue
from ..engine.rank_link import CONNECTED, DISCONNECTED
from ..errors import GroupLostError

__all__ = ["GroupWatch"]

log = logging.getLogger(__name__)

_WATCH_EVERY_S = 0.1


class GroupWatch:
    """Engine side, one per DP group: makes ``exist_tasks()``/``put_tasks()``/``num_tasks()``
    raise ``GroupLostError`` while the worker group the queue served is lost, so that
    FastDeploy's ``while exist_tasks(): sleep(0.001)`` fails loudly instead of spinning.

    Built on the queue's public API only: ``stats()`` (``TaskQueue``) or ``status()``
    (``TaskProducer``, one round trip) every 100 ms while the group is fine (a clock read
    per call otherwise), on every call while it is lost. The group counts as lost when the
    engine retired it (``groups_retired`` grew: a rank's connection gone and not back
    within the heartbeat timeout, a rank's BYE, or ``FD_SYNC_STALL_TIMEOUT`` of silence;
    see ``liveness``), or, with a ``TaskProducer`` (the engine elsewhere), when a rank is
    disconnected and the engine has heard nothing from it for longer than the heartbeat
    timeout (by the engine's monotonic clock: a wall-clock step is not a lost group),
    whatever the engine decided. It stays lost until a new group
    has every rank connected: batches put meanwhile wait for that group (``put_tasks()``
    raises instead of waiting). With a ``TaskQueue`` the retirement's ``GroupLost`` event (its
    ``unfinished`` batches) is taken from ``group_events`` and attached to the error: only
    the retirement counts there (the engine retires a rank disconnected and silent past the
    heartbeat timeout itself, within one heartbeat interval), so the first error the engine
    loop catches carries the unfinished batches however late the queue's I/O thread runs."""

    def __init__(self, queue, where, timeout):
        # where(): names the queue in messages (a callable: the port may be known later)
        self._q, self._where, self._timeout = queue, where, timeout
        self._lock = threading.Lock()
        self._next = 0.0
        self._lost = None  # the GroupLostError raised while the group is lost
        # a TaskQueue (this process's engine) retires a gone rank's group itself, and its
        # retirement carries the unfinished batches: a loaded engine's I/O thread may run
        # its tick after a check here has seen the rank silent past the timeout, and an
        # error raised then would have handed the engine loop none of them
        self._retires = isinstance(queue, TaskQueue)
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
            elif self._lost is None and not self._retires:
                # silent_s is the engine's monotonic count since it last heard the rank:
                # a wall-clock step (NTP) moves "since", never this
                gone = [r for r in ranks if r["state"] == DISCONNECTED
                        and (r.get("silent_s") or 0) > self._timeout]
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
