"""Prometheus metrics for ``TaskQueue``s: ``pip install 'fastdeploy_sync[metrics]'``.

    from prometheus_client import CollectorRegistry, generate_latest
    from fastdeploy_sync.metrics import register

    registry = CollectorRegistry()            # or the registry your /metrics already serves
    collector = register(registry, queue)     # one or more TaskQueues; collector.add(q) later
    generate_latest(registry)                 # what a scrape returns

Everything is read at scrape time from each queue's public ``stats()`` (one call per queue
per scrape; it includes ``ranks()``): nothing runs on a worker, nothing runs between scrapes,
and the engine pays one ``stats()`` per scrape. The only bookkeeping behind it is the
engine's own (a put time per batch in flight, one histogram bucket add when the slowest rank
passes a batch). ``import fastdeploy_sync`` never imports this module or prometheus_client.

Metrics (labels ``queue`` and ``dp_id`` on every one; ``rank`` on per-rank ones):

    fdsync_batches_put_total                counter    batches put (put_tasks and producers)
    fdsync_batches_delivered_total          counter    batches consumed by every rank
    fdsync_batches_in_flight                gauge      put, not yet consumed by every rank
    fdsync_max_inflight                     gauge      the queue's bound on that
    fdsync_delivery_seconds                 histogram  put -> consumed by every rank
    fdsync_rank_consumed_seq{rank}          gauge      the rank's consumed watermark
    fdsync_rank_lag_batches{rank}           gauge      batches put that the rank has not consumed
    fdsync_rank_state{rank,state}           gauge      1 for the rank's state (connected,
                                                       disconnected, never connected), else 0
    fdsync_rank_silent_seconds{rank}        gauge      since the engine last heard from the rank
    fdsync_groups_total                     counter    worker groups admitted
    fdsync_groups_retired_total{reason}     counter    retired groups by reason (silent: heartbeat
                                                       timeout; rank_restarted; replaced; left; other)
    fdsync_rejected_peers_total             counter    HELLOs and messages refused
    fdsync_garbage_frames_total             counter    messages that did not parse
    fdsync_stale_messages_total             counter    messages of another engine, group or worker
    fdsync_unreachable_sends_total          counter    sends to a rank whose connection was gone
    fdsync_scrape_errors_total              counter    queues whose stats() raised during a scrape

A rank's ``lag`` and ``consumed`` reset when its group is retired (a new group starts at
the queue's current seq); ``delivered`` counts only batches every rank of a group took.
"""

import threading

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

__all__ = ["TaskQueueCollector", "register", "RANK_STATES"]

RANK_STATES = ("connected", "disconnected", "never connected")

_C, _G, _H = CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
_RANK = ("rank",)
# key, family, name (after the prefix), help, labels beyond queue and dp_id (None: no labels)
_FAMILIES = (
    ("put", _C, "batches_put", "Batches put into the queue", ()),
    ("delivered", _C, "batches_delivered", "Batches consumed by every rank of a worker group", ()),
    ("in_flight", _G, "batches_in_flight", "Batches put and not yet consumed by every rank", ()),
    ("max_inflight", _G, "max_inflight", "The queue's bound on batches in flight", ()),
    ("delivery", _H, "delivery_seconds",
     "Time from put_tasks() until every rank consumed the batch", ()),
    ("consumed", _G, "rank_consumed_seq", "Highest seq the rank consumed", _RANK),
    ("lag", _G, "rank_lag_batches", "Batches put that the rank has not consumed", _RANK),
    ("state", _G, "rank_state", "1 for the rank's current state, 0 for the others",
     _RANK + ("state",)),
    ("silent", _G, "rank_silent_seconds", "Seconds since the engine last heard from the rank",
     _RANK),
    ("groups", _C, "groups", "Worker groups the engine admitted", ()),
    ("retired", _C, "groups_retired", "Worker groups retired, by reason", ("reason",)),
    ("rejected", _C, "rejected_peers", "HELLOs and messages the engine refused", ()),
    ("garbage", _C, "garbage_frames", "Messages to the engine that did not parse", ()),
    ("stale", _C, "stale_messages", "Messages of another engine instance, worker group or worker",
     ()),
    ("unreachable", _C, "unreachable_sends", "Sends to a rank whose connection was gone", ()),
    ("scrape_errors", _C, "scrape_errors", "Queues whose stats() raised during a scrape", None),
)


