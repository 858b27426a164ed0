"""The degenerate TP group of TP=1: no shared memory, no barrier, nothing to agree on."""

import threading
import time

from .layout import new_incarnation
from .protocol import NO_HOOKS

__all__ = ["SoloGroup"]


class SoloGroup:
    """TP=1 (``tp.protocol``).

    FastDeploy does not call the barrier at TP=1, so the decision is not indexed by
    generation here: ``decision()`` is whatever the last ``latch()`` said.
    ``wait_received`` blocks on a condition the receiving thread notifies.
    """

    tp_size = 1
    gen = 0
    spans_nodes = False

    def __init__(self):
        self.incarnation = new_incarnation()
        self._received = 0
        self._consumed = 0
        self._decision = None
        self._changed = threading.Condition(threading.Lock())
        self._wakes = 0  # wake() calls: a waiter returns to its caller's check on a change

    def publish_received(self, seq):
        with self._changed:
            self._received = seq
            self._changed.notify_all()

    def min_received(self):
        return self._received

    def wait_received(self, seq, timeout, check=None):
        """Block until this rank holds ``seq`` (True) or ``timeout`` seconds pass (False).
        GIL released while blocked. ``check`` runs after every ``wake()``; whatever it
        raises ends the wait."""
        deadline = time.monotonic() + timeout
        while True:
            with self._changed:
                wakes = self._wakes
                while self._received < seq and self._wakes == wakes:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    self._changed.wait(remaining)
                if self._received >= seq:
                    return True
            if check is not None:
                check()

    def wait_peers(self, seq, timeout):
        return self._received  # no peers to wait for

    def latch(self, gen, from_seq, to_seq):
        self._decision = (from_seq, to_seq)

    def decision(self, gen):
        return self._decision

    def publish_consumed(self, seq):
        self._consumed = seq

    def all_consumed(self, seq):
        return self._consumed >= seq

    def barrier(self, timeout=None, hooks=NO_HOOKS):
        pass

    def publish_engine(self, engine):
        pass

    def all_welcomed(self, engine):
        return True

    def engine_split(self, engine):
        return None

    def publish_fault(self, code):
        pass

    def peer_fault(self):
        return None

    def missing_fault(self):
        return None

    def wake(self):
        """Wake a ``wait_received`` in progress (e.g. the prefetch thread just failed)."""
        with self._changed:
            self._wakes += 1
            self._changed.notify_all()

    def close(self, timeout=None) -> bool:
        """Wake a ``wait_received`` of another thread (its check raises the client's
        ``ClosedError``). Nothing to free."""
        self.wake()
        return True
