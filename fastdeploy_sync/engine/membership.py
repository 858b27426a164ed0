"""Worker-group membership: which worker processes serve the queue, and when a group ends.

The ranks that serve a ``TaskQueue`` form one *group*, named by an incarnation id the ranks
agree on (``tp``); each rank's process has its own worker id. Both ids are secrets
(a message carrying them speaks for the rank): they never leave the engine except towards
the worker that owns them; status and logs show ``liveness.id_tag``. The engine serves one
group at a time:
  * a rank's place belongs to the worker that first took it. The same worker may come
    back on a new connection (a HELLO with its worker id) and is replayed what it lacks;
    another worker asking for it while the holder's connection is up is refused
    (``E_PLACE_TAKEN``);
  * the group is *retired* when one of its ranks is gone or left: its connection went
    away and nothing was heard from it for the heartbeat timeout (died, or unreachable),
    it stayed connected but sent nothing for ``stall_timeout`` (hung), it closed its
    client (``BYE``), or a new worker process took its place after its connection went
    (it restarted). Its live ranks are told (they raise ``GroupLostError``), every batch
    the group did not finish is handed back to the engine's code as a ``GroupLost``
    event (``TaskQueue.group_events``), and the queue waits for a new group, which
    receives only what is put from then on. Application silence alone (a rank whose
    main thread holds the GIL, a big batch in transit) never retires a group before
    ``stall_timeout`` (see ``liveness``);
  * a new group (a new incarnation) that asks while a rank of the old one is still
    connected is held back until the old one is gone, and refused if it stays (after the
    heartbeat timeout plus one interval). At most ``2 * tp_size`` HELLOs are held back.

What a peer can make this module do is bounded: a refusal is answered at most once a
second per connection, a rank is probed at most every ``_PROBE_MIN_S`` for HELLOs that
claim its place, and the lists it keeps have fixed bounds.

Division of labour: the ledger (``engine.ledger``) keeps what its lock guards (the group
being served; the batches in flight and what each rank consumed); this module applies the
rules above to what ranks send (HELLO, ACK, PING, BYE) and to time (``tick``). It changes
the ledger only through its methods (``start_group``, ``admit``, ``acknowledge``,
``retire``), talks to ranks only through the outbox (``engine.outbox``) and logs about
peers through the peer log. Everything here runs on the queue's I/O thread.
"""

import collections
import logging
import time
from typing import Any, Optional

from ..errors import ProtocolError
from ..wire import codec
from ..wire.liveness import Heartbeat, id_tag
from .rank_link import RankLink

__all__ = ["Group", "GroupLost", "LostBatch", "Membership"]

log = logging.getLogger(__name__)

# Incarnations of retired groups remembered, to refuse their stragglers precisely.
_RETIRED_MEMORY = 64
# A refusal is answered at most this often per connection (routing id), and so many
# connections are remembered: a peer that keeps asking cannot make the engine keep
# answering (each answer is a send, queued for a peer that may never read it).
_ANSWER_MIN_S = 1.0
_ANSWERED_MEMORY = 4096
# A rank is probed at most this often because someone claims its place or a connection
# dropped: a flood of claims must not become a flood of PONGs to the rank.
_PROBE_MIN_S = 0.05


class LostBatch:
    """A batch a retired group did not finish: ``seq`` (as ``put_tasks()`` returned it),
    ``tasks`` (the object put, decoded again from the retained bytes: numpy arrays in it
    are read-only; a ``ProtocolError``, its cause chained, if those bytes do not decode,
    e.g. a producer's object whose unpickling raises) and ``taken_by`` (the ranks known to
    have taken it; empty if none did)."""

    __slots__ = ("seq", "tasks", "taken_by")

    def __init__(self, seq: int, tasks: Any, taken_by: list) -> None:
        self.seq, self.tasks, self.taken_by = seq, tasks, taken_by

    def __repr__(self) -> str:
        return f"LostBatch(seq={self.seq}, taken_by={self.taken_by})"


class GroupLost:
    """Event: the engine retired a worker group (see the module docstring).

    ``incarnation`` (int), ``reason`` (str), ``at`` (wall-clock time), ``ranks`` (one dict
    per rank: state, since, silent_s, worker (``liveness.id_tag``), reason) and ``unfinished``: the
    ``LostBatch`` es it had not finished on every rank, in put order. The engine's
    scheduler should re-queue (or fail) their requests: a new group starts from an empty
    model state and receives only batches put after this event."""

    __slots__ = ("incarnation", "reason", "at", "ranks", "unfinished")

    def __init__(self, incarnation: int, reason: str, at: float, ranks: list,
                 unfinished: list) -> None:
        self.incarnation, self.reason, self.at = incarnation, reason, at
        self.ranks, self.unfinished = ranks, unfinished

    def __repr__(self) -> str:
        return (f"GroupLost(group={id_tag(self.incarnation)}, reason={self.reason!r}, "
                f"unfinished={[b.seq for b in self.unfinished]})")


