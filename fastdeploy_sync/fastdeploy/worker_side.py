"""One TP rank of the drop-in: FastDeploy's worker-side task path over a ``TaskClient``.

Step consistency under FastDeploy's loops. Rank 0's check (``exist_tasks()`` in develop,
``num_tasks() > 0`` in 2.x) latches "take (from, to]" for its next ``get_tasks()`` call
number j; the loop's TP barrier orders that before every rank's j-th call; every rank's j-th
``get_tasks()`` takes decision j (``TaskClient``, ``external_barrier``). That holds whichever
barrier the loop uses (``paddle.distributed.barrier`` or the queue's
``worker_process_tp_barrier``) provided every rank calls ``get_tasks()`` the same number of
times, which FastDeploy's loops do: all ranks call it iff the signal (or
``read_finish_flag``) rank 0 set before the barrier is set.

The overlap scheduler (develop's GPU default) makes the queue's barrier the step's only sync
point: an idle step does nothing, so rank 0 can finish its step and set the *next* step's
signal before a slower rank, already past this step's barrier, reads it. That rank would take
the batch a step early and enter the model's collective alone. Here the drop-in owns the
barrier and sees each rank's reads, so the read is made harmless instead: rank 0 records with
decision j the barrier generation it is for (its passes of ``worker_process_tp_barrier`` + 1),
and a ``get_tasks()`` made after fewer passes is early: it returns ``([], False)`` and changes
nothing; that rank reads the signal again after the next barrier and takes decision j with
its peers. Nothing blocks and nothing is deferred. A loop that never calls the queue's barrier
never has an early read (every rank's pass count stays 0).

Rank 0 latches only in a check made before its step's barrier: one made after the barrier
and before its read of that step (FastDeploy logs ``num_tasks()`` there) only reads, so the
decision its peers are about to read, and the generation it is for, stay as they are.
"""

import hashlib
import logging
import time

from .. import envs
from ..errors import EngineClosedError, ProtocolError
from ..worker.client import TaskClient
from .board import EARLY, GroupBoard, PaddleBoard, SoloBoard
from .clear import Clear

__all__ = ["WorkerSide"]

log = logging.getLogger(__name__)

# How long rank 0's latch may be refused (a peer read the call first) before that is a
# broken loop rather than a check made after the step's barrier (see WorkerSide._refused).
_REFUSED_FOR_S = 1.0


