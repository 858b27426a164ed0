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
    "heartbeat_interval_s",
    "heartbeat_timeout_s",
    "max_message_bytes",
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


def _positive_float(name: str, default: str) -> float:
    raw = os.environ.get(name, default)
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{name}={raw!r}: expected a number > 0")
    return value


def heartbeat_interval_s() -> float:
    """``FD_SYNC_HEARTBEAT_INTERVAL`` (seconds, default 1): how often each worker pings the
    engine (the engine answers every ping). Costs one wake-up of a blocked thread per
    interval, nothing on the step's critical path."""
    return _positive_float("FD_SYNC_HEARTBEAT_INTERVAL", "1")


def heartbeat_timeout_s() -> float:
    """``FD_SYNC_HEARTBEAT_TIMEOUT`` (seconds, default 3): silence after which a worker
    raises ``EngineGoneError`` and the engine marks a rank disconnected and retires its
    group. Raise it when you stop a process in a debugger for longer than this."""
    return _positive_float("FD_SYNC_HEARTBEAT_TIMEOUT", "3")


def max_message_bytes() -> int:
    """``FD_SYNC_MAX_MESSAGE_MB`` (default 1024): the largest message a worker accepts from
    the engine (ZeroMQ ``MAXMSGSIZE``; a larger one drops the connection instead of being
    allocated) and so the largest encoded batch ``put_tasks()`` accepts. The engine accepts
    at most 64 KiB per message from workers, whose messages are all small."""
    mb = _positive_float("FD_SYNC_MAX_MESSAGE_MB", "1024")
    return int(mb * (1 << 20))


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
