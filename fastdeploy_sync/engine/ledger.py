"""The engine's ledger: every batch in flight, what each rank consumed, and the room it
leaves for the next ``put_tasks()``.

Every batch gets a sequence number and is kept (``retained``) until every TP rank of the
group has acknowledged taking it; the window (``max_inflight``) bounds how many are in
flight. Acknowledgements arrive as ACK messages (``tcp://``: membership applies them) or
on the ack board in shared memory (``ipc://``: read here whenever a count or room is
needed; a put blocked on the window re-reads it with a short sleeping backoff, since the
board notifies nobody).

Sequence numbers on the wire are relative to the worker group (every group starts at 1),
so a new group never sees the previous group's numbering; the ledger speaks the queue's
own, global numbers (``base``: the global seq before the current group's first batch).

Lock invariant: ``mutex`` guards every field: the next seq, ``retained``, what each rank
consumed, ``base``, the group being served and the previous one, the board (detached at
close), the lifecycle flags (``closed``, ``stopping``, ``finished``), the I/O thread's
failure, and the metrics (put times, the delivery histogram, retirements); ``not_full`` is
a condition on it, notified whenever the slowest rank's acknowledgement advances, a group
is retired, the queue closes or the I/O thread fails. ``KeptBatches``' own locks are
always taken after ``mutex``, never before.
"""

import bisect
import collections
import logging
import threading
import time

from ..errors import ClosedError, ProtocolError, TaskSyncError
from ..wire import codec
from .rank_link import CONNECTED, NEVER

__all__ = ["Ledger", "DELIVERY_BOUNDS_S", "RETIREMENT_KINDS"]

log = logging.getLogger(__name__)

# A put_tasks() blocked on the bound re-reads the ack board at this pace (doubling).
_BOARD_POLL_MIN_S = 50e-6
_BOARD_POLL_MAX_S = 1e-3

# Delivery latency (put -> consumed by every rank) histogram, upper bounds in seconds (the
# last bucket is +Inf). Fixed, so that observing is one bisect and an add.
DELIVERY_BOUNDS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0)
# Why a group was retired, by kind: the first keyword of the retirement's reason found
# (membership words its reasons; metrics labels them). "gone": a rank's connection went
# and it did not come back (died, killed, frozen, unreachable); "hung": connected but
# silent past the stall timeout; "left": a rank closed its client (BYE).
RETIREMENT_KINDS = (("is gone", "gone"), ("is hung", "hung"), ("restarted", "rank_restarted"),
                    ("replaced", "replaced"), ("BYE", "left"))


