"""What a ``TaskClient`` is made of, and in which order it is made (``assemble``)."""

import contextlib

from ..shm.payload import PayloadReader
from ..tp.factory import make_group
from ..tp.protocol import TPGroup
from .acks import Acknowledger
from .background import BackgroundThread
from .connection import EngineConnection
from .engine_watch import EngineWatch
from .faults import Faults
from .receiver import Receiver
from .ring_prefetch import RingPrefetch
from .slot import LocalSlot
from .take import Taker

__all__ = ["Parts", "assemble"]


class Parts:
    """The collaborators of one rank's client, each with one idea (``worker.client``)."""

    __slots__ = ("slot", "group", "watch", "faults", "ring", "connection", "acks", "receiver",
                 "taker", "background")
    slot: LocalSlot
    group: TPGroup
    watch: EngineWatch
    faults: Faults
    ring: RingPrefetch
    connection: EngineConnection
    acks: Acknowledger
    receiver: Receiver
    taker: Taker
    background: BackgroundThread


def assemble(client, coordinator, auth, node_local: bool, closing, counters) -> Parts:
    """Make the collaborators of ``client`` (its public attributes say what for: name,
    ranks, endpoint, heartbeat, modes). ``closing``: the Event set when it begins to close;
    ``counters``: the ``stats()`` counters every part adds to. A failure part-way frees what
    was made (the group, the sockets) and propagates. Ranks other than 0 block here until
    rank 0 of the group exists (``tp``)."""
    name, rank, dp_id, tp_size = client.name, client.tp_rank, client.dp_id, client.tp_size
    who, label = f"rank {rank} of {name!r}", f"TaskClient {name} rank {rank}"
    p = Parts()
    with contextlib.ExitStack() as undo:
        slot = p.slot = LocalSlot()
        group = p.group = make_group(name, dp_id, tp_size, rank, coordinator)
        undo.callback(group.close)
        watch = p.watch = EngineWatch(who, client.endpoint, client.heartbeat,
                                      client.connect_timeout)
        wakers = [group.wake]  # what a background failure wakes (the ring's event below)
        faults = p.faults = Faults(who, label, client.endpoint, group, slot, watch,
                                   client.async_prefetch, wakers)
        payload_reader = PayloadReader(name, dp_id, tp_size, rank) if node_local else None
        ring = p.ring = RingPrefetch(name, dp_id, tp_size, rank, slot, payload_reader,
                                       closing, client.async_prefetch, counters,
                                       lambda exc: faults.fail(exc, closing.is_set()))
        wakers.append(ring.woke.set)
        conn = p.connection = EngineConnection(name, tp_size, rank, client.endpoint,
                                               client.heartbeat, auth, watch,
                                               group.incarnation, client.worker_id, closing)
        undo.callback(conn.close, True)
        acks = p.acks = Acknowledger(conn, name, dp_id, tp_size, rank, node_local, counters)
        receiver = p.receiver = Receiver(
            who=who, client=label, tp_rank=rank, connection=conn, watch=watch, slot=slot,
            faults=faults, group=group, acks=acks, ring=ring, payload_reader=payload_reader,
            closing=closing, counters=counters)
        undo.callback(receiver.wake.close)
        p.taker = Taker(rank, slot, ring, faults, group, acks, counters)
        # async: it receives the socket (fdsync-receiver-); sync: it only pings and watches
        role = "receiver" if client.async_prefetch else "heartbeat"
        p.background = BackgroundThread(f"fdsync-{role}-{name}-r{rank}", receiver, conn,
                                        watch, faults, client.heartbeat, closing)
        undo.pop_all()  # made: the client's close() frees it from now on
    return p
