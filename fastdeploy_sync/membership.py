"""Worker-group membership: which worker processes serve the queue, and when a group ends.

The ranks that serve a ``TaskQueue`` form one *group*, named by an incarnation id the ranks
agree on (``tp_group``); each rank's process has its own worker id. The engine serves one
group at a time:
  * a rank's place belongs to the worker that first took it; another worker asking for
    it while the holder is heard from is refused (``E_PLACE_TAKEN``);
  * when a rank of the group goes silent for the heartbeat timeout, or a new process
    takes a rank whose holder died, the group is *retired*: its live ranks are told
    (they raise ``GroupLostError``), every batch the group did not finish is handed back
    to the engine's code as a ``GroupLost`` event (``TaskQueue.group_events``), and the
    queue waits for a new group, which receives only what is put from then on;
  * a new group (a new incarnation) that asks while the old one is still heard from is
    held back until the old one is gone, and refused if it stays alive.

Division of labour with ``engine``: the queue keeps what its lock guards (the group being
served, ``_group``/``_previous``; the batches in flight and what each rank consumed) and
owns the socket; this module applies the rules above to what ranks send (HELLO, ACK,
PING) and to time (``tick``). It changes the queue's state only through the queue's ledger
methods (``_start_group``, ``_admit``, ``_acknowledge``, ``_retire_batches``) and talks to
ranks only through ``_send``. Everything here runs on the queue's I/O thread.
"""

import collections
import logging
import time

from . import codec
from .errors import ProtocolError
from .liveness import NEVER, RankLink, id_tag

__all__ = ["Group", "GroupLost", "LostBatch", "Membership"]

log = logging.getLogger(__name__)

# Incarnations of retired groups remembered, to refuse their stragglers precisely.
_RETIRED_MEMORY = 64


class LostBatch:
    """A batch a retired group did not finish: ``seq`` (as ``put_tasks()`` returned it),
    ``tasks`` (the object put, decoded again from the retained bytes: numpy arrays in it
    are read-only; a ``ProtocolError``, its cause chained, if those bytes do not decode,
    e.g. a producer's object whose unpickling raises) and ``taken_by`` (the ranks known to
    have taken it; empty if none did)."""

    __slots__ = ("seq", "tasks", "taken_by")

    def __init__(self, seq, tasks, taken_by):
        self.seq, self.tasks, self.taken_by = seq, tasks, taken_by

    def __repr__(self):
        return f"LostBatch(seq={self.seq}, taken_by={self.taken_by})"


class GroupLost:
    """Event: the engine retired a worker group (see the module docstring).

    ``incarnation`` (int), ``reason`` (str), ``at`` (wall-clock time), ``ranks`` (one dict
    per rank: state, since, silent_s, worker (``liveness.id_tag``), reason) and ``unfinished``: the
    ``LostBatch`` es it had not finished on every rank, in put order. The engine's
    scheduler should re-queue (or fail) their requests: a new group starts from an empty
    model state and receives only batches put after this event."""

    __slots__ = ("incarnation", "reason", "at", "ranks", "unfinished")

    def __init__(self, incarnation, reason, at, ranks, unfinished):
        self.incarnation, self.reason, self.at = incarnation, reason, at
        self.ranks, self.unfinished = ranks, unfinished

    def __repr__(self):
        return (f"GroupLost(group={id_tag(self.incarnation)}, reason={self.reason!r}, "
                f"unfinished={[b.seq for b in self.unfinished]})")


class Group:
    """The worker group the queue currently serves (I/O thread writes, others read)."""

    __slots__ = ("incarnation", "epoch", "links")

    def __init__(self, incarnation, epoch, tp_size):
        self.incarnation, self.epoch = incarnation, epoch
        self.links = [RankLink(r) for r in range(tp_size)]