class Ledger:
    """The batches in flight of one queue (module docstring). ``kept``: the queue's
    ``kept_batches.KeptBatches``, told what becomes of each batch; ``board``: the ack board (None for a
    ``tcp://`` queue); ``counters``: the queue's ``stats()`` counters."""

    def __init__(self, name, tp_size, max_inflight, kept, board, counters):
        self.name, self.tp_size, self.max_inflight = name, tp_size, max_inflight
        self._kept, self._board, self._counters = kept, board, counters
        self.mutex = threading.Lock()
        self.not_full = threading.Condition(self.mutex)
        self._next_seq = 1
        self._retained = collections.OrderedDict()  # global seq -> (payload frames, checksum)
        self.base = 0  # the global seq before the current group's first batch
        self._consumed = [0] * tp_size  # highest global seq acknowledged by each rank
        self.group = None  # the Group being served, None before the first / after a retire
        self._previous = None  # the last retired group, for ranks() until a new one comes
        self.error = None  # an I/O thread failure, re-raised by every call
        self.closed = False  # put_tasks() refused from now on
        self.stopping = False  # close() has drained: the I/O thread says CLOSE and exits
        self.finished = False  # close() has returned: num_tasks() refused too
        self._put_times = {}  # put time per retained seq
        self._delivery = [0] * (len(DELIVERY_BOUNDS_S) + 1) + [0.0]  # bucket counts, sum
        self._retirements = collections.Counter()

    # -- putting -------------------------------------------------------------------------

    def put(self, batch, timeout):
        """Enqueue an encoded ``batch``: wait for room (``timeout`` seconds, None forever:
        ``TimeoutError`` naming the ranks behind), give it the next seq, publish it in the
        group's ring (``KeptBatches.enqueue``). Returns ``(seq, retained)``; ``retained[0]`` is
        None for a batch the ranks read from the ring. ``ClosedError`` after ``close()``,
        ``TaskSyncError`` (chained) if the I/O thread failed; the batch is then not
        enqueued (the caller discards it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        backoff = _BOARD_POLL_MIN_S
        with self.not_full:
            while True:
                self._check_usable()
                self.read_board()
                if self._in_flight() < self.max_inflight:
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"put_tasks timed out after {timeout}s: "
                                       f"{self.describe_backlog()}")
                if self._board is not None:  # the board notifies nobody: re-read it soon
                    remaining = backoff if remaining is None else min(remaining, backoff)
                    backoff = min(backoff * 2, _BOARD_POLL_MAX_S)
                self.not_full.wait(remaining)
            return self._enqueue(batch)

    def offer(self, batch, expired: bool):
        """A producer's encoded ``batch``, enqueued if there is room now: ``(P_ACCEPTED,
        seq)``; ``(P_CLOSED, 0)`` once the queue closed; ``(P_TIMEOUT, 0)`` when full and
        ``expired``; ``(None, 0)`` when full and the producer still waits. Never waits."""
        with self.not_full:
            if self.closed:
                return codec.P_CLOSED, 0
            self.read_board()
            if self._in_flight() < self.max_inflight:
                return codec.P_ACCEPTED, self._enqueue(batch)[0]
        return (codec.P_TIMEOUT if expired else None), 0

    def has_room(self) -> bool:
        """True if a batch could be enqueued now (False once closed)."""
        with self.not_full:
            if self.closed:
                return False
            self.read_board()
            return self._in_flight() < self.max_inflight

    def _enqueue(self, batch):
        seq = self._next_seq
        self._next_seq += 1
        # published in the group's ring (node-local) before anyone can see the seq
        retained = self._retained[seq] = self._kept.enqueue(seq, seq - self.base, batch)
        self._put_times[seq] = time.monotonic()
        return seq, retained

    def _check_usable(self):
        if self.error is not None:
            raise TaskSyncError(f"TaskQueue {self.name}: the I/O thread failed") from self.error
        if self.closed:
            raise ClosedError(f"TaskQueue {self.name} is closed")

    # -- counting ------------------------------------------------------------------------

    def _in_flight(self) -> int:
        return self._next_seq - 1 - min(self._consumed)

    def in_flight(self) -> int:
        """Batches put but not yet consumed by every rank."""
        with self.mutex:
            self.read_board()
            return self._in_flight()

    def count(self) -> int:
        """``in_flight()``, refused (``ClosedError``) once ``close()`` returned."""
        with self.mutex:
            if self.finished:
                raise ClosedError(f"TaskQueue {self.name} is closed (close() returned what "
                                  f"was not consumed)")
            self.read_board()
            return self._in_flight()

    def read_board(self):
        """Fold the ack board into what each rank consumed (under ``mutex``). Entries tagged
        with another group's epoch (a retired group's straggler) are ignored; a seq past
        the last put is counted (``garbage_acks``) and ignored."""
        group = self.group
        if self._board is None or group is None:
            return
        last = self._next_seq - 1
        for rank, (epoch, rel) in enumerate(self._board.read()):
            if epoch != group.epoch:
                continue
            seq = self.base + rel
            if seq > self._consumed[rank]:
                if seq > last:
                    self._counters["garbage_acks"] += 1  # not ours to trust; ignore
                    continue
                self._consume(rank, seq)

    def _consume(self, rank, seq):
        """Rank ``rank`` has consumed up to ``seq`` (> its previous value; under ``mutex``):
        free what every rank has consumed and wake blocked puts."""
        low_before = min(self._consumed)
        self._consumed[rank] = seq
        low = min(self._consumed)
        if low > low_before:
            now = time.monotonic()
            for s in range(low_before + 1, low + 1):
                put_at = self._put_times.pop(s, None)
                if put_at is not None:  # delivered to every rank: one observation
                    self._delivery[bisect.bisect_left(DELIVERY_BOUNDS_S, now - put_at)] += 1
                    self._delivery[-1] += now - put_at
                self._retained.pop(s, None)
                self._kept.release(s)  # every rank mapped it when it received it
            self.not_full.notify_all()

    def describe_backlog(self) -> str:
        """For messages (under ``mutex``): how many batches are in flight, and which ranks
        are behind and in what state."""
        last = self._next_seq - 1
        low = min(self._consumed)
        group = self.group
        behind = []
        for rank, consumed in enumerate(self._consumed):
            if consumed == low:
                state = (group.links[rank].describe() if group is not None else
                         NEVER if self._previous is None else
                         f"its group was retired ({self._previous.links[rank].describe()}); "
                         f"waiting for a new worker group")
                behind.append(f"rank {rank} consumed up to seq {consumed} of {last} ({state})")
        return (f"{last - low} batch(es) in flight (max_inflight={self.max_inflight}); "
                f"behind: " + "; ".join(behind))

    # -- what membership changes (I/O thread) --------------------------------------------

    def start_group(self, group):
        """Serve ``group`` from now on (its first batch is the next one put)."""
        with self.mutex:
            self.group = group

    def admit(self, rank, first_missing, taken):
        """A rank (re)joins saying it lacks (group-relative) seq ``first_missing`` and has
        taken up to ``taken``: None if that fits what it consumed (its implicit ack is
        applied), else what does not fit."""
        with self.not_full:
            self.read_board()
            consumed = self._consumed[rank] - self.base
            taken = min(taken, self._next_seq - 1 - self.base)
            if first_missing - 1 < consumed:
                return (f"rank {rank} asks for seq {first_missing} but had consumed up to "
                        f"{consumed}")
            if self.base + taken > self._consumed[rank]:  # HELLO's implicit ack
                self._consume(rank, self.base + taken)
        return None

    def acknowledge(self, rank, seq, message=True):
        """Rank ``rank`` took every batch up to (group-relative) ``seq``. ``ProtocolError``
        for a seq never sent to its group. ``message``: it came as an ACK (counted in
        ``stats()["acks"]``), not with a BYE."""
        with self.not_full:
            seq += self.base
            if seq > self._next_seq - 1:
                raise ProtocolError(f"rank {rank} acknowledged seq {seq - self.base}, only "
                                    f"{self._next_seq - 1 - self.base} were sent to its group")
            if message:
                self._counters["acks"] += 1
            if seq > self._consumed[rank]:  # else stale or duplicate: acks are cumulative
                self._consume(rank, seq)

    def retire(self, group, reason) -> list:
        """Stop serving ``group`` (retired for ``reason``): reset the window for the next
        group and return what ``group`` did not finish, as ``(seq, tasks, taken_by)`` in
        put order (``tasks``: a ``ProtocolError``, cause chained, for bytes that do not
        decode). The decoding runs outside ``mutex``."""
        with self.not_full:
            self.read_board()
            low = min(self._consumed)
            consumed = list(self._consumed)
            unfinished = [(seq, frames, tuple(r for r, c in enumerate(consumed) if c >= seq))
                          for seq, (frames, _) in self._retained.items() if seq > low]
            self._retained.clear()
            self._put_times.clear()  # never delivered to every rank: not a delivery
            self._retirements[next((k for w, k in RETIREMENT_KINDS if w in reason), "other")] += 1
            # taken out now: batches put after this lock is released belong to the next group
            # (whose ring, epoch group.epoch + 1, exists before any of them is published)
            dropped = self._kept.drop_all(group.epoch + 1)
            self.base = self._next_seq - 1
            self._consumed = [self.base] * self.tp_size
            self.group, self._previous = None, group
            self.not_full.notify_all()
        lost = []
        try:
            for seq, frames, taken_by in unfinished:
                try:
                    tasks = self._kept.decode_retained(frames, dropped.get(seq))
                except BaseException as exc:
                    # A producer's bytes (or an object whose unpickling raises, even
                    # SystemExit) must not end the I/O thread; never lose the seq either.
                    tasks = ProtocolError(f"batch {seq} does not decode: {exc!r}")
                    tasks.__cause__ = exc
                lost.append((seq, tasks, taken_by))
        finally:
            # Nothing retained any more: free its shared memory (see KeptBatches.forget).
            self._kept.forget(dropped)
        return lost

    # -- what the I/O thread reads -------------------------------------------------------

    def unsent(self, group):
        """``(todo, last, base)``: ``todo`` is ``[(link, [(seq, (frames, check)), ...]),
        ...]``, for each connected rank of ``group`` that lacks a batch, the retained
        batches it has not been sent yet (global seqs; batches the ranks read from the ring
        are not sent); ``last`` the last seq put, ``base`` the group's."""
        with self.mutex:
            last = self._next_seq - 1
            retained = self._retained
            todo = [(link, [(s, retained[s]) for s in range(link.sent + 1, last + 1)
                            if s in retained and retained[s][0] is not None])
                    for link in group.links if link.identity is not None and link.sent < last]
            return todo, last, self.base

    def group_last(self) -> int:
        """The group-relative seq of the last batch put (what a CLOSE tells the ranks)."""
        with self.mutex:
            return self._next_seq - 1 - self.base

    def retained_bytes(self) -> int:
        """The bytes of the retained socket frames (shared memory is not counted)."""
        with self.mutex:
            return sum(len(f) for frames, _ in self._retained.values() if frames
                       for f in frames)

    def group_connected(self) -> bool:
        group = self.group
        return group is not None and any(link.state == CONNECTED for link in group.links)

    def snapshot(self) -> tuple:
        """The figures ``stats()`` shows, read together (board folded in first): the
        counters, last seq, consumed, retained count, retirements, delivery histogram and
        the current group (or None)."""
        with self.mutex:
            self.read_board()
            out = dict(self._counters)
            out.update(last_seq=self._next_seq - 1, consumed=list(self._consumed),
                       retained=len(self._retained), retirements=dict(self._retirements),
                       delivery_s={"bounds": list(DELIVERY_BOUNDS_S),
                                   "counts": self._delivery[:-1], "sum": self._delivery[-1],
                                   "count": sum(self._delivery[:-1])})
            return out, self.group

    def rank_view(self):
        """``(group, consumed)``: the group being served (else the last retired one, else
        None) and what each rank consumed, read together."""
        with self.mutex:
            self.read_board()
            return self.group or self._previous, list(self._consumed)

    # -- lifetime ------------------------------------------------------------------------

    def drain(self, timeout: float):
        """``close()``'s first part: refuse puts from now on, then wait up to ``timeout``
        seconds until every batch put was consumed by every rank, or the group being served
        has no rank connected any more, or the I/O thread failed; then mark the queue
        stopping. Returns the seqs not consumed (``[]`` after a clean drain), or None when
        another ``close()`` came first."""
        deadline = time.monotonic() + max(0.0, timeout)
        backoff = _BOARD_POLL_MIN_S
        with self.not_full:
            if self.closed:
                return None
            self.closed = True
            self.not_full.notify_all()
            while self.error is None:
                self.read_board()
                if min(self._consumed) >= self._next_seq - 1:
                    break  # drained
                if self.group is not None and not self.group_connected():
                    break  # the group being served has gone: nobody to deliver to
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self.not_full.wait(min(remaining, backoff) if self._board else remaining)
                backoff = min(backoff * 2, _BOARD_POLL_MAX_S)
            unconsumed = list(range(min(self._consumed) + 1, self._next_seq))
            if unconsumed:
                log.warning("TaskQueue %s closing with %d batch(es) not consumed by every rank: "
                            "%s", self.name, len(unconsumed), self.describe_backlog())
            self.stopping = True
            return unconsumed

    def fail(self, exc) -> None:
        """The I/O thread failed: every call raises ``TaskSyncError`` from now on."""
        with self.not_full:
            self.error = exc
            self.not_full.notify_all()

    def finish(self):
        """``close()``'s last part: the board's last word is read (``stats()`` and
        ``ranks()`` show it from now on), the board is detached and returned (the caller
        closes it), and ``count()`` refuses."""
        with self.mutex:  # queries from other threads read the board under the lock
            self.read_board()
            board, self._board = self._board, None
            self.finished = True
        return board

    def forget_in_child(self, error) -> None:
        """In a forked child: the queue is unusable there (``error`` says why)."""
        self.error = error
        self.closed = self.finished = True
