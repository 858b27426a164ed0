"""What a TP group is to a ``TaskClient``: the interface every coordinator implements.

Three implementations: ``shm_group.ShmTPGroup`` (the ranks share a node: shared memory and
semaphores), ``paddle_group.PaddleTPGroup`` (the ranks span nodes: one paddle.distributed
all-reduce per step) and ``solo.SoloGroup`` (TP=1: nothing to agree on).

The step, on every rank (the invariant: every rank takes the same batches at the same
step)::

    rank 0:    if it may: latch(index, taken, upto)     # "step ``index`` takes (taken, upto]"
    all ranks: barrier(timeout, hooks)                  # generation gen + 1
    all ranks: decision(gen) -> (taken, upto) or None   # the same answer on every rank
               publish_consumed(upto)

``index`` is the barrier generation the decision is for (``gen + 1``), or, for a caller
that orders the ranks with its own barrier, its ``get_tasks()`` call count.
"""

from typing import Callable, NamedTuple, Optional, Protocol

__all__ = ["TPGroup", "WaitHooks", "NO_HOOKS"]


class WaitHooks(NamedTuple):
    """What a rank does while it waits in a barrier it has arrived at; each may be None.

    ``service``: run while blocked, at least every 0.5 ms (sync mode keeps receiving from
    the engine). ``check``: run after every wake-up while blocked; whatever it raises ends
    the wait. The caller must not make it raise for a failure of its own once it has
    arrived (publish a fault and keep waiting: a peer arriving later would take the step
    alone); it raises ``ClosedError`` and the failures of ranks that will never arrive
    (``missing_fault``). ``on_wait``: run once when this rank has to wait in a busy loop
    (its partners did not arrive at once), before it spins on: work the waiting time can
    absorb (async mode receives what its prefetch thread has not). It must not raise.
    A coordinator with no waiting path of its own (paddle's collective) uses none."""

    service: Optional[Callable[[], None]] = None
    check: Optional[Callable[[], None]] = None
    on_wait: Optional[Callable[[], object]] = None  # its result is ignored


NO_HOOKS = WaitHooks()


class TPGroup(Protocol):
    """One rank's handle on its group. Not thread-safe unless said: the event loop calls
    everything; ``publish_received`` and ``wake`` may come from a background thread, and
    ``close`` from any thread."""

    tp_size: int
    incarnation: int  # the group's id, the same on every rank (the engine's view of it)
    gen: int  # barrier generations this rank has passed
    # The ranks may sit on several nodes (paddle): a rank's barrier offer is what it can take
    # itself, and no wait of its own can absorb work (``WaitHooks.on_wait`` is never run).
    spans_nodes: bool

    def publish_received(self, seq: int) -> None:
        """This rank holds every batch up to ``seq`` (received over the socket)."""

    def min_received(self) -> int:
        """The highest seq every rank holds (across nodes: this rank's own)."""

    def wait_received(self, seq: int, timeout: float, check=None) -> bool:
        """Rank 0: block until every rank holds ``seq`` (True) or ``timeout`` seconds pass
        or a peer published a fault (False); ``check`` runs after every wake-up."""

    def wait_peers(self, seq: int, timeout: float) -> int:
        """Rank 0, before latching: wait (bounded) for peers still receiving what rank 0
        holds; returns ``min_received()``."""

    def latch(self, index: int, from_seq: int, to_seq: int) -> None:
        """Rank 0: step ``index`` takes (from_seq, to_seq]."""

    def decision(self, index: int):
        """``(from_seq, to_seq)`` latched for step ``index``, or None."""

    def publish_consumed(self, seq: int) -> None:
        """This rank has taken every batch up to ``seq``."""

    def all_consumed(self, seq: int) -> bool:
        """True once every rank has taken ``seq``."""

    def barrier(self, timeout: Optional[float] = None, hooks: WaitHooks = NO_HOOKS) -> None:
        """Block until every rank has arrived at generation ``gen + 1``."""

    def publish_engine(self, engine: int) -> None:
        """This rank was welcomed by engine instance ``engine``."""

    def all_welcomed(self, engine: int) -> bool:
        """True once every rank was welcomed by engine instance ``engine``."""

    def engine_split(self, engine: int):
        """``[(rank, engine), ...]`` welcomed by another engine than ``engine``, or None."""

    def publish_fault(self, code: int) -> None:
        """This rank stopped at an error ``code``; waiting peers wake and see it."""

    def peer_fault(self):
        """``(rank, code)`` of the first other rank that published a fault, or None."""

    def missing_fault(self):
        """During a barrier wait: ``(rank, code)`` of a rank that has not arrived and
        published a fault (it never will); outside one: ``peer_fault()``."""

    def wake(self) -> None:
        """Wake this rank's waits early (thread-safe)."""

    def close(self, timeout: Optional[float] = None) -> bool:
        """Leave the group (any thread); True when everything was freed."""
