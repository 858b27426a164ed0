"""Exceptions that are part of the public API."""

__all__ = [
    "TaskSyncError",
    "PrefetchError",
    "ProtocolError",
    "EngineRejectedError",
    "BarrierTimeoutError",
    "GroupInUseError",
    "EndpointInUseError",
    "ClosedError",
    "EngineGoneError",
    "EngineClosedError",
    "GroupLostError",
    "EngineUnreachableError",
    "AuthenticationError",
    "ForkedProcessError",
]


class TaskSyncError(RuntimeError):
    """Base class of every error fastdeploy_sync raises on purpose."""


class PrefetchError(TaskSyncError):
    """Receiving from the engine failed; ``__cause__`` holds the original error.

    Async mode: the background prefetch thread failed; the next ``exist_tasks()``,
    ``barrier()``, ``get_tasks()``, ``num_tasks()`` or ``sync_step()`` raises this, and so does
    every call after it: the client is unusable. Sync mode: the call that hit the failure
    raises the original error, every later call raises this.
    """


class ProtocolError(TaskSyncError):
    """The step protocol was broken: a gap in sequence numbers, or ranks that disagree on
    what they have taken (e.g. ``get_tasks()`` called on some ranks of a step but not others)."""


class EngineRejectedError(TaskSyncError):
    """The engine refused this worker (wrong tp_size or name, its rank's place is held by a
    live worker, or a rank restarted inside a live group)."""


class GroupLostError(EngineRejectedError):
    """The engine retired this worker group: one of its ranks went silent for the heartbeat
    timeout or restarted, so the group's model state is no longer whole. Restart the whole
    group; the engine hands back the batches it did not finish (``TaskQueue.group_events``)."""


class EngineGoneError(TaskSyncError):
    """Nothing was heard from the engine for the heartbeat timeout (it died, hangs, or the
    network between us is down), or the engine this worker was bound to was replaced by a
    restarted one. Batches this rank held but the group had not taken are not taken."""


class EngineUnreachableError(TaskSyncError, ConnectionError):
    """No engine welcomed this worker within its connect bound (``TaskClient``'s
    ``connect_timeout``, default ``FD_SYNC_CONNECT_TIMEOUT``): nothing listens at the
    endpoint, or something does that is not a fastdeploy_sync engine serving this queue.
    A ``ConnectionError``; the message names the endpoint, the rank and what to check."""


class EngineClosedError(TaskSyncError):
    """The engine closed its queue cleanly (``TaskQueue.close()``) and this rank has taken
    every batch the engine delivered before closing."""


class AuthenticationError(TaskSyncError):
    """Keys are missing or wrong, or a peer failed the CURVE handshake. The message says
    which endpoint and which key file, and how to create keys (``fastdeploy-sync keys``)."""


class BarrierTimeoutError(TaskSyncError, TimeoutError):
    """``barrier()`` timed out or a rank of the group exited; the message names the ranks."""


class GroupInUseError(TaskSyncError):
    """Another live process already owns this (name, dp_id) TP group's shared memory."""


class EndpointInUseError(TaskSyncError):
    """A live TaskQueue is already bound to this ipc endpoint."""


class ClosedError(TaskSyncError):
    """The object was used after ``close()``."""


class ForkedProcessError(TaskSyncError):
    """The object was built in another process, and this process is a child forked from it
    (``os.fork``, or a ``multiprocessing`` "fork" start) that inherited a copy.

    Its sockets, threads and shared memory words are the parent's: a child acting on them
    would act for its parent (take batches, arrive at the parent's barrier, say goodbye on
    the parent's connection). So every call on an inherited object raises this, and its
    ``close()`` does nothing (nothing of the parent's is closed, sent or removed). Build
    your own ``TaskQueue``/``TaskClient``/``TaskProducer``/``EngineWorkerQueue`` in the child."""

    @classmethod
    def inherited(cls, what: str, owner_pid: int, child_pid: int) -> "ForkedProcessError":
        """The error for ``what`` (e.g. "TaskClient rank 1 of 'llm' dp_id=0"), built in
        process ``owner_pid`` and inherited by the forked child ``child_pid``."""
        return cls(f"{what} was built in process {owner_pid}; this process ({child_pid}) is "
                   f"a child forked from it and never acts on its parent's objects (their "
                   f"connections, threads and shared memory are the parent's): build your own "
                   f"in the child")
