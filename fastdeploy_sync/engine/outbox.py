"""Everything the engine sends to worker ranks, on the workers' socket, without ever blocking.

The socket is used under ``IOLoop.lock`` only (the I/O thread's passes, and ``put_tasks()``
sending its own batch): callers hold it.
"""

import logging

import zmq

from ..wire import codec
from .rank_link import RankLink

__all__ = ["Outbox"]

log = logging.getLogger(__name__)


class Outbox:
    """Sends of one queue (``name``, ``tp_size``, engine ``instance``) on ``sock`` (the
    workers' ROUTER socket, ``ROUTER_MANDATORY``). ``peers``: the queue's ``PeerLog``;
    ``counters``: its ``stats()`` counters."""

    def __init__(self, sock, name, tp_size, instance, peers, counters):
        self._sock, self._name, self._tp_size, self._instance = sock, name, tp_size, instance
        self._peers, self._counters = peers, counters

    def send(self, link_or_identity, frames) -> bool:
        """Send to a peer (a ``RankLink`` or a routing id) without ever blocking; False if
        it was not sent. A peer that went away or stopped reading can never kill or stall
        the sender.

        A peer whose connection is gone (``EHOSTUNREACH``): a rank's link is marked
        disconnected (membership decides what that means). A peer that has not read its
        last ``SNDHWM`` messages (``EAGAIN``: a stopped process, or a flood's sender that
        never reads its replies): dropped and counted; a rank's batches are sent again on
        a later pass, its connection is judged by ZMTP heartbeats."""
        link = link_or_identity if isinstance(link_or_identity, RankLink) else None
        identity = link.identity if link is not None else link_or_identity
        if identity is None:
            return False
        try:
            self._sock.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            self._counters["sends_dropped_full"] += 1
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                self._counters["send_errors"] += 1
                self._peers.log(("send", exc.errno), logging.WARNING,
                                "TaskQueue %s: send failed: %s", self._name, exc)
            self._counters["unreachable"] += 1
            if link is not None and link.identity is not None:
                # INFO: a rank closing first is the normal shutdown order; a rank that
                # stays away is reported (WARNING) when its group is retired
                log.info("TaskQueue %s: rank %d's connection went away", self._name, link.rank)
                link.disconnect("its connection closed")
            return False

    def send_new(self, ledger, by_caller: bool = False) -> None:
        """Send each connected rank of the group being served every retained batch it has
        not been sent yet (``ledger.unsent``); a rank that does not take one gets the rest
        on a later pass. ``by_caller``: from ``put_tasks()``, counted apart
        (``sent_by_put``)."""
        group = ledger.group
        if group is None:
            return
        todo, last, base = ledger.unsent(group)
        for link, batches in todo:
            for seq, (frames, check) in batches:
                header = codec.pack_header(codec.DATA, link.rank, self._tp_size, seq=seq - base,
                                           engine=self._instance, group=group.incarnation,
                                           worker=link.worker, check=check)
                if not self.send(link, [header, *frames]):
                    break  # gone, or not reading: the rest waits for a later pass
                link.sent = seq
                self._counters["sent"] += 1
                if by_caller:
                    self._counters["sent_by_put"] += 1
            else:
                link.sent = last

    def tell_close(self, group, last) -> set:
        """CLOSE to every rank of ``group`` (``last``: the group-relative seq of the last
        batch sent); each link is marked disconnected. Returns the routing ids it went to."""
        told = set()  # routing ids the CLOSE went to (disconnect() forgets them)
        for link in group.links:
            identity = link.identity
            if identity is not None and self.send(link, [codec.pack_header(
                    codec.CLOSE, link.rank, self._tp_size, seq=last, engine=self._instance,
                    group=group.incarnation, worker=link.worker)]):
                told.add(identity)
            link.disconnect("the queue closed")
        return told
