"""Every environment variable fastdeploy_sync reads, in one place.

Values are read when a TaskQueue / TaskClient is constructed (not at import), so a
test or a launcher can set them per process before building the objects.
"""

import os
import stat
import tempfile
from typing import Optional

__all__ = [
    "async_task_comm_enabled",
    "ipc_dir",
    "attach_timeout_s",
    "barrier_spin_us",
    "heartbeat_interval_s",
    "heartbeat_timeout_s",
    "stall_timeout_s",
    "max_message_bytes",
    "side_wait_s",
    "connect_timeout_s",
    "queue_role",
    "tp_coordinator",
    "profile_enabled",
    "profile_dir",
    "keys_dir",
    "insecure_tcp",
    "shm_payload_min_bytes",
    "shm_pool_bytes",
    "shm_checksum",
    "shm_ring_slot_bytes",
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
    """``FD_SYNC_IPC_DIR``: where default ``ipc://`` socket files live.

    Default: ``$XDG_RUNTIME_DIR/fastdeploy_sync`` when ``XDG_RUNTIME_DIR`` is an absolute
    path to a directory owned by us, else ``<tempdir>/fastdeploy_sync-<uid>``. The directory
    is created with mode 0700 and must stay private (``wire.endpoints.private_dir``): a socket in
    a directory others can write to can be bound by them first. Keep it short: a unix socket
    path is limited to 107 bytes. Only computes the path; creates nothing.
    """
    explicit = os.environ.get("FD_SYNC_IPC_DIR")
    if explicit:
        return explicit
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        try:
            st = os.stat(runtime)
        except OSError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            return os.path.join(runtime, "fastdeploy_sync")
    return os.path.join(tempfile.gettempdir(), f"fastdeploy_sync-{os.geteuid()}")


def attach_timeout_s() -> float:
    """``FD_SYNC_ATTACH_TIMEOUT`` (seconds, default 120): how long a TP rank other than 0
    waits in its constructor for rank 0 to create the group's shared-memory segment."""
    return float(os.environ.get("FD_SYNC_ATTACH_TIMEOUT", "120"))


def barrier_spin_us() -> float:
    """``FD_SYNC_BARRIER_SPIN_US`` (default 50): how long ``barrier()`` spins on shared memory
    before blocking on a semaphore. Spinning releases ranks that arrive together at once;
    blocking costs a semaphore's wake-up but no CPU while a rank is late (``tp.spin``)."""
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


def stall_timeout_s() -> float:
    """``FD_SYNC_STALL_TIMEOUT`` (seconds, default 300; ``0`` = never): how long a peer whose
    connection is alive (libzmq still answers its ZMTP heartbeats) may send no application
    message before it is taken for hung. A process whose main thread holds the GIL (a long
    C call, a compile, a weight load) stays connected but cannot send: this bound, not the
    heartbeat timeout, is what it must stay under. A dead or frozen process loses its
    connection and is detected within the heartbeat timeout whatever this says."""
    raw = os.environ.get("FD_SYNC_STALL_TIMEOUT", "300")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"FD_SYNC_STALL_TIMEOUT={raw!r}: expected a number of seconds") from None
    if value < 0:
        raise ValueError(f"FD_SYNC_STALL_TIMEOUT={raw!r}: expected a number >= 0 (0 = never)")
    return value


def max_message_bytes() -> int:
    """``FD_SYNC_MAX_MESSAGE_MB`` (default 1024): the largest message a worker accepts from
    the engine (ZeroMQ ``MAXMSGSIZE``; a larger one drops the connection instead of being
    allocated) and so the largest encoded batch ``put_tasks()`` accepts. The engine accepts
    at most 64 KiB per message from workers, whose messages are all small."""
    mb = _positive_float("FD_SYNC_MAX_MESSAGE_MB", "1024")
    return int(mb * (1 << 20))