class WorkerSide:
    """TP rank ``tp_rank`` of DP group ``dp_id``: a ``TaskClient`` and its group board.

    The constructor blocks until the engine welcomed this rank (``ConnectionError`` after
    ``connect_timeout`` s), ranks other than 0 also until their rank 0 exists
    (``FD_SYNC_ATTACH_TIMEOUT``); on a group spanning nodes it makes one all_gather over
    the paddle world (every rank joins at the same point of the loop). Used from the worker's
    event loop thread."""

    def __init__(self, name, address, tp_size, tp_rank, dp_id, *, keys_dir=None,
                 connect_timeout=None):
        self.tp_size, self.tp_rank, self.dp_id = tp_size, tp_rank, dp_id
        self._address = address
        endpoint = address.task_endpoint(dp_id)
        timeout = envs.connect_timeout_s() if connect_timeout is None else float(connect_timeout)
        group = self._choose_coordinator(endpoint or name)
        self.coordinator = "shm" if group == "shm" else "paddle"
        if self.coordinator == "paddle":
            from ..tp.paddle_group import PaddleTPGroup

            # all_client_read is PaddleBoard's: the step's collective needs the offer only
            group = PaddleTPGroup(tp_size, tp_rank, group=None if group == "paddle" else group,
                                  track_consumed=False)
        self.client = TaskClient(name, tp_size, tp_rank, dp_id=dp_id, endpoint=endpoint,
                                 external_barrier=group == "shm", coordinator=group,
                                 keys_dir=keys_dir)
        self._board = None
        try:
            if tp_size == 1:
                self._board = SoloBoard()
            elif self.coordinator == "paddle":
                self._board = PaddleBoard(tp_size, tp_rank)
            else:
                self._board = GroupBoard(name, dp_id, tp_size, tp_rank, envs.attach_timeout_s())
            self._wait_welcome(timeout)
        except BaseException:
            self.client.close()
            if self._board is not None:
                self._board.close()
            raise
        self.calls = 0  # get_tasks() calls that read a decision
        self._taken = self.client.stats()["taken"]  # the seq this rank took up to
        self.barriers = 0  # passes of the queue's worker_process_tp_barrier
        self.cleared = 0  # batches dropped by clear_data() (the engine's or a worker's)
        # rank 0: its pass count at its last latching check, None once it read since
        self._checked_at = None
        self._refused_since = None  # rank 0: (call, since) while its latch is refused
        log.info("Connected EngineWorkerQueue client_id: %d (DP group %d) to %s",
                 tp_rank, dp_id, self.client.endpoint)

    def _choose_coordinator(self, where):
        """How this TP group agrees on each step: ``"shm"`` (node-local shared memory), or
        the paddle.distributed group of its ranks (``"paddle"``: the whole world).

        ``FD_SYNC_TP_COORDINATOR`` (default ``auto``): ``shm`` and ``paddle`` force it;
        ``auto`` picks shm at TP=1, for FastDeploy's one-node address ``0.0.0.0`` and when
        this process has not initialised paddle.distributed (then the ranks cannot be
        coordinated across nodes anyway); otherwise every rank of the paddle world tells
        the others its node (``paddle_group.locate_tp_group``, one all_gather) and a group
        whose ranks do not all share a node uses paddle."""
        choice = envs.tp_coordinator(allow_auto=True)
        if self.tp_size == 1 or choice == "shm" or (choice == "auto"
                                                    and self._address.single_node):
            return "shm"
        from ..tp import paddle_group  # imports paddle only inside its functions

        if not paddle_group.paddle_initialized():
            if choice == "paddle":
                raise RuntimeError(f"EngineWorkerQueue rank {self.tp_rank}: "
                                   f"FD_SYNC_TP_COORDINATOR=paddle needs paddle.distributed "
                                   f"initialised (init_parallel_env()) before the queue")
            return "shm"
        digest = hashlib.blake2b(f"{where}|{self.dp_id}".encode(), digest_size=8).digest()
        key = int.from_bytes(digest, "big") >> 1
        group, spans = paddle_group.locate_tp_group(key, self.tp_size, self.tp_rank,
                                                    force=choice == "paddle")
        log.info("EngineWorkerQueue rank %d (DP group %d): TP ranks %s; coordinating "
                 "through %s%s", self.tp_rank, self.dp_id,
                 "span nodes" if spans else "share this node",
                 "paddle.distributed" if group else "node-local shared memory",
                 " (FD_SYNC_TP_COORDINATOR=paddle)" if group and not spans else "")
        return group or "shm"

    def _wait_welcome(self, timeout):
        """Fail fast when the engine never welcomes this rank, as FastDeploy's
        ``_connect_with_retry``."""
        deadline = time.monotonic() + timeout
        client = self.client
        while client.stats()["engine"] is None:
            # sync mode: the event loop receives the WELCOME; both modes: raises what the
            # engine answered instead (a wrong name, a taken rank...) rather than waiting
            client.num_tasks()
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"EngineWorkerQueue rank {self.tp_rank} (DP group {self.dp_id}) cannot "
                    f"connect to {client.endpoint} (address {self._address}) within "
                    f"{timeout:g} s: is the engine's server (is_server=True) running with "
                    f"this address? (FD_SYNC_CONNECT_TIMEOUT sets the wait)")
            time.sleep(0.005)

    # -- the step ----------------------------------------------------------------------------

    def exist_tasks(self) -> bool:
        """True when every rank holds a batch not yet taken; on rank 0 it also latches what
        the group's next ``get_tasks()`` takes (see ``check``). A flag read in async mode;
        never blocks (but see ``TaskClient.exist_tasks``)."""
        if self.tp_rank == 0:
            return bool(self.check())
        return self.client.exist_tasks()

    def num_tasks(self) -> int:
        """Rank 0: what its check latched for the next ``get_tasks()`` (0: nothing); a
        check that only reads (see the module docstring) returns this rank's own count.
        Other ranks: batches this rank holds and has not taken. Never blocks."""
        if self.tp_rank == 0:
            latched = self.check()
            return self.client.num_tasks() if latched is None else latched
        return self.client.num_tasks()

    def check(self):
        """TP rank 0's check: announce the next ``get_tasks()`` call and, if every rank
        holds a batch not yet taken, latch it for that call, for the barrier generation
        after this rank's last pass. Returns the number of batches latched (0: none), or
        None when it latched nothing because the call's decision was already read, or
        because this check came after the step's barrier (it only reads then)."""
        client, call = self.client, self.calls + 1
        self._board.announce(call)
        checked_at = self._checked_at
        if checked_at is not None and checked_at != self.barriers:
            return None  # past the barrier of the step it checked for: a read only
        try:
            held = client.num_tasks()  # sync mode: receives first
        except EngineClosedError:
            if self.coordinator == "paddle":
                raise  # every rank raises in the step's collective
            # Every rank raises after this step's barrier, in whatever it calls of this
            # queue then (get_tasks(), read_finish_flag): a rank raising alone, before the
            # caller's barrier, would leave its peers waiting in that barrier. "Tasks
            # exist" sends every loop's ranks to get_tasks().
            self._board.set_closed(self.calls + 1, self.barriers + 1)
            return 1
        if held == 0:  # rank 0 holds nothing new
            self._checked_at = None  # nothing latched: nothing a later check must keep
            return 0
        latched = self._board.latch_unless_read(call, self.barriers + 1, self._decide)
        if latched is False:
            self._refused(call)
            return None
        # A check that latched nothing leaves nothing for the peers to read, so the next
        # one latches again even without a read in between: an idle step that reads
        # neither the signal's batch nor read_finish_flag (the overlap loop reading only
        # its signal) must not turn every later check into a read.
        self._checked_at = self.barriers if latched else None
        return latched[0] if latched else 0

    def _refused(self, call):
        """Rank 0's latch for ``call`` was refused: a peer already read that call. Legal
        for a moment (a check after the step's barrier, before rank 0's own read); but if
        rank 0 keeps not making that call, a peer called ``get_tasks()`` without rank 0's
        signal and the group would stall silently: ``ProtocolError`` after
        ``_REFUSED_FOR_S``."""
        now = time.monotonic()
        if self._refused_since is None or self._refused_since[0] != call:
            self._refused_since = (call, now)
        elif now - self._refused_since[1] >= _REFUSED_FOR_S:
            raise ProtocolError(
                f"EngineWorkerQueue TP rank 0 (DP group {self.dp_id}): get_tasks() call {call} "
                f"was made by a peer without this rank's check having set the signal for it "
                f"(rank 0 has not made it for {now - self._refused_since[1]:.1f} s): the ranks "
                f"no longer call get_tasks() at the same steps. Fix the worker loop: every rank "
                f"calls it iff the signal TP rank 0 set before the TP barrier is set, at most "
                f"once per step")

    def _decide(self):
        """Under the board lock: latch in the TaskClient; ``(count, first, last)`` (the
        seqs ``(first, last]``, at most: a peer may have received more meanwhile, which the
        latch does not take) or None."""
        client = self.client
        if not client.exist_tasks():
            return None
        ready = client.ready_count()
        return ready, self._taken, self._taken + ready

    def get_tasks(self):
        """``(tasks, all_client_read)``; see ``EngineWorkerQueue.get_tasks``."""
        call = self.calls + 1
        if self._board.closed(call, self.barriers):
            self._raise_closed()
        # count (and seal decision `call`) before reading it: see latch_unless_read
        answer = self._board.last_reader(call, self.barriers)
        if answer is EARLY:
            return [], False
        last, drop = answer
        tasks, _ = self.client.get_tasks()
        self.calls = call
        self._taken += len(tasks)
        self._checked_at = self._refused_since = None
        if drop and tasks:
            dropped = tasks[:drop]
            self.cleared += sum(1 for t in dropped if not isinstance(t, Clear))
            tasks = tasks[drop:]
        if tasks:
            kept = []
            for t in tasks:
                if isinstance(t, Clear):
                    self.cleared += len(kept)
                    kept = []
                else:
                    kept.append(t)
            tasks = kept
        else:
            # a call that took nothing raises what the engine side learned: in a loop whose
            # ranks other than 0 call nothing else of this queue (docs' loop: get_tasks()
            # every step) they would otherwise never learn it
            self._after_barrier_faults()
        return tasks, bool(last)

    def _after_barrier_faults(self):
        """Raise what the engine side learned, after the step's barrier, except its CLOSE:
        that one every rank raises together, once rank 0's check said so (see
        ``check``); this rank may have seen it a step before rank 0 did. In sync mode
        it also receives what arrived."""
        try:
            self.client.num_tasks()
        except EngineClosedError:
            pass

    def _raise_closed(self):
        raise EngineClosedError(
            f"EngineWorkerQueue TP rank {self.tp_rank} (DP group {self.dp_id}): the engine at "
            f"{self.client.endpoint} closed the queue (its server's cleanup()); every batch "
            f"it sent was taken")

    def flag_get(self) -> int:
        """``read_finish_flag.get()``: on one node the group's shared flag (in sync mode it
        also receives what arrived, which keeps ranks other than 0 receiving while the loop
        idles); across nodes the step's collective (see ``EngineWorkerQueue``). Raises what
        the engine side learned (``EngineClosedError``...), as ``TaskClient.num_tasks``."""
        if self.coordinator == "paddle":
            self.client.barrier()
            return 1 if self.client.step_size() else 0
        if self._board.closed(self.calls + 1, self.barriers):
            self._raise_closed()
        # FastDeploy's idle loop calls nothing else of this queue on ranks other than 0
        self._after_barrier_faults()
        value = int(self._board.get_flag())
        self._checked_at = None
        return value

    def flag_set(self, value) -> None:
        self._board.set_flag(int(value))  # across nodes: nothing to set, see flag_get()

    def barrier(self, timeout=None) -> None:
        """``worker_process_tp_barrier.wait()``: the group's shared-memory barrier. In sync
        mode a rank other than 0 first receives what arrived (a non-blocking poll): a loop
        whose only other call on this queue is ``get_tasks()`` once the signal is set
        (the overlap loop reading only its signal) must keep those ranks receiving, or
        rank 0 never sees every rank holding a batch."""
        client = self.client
        if self.tp_rank and not client.async_prefetch:
            client.num_tasks()
        client.barrier(timeout)
        self.barriers += 1

    def clear_data(self) -> int:
        """Every batch this rank holds now is dropped, by every rank alike, when the group
        takes it: the board's clear bound, fixed into each call's decision by the first
        rank that reads it (a call some rank already read is not changed). Returns the
        seq bound; never blocks beyond the board lock."""
        upto = self.client.stats()["received"]
        if self._board.request_clear(upto) is False:
            log.warning("EngineWorkerQueue rank %d (DP group %d): clear_data() on a worker "
                        "of a group spanning nodes drops nothing; the engine's clear_data() "
                        "retires pending batches", self.tp_rank, self.dp_id)
        return upto

    def close(self) -> None:
        self.client.close()
        self._board.close()
