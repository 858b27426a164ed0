"""What a rank learned that its next step call must raise, and the fault protocol between ranks.

The receiving side (a background thread, or the event loop's own receives in sync mode)
leaves what it learns in ``Faults.error``, the one slot every step call already reads, so
liveness adds nothing to the step's critical path: a failure, the engine's CLOSE
(``EngineClosedError``, deferred until everything sent was taken), or this client's own
``close()`` (``ClosedError``). Errors about the engine are raised only where a step starts
(``exist_tasks``, ``barrier``, ``num_tasks``), never by ``get_tasks()`` once the group's
decision is made: every rank takes what the group decided, or none does.

Between ranks (``tp.protocol``: ``publish_fault``, ``peer_fault``, ``missing_fault``): a rank
that stops at an error publishes a code, so that a peer waiting for it in a barrier raises
the same kind of error at once instead of "rank N exited" after a timeout. A step stays
all-or-none: a rank that learns of its own failure after it arrived at a barrier publishes
it and keeps waiting (``barrier_check``); it leaves only when a rank that has not arrived
will never arrive.
"""

import logging

from ..errors import (
    BarrierTimeoutError,
    ClosedError,
    EngineClosedError,
    EngineGoneError,
    EngineRejectedError,
    EngineUnreachableError,
    GroupLostError,
    PrefetchError,
)
from ..tp.layout import FAULT_LEFT

__all__ = ["Faults"]

log = logging.getLogger(__name__)

# Engine-side errors a rank publishes to its group when it stops at one; GroupLostError
# before EngineRejectedError, its base class.
_FAULT_CODES = ((EngineGoneError, 1), (GroupLostError, 2), (EngineRejectedError, 3),
                (EngineClosedError, 4), (EngineUnreachableError, 5))
_FAULT_CLASSES = {code: cls for cls, code in _FAULT_CODES}
# Any other failure a rank stops at (a batch that does not decode, a lost seq...): its peers
# learn that it will not arrive, not why (its own exception says).
_FAULT_OTHER = 32
# Raised as themselves by every step call, in both modes (never wrapped in PrefetchError).
_RAISED_AS_IS = (EngineClosedError, EngineUnreachableError)


