"""What a waiting rank may know of its peers: who stopped at an error, who left, who died.

Read from the group's segment (each rank's FAULT, ARRIVED and PID slots, ``layout``) and
from the rank locks (``GroupSegment.rank_alive``); never blocks, writes nothing.
"""

from ..errors import BarrierTimeoutError
from .layout import FAULT_LEFT, R_ARRIVED, R_FAULT, R_PID, RANK_BASE, RANK_STRIDE

__all__ = ["PeerWatch"]


class PeerWatch:
    """The peers of rank ``tp_rank`` as the segment ``view`` of ``segment`` (a
    ``GroupSegment``) shows them."""

    def __init__(self, segment, tp_size: int, tp_rank: int):
        self._segment = segment
        self._view = segment.view
        self.tp_rank = tp_rank
        self._ranks = [RANK_BASE + r * RANK_STRIDE for r in range(tp_size)]

    def peer_fault(self):
        """``(rank, code)`` of the first other rank that published a fault, or None."""
        v = self._view
        for r, base in enumerate(self._ranks):
            if r != self.tp_rank and v[base + R_FAULT]:
                return r, v[base + R_FAULT]
        return None

    def missing_fault(self, gen: int):
        """``(rank, code)`` of the first rank that has not arrived at barrier generation
        ``gen`` and published a fault, i.e. will never arrive (a faulted rank arrives
        nowhere again); else None. ``gen`` 0 (no wait in progress): ``peer_fault()``."""
        if not gen:
            return self.peer_fault()
        v = self._view
        for r, base in enumerate(self._ranks):
            if r != self.tp_rank and v[base + R_FAULT] and v[base + R_ARRIVED] < gen:
                return r, v[base + R_FAULT]
        return None

    def missing(self, gen: int) -> list:
        """``[(rank, pid), ...]`` of the ranks that have not arrived at ``gen``."""
        v = self._view
        return [(r, v[b + R_PID]) for r, b in enumerate(self._ranks) if v[b + R_ARRIVED] < gen]

    def describe_missing(self, gen: int) -> str:
        """For a timeout's message: who has not arrived at ``gen``, and in what state."""
        parts = []
        v = self._view
        for r, pid in self.missing(gen):
            if pid == 0:
                parts.append(f"rank {r} (never attached)")
            elif v[self._ranks[r] + R_FAULT] == FAULT_LEFT:
                parts.append(f"rank {r} (pid {pid}, closed its client)")
            else:
                alive = self._segment.rank_alive(r)
                parts.append(f"rank {r} (pid {pid}, {'alive' if alive else 'exited'})")
        return "waiting for " + ", ".join(parts)

    def check_missing(self, gen: int) -> None:
        """Raise ``BarrierTimeoutError`` if a rank that has not arrived at ``gen`` closed
        its client or exited: it never will. A rank that published a fault first is the
        caller's ``check`` to judge (it knows what the fault means: e.g. an engine CLOSE
        that this rank's own CLOSE, still on its way, will confirm), not an exit."""
        v = self._view
        gone = []
        for r, pid in self.missing(gen):
            fault = v[self._ranks[r] + R_FAULT]
            if fault == FAULT_LEFT:
                gone.append(f"rank {r} (pid {pid}) closed its client")
            elif not fault and pid and not self._segment.rank_alive(r):
                gone.append(f"rank {r} (pid {pid}) exited")
        if gone:
            raise BarrierTimeoutError(
                f"rank {self.tp_rank}: barrier generation {gen} cannot complete: "
                + ", ".join(gone))