def side_wait_s() -> float:
    """``FD_SYNC_SIDE_WAIT_S`` (seconds, default 300): how long a FastDeploy drop-in's
    side-channel wait lasts when the caller gives no ``timeout`` (a barrier, the lock, a
    put waiting for every client to read, a get waiting for every client to report), where
    FastDeploy waits without end. A barrier wait that runs out breaks that round only."""
    return _positive_float("FD_SYNC_SIDE_WAIT_S", "300")


def connect_timeout_s() -> float:
    """``FD_SYNC_CONNECT_TIMEOUT`` (seconds, default 15): how long a worker waits for its
    engine before raising ``ConnectionError``, as FastDeploy's ``_connect_with_retry`` (5
    attempts 3 s apart). A FastDeploy drop-in worker (``fastdeploy.EngineWorkerQueue``)
    waits this long for its server; a ``TaskClient`` whose engine has not welcomed it this
    long after construction raises ``EngineUnreachableError`` (a ``ConnectionError``) from
    its next step call. Workers may start before the engine within this bound."""
    return _positive_float("FD_SYNC_CONNECT_TIMEOUT", "15")


def queue_role() -> str:
    """``FD_SYNC_QUEUE_ROLE`` (``engine`` or ``worker``; ``worker`` when read unset): what a
    FastDeploy drop-in client (``is_server=False``) is when no server for its address lives
    in this process. The drop-in reads it only when it is set; unset, the client's first
    call decides (``fastdeploy.queue``)."""
    value = os.environ.get("FD_SYNC_QUEUE_ROLE", "worker").strip().lower()
    if value not in ("engine", "worker"):
        raise ValueError(f"FD_SYNC_QUEUE_ROLE={value!r}: expected engine or worker")
    return value


def tp_coordinator(allow_auto: bool = False) -> str:
    """``FD_SYNC_TP_COORDINATOR`` (``shm``, ``paddle`` or ``auto``): how TP ranks agree on
    each step. ``shm``: node-local shared memory. ``paddle``: one paddle.distributed
    all-reduce per step, for TP groups that span nodes. ``auto``: the FastDeploy drop-in
    (``allow_auto=True``) decides per group: paddle where the group's ranks do not share
    a node, shm where they do (``fastdeploy``); unset means ``auto`` there.
    ``TaskClient(coordinator=None)`` reads it with ``allow_auto=False``: unset or ``auto``
    is ``shm`` (a TaskClient alone cannot see where its peers run)."""
    value = os.environ.get("FD_SYNC_TP_COORDINATOR", "auto").strip().lower()
    if value not in ("shm", "paddle", "auto"):
        raise ValueError(f"FD_SYNC_TP_COORDINATOR={value!r}: expected shm, paddle or auto")
    if value == "auto" and not allow_auto:
        return "shm"
    return value


def profile_enabled() -> bool:
    """``FD_SYNC_PROFILE`` (default ``0``): ``1`` gives every ``TaskClient`` a
    ``StepProfiler`` (``client.profiler``) timing exist_tasks / barrier / get_tasks per step,
    in fixed memory (docs/profiling.md has its cost per step)."""
    return _flag("FD_SYNC_PROFILE")


def profile_dir() -> Optional[str]:
    """``FD_SYNC_PROFILE_DIR`` (default unset): with profiling on, ``TaskClient.close()``
    writes the profiler's JSON summary into this directory, one file per rank and process."""
    return os.environ.get("FD_SYNC_PROFILE_DIR") or None


def keys_dir() -> Optional[str]:
    """``FD_SYNC_KEYS_DIR`` (default unset): the directory of CURVE keys made by
    ``fastdeploy-sync keys DIR``, needed by ``tcp://`` endpoints (see ``wire.auth``)."""
    return os.environ.get("FD_SYNC_KEYS_DIR") or None