class TaskQueueCollector(Collector):
    """A prometheus_client collector over a set of ``TaskQueue``s (anything with the same
    ``stats()``, ``name`` and ``dp_id``). ``add``/``remove`` are thread-safe and may be
    called while the registry is being scraped. A queue whose ``stats()`` raises (an engine
    whose I/O thread failed) is skipped and counted, never breaking the scrape."""

    def __init__(self, queues=(), prefix: str = "fdsync"):
        self._lock = threading.Lock()
        self._queues = list(queues)
        self._prefix = prefix
        self._errors = 0

    def add(self, queue) -> None:
        with self._lock:
            if queue not in self._queues:
                self._queues.append(queue)

    def remove(self, queue) -> None:
        with self._lock:
            if queue in self._queues:
                self._queues.remove(queue)

    def describe(self):
        # Registration must not scrape the queues: say which names we own, without values.
        return list(self._families().values())

    def collect(self):
        families = self._families()
        with self._lock:
            queues = list(self._queues)
        for queue in queues:
            try:
                stats = queue.stats()
            except Exception:  # noqa: BLE001 -- one broken queue must not hide the others
                with self._lock:
                    self._errors += 1
                continue
            self._add(families, queue, stats)
        with self._lock:
            families["scrape_errors"].add_metric([], self._errors)
        return list(families.values())

    def _families(self) -> dict:
        made = {}
        for key, family, name, text, extra in _FAMILIES:
            labels = None if extra is None else ["queue", "dp_id", *extra]
            made[key] = family(f"{self._prefix}_{name}", text, labels=labels)
        return made

    @staticmethod
    def _add(f, queue, s) -> None:
        q = [str(queue.name), str(queue.dp_id)]
        last = s["last_seq"]
        f["put"].add_metric(q, last)
        delivery = s.get("delivery_s") or {"bounds": [], "counts": [0], "sum": 0.0, "count": 0}
        f["delivered"].add_metric(q, delivery["count"])
        f["in_flight"].add_metric(q, s.get("retained", 0))
        f["max_inflight"].add_metric(q, getattr(queue, "max_inflight", 0))
        cumulative, buckets = 0, []
        for bound, count in zip(list(delivery["bounds"]) + [float("inf")], delivery["counts"]):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
        f["delivery"].add_metric(q, buckets, delivery["sum"])
        for rank in s.get("ranks", ()):
            labels = q + [str(rank["rank"])]
            f["consumed"].add_metric(labels, rank["consumed"])
            f["lag"].add_metric(labels, max(0, last - rank["consumed"]))
            for state in RANK_STATES:
                f["state"].add_metric(labels + [state], 1.0 if rank["state"] == state else 0.0)
            if rank["silent_s"] is not None:
                f["silent"].add_metric(labels, rank["silent_s"])
        f["groups"].add_metric(q, s.get("groups", 0))
        for reason, count in sorted((s.get("retirements") or {}).items()):
            f["retired"].add_metric(q + [reason], count)
        f["rejected"].add_metric(q, s.get("rejected", 0))
        f["garbage"].add_metric(q, s.get("garbage_frames", 0))
        f["stale"].add_metric(q, s.get("stale", 0))
        f["unreachable"].add_metric(q, s.get("unreachable", 0))


def register(registry, *queues, prefix: str = "fdsync") -> TaskQueueCollector:
    """Register a ``TaskQueueCollector`` for ``queues`` on ``registry`` (a
    ``prometheus_client.CollectorRegistry``, e.g. the one FastDeploy's ``/metrics`` serves,
    or ``prometheus_client.REGISTRY``) and return it; ``collector.add(queue)`` adds more
    later, ``registry.unregister(collector)`` stops. Never blocks; reads no queue until a
    scrape. ``ValueError`` (from prometheus_client) if the registry already has these names."""
    collector = TaskQueueCollector(queues, prefix=prefix)
    registry.register(collector)
    return collector
