"""What a drop-in client undecided about its role (``EngineWorkerQueue``, see ``queue``)
does when a loop polls it with ``exist_tasks()``/``num_tasks()``, which FastDeploy's engine
and its TP rank 0 both call first: ``UndecidedRole`` says whether something marks the
caller as a TP rank, and says so, once, when nothing does for a while.

Role hints, each unambiguous in FastDeploy's layouts:
  * ``client_id > 0``: FastDeploy's engine-side clients (its engine, the splitwise
    connector) are ``client_id=0``; a cache messager (``client_id=rank``) never calls the
    task path.
  * ``PADDLE_TRAINER_ID`` in the environment: paddle.distributed's launcher started this
    process; FastDeploy starts its workers so, one per TP rank, never its engines. (Not
    whether paddle.distributed is initialised: a cache messager may share a worker's
    process, but it never calls the task path either.)
  * the server's process holds the engine's own client of this DP group (FastDeploy's
    engine builds it beside the server; the server answers ``engine_here``): the engine
    is there, so a client elsewhere polling for tasks is a TP rank. Asked at most every
    ``ASK_EVERY_S``, only while undecided.
An engine in a process of its own (the V0 scheduler's, a DP engine) has none of them: its
polls read False/0 and its first ``put_tasks()`` decides. On an address across nodes no hint
is used (``hints_apply``).
"""

import logging
import os
import time

from .. import envs
from ..errors import ProtocolError

__all__ = ["UndecidedRole", "launched_as_tp_rank", "hints_apply", "how_to_decide",
           "late_rank0_error"]

log = logging.getLogger(__name__)

# How often an undecided poll may ask the server (one side-channel round trip), and how
# long it waits for the answer.
ASK_EVERY_S = 0.25
ASK_TIMEOUT_S = 2.0
# An undecided client polled this long says so (once, in the log).
WARN_AFTER_S = 1.0


def launched_as_tp_rank() -> bool:
    """This process was started by paddle.distributed's launcher (see the module
    docstring)."""
    return "PADDLE_TRAINER_ID" in os.environ


def hints_apply(single_node, tp_size) -> bool:
    """Whether a poll may make the client join its TP group. Not where the join may locate
    the group with a collective over the paddle world (an address across nodes, see
    ``WorkerSide``): every rank must join at the same point of the loop then, and rank 0
    joins in ``read_finish_flag.get()`` with its peers, as FastDeploy's ``nnode > 1`` loop
    makes it, never in its check alone."""
    return single_node or tp_size == 1 or envs.tp_coordinator(allow_auto=True) == "shm"


def how_to_decide() -> str:
    return ("Decide the role at construction: EngineWorkerQueue(..., role='worker') in TP "
            "rank processes (role='engine' in an engine process), or FD_SYNC_QUEUE_ROLE=worker "
            "/ engine in the process's environment")


def late_rank0_error(where) -> ProtocolError:
    """TP rank 0 joined its group in ``get_tasks()`` after polls that read False
    undecided: its check for that call was never made (its peers would blame the loop)."""
    return ProtocolError(
        f"{where} TP rank 0: get_tasks() made this client a TP rank, but its "
        f"exist_tasks()/num_tasks() before read False because its role was undecided, so "
        f"rank 0 has not checked for this call. {how_to_decide()}")


class UndecidedRole:
    """The role hints of one undecided client: ``link`` (its side channels), ``dp_id``,
    ``client_id``, ``where`` (a callable naming the queue in messages); ``hints=False``:
    none applies (polls only read, and warn). Used under the client's role lock or from
    its one polling thread."""

    def __init__(self, link, dp_id, client_id, where, *, hints=True):
        self._link, self._dp, self._cid, self._where = link, dp_id, client_id, where
        self._hints = hints
        self.polled_since = None  # the first poll that found no hint
        self.said = None  # the warning, once logged
        self._next_ask = 0.0

    def poll(self, what) -> bool:
        """A poll (``what``: ``"exist_tasks"`` or ``"num_tasks"``): True when a hint says
        the caller is TP rank ``client_id`` (it joins its group then). Else False, and
        after ``WARN_AFTER_S`` of such polls one warning naming the fix. Blocks at most
        ``ASK_TIMEOUT_S`` asking the server; ``ConnectionError`` without an answer (its
        message carries the warning, if logged)."""
        if self._hint():
            return True
        now = time.monotonic()
        if self.polled_since is None:
            self.polled_since = now
        elif self.said is None and now - self.polled_since >= WARN_AFTER_S:
            self.said = (
                f"{self._where()} client_id {self._cid}: role undecided after "
                f"{now - self.polled_since:.1f} s of {what}() calls, which read "
                f"{'False' if what == 'exist_tasks' else '0'} until a put_tasks() makes it "
                f"the engine's or a get_tasks(), read_finish_flag or worker_process_tp_barrier "
                f"call makes it a TP rank. {how_to_decide()}")
            log.warning("%s", self.said)
        return False

    def _hint(self) -> bool:
        if not self._hints:
            return False
        if self._cid > 0 or launched_as_tp_rank():
            return True
        now = time.monotonic()
        if now < self._next_ask:
            return False
        self._next_ask = now + ASK_EVERY_S
        try:
            return bool(self._link.call("engine_here", self._dp, self._cid,
                                        timeout=ASK_TIMEOUT_S))
        except ConnectionError as exc:
            note = f" ({self.said})" if self.said else ""
            raise ConnectionError(f"{exc}{note}") from None
