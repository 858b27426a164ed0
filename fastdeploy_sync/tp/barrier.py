"""``ShmBarrier``: the shared-memory barrier of a node's TP group, for processes that are not a
``TaskClient`` group: a loop's own collective (the ``profile`` command's model step), a
test's or a benchmark's ranks. It is the barrier ``TaskClient.barrier()`` passes
(``shm_group``: spin while the ranks come together, block on a semaphore otherwise), with
nothing of the task path: no watermarks, no decisions, no engine.
"""

from typing import Optional

from ..forks import refuse_in_child
from .shm_group import ShmTPGroup

__all__ = ["ShmBarrier"]


class ShmBarrier:
    """A barrier of ``size`` processes of one node, named ``name``; this process is
    ``rank`` (0 <= rank < size).

    Construction: rank 0 creates the shared memory and semaphores (reclaiming what a
    crashed run of the same name left; ``GroupInUseError`` if a live rank 0 of the name
    exists). The other ranks block until rank 0 has made them, up to ``attach_timeout``
    seconds (None: ``FD_SYNC_ATTACH_TIMEOUT``), then raise ``TimeoutError``. The name
    shares the node's namespace with the queues' TP groups (``names.group_segment``): give
    it one no ``TaskQueue`` of this node uses (the ``profile`` command adds a suffix).

    ``spin_us``: the longest ``wait()`` spins before it blocks (None:
    ``FD_SYNC_BARRIER_SPIN_US``); it spins only while that pays (``tp.spin``).

    One thread uses it; ``close()`` may come from any thread. In a forked child every
    method raises ``ForkedProcessError`` and ``close()`` does nothing (returns None): the
    barrier is the parent's. Release the shared memory with ``close()`` (or ``with``), not
    by dropping the object.
    """

    def __init__(self, name: str, size: int, rank: int, *, attach_timeout: Optional[float] = None,
                 spin_us: Optional[float] = None):
        self._group = ShmTPGroup(name, 0, size, rank, attach_timeout=attach_timeout,
                                 spin_us=spin_us)
        self.name, self.size, self.rank = name, size, rank
        self._fork_guard = refuse_in_child(self, f"ShmBarrier rank {rank} of {name!r}",
                                           idle={"close": None})

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until every rank has called ``wait()`` for this generation.

        ``timeout`` (seconds, None = forever): ``BarrierTimeoutError`` naming the ranks that
        did not arrive, raised early when one of them has exited or closed its barrier;
        calling ``wait()`` again resumes the same generation. ``ClosedError`` if
        ``close()`` runs meanwhile in another thread."""
        self._group.barrier(timeout)

    def last_arrival_ns(self) -> int:
        """``CLOCK_MONOTONIC`` ns at which the last rank arrived at the barrier this rank
        last passed: the same instant on every rank (a loop can leave it together, as a
        collective does). Valid until a partner arrives at the next generation. Never
        blocks."""
        return self._group.last_arrival_ns()

    def close(self, timeout: float = 1.0) -> bool:
        """Leave the barrier: ranks waiting for this one raise at once; rank 0 removes the
        names (the others keep their mappings). Waits at most ``timeout`` seconds for a
        ``wait()`` of another thread of this process to leave; if it has not, the
        semaphores are kept rather than freed under it, and False is returned. Idempotent,
        any thread; True when everything was freed."""
        return self._group.close(timeout)

    def __enter__(self) -> "ShmBarrier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ShmBarrier({self.name!r}, size={self.size}, rank={self.rank})"