class Membership:
    """The membership rules of one ``TaskQueue`` (see the module docstring)."""

    def __init__(self, queue):
        self._queue = queue
        self.name, self.tp_size = queue.name, queue.tp_size
        self.instance, self.heartbeat = queue.instance, queue.heartbeat
        self._counters = queue._counters
        self._epochs = 0  # groups served so far; tags the ack board (see ack_board)
        self._parked = []  # HELLOs of a new group waiting for the old one to go: (since, identity, header, name)
        self._retired = collections.deque(maxlen=_RETIRED_MEMORY)  # incarnations

    @property
    def group(self):
        """The group being served (None before the first and after a retirement)."""
        return self._queue._group

    def handle(self, identity, header, frames):
        """A rank's HELLO, ACK or PING (``frames``: what followed the header). Raises
        ``ProtocolError`` for a message that is not one of them."""
        if header.kind == codec.HELLO:
            self._counters["hellos"] += 1
            name = frames[0] if len(frames) == 1 else b""
            self._hello(identity, header, name, time.monotonic())
        elif header.kind == codec.ACK:
            self._ack(header)
        elif header.kind == codec.PING:
            self._ping(identity, header)
        else:
            raise ProtocolError(f"a worker sent message kind {header.kind}")

    def _reject(self, identity, header, code, reason, detail=None):
        """Refuse a peer: it learns ``reason`` (nothing about the queue: no name, tp_size
        or watermark), the log gets ``detail`` too, at most once per peer and interval."""
        queue = self._queue
        self._counters["rejected"] += 1
        peer = queue._peer()
        queue._peer_log.log(("reject", peer, code), logging.WARNING,
                            "TaskQueue %s: rejected a worker from %s claiming rank %d (%d "
                            "rejected so far): %s", self.name, peer, header.rank,
                            self._counters["rejected"], detail or reason)
        queue._send(identity, [codec.pack_header(codec.ERROR, header.rank, aux=code,
                                                 engine=self.instance, group=header.group,
                                                 worker=header.worker), reason.encode()])

    def _hello(self, identity, h, name, now, parked_since=None):
        rank = h.rank
        if name != self.name.encode():
            return self._reject(identity, h, codec.E_REJECTED,
                                "this endpoint does not serve the queue name this worker asked "
                                "for: check the name and dp_id on the engine and the workers",
                                f"it asked for {bytes(name[:64])!r}")
        if h.tp_size != self.tp_size:
            return self._reject(identity, h, codec.E_REJECTED,
                                f"tp_size={h.tp_size} does not match the engine's: start the "
                                f"engine and every rank with the same tp_size",
                                f"it has tp_size={h.tp_size}, the queue {self.tp_size}")
        if h.engine and h.engine != self.instance:
            return self._reject(identity, h, codec.E_STALE_ENGINE,
                                "the engine this worker was bound to is gone (the engine "
                                "restarted): restart the worker group",
                                f"it is bound to engine {h.engine:#x}, this is {self.instance:#x}")
        if not h.group or not h.worker:
            raise ProtocolError("HELLO without group or worker id")
        if h.group in self._retired:
            return self._reject(identity, h, codec.E_GROUP_LOST,
                                "this worker group was retired earlier (a rank went silent or "
                                "restarted): restart the whole group")
        group = self.group
        if group is not None and group.incarnation != h.group:
            self._probe(group)
            if any(link.alive(now, self.heartbeat.timeout) and link.identity is not None
                   for link in group.links):
                since = parked_since if parked_since is not None else now
                if now - since > self.heartbeat.timeout + self.heartbeat.interval:
                    return self._reject(identity, h, codec.E_GROUP_BUSY,
                                        "another live worker group serves this queue: stop it "
                                        "first, or use another name or dp_id")
                self._parked.append((since, identity, h, name))
                return
            self.retire(group, f"replaced by a new worker group ({id_tag(h.group)}) while "
                               f"none of its ranks was reachable")
            group = None
        if group is None:
            if h.seq != 1 or h.aux != 0:  # a fresh group holds nothing yet
                return self._reject(identity, h, codec.E_GROUP_LOST,
                                    "this worker holds batches of a worker group the engine no "
                                    "longer serves: restart the whole group")
            group = self._new_group(h.group)
        link = group.links[rank]
        if link.worker and link.worker != h.worker:
            self._probe(group)
            if link.alive(now, self.heartbeat.timeout) and link.identity is not None:
                return self._reject(identity, h, codec.E_PLACE_TAKEN,
                                    f"rank {rank} is held by a live worker: two processes "
                                    f"cannot serve one rank; check tp_rank on each worker")
            self._reject(identity, h, codec.E_GROUP_LOST,
                         f"rank {rank} restarted inside a live worker group: its peers' "
                         f"model state is gone too, restart the whole group")
            return self.retire(group, f"rank {rank} restarted (a new worker process took its "
                                      f"place)")
        problem = self._queue._admit(rank, h.seq, h.aux)
        if problem:
            return self._reject(identity, h, codec.E_REJECTED,
                                "this worker's history does not match the engine's: restart "
                                "the worker group", problem)
        link.connect(identity, h.worker, now)
        link.sent = self._queue._base + h.seq - 1
        self._queue._send(link, [codec.pack_header(
            codec.WELCOME, rank, self.tp_size, aux=group.epoch, engine=self.instance,
            group=group.incarnation, worker=h.worker)])
        log.info("TaskQueue %s: rank %d connected (worker %s, group %s), wants seq %d",
                 self.name, rank, id_tag(h.worker), id_tag(group.incarnation), h.seq)

    def _new_group(self, incarnation):
        self._epochs += 1
        group = Group(incarnation, self._epochs, self.tp_size)
        self._queue._start_group(group)
        self._counters["groups"] += 1
        return group

    def _link_of(self, h, unbound_ok=False):
        """The link ``h`` speaks for, or None (counted as stale) if it belongs to another
        engine, another group or another worker of that rank. ``unbound_ok``: a worker
        that has not read its WELCOME yet (engine id 0) counts too (a sync-mode heartbeat
        thread pings before the event loop's first step reads the WELCOME)."""
        group = self.group
        engine_ok = h.engine == self.instance or (unbound_ok and h.engine == 0)
        if (not engine_ok or group is None or h.group != group.incarnation
                or group.links[h.rank].worker != h.worker):
            self._counters["stale"] += 1
            return None
        return group.links[h.rank]

    def _ack(self, h):
        link = self._link_of(h)
        if link is None:
            return
        link.heard(time.monotonic())
        self._queue._acknowledge(h.rank, h.seq)

    def _ping(self, identity, h):
        self._counters["pings"] += 1
        link = self._link_of(h, unbound_ok=True)
        if link is None:
            # tell a straggler why nobody answers it, so it fails with the right error
            if h.engine and h.engine != self.instance:
                code, why = codec.E_STALE_ENGINE, "the engine this worker was bound to is gone"
            elif h.group in self._retired:
                code, why = codec.E_GROUP_LOST, "this worker group was retired"
            else:
                return  # not welcomed yet: its HELLO is being handled or parked
            return self._reject(identity, h, code, why)
        link.heard(time.monotonic())
        self._queue._send(identity, [codec.pack_header(codec.PONG, h.rank, engine=self.instance,
                                                       group=h.group, worker=h.worker)])

    def _probe(self, group):
        """Send a PONG to every rank thought reachable: a socket that went away fails the
        send at once (ROUTER_MANDATORY), which is quicker than waiting for silence."""
        for link in group.links:
            if link.identity is not None:
                self._queue._send(link, [codec.pack_header(
                    codec.PONG, link.rank, engine=self.instance, group=group.incarnation,
                    worker=link.worker)])

    def tick(self, now) -> float:
        """Liveness: mark silent ranks, retire a group that lost one, admit parked HELLOs.
        Returns when the first rank still heard from would become silent."""
        group = self.group
        if group is not None:
            timeout = self.heartbeat.timeout
            for link in group.links:
                if link.state != NEVER and link.silent_for(now) > timeout:
                    silent = link.silent_for(now)
                    link.disconnect(f"silent for {silent:.1f} s")
                    self.retire(group, f"rank {link.rank} was silent for {silent:.1f} s "
                                       f"(died, hung or unreachable)")
                    break
        if self._parked:
            parked, self._parked = self._parked, []
            for since, identity, h, name in parked:
                self._hello(identity, h, name, now, parked_since=since)
        group = self.group
        if group is None:
            return float("inf")
        return min((link.last_heard + self.heartbeat.timeout + 0.001 for link in group.links
                    if link.state != NEVER), default=float("inf"))

    def retire(self, group, reason):
        """Stop serving ``group``: tell its reachable ranks, hand back what it did not
        finish as a ``GroupLost`` event, and reset the queue for the next group."""
        lost = self._queue._retire_batches(group)
        self._retired.append(group.incarnation)
        self._counters["groups_retired"] += 1
        for link in group.links:
            if link.identity is not None:
                self._queue._send(link, [codec.pack_header(
                    codec.ERROR, link.rank, aux=codec.E_GROUP_LOST, engine=self.instance,
                    group=group.incarnation, worker=link.worker),
                    f"the engine retired this worker group: {reason}; restart the whole "
                    f"group".encode()])
                link.disconnect("group retired")
        now = time.monotonic()
        event = GroupLost(group.incarnation, reason, time.time(),
                          [link.snapshot(now) for link in group.links],
                          [LostBatch(seq, tasks, taken_by) for seq, tasks, taken_by in lost])
        log.warning("TaskQueue %s: retired worker group %s: %s; %d batch(es) unfinished "
                    "(group_events)", self.name, id_tag(group.incarnation), reason, len(lost))
        self._queue.group_events.put(event)
