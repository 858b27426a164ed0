"""Every environment variable fastdeploy_sync reads, in one place.

Values are read when a TaskQueue / TaskClient is constructed (not at import), so a
test or a launcher can set them per process before building the objects.
"""

import os
import tempfile

__all__ = [
    "async_task_comm_enabled",
    "ipc_dir",
    "attach_timeout_s",
    "barrier_spin_us",
    "tp_coordinator",
    "profile_enabled",
    "profile_dir",
]


def _flag(name: str, default: str = "0") -> bool:
    value = os.environ.get(name, default).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{name}={value!r}: expected 0 or 1")


def async_task_comm_enabled() -> bool:
    """``DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM`` (default ``0``).

    ``0``: each worker runs a background prefetch thread (the fast path).
    ``1``: no thread; the event loop receives from the engine itself at step time
    (for debugging, and the baseline the benchmarks compare against).
    """
    return not _flag("DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM")


def ipc_dir() -> str:
    """``FD_SYNC_IPC_DIR``: where default ``ipc://`` socket files live (default: the temp dir).

    Keep it short: a unix socket path is limited to 107 bytes.
    """
    return os.environ.get("FD_SYNC_IPC_DIR") or tempfile.gettempdir()


def attach_timeout_s() -> float:
    """``FD_SYNC_ATTACH_TIMEOUT`` (seconds, default 120): how long a TP rank other than 0
    waits in its constructor for rank 0 to create the group's shared-memory segment."""
    return float(os.environ.get("FD_SYNC_ATTACH_TIMEOUT", "120"))


def barrier_spin_us() -> float:
    """``FD_SYNC_BARRIER_SPIN_US`` (default 50): how long ``barrier()`` spins on shared memory
    before blocking on a semaphore. Spinning gives sub-microsecond release when ranks arrive
    together; blocking costs ~30 us of wake-up but no CPU while a rank is late."""
    return float(os.environ.get("FD_SYNC_BARRIER_SPIN_US", "50"))


def tp_coordinator() -> str:
    """``FD_SYNC_TP_COORDINATOR`` (default ``shm``): how TP ranks agree on each step when
    ``TaskClient(coordinator=None)``. ``shm``: node-local shared memory. ``paddle``: one
    paddle.distributed all-reduce per step, for TP groups that span nodes."""
    value = os.environ.get("FD_SYNC_TP_COORDINATOR", "shm").strip().lower()
    if value not in ("shm", "paddle"):
        raise ValueError(f"FD_SYNC_TP_COORDINATOR={value!r}: expected shm or paddle")
    return value


def profile_enabled() -> bool:
    """``FD_SYNC_PROFILE`` (default ``0``): ``1`` gives every ``TaskClient`` a
    ``StepProfiler`` (``client.profiler``) timing exist_tasks / barrier / get_tasks per step,
    in fixed memory, at about a microsecond per step (``scripts/bench_sync.py`` section 6)."""
    return _flag("FD_SYNC_PROFILE")


def profile_dir() -> str:
    """``FD_SYNC_PROFILE_DIR`` (default unset): with profiling on, ``TaskClient.close()``
    writes the profiler's JSON summary into this directory, one file per rank and process."""
    return os.environ.get("FD_SYNC_PROFILE_DIR") or None