class Group:
    """The worker group the queue currently serves (I/O thread writes, others read)."""

    __slots__ = ("incarnation", "epoch", "links")

    def __init__(self, incarnation: int, epoch: int, tp_size: int) -> None:
        self.incarnation, self.epoch = incarnation, epoch
        self.links = [RankLink(r) for r in range(tp_size)]


class Membership:
    """The membership rules of one ``TaskQueue`` (see the module docstring): queue ``name``
    with ``tp_size`` ranks, engine ``instance``, its ``heartbeat``; ``ledger``, ``outbox``
    and ``peers`` (its ``PeerLog``) as above; ``events``: where ``GroupLost`` events go (the
    queue's ``group_events``); ``counters``: its ``stats()`` counters."""

    def __init__(self, name: str, tp_size: int, instance: int, heartbeat: Heartbeat,
                 ledger: Any, outbox: Any, peers: Any, events: Any,
                 counters: collections.Counter) -> None:
        self.name, self.tp_size = name, tp_size
        self.instance, self.heartbeat = instance, heartbeat
        self._ledger, self._outbox, self._peers, self._events = ledger, outbox, peers, events
        self._counters = counters
        self._epochs = 0  # groups served so far; tags the ack board (see ack_board)
        # HELLOs of a new group waiting for the old one to go, the latest per (group, rank):
        # (group, rank) -> (since, identity, header, name)
        self._parked: collections.OrderedDict = collections.OrderedDict()
        self._max_parked = 2 * self.tp_size
        self._retired: collections.deque = collections.deque(maxlen=_RETIRED_MEMORY)  # incarnations
        # identity -> when a refusal was sent
        self._answered: collections.OrderedDict = collections.OrderedDict()
        self._probed_all_at = 0.0

    @property
    def group(self) -> Any:
        """The group being served (None before the first and after a retirement)."""
        return self._ledger.group

    def handle(self, identity: bytes, header: codec.Header, frames: list) -> bool:
        """A rank's HELLO, ACK, PING or BYE (``frames``: what followed the header). True if
        it came from a rank of the group or admitted one; False if it was stale, held back
        or refused. Raises ``ProtocolError`` for a message that is not one of them."""
        now = time.monotonic()
        kind = header.kind
        if kind == codec.PING:
            return self._ping(identity, header, now)
        if kind == codec.ACK:
            return self._ack(header, now)
        if kind == codec.HELLO:
            self._counters["hellos"] += 1
            name = frames[0] if len(frames) == 1 else b""
            return bool(self._hello(identity, header, name, now))
        if kind == codec.BYE:
            return self._bye(header, now)
        raise ProtocolError(f"a worker sent message kind {kind}")

    # -- liveness ----------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Every heartbeat interval: probe every connected rank (an unasked PONG: proof of
        life for the rank, and a send that fails for a connection that went away), retire
        the group if a rank is gone or hung, admit held-back HELLOs."""
        group = self.group
        if group is not None:
            self._probe(group, now)
            for link in group.links:
                if now >= link.retire_at(self.heartbeat):
                    self.retire(group, self._why_gone(link, now))
                    break
        if self._parked:
            parked, self._parked = self._parked, collections.OrderedDict()
            for since, identity, h, name in parked.values():
                self._hello(identity, h, name, now, parked_since=since)

    def deadline(self) -> float:
        """When (monotonic) a rank's state would retire the group unless something is
        heard first: the I/O thread runs ``tick`` then at the latest. ``inf`` if never."""
        group = self.group
        if group is None:
            return float("inf")
        return min(link.retire_at(self.heartbeat) for link in group.links)

    def connections_changed(self, now: float) -> None:
        """A connection of the workers' socket went away (socket monitor): probe now
        rather than at the next tick (at most every ``_PROBE_MIN_S``)."""
        group = self.group
        if group is not None and now - self._probed_all_at >= _PROBE_MIN_S:
            self._probe(group, now)

    def _why_gone(self, link: RankLink, now: float) -> str:
        silent = link.silent_for(now)
        if link.identity is None:
            how = link.reason or "its connection closed"
            return (f"rank {link.rank} is gone: {how} and it did not come back; nothing "
                    f"heard from it for {silent:.1f} s (died, killed or unreachable)")
        return (f"rank {link.rank} is hung: its connection stayed up but it sent nothing for "
                f"{silent:.1f} s (stall timeout {self.heartbeat.stall_timeout:g} s, "
                f"FD_SYNC_STALL_TIMEOUT)")

    def _probe(self, group: Group, now: float) -> None:
        """Send a PONG to every rank thought reachable: proof of life for the rank, and
        a socket that went away fails the send at once (ROUTER_MANDATORY)."""
        self._probed_all_at = now
        for link in group.links:
            if link.identity is not None:
                self._send_pong(link, now)

    def _reachable(self, link: RankLink, now: float) -> bool:
        """Whether ``link``'s connection is up, probed if that was not done in the last
        ``_PROBE_MIN_S`` (so a flood of HELLOs cannot make the engine flood the rank)."""
        if link.identity is not None and now - link.probed_at >= _PROBE_MIN_S:
            self._send_pong(link, now)
        return link.identity is not None

    def _send_pong(self, link: RankLink, now: float) -> None:
        link.probed_at = now
        self._counters["probes"] += 1
        self._outbox.send(link, [codec.pack_header(
            codec.PONG, link.rank, engine=self.instance, group=self.group.incarnation,
            worker=link.worker)])

    # -- what ranks say ----------------------------------------------------------------------

    def _reject(self, identity: bytes, header: codec.Header, code: int, reason: str,
                detail: Optional[str] = None) -> Optional[bool]:
        """Refuse a peer: it learns ``reason`` (nothing about the queue: no name, tp_size
        or watermark), at most once a second per connection; the log gets ``detail``
        too, at most once per peer address and interval. Returns None (refused), which
        ``_hello`` passes on."""
        self._counters["rejected"] += 1
        peer = self._peers.peer()
        self._peers.log(("reject", peer, code), logging.WARNING,
                        "TaskQueue %s: rejected a worker from %s claiming rank %d (%d "
                        "rejected so far): %s", self.name, peer, header.rank,
                        self._counters["rejected"], detail or reason)
        now = time.monotonic()
        last = self._answered.get(identity)
        if last is not None and now - last < _ANSWER_MIN_S:
            self._counters["refusals_unanswered"] += 1  # a peer that keeps asking
            return None
        self._answered[identity] = now
        self._answered.move_to_end(identity)
        while len(self._answered) > _ANSWERED_MEMORY:
            self._answered.popitem(last=False)
        self._outbox.send(identity, [codec.pack_header(codec.ERROR, header.rank, aux=code,
                                                       engine=self.instance, group=header.group,
                                                       worker=header.worker), reason.encode()])
        return None

    def _hello(self, identity: bytes, h: codec.Header, name: bytes, now: float,
               parked_since: Optional[float] = None) -> Optional[bool]:
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
                                f"it is bound to engine {id_tag(h.engine)}, this is "
                                f"{id_tag(self.instance)}")
        if not h.group or not h.worker:
            raise ProtocolError("HELLO without group or worker id")
        if h.group in self._retired:
            return self._reject(identity, h, codec.E_GROUP_LOST,
                                "this worker group was retired earlier (a rank went away, "
                                "hung, left or restarted): restart the whole group")
        group = self.group
        if group is not None and group.incarnation != h.group:
            if any(self._reachable(link, now) for link in group.links):
                since = parked_since if parked_since is not None else now
                key = (h.group, rank)
                if now - since > self.heartbeat.timeout + self.heartbeat.interval or (
                        key not in self._parked and len(self._parked) >= self._max_parked):
                    return self._reject(identity, h, codec.E_GROUP_BUSY,
                                        "another live worker group serves this queue: stop it "
                                        "first, or use another name or dp_id")
                self._parked[key] = (since, identity, h, name)
                return None
            self.retire(group, f"replaced by a new worker group ({id_tag(h.group)}) while "
                               f"none of its ranks was connected")
            group = None
        if group is None:
            if h.seq != 1 or h.aux != 0:  # a fresh group holds nothing yet
                return self._reject(identity, h, codec.E_GROUP_LOST,
                                    "this worker holds batches of a worker group the engine no "
                                    "longer serves: restart the whole group")
            group = self._new_group(h.group)
        link = group.links[rank]
        if link.worker and link.worker != h.worker:
            if self._reachable(link, now):
                return self._reject(identity, h, codec.E_PLACE_TAKEN,
                                    f"rank {rank} is held by a live worker: two processes "
                                    f"cannot serve one rank; check tp_rank on each worker")
            self._reject(identity, h, codec.E_GROUP_LOST,
                         f"rank {rank} restarted inside a live worker group: its peers' "
                         f"model state is gone too, restart the whole group")
            self.retire(group, f"rank {rank} restarted (a new worker process took its place)")
            return None
        problem = self._ledger.admit(rank, h.seq, h.aux)
        if problem:
            return self._reject(identity, h, codec.E_REJECTED,
                                "this worker's history does not match the engine's: restart "
                                "the worker group", problem)
        link.connect(identity, h.worker, now)
        link.sent = self._ledger.base + h.seq - 1
        self._outbox.send(link, [codec.pack_header(
            codec.WELCOME, rank, self.tp_size, aux=group.epoch, engine=self.instance,
            group=group.incarnation, worker=h.worker)])
        log.info("TaskQueue %s: rank %d connected (worker %s, group %s), wants seq %d",
                 self.name, rank, id_tag(h.worker), id_tag(group.incarnation), h.seq)
        return True

    def _new_group(self, incarnation: int) -> Group:
        self._epochs += 1
        group = Group(incarnation, self._epochs, self.tp_size)
        self._ledger.start_group(group)
        self._counters["groups"] += 1
        return group

    def _link_of(self, h: codec.Header, unbound_ok: bool = False) -> Optional[RankLink]:
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

    def _ack(self, h: codec.Header, now: float) -> bool:
        link = self._link_of(h)
        if link is None:
            return False
        link.heard(now)
        self._ledger.acknowledge(h.rank, h.seq)
        return True

    def _ping(self, identity: bytes, h: codec.Header, now: float) -> bool:
        self._counters["pings"] += 1
        link = self._link_of(h, unbound_ok=True)
        if link is None:
            # tell a straggler why nobody answers it, so it fails with the right error
            if h.engine and h.engine != self.instance:
                code, why = codec.E_STALE_ENGINE, "the engine this worker was bound to is gone"
            elif h.group in self._retired:
                code, why = codec.E_GROUP_LOST, "this worker group was retired"
            else:
                return False  # not welcomed yet: its HELLO is being handled or parked
            self._reject(identity, h, code, why)
            return False
        link.heard(now)
        self._outbox.send(identity, [codec.pack_header(codec.PONG, h.rank, engine=self.instance,
                                                       group=h.group, worker=h.worker)])
        return True

    def _bye(self, h: codec.Header, now: float) -> bool:
        """The rank closed its client on purpose: apply what it says it took, then retire
        the group at once (its peers cannot go on without it)."""
        link = self._link_of(h, unbound_ok=True)
        if link is None:
            return False
        link.heard(now)
        self._counters["byes"] += 1
        try:
            if h.seq > 0:
                self._ledger.acknowledge(h.rank, h.seq, message=False)
        except ProtocolError as exc:  # a seq never sent: ignore it, the rank still left
            self._peers.garbage(exc)
        link.disconnect("it closed its client (BYE)", now)
        self.retire(self.group, f"rank {h.rank} closed its client (BYE)", left=True)
        return True

    # -- retirement --------------------------------------------------------------------------

    def retire(self, group: Group, reason: str, left: bool = False) -> None:
        """Stop serving ``group``: hand back what it did not finish as a ``GroupLost``
        event, tell its reachable ranks, and reset the queue for the next group. ``left``:
        a rank closed on purpose (logged at INFO when nothing was left unfinished)."""
        lost = self._ledger.retire(group, reason)
        self._retired.append(group.incarnation)
        now = time.monotonic()
        for link in group.links:
            if link.identity is not None:
                self._outbox.send(link, [codec.pack_header(
                    codec.ERROR, link.rank, aux=codec.E_GROUP_LOST, engine=self.instance,
                    group=group.incarnation, worker=link.worker),
                    f"the engine retired this worker group: {reason}; restart the whole "
                    f"group".encode()])
                link.disconnect("group retired", now)
        # counted once its ranks read disconnected: stats() never shows a retired group
        # with a rank still connected
        self._counters["groups_retired"] += 1
        event = GroupLost(group.incarnation, reason, time.time(),
                          [link.snapshot(now) for link in group.links],
                          [LostBatch(seq, tasks, taken_by) for seq, tasks, taken_by in lost])
        level = logging.INFO if left and not lost else logging.WARNING
        log.log(level, "TaskQueue %s: retired worker group %s: %s; %d batch(es) unfinished "
                "(group_events)", self.name, id_tag(group.incarnation), reason, len(lost))
        self._events.put(event)