class Faults:
    """One rank's error slot (``error``) and its side of the fault protocol.

    ``who``: "rank R of 'name'", for messages; ``client``: "TaskClient name rank R";
    ``slot`` (its ``taken``) and ``watch`` (its ``close_seq``) say whether an engine CLOSE
    may be raised yet (only once this rank took everything it was sent); ``wakers``: what
    to call when a background thread fails, so that a wait in progress sees it at once.
    ``async_prefetch``: how a failure is reported (see ``raise_error``)."""

    def __init__(self, who, client, endpoint, group, slot, watch, async_prefetch, wakers):
        self._who, self._client, self._endpoint = who, client, endpoint
        self._group, self._slot, self._watch = group, slot, watch
        self._async = async_prefetch
        self._wakers = wakers
        self.error = None
        self._raised = False  # sync mode: the original error was raised once
        self._published = False  # this rank published its failure to the group

    # -- recording -----------------------------------------------------------------------

    def latch(self, exc) -> None:
        """Record ``exc`` unless a failure is recorded already (an engine CLOSE gives way
        to a real failure)."""
        if self.error is None or isinstance(self.error, EngineClosedError):
            self.error = exc

    def fail(self, exc, closed: bool) -> None:
        """A background thread stopped at ``exc``: the next step call raises it, which is
        its one report (nothing is logged above DEBUG); waits in progress are woken.
        Nothing once the client is ``closed``."""
        if closed:
            return
        self.latch(exc)
        log.debug("%s: %s; the next step call raises it", self._client, exc, exc_info=True)
        for wake in self._wakers:
            wake()

    def raised_now(self, exc) -> None:
        """Sync mode: ``exc`` is being raised from the call that met it; later calls raise
        ``PrefetchError`` (nothing can step past a batch this rank lost)."""
        self.error = exc
        self._raised = True

    def close(self):
        """This client is closing: every step call raises ``ClosedError`` from now on.
        Returns what was recorded before."""
        prior, self.error = self.error, ClosedError(f"{self._client} is closed")
        return prior

    # -- raising -------------------------------------------------------------------------

    def raise_error(self) -> None:
        """Raise what ``error`` holds, in this client's terms; return (raise nothing) for
        an engine CLOSE while this rank still has batches it was sent to take. An
        engine-side error is first published to the group, so that peers blocked in the
        barrier raise the same kind of error instead of "rank N exited".

        ``EngineClosedError`` and ``EngineUnreachableError`` are raised as themselves. Any
        other failure: in async mode wrapped in ``PrefetchError``; in sync mode the first
        call raises it as is and later calls raise ``PrefetchError``."""
        err = self.error
        if isinstance(err, ClosedError):
            raise ClosedError(str(err))
        if isinstance(err, EngineClosedError) and self._slot.taken < (self._watch.close_seq or 0):
            return
        if not self._published:
            self._publish(err)
        if isinstance(err, _RAISED_AS_IS):
            raise type(err)(str(err))
        if not self._async and not self._raised:
            self._raised = True
            raise err
        where = ("the prefetch thread (or a decode at a take)" if self._async else
                 "an earlier receive or decode")
        raise PrefetchError(f"{self._client}: {where} failed: {err}") from err

    def check_before_arriving(self) -> None:
        """Before this rank arrives anywhere (``wait_for_tasks``): its own error, then a
        peer's fault; either is raised (nobody can pass a barrier this rank has not
        reached)."""
        if self.error is not None:
            self.raise_error()
        fault = self._group.peer_fault()
        if fault is not None:
            self.raise_peer_fault(*fault)

    def barrier_check(self) -> None:
        """The barrier's check after every wake-up, once this rank has arrived (see the
        module docstring). Its own failure is published to the group and raised only when a
        rank that has not arrived failed too (the step can never complete); otherwise the
        wait goes on and the next step call raises it. A ``close()`` from another thread is
        raised at once."""
        err = self.error
        if isinstance(err, ClosedError):
            raise ClosedError(str(err))
        fault = self._group.missing_fault()
        if fault is None:
            if err is not None and not self._published:
                self._publish(err)
            return
        if err is not None:
            self.raise_error()  # returns only for an engine CLOSE with batches left to take
        self.raise_peer_fault(*fault)

    def raise_peer_fault(self, rank, code) -> None:
        """Rank ``rank`` published fault ``code``: raise what it means for this rank (the
        same kind of engine error; ``BarrierTimeoutError`` for a peer that left or failed
        otherwise). Returns for an engine CLOSE while this rank's own CLOSE is on its way
        or it still has batches to take."""
        if code == FAULT_LEFT:
            raise BarrierTimeoutError(
                f"{self._who}: rank {rank} of the group closed its client, so this step "
                f"cannot complete; close this client too and build the whole group again")
        if code == _FAULT_OTHER:
            raise BarrierTimeoutError(
                f"{self._who}: rank {rank} of the group stopped at an error (its own "
                f"exception says which), so this step cannot complete; close this client and "
                f"build the whole group again")
        cls = _FAULT_CLASSES.get(code, EngineRejectedError)
        close_seq = self._watch.close_seq
        if cls is EngineClosedError and (close_seq is None or self._slot.taken < close_seq):
            return
        self.error = cls(f"{self._who}: rank {rank} of the group stopped at {cls.__name__} "
                         f"about the engine at {self._endpoint} (its exception says why), so "
                         f"this step cannot complete")
        self.raise_error()

    def raise_engine_split(self, engine: int, split) -> None:
        """Rank 0 found ranks of its group welcomed by other engine instances (``split``:
        ``[(rank, engine), ...]``) than its own ``engine``: seqs are an engine's, so the
        ranks would take different batches under the same numbers. The group stops here
        (its peers raise the same error from their barrier)."""
        others = ", ".join(f"rank {r}: {e:#x}" for r, e in split)
        self.error = EngineGoneError(
            f"{self._who}: the ranks of this group were welcomed by different engine "
            f"instances (this rank: {engine:#x} at {self._endpoint}; {others}): an engine "
            f"restarted while the group started, or the ranks were given different "
            f"endpoints; nothing was taken. Restart the worker group, every rank with the "
            f"same endpoint")
        self.raise_error()

    def _publish(self, err) -> bool:
        """Tell the group this rank stopped at ``err``: peers waiting for it raise at once
        (the same kind of error for an engine-side one, instead of "rank N exited"). False
        (nothing published) for ``ClosedError`` (close() says LEFT itself) and for an
        engine CLOSE while this rank still has batches to take."""
        if isinstance(err, ClosedError):
            return False
        code = _FAULT_OTHER
        for cls, cls_code in _FAULT_CODES:
            if isinstance(err, cls):
                if cls is EngineClosedError and self._slot.taken < (self._watch.close_seq or 0):
                    return False
                code = cls_code
                break
        self._group.publish_fault(code)
        self._published = True
        return True