def insecure_tcp() -> bool:
    """``FD_SYNC_INSECURE_TCP`` (default ``0``): ``1`` lets ``tcp://`` endpoints run without
    CURVE keys. Anyone who reaches the port can then read users' prompts and run code in the
    workers; use it only on a network nobody else can reach."""
    return _flag("FD_SYNC_INSECURE_TCP")


def shm_payload_min_bytes():
    """``FD_SYNC_SHM_PAYLOAD_MIN_KB`` (KiB, default 1024): a node-local engine (``ipc://``
    endpoint) writes a batch whose out-of-band arrays take at least this many bytes once
    into shared memory, which every local rank maps read-only, instead of sending each
    rank its own copy over the socket (see ``shm.payload``). ``off`` sends every batch
    over the socket. Read by ``TaskQueue`` at construction; ``tcp://`` endpoints ignore
    it. Returns the threshold in bytes, or None for ``off``."""
    value = _size_or_off("FD_SYNC_SHM_PAYLOAD_MIN_KB", "1024", "KiB")
    return None if value is None else int(value * 1024)


def shm_pool_bytes() -> int:
    """``FD_SYNC_SHM_POOL_MB`` (MiB, default 256; ``0`` or ``off`` disables it): the pool of
    reused, pre-faulted shared memory a node-local queue writes its shared batches into
    (see ``shm.pool``). Created at the queue's first shared batch, one per worker
    group; never more than half of ``/dev/shm`` nor more than leaves a quarter of it
    free (sized down, or disabled, with a WARNING). Batches that do not fit go to a
    segment of their own, or over the socket. Returns bytes (0: no pool)."""
    value = _size_or_off("FD_SYNC_SHM_POOL_MB", "256", "MiB")
    return 0 if value is None else int(value * (1 << 20))


def shm_ring_slot_bytes():
    """``FD_SYNC_SHM_RING_KB`` (KiB, default 1024; ``0`` or ``off`` disables the ring): a
    node-local engine (``ipc://`` endpoint) writes every batch once into a shared-memory
    ring of fixed slots of this size, one ring per worker group, which every local rank
    reads (see ``batch_ring``): rank 0's check reads one word and no rank waits for a
    thread to receive. A batch larger than a slot puts its arrays into the large-batch
    pool (``FD_SYNC_SHM_PAYLOAD_MIN_KB``) and its pickle body into a slot; one that fits
    nowhere travels over the socket. The ring has ``2 * max_inflight + 2`` slots, at most
    64 MiB of them (at least 4). Read by ``TaskQueue`` at construction; ``tcp://``
    endpoints ignore it. Returns bytes (a multiple of 4 KiB, at least 4 KiB), or 0 for
    no ring."""
    value = _size_or_off("FD_SYNC_SHM_RING_KB", "1024", "KiB")
    if not value:
        return 0
    return max(4096, int(value * 1024) // 4096 * 4096)


def _size_or_off(name: str, default: str, unit: str):
    """A size variable: a number >= 0 of ``unit``, or ``off`` (also ``none``, ``never``:
    None). Anything else raises ``ValueError`` naming the variable."""
    raw = os.environ.get(name, default).strip().lower()
    if raw in ("off", "none", "never"):
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number of {unit} or 'off'") from None
    if not value >= 0:
        raise ValueError(f"{name}={raw!r}: expected a number >= 0 or 'off'")
    return value


def shm_checksum() -> bool:
    """``FD_SYNC_SHM_CHECKSUM`` (default ``0``): ``1`` makes the engine hash the array bytes
    of every shared-memory batch (``shm.payload``) and every rank verify the hash before
    decoding. The pickle body and the reference (offsets, region, stamp) are always
    checked before anything is unpickled; the array bytes are only ever the contents of
    arrays whose dtype and shape come from the checked body, and only this user can write
    them (see docs/large-batches.md, which has the cost: each rank makes one more pass over
    the bytes). Read by ``TaskQueue`` at construction."""
    return _flag("FD_SYNC_SHM_CHECKSUM", "0")
