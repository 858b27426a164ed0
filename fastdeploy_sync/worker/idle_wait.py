"""Rank 0's idle wait: block, with no CPU, until a step would take a batch.

For an idle loop that would otherwise poll ``exist_tasks()`` every millisecond. What wakes
the wait, by where the batch comes from:

  * the ring (a node-local engine): the prefetch thread's wake-up (async mode), or this
    rank's ring semaphore itself (sync mode, receiving from the socket between waits);
  * the socket: the receiver of whichever rank completes the batch posts rank 0's group
    semaphore (``TPGroup.wait_received``; TP=1: a condition); in sync mode this rank
    first receives its own copy (a poll of the data socket's descriptor, GIL released).
"""

import select
import time
from typing import Optional

import zmq

__all__ = ["IdleWait"]

# An async wait with a ring re-checks this often without a wake-up (a safety net: errors
# and close() wake it at once).
_RING_IDLE_CHECK_S = 0.1
# Sync mode with a ring: how often the wait also receives from the socket (CLOSE, errors,
# batches that did not fit the ring) while it waits on the ring.
_SYNC_RING_CHECK_S = 0.05
# Sync mode without a ring: how often the wait looks again while it polls the data socket
# (the heartbeat thread's findings wake no poll).
_SYNC_POLL_S = 0.05
# After a peer's fault: how often the wait offers what this rank still holds.
_AFTER_FAULT_POLL_S = 0.001


class IdleWait:
    """Rank 0's ``wait_for_tasks`` (``TaskClient`` documents the contract).

    ``exist_tasks``: the client's check (it receives in sync mode, latches, and raises what
    the receivers learned); ``ring``, ``slot``, ``group``, ``faults``, ``receiver``,
    ``connection``: the client's collaborators."""

    def __init__(self, exist_tasks, async_prefetch, ring, slot, group, faults, receiver,
                 connection):
        self._exist_tasks = exist_tasks
        self._async = async_prefetch
        self._ring, self._slot, self._group = ring, slot, group
        self._faults, self._receiver, self._conn = faults, receiver, connection

    def closed(self, check) -> None:
        """The client closed: ``check`` (which raises ``ClosedError``) replaces its
        ``exist_tasks``, so that this object no longer refers to the client."""
        self._exist_tasks = check

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        exist_tasks = self._exist_tasks
        if exist_tasks():
            return True
        if self._ring.reader is not None:
            return self._wait_ring(deadline)
        need = self._slot.taken + 1
        if not self._async:
            found = self._own_batch(need, deadline)
            if found is not None:
                return found
        faults, group = self._faults, self._group

        def check():
            if faults.error is not None:
                faults.raise_error()
            if not self._async:
                self._receiver.receive_now()  # CLOSE and errors keep arriving on our socket

        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return exist_tasks()
            if not group.wait_received(need, remaining, check):
                if group.peer_fault() is None:
                    return exist_tasks()  # timed out
                return self._after_peer_fault(deadline)
            if exist_tasks():
                return True

    def _own_batch(self, need, deadline) -> Optional[bool]:
        """Sync mode: this rank's own copy of batch ``need`` first, polling the data socket's
        descriptors (an OS-level poll touches no socket, so ``close()`` from another thread
        may close them meanwhile: the next check raises ``ClosedError``). True when a check
        found a step's batch, False when the time ran out, None once this rank holds
        ``need`` (the wait goes on for the other ranks)."""
        poller = select.poll()
        for sock in (self._conn.data, self._conn.monitor):
            poller.register(sock.getsockopt(zmq.FD), select.POLLIN)
        while self._slot.received < need:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            poller.poll(min(remaining, _SYNC_POLL_S) * 1000)
            if self._exist_tasks():  # receives, raises what the receivers learned
                return True
        return None

    def _wait_ring(self, deadline) -> bool:
        """With a ring: async mode waits for the prefetch thread's wake-up (set after every
        post, error and close), sync mode on this rank's ring semaphore itself, receiving
        from the socket between waits."""
        exist_tasks, ring = self._exist_tasks, self._ring
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return exist_tasks()
            if self._group.peer_fault() is not None:
                return self._after_peer_fault(deadline)
            if self._async:
                ring.woke.clear()
                if exist_tasks():  # published between the last check and the clear
                    return True
                ring.woke.wait(min(remaining, _RING_IDLE_CHECK_S))
            else:
                reader = ring.reader
                if reader is None:  # closed by another thread: exist_tasks() raises
                    return exist_tasks()
                reader.wait(min(remaining, _SYNC_RING_CHECK_S))
            if exist_tasks():  # receives (sync), raises what the receivers learned
                return True

    def _after_peer_fault(self, deadline) -> bool:
        """A peer stopped at an engine-side error while rank 0 waited: raise the same kind
        of error, as ``barrier()`` would. An engine CLOSE is raised only once this rank's
        own CLOSE arrived and everything it was sent is taken; until then batches it still
        holds are offered as usual."""
        while True:
            self._faults.check_before_arriving()
            if not self._async:
                self._receiver.receive_now()
            if self._exist_tasks():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(_AFTER_FAULT_POLL_S)
