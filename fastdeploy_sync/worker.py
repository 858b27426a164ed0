"""Worker side: ``TaskClient``, one per TP rank, used from the worker's event loop.

Async mode (default): a background prefetch thread receives. It blocks in an OS-level
``poll()`` on the data socket's ``zmq.FD`` (and its monitor's, a wake pipe, and its own
heartbeat socket and monitor) with the GIL released and without touching the sockets,
then, holding the receive lock, drains them: decodes each batch (numpy arrays zero-copy, see ``codec``) into a lock-guarded
local slot and publishes "I hold up to seq N" to the group's shared memory. The event
loop's ``exist_tasks()`` is then a few shared-memory reads: no socket, no lock.

Receiving is handed over, not shared: a ZeroMQ socket is not thread-safe, so the data
socket and its monitor are used only by the thread holding ``_recv_lock`` (a lock is a
full memory barrier). The prefetch thread takes it after every wake-up; the event loop
may take it without waiting, when frames have arrived that the prefetch thread has not
handled (it is waiting for the GIL the event loop holds), and handles them itself.

Sync mode (``DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM=1``): no thread; the same protocol
runs with the event loop receiving from the socket itself, in ``exist_tasks()``,
``num_tasks()`` and while it waits in ``barrier()`` (ranks other than 0 must keep
receiving while they wait, or rank 0 would never see every rank holding a batch).

The step, every rank, every iteration of the event loop::

    if tp_rank == 0: client.exist_tasks()     # latches "this step takes up to seq N"
    client.barrier()                         # all ranks; node-local shared memory
    tasks, read_finished = client.get_tasks() # the same batches on every rank

or ``tasks = client.sync_step()``. See ``tp_group`` for why the decision is indexed by the
barrier generation.

Liveness (see ``liveness``, whose contract this implements on the worker's side): a
thread that otherwise blocks (the prefetch thread; in sync mode a heartbeat thread) pings
the engine every heartbeat interval on a socket of its own, one that never carries a
batch, and watches that socket's connection through a socket monitor (a batch slower to
cross than the heartbeat timeout must not look like a dead engine). The engine is *gone* when that connection is down
(disconnected, or a handshake that never completes) and has not been re-established to
the same engine instance within the heartbeat timeout, or when nothing was heard on it
for that long while it is down (libzmq dropped it for missing ZMTP heartbeats: the engine
was frozen that long already); it is *hung* after ``stall_timeout`` of application
silence on a live connection. Silence alone, for less than ``stall_timeout``, is never
death: libzmq's own I/O thread keeps a connection alive with ZMTP heartbeats while a
Python thread on either side holds the GIL (a long C call, a compile, a huge pickle).

What the watching thread learns is left in ``_error``, the one slot every step call
already reads, so liveness adds nothing to the step's critical path. Errors about the
engine are raised only where a step starts (``exist_tasks``, ``barrier``, ``num_tasks``),
never by ``get_tasks()`` once the group's decision is made: every rank takes what the
group decided, or none does (a rank that learns of a failure after it arrived at a
barrier waits for its peers: see ``tp_group``).

Any thread may call ``close()``: a step call blocked in the barrier or in
``wait_for_tasks()`` is woken and raises ``ClosedError``, and nothing (semaphore, socket,
mapping) is freed while a thread may still use it.
"""

import collections
import errno
import logging
import os
import secrets
import select
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from . import batch_ring, codec, envs, payload_shm
from .ack_board import EPOCH_SHIFT, AckBoard
from .auth import HANDSHAKE_FAILED_EVENTS, ClientAuth, handshake_failure_message
from .errors import (AuthenticationError, BarrierTimeoutError, ClosedError, EngineClosedError,
                     EngineGoneError, EngineRejectedError, EngineUnreachableError, GroupLostError,
                     PrefetchError, ProtocolError)
from .liveness import Heartbeat
from .logs import RateLimitedLog
from .step_profiler import StepProfiler
from .tp_group import FAULT_LEFT, ShmTPGroup, SoloGroup
from .transport import (CLIENT_FDS, ReadinessPoll, WakePipe, check_ipc_endpoint,
                        default_endpoint, ensure_free_fds, ipc_path, new_socket, validate_name)

__all__ = ["TaskClient"]

log = logging.getLogger(__name__)


def _make_group(name, dp_id, tp_size, tp_rank, coordinator):
    if tp_size == 1:
        return SoloGroup()
    if coordinator is None:
        coordinator = envs.tp_coordinator()
    if coordinator == "shm":
        return ShmTPGroup(name, dp_id, tp_size, tp_rank)
    from .paddle_group import PaddleTPGroup  # imports paddle: only when asked for

    if coordinator == "paddle":
        return PaddleTPGroup(tp_size, tp_rank)
    if isinstance(coordinator, PaddleTPGroup):  # built by the caller (its own options)
        return coordinator
    if isinstance(coordinator, str):
        raise ValueError(f"coordinator={coordinator!r}: expected 'shm', 'paddle' or a "
                         f"paddle.distributed group")
    return PaddleTPGroup(tp_size, tp_rank, group=coordinator)


# Engine-side errors a rank publishes to its group when it stops at one (tp_group FAULT);
# GroupLostError before EngineRejectedError, its base class.
_FAULT_CODES = ((EngineGoneError, 1), (GroupLostError, 2), (EngineRejectedError, 3),
                (EngineClosedError, 4), (EngineUnreachableError, 5))
_FAULT_CLASSES = {code: cls for cls, code in _FAULT_CODES}
# Any other failure a rank stops at (a batch that does not decode, a lost seq...): its peers
# learn that it will not arrive, not why (its own exception says).
_FAULT_OTHER = 32
# Raised as themselves by every step call, in both modes (never wrapped in PrefetchError).
_RAISED_AS_IS = (EngineClosedError, EngineUnreachableError)

# How long close() lets its BYE leave (the engine then knows at once that this rank left).
_BYE_LINGER_MS = 200
# The longest rank 0's check waits for a peer that is receiving a batch rank 0 holds
# (ShmTPGroup.wait_peers); the wait ends as soon as the peer arrives at the barrier.
_PEER_WAIT_S = 0.005
# How long the event loop waits for a prefetch thread in the middle of handling what
# arrived (decoding 64 x 512 token ids: ~40 us once it has the GIL) before going on.
_DRAIN_WAIT_S = 0.002
# A look at the data socket by the event loop stands for this long: the barrier that
# follows the check of the same step does not look again (~1.2 us a look, ZMQ_EVENTS).
_RELOOK_NS = 200_000
# How long close() waits for a step call in another thread to let go of a socket before it
# keeps the sockets (leaks them until exit) rather than closing them under that thread.
_CLOSE_WAIT_S = 2.0
# ACKs queued towards the engine at most (tcp); beyond, the latest is kept and sent again.
_ACK_HWM = 64
# The ring's prefetch thread re-checks the ring this often without a post, and an async
# wait_for_tasks() re-checks this often without a wake-up (both: a safety net; errors and
# close() wake them at once).
_RING_WAIT_S = 1.0
_RING_IDLE_CHECK_S = 0.1
# Sync mode's wait_for_tasks() with a ring: how often it also receives from the socket
# (CLOSE, errors, batches that did not fit the ring) while it waits on the ring.
_SYNC_RING_CHECK_S = 0.05
_RING_KINDS = (batch_ring.INLINE, batch_ring.SHARED)
_PUBLISHED = batch_ring.PUBLISHED
# Socket-monitor events a worker watches: connection up and down, and handshakes.
_MONITOR_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED_EVENTS)


class TaskClient:
    """One TP rank's end of the task channel.

    ``TaskClient(name, tp_size, tp_rank, *, dp_id=0, endpoint=None, async_prefetch=None)``
    connects to the engine's endpoint (derived from name and dp_id when ``endpoint`` is
    None, exactly as ``TaskQueue`` does). The engine may start before or after the
    workers: nothing is lost either way.

    Ranks other than 0 block in the constructor until rank 0 of the group exists
    (``FD_SYNC_ATTACH_TIMEOUT`` seconds, then ``TimeoutError``).

    ``async_prefetch=None`` reads ``DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM`` (``0``, the
    default: background prefetch thread; ``1``: synchronous polling, no prefetch thread).

    ``coordinator`` says how the TP ranks agree on each step: ``"shm"`` (node-local
    shared memory, the default), ``"paddle"`` (ranks on several nodes: one
    paddle.distributed all-reduce per step over the default group; see
    ``paddle_group``), or a paddle.distributed group object (the TP ranks' group).
    ``None`` reads ``FD_SYNC_TP_COORDINATOR`` (default ``shm``). Ignored at tp_size=1.

    ``heartbeat``: a ``liveness.Heartbeat`` (None: ``FD_SYNC_HEARTBEAT_INTERVAL`` /
    ``FD_SYNC_HEARTBEAT_TIMEOUT`` / ``FD_SYNC_STALL_TIMEOUT``, default 1 s / 3 s / 300 s).
    Once the engine has welcomed this rank, the next step call raises ``EngineGoneError``
    when the connection to it is lost and not re-established to the same engine within the
    timeout, or when it was silent for ``stall_timeout`` on a live connection (see the
    module docstring); a long GIL hold in this process or the engine's is neither.

    ``connect_timeout`` (seconds; None: ``FD_SYNC_CONNECT_TIMEOUT``, default 15): the engine
    may start after the workers, but if none has welcomed this rank this long after
    construction, the next step call raises ``EngineUnreachableError`` (a
    ``ConnectionError``) naming the endpoint and what to check.

    ``profile=None`` reads ``FD_SYNC_PROFILE`` (default ``0``). When on, ``profiler`` is a
    ``StepProfiler`` timing ``exist_tasks``/``barrier``/``get_tasks`` of every step (they
    are wrapped on this instance); when off, ``profiler`` is None and nothing is timed.

    Errors from the engine side, raised by ``exist_tasks``/``barrier``/``num_tasks``/
    ``sync_step`` on every rank (``get_tasks`` still takes what the group decided):

    * ``EngineClosedError``: the engine called ``TaskQueue.close()`` and this rank has
      taken everything it was sent (raised as is, in both modes);
    * ``EngineGoneError`` (engine silent for the heartbeat timeout, or restarted),
      ``GroupLostError`` (the engine retired this group) and ``EngineRejectedError``:
      in async mode wrapped in ``PrefetchError`` (``__cause__`` holds them), as every
      failure of the prefetch thread; in sync mode the first call raises them as is and
      later calls raise ``PrefetchError``.

    Security: a ``tcp://`` endpoint uses ZeroMQ CURVE with the keys in ``keys_dir`` (None:
    ``FD_SYNC_KEYS_DIR``): this worker pins the engine's public key, so it never talks to
    (or unpickles anything from) another process that holds the port; a failed handshake
    raises ``AuthenticationError`` from the next step call. Without keys the constructor
    raises ``AuthenticationError``, unless ``insecure_tcp=True`` / ``FD_SYNC_INSECURE_TCP=1``.
    An ``ipc://`` endpoint must sit in a directory private to this user (checked before
    connecting: ``PermissionError`` otherwise).

    Threading: call the step methods from one thread (the event loop). ``close()`` may be
    called from any thread (a shutdown or signal-handling thread): a step call blocked
    meanwhile raises ``ClosedError``. Use as a context manager, or call ``close()``.

    ``external_barrier=True``: the caller's loop orders the ranks with its own TP barrier
    (FastDeploy's ``paddle.distributed.barrier``), not ``barrier()``. Rank 0's
    ``exist_tasks()`` then latches its decision for its *next* ``get_tasks()`` call number
    j (its calls so far + 1) and every rank's j-th ``get_tasks()`` takes decision j. This
    is consistent as long as every rank calls ``get_tasks()`` the same number of times,
    each j-th call after a barrier that rank 0 passed after latching j (FastDeploy's loop:
    every rank calls it iff the flag rank 0 set before the barrier is set). That contract is
    the caller's: a rank that calls it more often than its peers is off by one call from
    then on; ``get_tasks()`` raises ``ProtocolError`` only if that makes it disagree with
    rank 0 about what was taken (``fastdeploy.EngineWorkerQueue`` checks the call counts
    of every rank). At tp_size=1 it changes nothing.

    Decoded numpy arrays alias the received message and are read-only; copy before writing.
    """

    def __init__(self, name: str, tp_size: int, tp_rank: int, *, dp_id: int = 0,
                 endpoint: str = None, async_prefetch: bool = None, coordinator=None,
                 profile: bool = None, heartbeat: Heartbeat = None, keys_dir: str = None,
                 insecure_tcp: bool = None, external_barrier: bool = False,
                 connect_timeout: float = None):
        validate_name(name, dp_id)
        if type(tp_size) is not int or tp_size < 1:
            raise ValueError(f"tp_size={tp_size!r}: expected an int >= 1")
        if type(tp_rank) is not int or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank!r}: expected an int in [0, {tp_size})")
        self.name, self.tp_size, self.tp_rank, self.dp_id = name, tp_size, tp_rank, dp_id
        self.async_prefetch = (envs.async_task_comm_enabled() if async_prefetch is None
                               else bool(async_prefetch))
        self.endpoint = endpoint or default_endpoint(name, dp_id)
        self.heartbeat = heartbeat or Heartbeat()
        self.connect_timeout = (envs.connect_timeout_s() if connect_timeout is None
                                else float(connect_timeout))
        if not self.connect_timeout > 0:
            raise ValueError(f"connect_timeout={connect_timeout!r}: expected seconds > 0")
        # This process's claim on its rank: the engine refuses another worker id for the
        # same rank while this one is alive, and accepts this one back after a reconnect.
        self.worker_id = secrets.randbits(63) | 1
        profile = envs.profile_enabled() if profile is None else bool(profile)
        self.profiler = StepProfiler() if profile else None
        # Lock invariant: _held maps seq -> (decoded tasks, whether they were read through
        # the large-batch pool) for seqs above _taking that a background thread decoded
        # ahead of the event loop (socket batches, ring batches the prefetch thread
        # pre-decoded); _taking (event loop) only grows, and nothing at or below it is
        # added. _received (the highest seq received over the socket, every earlier one
        # that travelled over the socket received too) only grows and is written, with
        # _held, under _lock by the socket's receiver.
        self._lock = threading.Lock()
        self._held = {}
        self._taking = 0
        self._received = 0
        # The worker group's ring (batch_ring.RingReader), attached at the engine's WELCOME
        # when the engine is node-local and made one; its prefetch thread (async mode), and
        # the event the thread sets after each wake-up (wait_for_tasks in async mode).
        self._ring = None
        self._ring_words = None  # the ring's words (batch_ring.PUBLISHED), set with _ring
        self._peers_welcomed = False  # event loop: every rank attached (all_welcomed)
        self._ring_thread = None
        self._ring_woke = threading.Event()
        self._taken = 0  # event loop only
        # external_barrier: the caller orders the ranks with its own barrier, so decisions
        # are indexed by this rank's get_tasks() call count instead of our barrier's
        # generation (see the class docstring).
        self.external_barrier = bool(external_barrier)
        self._calls = 0  # get_tasks() calls so far (event loop only)
        # What the receiving side learned for the event loop: a failure, the engine's
        # CLOSE (EngineClosedError, deferred until everything sent was taken), or this
        # client's own close() (ClosedError). Every step call reads it first.
        self._error = None
        self._error_raised = False  # sync mode: the original error was raised once
        self._close_seq = None  # the engine's last seq, from its CLOSE message
        self._engine_instance = 0  # the engine that welcomed this rank (receiver only)
        self._epoch_tag = 0  # the group's ack board tag, from WELCOME
        self._bound = False  # welcomed once: from now on its absence means it is gone
        self._last_heard = time.monotonic()
        # The watched connection (see _watch_event): when it went down, None while up or
        # before the first connection; whether any connection was ever made.
        self._down_since = None
        self._ever_connected = False
        self._closed = False
        # The data socket and its monitor belong to whoever holds _recv_lock (the prefetch
        # thread, or the event loop: see the module docstring); _ack belongs to the event
        # loop, and close() takes _ack_lock before closing it.
        self._recv_lock = threading.Lock()
        self._ack_lock = threading.Lock()
        # The cumulative ACK a send could not queue (the engine's connection down, or not
        # reading), sent again at the next step call; 0: none. Event loop only.
        self._unsent_ack = 0
        self._counters = collections.Counter()
        self._peer_log = RateLimitedLog(log)

        # Node-local engine (ipc): acknowledge through its ack board (a store, no send).
        # Attached by the receiver when the engine welcomes it: the engine exists then.
        self._board = None
        self._board_wanted = ipc_path(self.endpoint) is not None
        self._payload_reader = None  # shared-memory batches (_decode_shared), receiver only
        who = f"TaskClient rank {tp_rank} of {name!r} dp_id={dp_id}"
        path = ipc_path(self.endpoint)
        if path is not None:
            check_ipc_endpoint(path)  # never connect to a socket another user could own
        self._auth = ClientAuth.load(self.endpoint, keys_dir, insecure_tcp)
        # libzmq aborts the process when it runs out of fds: fail here, cleanly, instead
        ensure_free_fds(CLIENT_FDS, who)
        self._group = _make_group(name, dp_id, tp_size, tp_rank, coordinator)
        self.incarnation = self._group.incarnation
        self._missing_fault = getattr(self._group, "missing_fault", self._group.peer_fault)
        self._local_group = isinstance(self._group, (ShmTPGroup, SoloGroup))
        # barrier()'s call into the group, its arguments bound once: two bound methods made
        # per call cost ~80 ns of a ~450 ns barrier (measured with the partner already there)
        self._group_barrier = self._group.barrier
        self._check_in_wait = self._barrier_check
        self._work_in_wait = self._drain if self._local_group and self.async_prefetch else None
        self._service_in_wait = None if self.async_prefetch else self._receive_in_wait
        # rank 0's check waits for peers still receiving what it holds (tp_group.wait_peers)
        # where the barrier that follows is this group's own: its arrivals end the wait
        self._waits_for_peers = (tp_rank == 0 and isinstance(self._group, ShmTPGroup)
                                 and not self.external_barrier)
        # rank 0 checks, before latching, that every rank was welcomed by its engine
        self._engine_split = getattr(self._group, "engine_split", None)
        self._publish_engine = getattr(self._group, "publish_engine", None)
        self._own_fault = False  # this rank published its failure to the group
        self._ctx = zmq.Context(io_threads=1)
        self._hb_sock = self._hb_monitor = None
        try:
            # HELLO tells the engine where this rank (re)starts. The first one is sent at
            # once (a DEALER queues it until the connection is up, so a worker may start
            # before the engine); the monitor re-sends it on every *re*connection. The
            # monitor is attached before connect: a handshake refused in between would be
            # an event nobody sees (a rejected key then reads as an engine that never came).
            # The data socket carries batches, so libzmq must not drop it for silence (a
            # batch still crossing is silence to it: see liveness); the engine is judged
            # by a connection of its own that carries only small messages.
            self._data, self._monitor = self._connect(monitored=True, receives_batches=True)
            self._connections = 0
            self._ack = self._connect(acks=True)
            # The thread in the background (prefetch, or heartbeat in sync mode) pings on,
            # and watches, this socket.
            self._hb_sock, self._hb_monitor = self._connect(monitored=True)
        except BaseException:
            self._ctx.destroy(linger=0)
            self._group.close()
            raise
        self._started = time.monotonic()
        self._wake = WakePipe()
        # The prefetch thread's poll: the kernel's answer for the data socket is visible to
        # the event loop before that thread has the GIL again (see _drain).
        self._ready = ReadinessPoll([self._data.getsockopt(zmq.FD),
                                     self._monitor.getsockopt(zmq.FD), self._wake.r,
                                     self._hb_sock.getsockopt(zmq.FD),
                                     self._hb_monitor.getsockopt(zmq.FD)])
        # The prefetch thread's wake-up (ReadinessPoll.polls) whose batch the event loop
        # received itself, down to an empty socket, and when it last looked (_drain).
        self._looked_at, self._looked_ns = -1, 0
        # [3]: async, the data socket's revents (ReadinessPoll.revents), read on the step's
        # path (one check instead of two: "sync mode, or a batch woke the prefetch thread");
        # sync mode receives at every step call: a buffer whose [3] is always true
        self._data_ready = self._ready.revents if self.async_prefetch else (1, 1, 1, 1)
        self._thread = None
        if not self.async_prefetch:
            self._send_hello()
            target, role = self._heartbeat_main, "heartbeat"
        else:
            target, role = self._prefetch_main, "prefetch"
        self._thread = threading.Thread(target=target, daemon=True,
                                        name=f"fdsync-{role}-{name}-r{tp_rank}")
        self._thread.start()
        if profile:
            self.profiler.attach(self)

    def _connect(self, monitored: bool = False, receives_batches: bool = False,
                 acks: bool = False):
        """A DEALER connected to the engine; with ``monitored``, ``(socket, monitor)``, the
        monitor attached before the connect so that no connection event is missed.
        ``receives_batches``: see ``Heartbeat.configure_socket``. ``acks``: the ACK socket,
        which queues at most ``_ACK_HWM`` ACKs and none on a connection that is not up
        (``IMMEDIATE``): ACKs are cumulative, so one that cannot be queued is kept as the
        latest and sent again (``_take``), never piled up on a dead connection."""
        sock = new_socket(self._ctx, zmq.DEALER)
        if acks:
            sock.setsockopt(zmq.SNDHWM, _ACK_HWM)
            sock.setsockopt(zmq.IMMEDIATE, 1)
        # What the engine may make us allocate: one batch, plus room for the header.
        sock.setsockopt(zmq.MAXMSGSIZE, envs.max_message_bytes() + 4096)
        self.heartbeat.configure_socket(sock, receives_batches=receives_batches)
        if self._auth is not None:
            self._auth.apply(sock)
        monitor = sock.get_monitor_socket(_MONITOR_EVENTS) if monitored else None
        sock.connect(self.endpoint)
        return (sock, monitor) if monitored else sock

    # -- step API (event loop thread) --------------------------------------------------------

    def exist_tasks(self) -> bool:
        """True when every rank of the group holds at least one batch not yet taken.

        On rank 0 a True result latches "the next barrier's step takes up to seq N" for
        the whole group; calling it again before the barrier may raise N. On other ranks
        it only reports. Async mode: a few shared-memory reads, no socket, no lock; only
        when the prefetch thread was woken by a batch it has not handled yet (it waits for
        the GIL this thread holds) does it receive that batch itself, as sync mode would
        (``_drain``). Sync mode: first receives whatever has arrived.

        Waits only on rank 0 of a node-local group, and only while it holds a batch that a
        peer is still receiving: until that peer holds it too or arrives at the barrier
        without it, at most 5 ms (``tp_group.ShmTPGroup.wait_peers``). The barrier would
        have waited for that peer just as long; waiting before the decision lets the step
        take the batch instead of the next one.

        With ``coordinator="paddle"`` (ranks on several nodes) it can only speak for rank 0;
        the barrier's all-reduce then takes what every rank holds (see ``paddle_group``).
        """
        if self._error is not None:
            self._raise_error()
        if self._unsent_ack:
            self._resend_ack()
        if self._data_ready[3]:  # sync: always; async: a batch woke the prefetch thread
            self._receive_now() if not self.async_prefetch else self._drain()
        taken = self._taken
        words = self._ring_words
        if words is not None:
            # the ring says what every rank of the node can take: no rank's thread needs to
            # have run (batches that travelled over the socket: once every rank received them)
            if words[_PUBLISHED] <= taken:
                return False  # nothing published this rank has not taken: one read
            ring = self._ring
            if not self._peers_welcomed:
                if not self._group.all_welcomed(self._engine_instance):
                    return False  # a peer has not attached the ring yet
                self._peers_welcomed = True  # for good: the engine is this client's for life
            upto = ring.ready_upto(taken, self._group.min_received)
            if upto <= taken:
                return False
        else:
            if self._received <= taken:  # this rank holds nothing new: no shared memory read
                return False
            upto = self._group.min_received()
            if upto < self._received and self._waits_for_peers:
                # a peer is still receiving what this rank holds: take it this step (tp_group)
                upto = self._group.wait_peers(self._received, _PEER_WAIT_S)
            if upto <= taken:
                return False
        if self.tp_rank == 0:
            if self._engine_split is not None and self._engine_split(self._engine_instance):
                self._split_group()  # raises
            index = self._calls + 1 if self.external_barrier else self._group.gen + 1
            self._group.latch(index, taken, upto)
        return True

    def _split_group(self):
        """Rank 0 found ranks of its group welcomed by another engine instance: seqs are an
        engine's, so the ranks would take different batches under the same numbers. The
        group stops here (its peers raise the same error from their barrier)."""
        split = self._engine_split(self._engine_instance)
        others = ", ".join(f"rank {r}: {e:#x}" for r, e in split)
        self._error = EngineGoneError(
            f"rank {self.tp_rank} of {self.name!r}: the ranks of this group were welcomed by "
            f"different engine instances (this rank: {self._engine_instance:#x} at "
            f"{self.endpoint}; {others}): an engine restarted while the group started, or "
            f"the ranks were given different endpoints; nothing was taken. Restart the "
            f"worker group, every rank with the same endpoint")
        self._raise_error()

    def wait_for_tasks(self, timeout: float) -> bool:
        """Rank 0's idle wait: block until ``exist_tasks()`` would return True, then latch
        exactly as it does and return True; return False once ``timeout`` seconds passed.

        For an idle loop that would otherwise poll ``exist_tasks()`` every millisecond::

            if tp_rank == 0: client.wait_for_tasks(0.1)   # or exist_tasks(): both work
            client.barrier()
            tasks, _ = client.get_tasks()

        Blocks with the GIL released and no CPU: the receiver of whichever rank completes
        the batch posts rank 0's semaphore (node-local group, ~30 µs wake-up; TP=1: a
        condition variable). Without a post it re-checks after 10 ms, backing off to every
        100 ms while nothing comes.

        Raises what ``exist_tasks()`` raises, promptly when the engine side fails or
        closes while it waits (``EngineClosedError`` once this rank has taken everything
        it was sent). Returns False early if a peer rank stopped at an engine error (the
        next ``barrier()`` raises it).

        Sync mode (``DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM=1``): receives from the socket
        itself while it waits (polls it with the GIL released), then waits for the other
        ranks as above; an error found by the heartbeat thread is seen within 50 ms.
        ``coordinator="paddle"``: waits for this rank's own receipt only (the others' are
        known at the barrier, as for ``exist_tasks()``), polling it every millisecond.

        Rank 0 only (the other ranks wait in ``barrier()``): raises ``RuntimeError`` on
        others. ``timeout`` is in seconds, ``0`` is ``exist_tasks()``.
        """
        if self.tp_rank != 0:
            raise RuntimeError(f"TaskClient {self.name} rank {self.tp_rank}: wait_for_tasks() "
                               f"is rank 0's; the other ranks wait in barrier()")
        deadline = time.monotonic() + timeout
        if self.exist_tasks():
            return True
        if self._ring is not None:
            return self._wait_ring(deadline)
        need = self._taken + 1
        if not self.async_prefetch:
            # this rank's own batch first: only this thread reads the socket. An OS-level
            # poll of the sockets' descriptors touches no socket, so close() from another
            # thread may close them meanwhile (the next exist_tasks() raises ClosedError).
            poller = select.poll()
            for sock in (self._data, self._monitor):
                poller.register(sock.getsockopt(zmq.FD), select.POLLIN)
            while self._received < need:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                # bounded: the heartbeat thread's findings wake no poll, only a semaphore
                poller.poll(min(remaining, 0.05) * 1000)
                if self.exist_tasks():  # receives, raises what the receivers learned
                    return True
        wait = getattr(self._group, "wait_received", None)

        def check():
            if self._error is not None:
                self._raise_error()
            if not self.async_prefetch:
                self._receive_now()  # CLOSE and errors keep arriving on our socket

        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return self.exist_tasks()
            if wait is None:  # paddle coordinator: min_received() is this rank's own
                time.sleep(min(remaining, 0.001))
            elif not wait(need, remaining, check):
                if self._group.peer_fault() is None:
                    return self.exist_tasks()  # timed out
                return self._after_peer_fault(deadline)
            if self.exist_tasks():
                return True

    def _wait_ring(self, deadline) -> bool:
        """``wait_for_tasks`` with a ring: async mode waits for the prefetch thread's
        wake-up (set after every post, error and close), sync mode on this rank's
        semaphore itself, receiving from the socket between waits."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return self.exist_tasks()
            if self._group.peer_fault() is not None:
                return self._after_peer_fault(deadline)
            if self.async_prefetch:
                self._ring_woke.clear()
                if self.exist_tasks():  # published between the last check and the clear
                    return True
                self._ring_woke.wait(min(remaining, _RING_IDLE_CHECK_S))
            else:
                self._ring.wait(min(remaining, _SYNC_RING_CHECK_S))
            if self.exist_tasks():  # receives (sync), raises what the receivers learned
                return True

    def _after_peer_fault(self, deadline) -> bool:
        """A peer stopped at an engine-side error while rank 0 waited: raise the same kind
        of error, as ``barrier()`` would. An engine CLOSE is raised only once this rank's
        own CLOSE arrived (milliseconds later) and everything it was sent is taken; until
        then batches it still holds are offered as usual."""
        while True:
            self._check_error()
            if not self.async_prefetch:
                self._receive_now()
            if self.exist_tasks():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)

    def barrier(self, timeout: float = None) -> None:
        """Block until every rank of the group has reached this step's barrier.

        Node-local shared memory: spins (up to ``FD_SYNC_BARRIER_SPIN_US``) only while the
        partners have recently arrived within that window, else blocks on a semaphore at once
        (no CPU; see ``tp_group``).
        ``timeout`` in seconds (None = forever) raises ``BarrierTimeoutError`` naming the
        missing ranks, early if one of them exited or closed its client. A no-op at
        tp_size=1. A rank that has not arrived and stopped at an engine-side error makes it
        raise the same kind of error at once, instead of waiting for the timeout. What this
        rank itself learns while it waits (after arriving) is raised by the next step call,
        once every rank arrived: otherwise a peer arriving later would take the step alone.
        Raises ``ClosedError`` when ``close()`` runs meanwhile in another thread.
        """
        if self._error is not None:
            self._raise_error()
        if self._unsent_ack:
            self._resend_ack()
        if self.async_prefetch:
            if self._data_ready[3]:  # a batch woke the prefetch thread: take it before arriving
                self._drain()
        else:
            self._receive_now()
        if self._ring is not None and not self._local_group:
            # across nodes every rank offers what it can take: the ring's part is a read
            self._group.publish_received(self._ring.ready_upto(self._taken, self._own_received))
        # async: on_wait drains in a node-local wait (across nodes, paddle's collective has
        # no waiting path of ours); sync: the wait keeps receiving from the engine
        self._group_barrier(timeout, self._service_in_wait, self._check_in_wait,
                            self._work_in_wait)

    def get_tasks(self):
        """Take this step's batches: ``(tasks, read_finished)``. Never blocks.

        ``tasks`` is the list of objects passed to ``put_tasks``, in put order: exactly the
        batches rank 0 latched for the barrier this rank last passed (``[]`` if none), so
        every rank takes the same list at the same step. ``read_finished`` is True once
        every rank of the group has taken everything this rank has taken; it is True on at
        least one rank of a step and never before every rank has taken the set.

        It raises nothing the engine side learned (those wait for the next step's
        ``exist_tasks``/``barrier``): the batches were latched only once every rank held
        them, so every rank can take them. Raises ``ClosedError`` after ``close()``, and
        ``ProtocolError`` if this rank's history disagrees with rank 0's decision (e.g.
        ``get_tasks()`` was called on some ranks of an earlier step but not others).
        """
        if self._closed:
            raise ClosedError(f"TaskClient {self.name} rank {self.tp_rank} is closed")
        if self.external_barrier:
            self._calls += 1
            decision = self._group.decision(self._calls)
        else:
            decision = self._group.decision(self._group.gen)
        tasks = []
        if decision is not None and decision[1] > self._taken:
            tasks = self._take(*decision)
        return tasks, self._group.all_consumed(self._taken)

    def num_tasks(self) -> int:
        """Batches this rank holds (or can read from the ring) and has not taken. Never
        blocks."""
        if self._error is not None:
            self._raise_error()
        if not self.async_prefetch:
            self._receive_now()
        words, taken = self._ring_words, self._taken
        if words is not None:
            if words[_PUBLISHED] <= taken:
                return 0  # nothing published this rank has not taken: one read
            return self._ring.ready_upto(taken, self._own_received) - taken
        return self._received - taken

    def _own_received(self) -> int:
        return self._received

    def ready_count(self) -> int:
        """Batches every rank of the group holds that this rank has not taken: what a step
        latched now would take (rank 0's view; with ``coordinator="paddle"`` this rank's
        own count, as ``exist_tasks()``). Shared-memory reads: never blocks, receives
        nothing, latches nothing, raises nothing."""
        if self._ring is not None:
            return self._ring.ready_upto(self._taken, self._group.min_received) - self._taken
        return max(0, min(self._received, self._group.min_received()) - self._taken)

    def step_size(self) -> int:
        """After ``barrier()``: how many batches this step's ``get_tasks()`` takes (0:
        none), as every rank of the group computes it. A read; never blocks. (For a caller
        that must tell its ranks whether to call ``get_tasks()``, e.g. the FastDeploy
        drop-in's flag across nodes.) Meaningless with ``external_barrier=True``."""
        decision = self._group.decision(self._group.gen)
        if decision is None or decision[1] <= self._taken:
            return 0
        return decision[1] - self._taken

    def sync_step(self, timeout: float = None) -> list:
        """``exist_tasks()`` on rank 0, ``barrier(timeout)``, ``get_tasks()``: the batches this
        step takes, identical on every rank (``[]`` if none). Blocks only in the barrier."""
        if self.tp_rank == 0:
            self.exist_tasks()
        self.barrier(timeout)
        return self.get_tasks()[0]

    def stats(self) -> dict:
        """Counters (``garbage_frames``, ``duplicates``, ``stale``, ``pongs``...), watermarks
        (``received``: the highest seq up to which this rank can take every batch, from
        the ring or received over the socket; ``taken``), and the ids this rank is bound
        to, for logs and tests."""
        ring = self._ring
        with self._lock:
            out = dict(self._counters)
            received = self._received
            if ring is not None:
                received = max(received, ring.ready_upto(self._taken, self._own_received))
            out.update(received=received, taken=self._taken, held=len(self._held),
                       ring=ring.name if ring is not None else None)
        out.update(worker=f"{self.worker_id:016x}", group=f"{self.incarnation:016x}",
                   engine=f"{self._engine_instance:016x}" if self._engine_instance else None,
                   engine_silent_s=round(time.monotonic() - self._last_heard, 3))
        return out

    def prefetch_cpu_seconds(self) -> float:
        """CPU time the background threads of async mode (the socket's receiver and the
        ring's prefetch thread) have used so far (user + system), from their own thread
        clocks; None in sync mode or where the platform has no per-thread clock. A thread
        blocked in poll or on its semaphore, as it should be while idle, adds nothing."""
        if not self.async_prefetch or not hasattr(time, "pthread_getcpuclockid"):
            return None
        total = None
        for thread in (self._thread, self._ring_thread):
            try:
                used = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            except (OSError, TypeError, AttributeError):  # exited, never started, none
                continue
            total = used + (total or 0.0)
        return total

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Say goodbye to the engine, stop the background thread, close every socket,
        leave the group and remove the shared memory it owns. Idempotent; may be called
        from any thread.

        A step call that another thread is blocked in (``barrier()``,
        ``wait_for_tasks()``) is woken and raises ``ClosedError``; later step calls raise
        ``ClosedError``. Peers of this rank waiting in the barrier raise
        ``BarrierTimeoutError`` ("closed its client") at once.

        The engine is told (a ``BYE`` carrying the highest seq this rank took) when it
        welcomed this rank and is not known to be gone, so it need not wait for a timeout.

        Blocks at most ~5 s for the background thread (it is normally blocked in poll and
        wakes at once), ~1 s for a thread blocked in the group, ~2 s for a step call of
        another thread to let go of a socket, and 0.2 s for the goodbye to leave. Whatever
        is still in use when a bound passes is kept (leaked until the object is garbage, or
        the process exits), never freed under its user; that is logged."""
        if self._closed:
            return
        self._closed = True
        prior = self._error
        # Before waking anyone: a woken step call raises this.
        self._error = ClosedError(f"TaskClient {self.name} rank {self.tp_rank} is closed")
        profile_dir = envs.profile_dir() if self.profiler is not None else None
        if profile_dir:
            self._dump_profile(profile_dir)
        self._wake.wake()
        ring = self._ring
        self._ring_woke.set()
        if ring is not None:
            ring.post()  # the prefetch thread, or a sync-mode wait_for_tasks() of another thread
        self._thread.join(timeout=5.0)
        if self._ring_thread is not None:
            self._ring_thread.join(timeout=5.0)
        thread_stopped = not self._thread.is_alive() and not (
            self._ring_thread is not None and self._ring_thread.is_alive())
        if not thread_stopped:
            log.error("TaskClient %s rank %d: background thread did not stop within 5 s; its "
                      "sockets are kept open until exit", self.name, self.tp_rank)
        else:
            self._wake.close()
        # Leave the group: wakes a barrier or wait_for_tasks() of another thread and frees
        # the semaphores once it left; the mapping stays while anything can read it, and
        # a post from a thread that did not stop is dropped, not made on a freed semaphore.
        self._group.close()
        # The sockets: the event loop may be inside a step call that uses one.
        got_recv = self._recv_lock.acquire(timeout=_CLOSE_WAIT_S)
        got_ack = self._ack_lock.acquire(timeout=_CLOSE_WAIT_S)
        try:
            if thread_stopped and got_recv and got_ack:
                self._data.disable_monitor()
                if self._hb_sock is not None:
                    self._hb_sock.disable_monitor()
                self._say_bye(prior)
                self._ctx.destroy(linger=0)
            else:
                log.error("TaskClient %s rank %d: a thread still uses its sockets; they are "
                          "kept open until exit", self.name, self.tp_rank)
        finally:
            if got_ack:
                self._ack_lock.release()
            if got_recv:
                self._recv_lock.release()
        # The ack board: a take in another thread may be writing it; it is unmapped when
        # it is garbage (the engine owns its name). The ring likewise: arrays may view it.
        self._board = None
        if ring is not None and thread_stopped:
            ring.close()

    def _say_bye(self, prior) -> None:
        """BYE to the engine, if it welcomed us and is not known to be gone or closed: it
        then retires this rank's group at once instead of after the heartbeat timeout.
        Holding _recv_lock. The data socket lingers ``_BYE_LINGER_MS`` for it."""
        if not self._bound or self._close_seq is not None or isinstance(
                prior, (EngineGoneError, EngineRejectedError, EngineUnreachableError)):
            return
        try:
            self._data.send(self._header(codec.BYE, seq=self._taken), zmq.NOBLOCK)
        except zmq.ZMQError:  # no connection to queue it on: the engine learns otherwise
            return
        self._data.close(linger=_BYE_LINGER_MS)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _dump_profile(self, directory):
        path = os.path.join(directory, f"fdsync-profile-{self.name}-dp{self.dp_id}-"
                                       f"r{self.tp_rank}-{os.getpid()}.json")
        try:
            self.profiler.dump(path)
        except OSError as exc:  # a profile must never break the worker's shutdown
            log.error("TaskClient %s rank %d: could not write the step profile to %s: %s",
                      self.name, self.tp_rank, path, exc)

    # -- background threads ------------------------------------------------------------------

    def _drain(self) -> bool:
        """Event loop, async mode: if a batch has arrived that the prefetch thread has not
        handled yet (it waits for the GIL, which this thread holds while the step is pure
        Python), receive and decode it here, now.

        Looked at by ``exist_tasks()`` and before arriving at ``barrier()`` (~40 ns: the
        prefetch thread's poll result, which the kernel wrote before that thread woke,
        ``ReadinessPoll``), and while this rank waits in a busy loop's barrier: where sync
        mode would receive, so that a batch is taken at the same step as in sync mode.
        Gives the GIL away only when there is a batch: the data socket is asked with
        ZMQ_EVENTS (~1.2 µs; pyzmq keeps the GIL for it, while every recv or poll call
        releases it). Waits only when the prefetch thread is in the middle of handling
        what arrived (it holds the receive lock): until it has, at most ``_DRAIN_WAIT_S``
        (2 ms), so that this rank does not arrive at the barrier without a batch it is
        about to hold. A failure is latched as the prefetch thread's would be (the
        next step call raises it). True if it received a batch. The socket monitor is left
        to the prefetch thread (connection events are rare and not urgent).

        Once this thread has emptied the socket for a wake-up, the poll result stays set
        until the prefetch thread gets the GIL and polls again: up to the interpreter's
        switch interval (5 ms) under a pure-Python step. Meanwhile a check looks at the
        socket at most once per ``_RELOOK_NS`` (a batch that arrives then is still
        received at once), and never waits for the prefetch thread, whose pass can only
        find what came after (it was 60 % of a GIL-holding loop's steps without a batch,
        at 12.6 µs p50 each against 0.6 µs, before: each waited for that pass)."""
        ready = self._ready
        if not ready.ready(0):
            return False
        handled = self._looked_at == ready.polls
        if handled and time.monotonic_ns() - self._looked_ns < _RELOOK_NS:
            return False
        if not self._recv_lock.acquire(False):
            # The prefetch thread is handling what arrived and needs the GIL to finish.
            # Yielding once (sleep(0)) let it run only to its next release of the GIL (a
            # recv, a checksum) and this rank then arrived at the barrier without the
            # batch, so rank 0 could not take it at this step (tp_group.wait_peers): wait
            # for the thread to finish, bounded. Not when this thread emptied the socket
            # for this wake-up: the thread's pass then only re-arms its poll.
            if not handled and self._recv_lock.acquire(timeout=_DRAIN_WAIT_S):
                self._recv_lock.release()
            return False
        try:
            if self._closed or self._close_seq is not None:
                return False
            if not self._data.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._looked_at, self._looked_ns = ready.polls, time.monotonic_ns()
                return False
            before = self._received
            try:
                while True:
                    try:
                        frames = self._data.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        self._looked_at, self._looked_ns = ready.polls, time.monotonic_ns()
                        break
                    self._on_message(frames)
                    if self._close_seq is not None:
                        break
            except BaseException as exc:
                self._fail(exc)
            if self._received == before:
                return False
            self._counters["received_by_loop"] += self._received - before
            return True
        finally:
            self._recv_lock.release()

    def _loop_took_wake(self, poller, until) -> bool:
        """Prefetch thread, back from its poll: True if the only thing that woke it was the
        data socket, which the event loop has emptied since (``_drain``), and nothing is
        due before ``until`` (monotonic s): it can poll again at once. A pass would touch
        every socket, and each pyzmq call hands the GIL to a pure-Python step and waits up
        to 5 ms to get it back."""
        return (self._looked_at == poller.polls and not self._closed
                and not poller.ready_other_than(0) and time.monotonic() < until)

    def _prefetch_main(self):
        """Async mode: receive, decode, ping, watch the engine. Blocks in an OS-level poll of
        the sockets' descriptors (``ReadinessPoll``: GIL released, no socket touched, its
        answer visible to the event loop at once), then drains them under _recv_lock; the
        event loop may have drained them first (see the module docstring and _drain).
        ZeroMQ's descriptors signal edges: after every drain to EAGAIN the next arrival
        signals again, so nothing waits unseen."""
        poller = self._ready
        interval = self.heartbeat.interval
        try:
            with self._recv_lock:
                self._send_hello()
            next_ping = time.monotonic() + interval
            while True:
                with self._recv_lock:
                    if self._closed:
                        return
                    self._receive_available()
                    if self._close_seq is not None:
                        return  # the engine closed: nothing more will come, say nothing more
                    self._receive_heartbeat_socket()
                    now = time.monotonic()
                    self._check_engine(now)
                    if now >= next_ping:
                        next_ping = now + interval
                        self._send_ping(self._hb_sock)
                    # A send processes the socket's pending commands and may consume the
                    # descriptor's signal for messages that arrived meanwhile: look.
                    pending = ((self._data.getsockopt(zmq.EVENTS)
                                | self._hb_sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)
                if pending:
                    continue
                while True:
                    until = min(next_ping, self._liveness_deadline())
                    # blocks with the GIL released: no CPU when idle
                    poller.wait(max(0.0, until - time.monotonic()) * 1000)
                    if not self._loop_took_wake(poller, until):
                        break
                self._wake.drain()
        except BaseException as exc:  # never silent: raised on the event loop
            self._fail(exc)

    def _heartbeat_main(self):
        """Sync mode: the event loop owns the data socket; this thread only pings the
        engine on its own socket and watches that socket's connection, so a step longer
        than the heartbeat timeout is not taken for a dead worker."""
        poller = zmq.Poller()
        poller.register(self._hb_sock, zmq.POLLIN)
        poller.register(self._hb_monitor, zmq.POLLIN)
        poller.register(self._wake.r, zmq.POLLIN)
        interval = self.heartbeat.interval
        try:
            next_ping = time.monotonic()
            while not self._closed:
                wait_s = max(0.0, min(next_ping, self._liveness_deadline()) - time.monotonic())
                poller.poll(wait_s * 1000)
                if self._closed:
                    return
                self._receive_heartbeat_socket()
                if self._error is not None:
                    return  # the engine closed, or the event loop has something to raise
                # ping even before the event loop has read the WELCOME (a model may load
                # for minutes before the first step): the engine must hear this rank
                now = time.monotonic()
                self._check_engine(now)
                if now >= next_ping:
                    next_ping = now + interval
                    self._send_ping(self._hb_sock)
        except BaseException as exc:
            self._fail(exc)

    def _fail(self, exc):
        """A background thread stopped at ``exc``: the next step call raises it, which is
        its one report (nothing is logged above DEBUG: issue "reported once")."""
        if self._closed:
            return
        if self._error is None or isinstance(self._error, EngineClosedError):
            self._error = exc
        log.debug("TaskClient %s rank %d: %s; the next step call raises it", self.name,
                  self.tp_rank, exc, exc_info=True)
        self._group.wake()  # a barrier wait in progress sees it now
        self._ring_woke.set()  # and so does wait_for_tasks()

    def _liveness_deadline(self) -> float:
        """When the watching thread must wake to judge the engine (see _check_engine)."""
        if self._close_seq is not None:
            return float("inf")
        if not self._bound:
            return self._started + self.connect_timeout + 0.001
        timeout = self.heartbeat.timeout
        if self._down_since is not None:
            return min(self._down_since, self._last_heard) + timeout + 0.001
        if self.heartbeat.stall_timeout:
            return self._last_heard + self.heartbeat.stall_timeout + 0.001
        return float("inf")

    def _check_engine(self, now):
        """The liveness contract on this side (module docstring): raises
        ``EngineUnreachableError`` (never welcomed within the connect bound) or
        ``EngineGoneError`` (connection lost and not re-established in time; or silent
        past the stall timeout on a live connection)."""
        if self._close_seq is not None:
            return
        if not self._bound:
            waited = now - self._started
            if waited > self.connect_timeout:
                raise EngineUnreachableError(self._unreachable_message(waited))
            return
        timeout = self.heartbeat.timeout
        silent = now - self._last_heard
        down = self._down_since
        if down is not None and (now - down > timeout or silent > timeout):
            raise EngineGoneError(
                f"rank {self.tp_rank} of {self.name!r}: the connection to the engine at "
                f"{self.endpoint} was lost {now - down:.1f} s ago and not re-established to "
                f"the same engine (nothing heard for {silent:.1f} s; heartbeat timeout "
                f"{timeout:g} s): it died, is frozen, or the network to it is down; restart "
                f"the worker group once the engine is back (FD_SYNC_HEARTBEAT_TIMEOUT sets "
                f"the bound)")
        if down is None and self.heartbeat.stalled(silent):
            raise EngineGoneError(
                f"rank {self.tp_rank} of {self.name!r}: the engine at {self.endpoint} keeps "
                f"its connection alive but has sent nothing for {silent:.1f} s (stall "
                f"timeout {self.heartbeat.stall_timeout:g} s): it hangs; restart it and the "
                f"worker group (FD_SYNC_STALL_TIMEOUT sets the bound)")

    def _unreachable_message(self, waited) -> str:
        if ipc_path(self.endpoint) is not None:
            check = ("is the engine (TaskQueue) running on this node with the same name, "
                     "dp_id and FD_SYNC_IPC_DIR?")
        else:
            check = ("is the engine (TaskQueue) running and listening there, and can this "
                     "node reach it (firewall, address)?")
        if self._ever_connected:
            what = ("a connection was made, but nothing there welcomed this rank (another "
                    "program holds the endpoint, or the engine refuses to serve a second "
                    "worker group while another one is alive)")
        else:
            what = "no connection could be made"
        return (f"rank {self.tp_rank} of {self.name!r}: no engine welcomed this worker at "
                f"{self.endpoint} within {waited:.1f} s ({what}): {check} "
                f"(FD_SYNC_CONNECT_TIMEOUT={self.connect_timeout:g} s sets the bound; the "
                f"engine may start after the workers, within it)")

    # -- receiving (the data socket's owner: prefetch thread, or event loop in sync mode) ---

    def _receive_now(self):
        """Sync mode: receive what has arrived, on the calling (event loop) thread.

        A failure is raised as is, and latched: every later call raises
        ``PrefetchError``, so nothing can step past a batch this rank lost."""
        try:
            with self._recv_lock:
                if self._closed:
                    raise ClosedError(f"TaskClient {self.name} rank {self.tp_rank} is closed")
                self._receive_available()
        except ClosedError:
            raise
        except BaseException as exc:
            self._error = exc
            self._error_raised = True
            raise

    def _receive_in_wait(self):
        """Sync mode, while this rank waits in a barrier it arrived at: receive, but leave
        a failure in ``_error`` for the barrier's check instead of raising it out of the
        wait (see ``tp_group``: a rank that arrived does not leave on its own failure)."""
        try:
            with self._recv_lock:
                if not self._closed:
                    self._receive_available()
        except BaseException as exc:
            if self._error is None or isinstance(self._error, EngineClosedError):
                self._error = exc

    def _receive_available(self):
        if self._close_seq is not None:
            return  # the engine closed: a later engine on the endpoint is not ours
        self._receive_monitor(self._monitor, watch=False)
        while True:
            try:
                frames = self._data.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._on_message(frames)
            if self._close_seq is not None:
                return

    def _receive_heartbeat_socket(self):
        """The background thread's own socket: its connection is the one the engine is
        judged by (``watch``), its messages are the engine's PONGs."""
        self._receive_monitor(self._hb_monitor, watch=True)
        while True:
            try:
                frames = self._hb_sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._on_message(frames)

    def _receive_monitor(self, monitor, watch):
        """Handle the socket-monitor events of one of our sockets: re-HELLO on a data
        socket reconnection, authentication failures, and (``watch``: the socket whose
        connection the liveness judgement follows) the connection going down."""
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_CONNECTED:
                self._ever_connected = True
                if monitor is self._monitor:
                    self._connections += 1
                    if self._connections > 1:
                        self._send_hello()
            elif kind & HANDSHAKE_FAILED_EVENTS:
                if self._auth is not None and not (
                        kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and value == errno.EAGAIN):
                    # nothing was received from that peer: CURVE failed before any message
                    raise AuthenticationError(
                        f"rank {self.tp_rank} of {self.name!r}: " + handshake_failure_message(
                            kind, self.endpoint, value, self._auth.keys_dir))
                # a handshake that timed out (a frozen peer accepts but never answers):
                # the connection is not up, as for a disconnect
                if watch and self._down_since is None:
                    self._down_since = time.monotonic()
            elif kind == zmq.EVENT_DISCONNECTED:
                if watch and self._down_since is None:
                    self._down_since = time.monotonic()

    def _header(self, kind, seq=0, aux=0):
        return codec.pack_header(kind, self.tp_rank, self.tp_size, seq=seq, aux=aux,
                                 engine=self._engine_instance, group=self.incarnation,
                                 worker=self.worker_id)

    def _send_hello(self):
        # seq: the first batch this rank does not hold; aux: what it has taken (an
        # implicit acknowledgement, in case an ACK was lost with a broken connection);
        # engine: the instance it is bound to (0: none yet), so a restarted engine knows
        # this worker holds another engine's batches.
        # (with a ring, batches up to _taken may never have crossed the socket)
        self._data.send_multipart([self._header(codec.HELLO, seq=max(self._received,
                                                                     self._taken) + 1,
                                                aux=self._taken), self.name.encode()])

    def _send_ping(self, sock):
        try:
            sock.send(self._header(codec.PING), zmq.NOBLOCK)
        except zmq.Again:  # not connected yet: the HELLO queued first will tell the engine
            pass

    def _on_message(self, frames):
        try:
            header = codec.unpack_header(frames[0].buffer)
        except ProtocolError as exc:
            self._garbage(exc)
            return
        if header.worker != self.worker_id or header.rank != self.tp_rank:
            self._counters["stale"] += 1  # addressed to another worker: not ours
            return
        kind = header.kind
        if kind == codec.ERROR:
            raise self._engine_error(header, frames)
        if header.engine != self._engine_instance:
            if kind == codec.WELCOME and not self._bound:
                self._engine_instance = header.engine
            else:
                self._counters["stale"] += 1  # from an engine this rank is not bound to
                return
        self._last_heard = time.monotonic()
        self._down_since = None  # a message from our engine: the connection is back
        if kind == codec.DATA:
            self._on_data(header, frames)
        elif kind == codec.PONG:
            self._counters["pongs"] += 1
        elif kind == codec.WELCOME:
            self._epoch_tag = header.aux << EPOCH_SHIFT
            if self._board_wanted:
                self._board_wanted = False
                self._board = AckBoard.attach(self.name, self.dp_id, self.tp_size)
                if self._board is not None:
                    self._attach_ring(header.aux)
            if self._publish_engine is not None and not self._bound:
                # after the ring, before any batch is published: rank 0 latches nothing
                # until every rank's engine is written (tp_group.all_welcomed)
                self._publish_engine(header.engine)
            self._bound = True
        elif kind == codec.CLOSE:
            if self._close_seq is None:
                # The engine reads its socket until every rank it told answers (at most
                # 1 s), then closes it without lingering (engine._await_goodbyes).
                try:
                    self._data.send(self._header(codec.BYE, seq=self._taken), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # no room or no connection: the engine stops waiting at its bound
            self._close_seq = header.seq
            if self._error is None:
                self._error = EngineClosedError(
                    f"rank {self.tp_rank} of {self.name!r}: the engine at {self.endpoint} "
                    f"closed the queue; every batch it sent was taken")
            self._group.wake()
        else:
            self._garbage(ProtocolError(f"unexpected message kind {kind}"))

    def _on_data(self, header, frames):
        if not self._bound:
            self._garbage(ProtocolError("a batch before the engine's WELCOME"))
            return
        seq = header.seq
        if seq <= self._received or seq <= self._taken:
            self._counters["duplicates"] += 1  # replayed after a reconnect
            return
        if seq != self._received + 1 and not self._ring_covers(self._received + 1, seq):
            raise ProtocolError(f"rank {self.tp_rank} received seq {seq} after "
                                f"{self._received}: a batch was lost in transport")
        if len(frames) == 3:  # header, body, shared-memory reference (payload_shm)
            tasks = self._decode_shared(frames[1], frames[2], header.check)
        else:
            tasks = codec.decode_payload(frames[1:], header.check)
        with self._lock:
            if seq > self._taking:
                self._held[seq] = (tasks, False)  # a shared batch was counted by the decode
            self._received = seq
        self._group.publish_received(seq)  # after _held: whoever sees it can take it

    def _ring_covers(self, first: int, end: int) -> bool:
        """True if every seq in [first, end) was taken already or is in the ring: only the
        batches that did not fit the ring travel over the socket, so a gap is no loss."""
        ring, taken = self._ring, self._taken
        return ring is not None and all(s <= taken or ring.kind(s) in _RING_KINDS
                                        for s in range(first, end))

    def _attach_ring(self, epoch):
        """At the first WELCOME (receiver): attach the worker group's ring (``batch_ring``)
        and, in async mode, start the prefetch thread that pre-decodes from it. No ring
        (the engine had no room for one in ``/dev/shm``): every batch comes over the
        socket, as for a ``tcp://`` engine."""
        if self._payload_reader is None:
            self._payload_reader = payload_shm.PayloadReader(self.name, self.dp_id,
                                                             self.tp_size, self.tp_rank)
        try:
            ring = batch_ring.RingReader.attach(self.name, self.dp_id, self.tp_size,
                                                self.tp_rank, epoch, self._board.owner_pid,
                                                self._payload_reader)
        except FileNotFoundError:
            self._counters["no_ring"] += 1
            return
        self._ring = ring
        self._ring_words = ring.words  # last: from here on the event loop reads the ring
        if self.async_prefetch and not self._closed:
            self._ring_thread = threading.Thread(
                target=self._ring_main, daemon=True,
                name=f"fdsync-prefetch-{self.name}-r{self.tp_rank}")
            self._ring_thread.start()

    def _ring_main(self):
        """Async mode, with a ring: the prefetch thread. Blocks on this rank's semaphore with
        the GIL released; after each post it decodes what was published ahead of the event
        loop, one batch per hold of the GIL, and wakes ``wait_for_tasks`` after each (the
        loop, woken first, would only contend for the GIL to decode the same batch).
        Nothing waits for it: a batch it has not decoded when the step takes it is decoded
        by the event loop (``_take``), and what it decodes later is dropped. A batch that
        does not decode stops it, as a receiver's failure does: the next step call raises
        it."""
        ring = self._ring
        next_seq = 1
        try:
            while not self._closed:
                ring.wait(_RING_WAIT_S)
                if self._closed:
                    return
                next_seq = self._predecode(ring, next_seq)
                if not self._ring_woke.is_set():
                    self._ring_woke.set()  # also for what it does not decode (socket batches)
        except BaseException as exc:  # never silent: raised on the event loop
            self._fail(exc)

    def _predecode(self, ring, next_seq) -> int:
        """Decode every published ring batch from ``next_seq`` on that the event loop has
        not taken yet into ``_held``; returns the next seq to look at. Raises what a
        decode raises."""
        words = ring.words
        while not self._closed:
            seq = max(next_seq, self._taking + 1)
            if seq > words[_PUBLISHED]:
                return seq
            kind = ring.kind(seq)
            if kind == 0:
                return seq  # its descriptor is being reused: taken meanwhile
            next_seq = seq + 1
            if kind not in _RING_KINDS:
                continue  # travels over the socket: the receiver's
            tasks = ring.decode(seq)
            with self._lock:
                if seq > self._taking:
                    self._held[seq] = (tasks, kind == batch_ring.SHARED)
                    self._counters["predecoded"] += 1
            del tasks
            self._ring_woke.set()
            if words[_PUBLISHED] > seq:
                time.sleep(0)  # the GIL goes back to the step before the next batch
        return next_seq

    def _decode_shared(self, body, ref, check):
        """Decode a batch whose arrays the engine wrote into node-local shared memory
        (``payload_shm.PayloadReader``): checked as for the socket path before anything is
        mapped or unpickled, then decoded zero-copy from a read-only mapping. The arrays
        keep the mapping alive; when the last of a pool batch's arrays is freed, this
        rank tells the engine (one store into the pool's header), which only then may
        reuse that memory."""
        if ipc_path(self.endpoint) is None:
            raise ProtocolError(f"rank {self.tp_rank} of {self.name!r}: a shared-memory batch "
                                f"from {self.endpoint}, which is not node-local")
        if self._payload_reader is None:
            self._payload_reader = payload_shm.PayloadReader(self.name, self.dp_id,
                                                             self.tp_size, self.tp_rank)
        self._counters["shared_batches"] += 1
        return self._payload_reader.decode(body.buffer, ref.buffer, check)

    def _engine_error(self, header, frames):
        reason = (bytes(frames[1].buffer[:4096]).decode("utf-8", "replace") if len(frames) > 1
                  else "no reason given")
        msg = f"rank {self.tp_rank} of {self.name!r}, engine at {self.endpoint}: {reason}"
        if header.aux == codec.E_STALE_ENGINE:
            return EngineGoneError(msg)
        if header.aux == codec.E_GROUP_LOST:
            return GroupLostError(msg)
        return EngineRejectedError(msg)

    def _garbage(self, exc):
        self._counters["garbage_frames"] += 1
        self._peer_log.log("garbage", logging.WARNING,
                           "TaskClient %s rank %d: dropped a message (%d so far): %s",
                           self.name, self.tp_rank, self._counters["garbage_frames"], exc)

    # -- taking (event loop) ---------------------------------------------------------------

    def _take(self, from_seq: int, to_seq: int) -> list:
        if from_seq != self._taken:
            raise ProtocolError(
                f"rank {self.tp_rank} has taken up to seq {self._taken} but the group's step "
                f"takes ({from_seq}, {to_seq}]: get_tasks() must be called on every rank of a "
                f"step or on none")
        seqs = range(from_seq + 1, to_seq + 1)
        with self._lock:
            # from now on no background thread adds these: they are this thread's to decode
            self._taking = to_seq
            held = self._held
            items = {s: held.pop(s) for s in seqs if s in held}  # seq -> (tasks, shared)
        if len(items) < len(seqs):
            ring = self._ring
            for s in seqs:
                if s in items:
                    continue
                kind = ring.kind(s) if ring is not None else 0
                if kind not in _RING_KINDS:
                    raise ProtocolError(f"rank {self.tp_rank} holds {len(items)} of the "
                                        f"{len(seqs)} batch(es) the step takes ({from_seq}, "
                                        f"{to_seq}]: seq {s} is missing")
                # not decoded ahead (the prefetch thread had not got the GIL, or sync mode)
                try:
                    items[s] = (ring.decode(s), kind == batch_ring.SHARED)
                except Exception as exc:
                    # as a receiver's failure: latched, so every later step call raises it
                    if self._error is None or isinstance(self._error, EngineClosedError):
                        self._error = exc
                    self._raise_error()
                    raise  # _raise_error returns only for an engine CLOSE: not this error
                self._counters["decoded_by_loop"] += 1
        tasks = []
        for s in seqs:
            batch, shared = items[s]
            tasks.append(batch)
            if shared:  # a large batch read through the pool, for stats()
                self._counters["shared_batches"] += 1
        self._taken = to_seq
        self._group.publish_consumed(to_seq)
        board = self._board
        if board is not None:
            board.publish(self.tp_rank, self._epoch_tag | to_seq)
        else:
            self._send_ack(to_seq)
        return tasks

    def _send_ack(self, seq: int) -> None:
        """Send the cumulative ACK ``seq`` without blocking and without raising: the step
        has taken its batches, whatever becomes of the ACK. One that cannot be queued (the
        engine's connection down or full: ``zmq.Again``; the context closing) is kept in
        ``_unsent_ack`` and sent again by the next step call (``_resend_ack``); a newer one
        supersedes it. A rank that reconnects says what it has taken in its HELLO anyway."""
        with self._ack_lock:  # close() in another thread must not close it meanwhile
            if self._closed:
                return
            try:
                self._ack.send(self._header(codec.ACK, seq=seq), zmq.NOBLOCK)
            except zmq.ZMQError:
                self._unsent_ack = seq
                self._counters["acks_deferred"] += 1
            else:
                self._unsent_ack = 0

    def _resend_ack(self) -> None:
        """Step calls, when an ACK could not be queued before: try it again."""
        self._send_ack(self._unsent_ack)

    def _check_error(self):
        """Before this rank arrives anywhere (``wait_for_tasks``): our own error, then a
        peer's fault; either is raised (nobody can pass a barrier we have not reached)."""
        if self._error is not None:
            self._raise_error()
        fault = self._group.peer_fault()
        if fault is not None:
            self._raise_peer_fault(*fault)

    def _barrier_check(self):
        """The barrier's check after every wake-up, once this rank has arrived: see
        ``tp_group`` ("A step stays all-or-none"). Our own failure is published to the group
        and raised only when a rank that has not arrived failed too (the step can never
        complete); otherwise the wait goes on and the next step call raises it. A
        ``close()`` from another thread is raised at once."""
        err = self._error
        if isinstance(err, ClosedError):
            raise ClosedError(str(err))
        fault = self._missing_fault()
        if fault is None:
            if err is not None and not self._own_fault:
                self._publish_own_fault(err)
            return
        if err is not None:
            self._raise_error()  # returns only for an engine CLOSE with batches left to take
        self._raise_peer_fault(*fault)

    def _raise_peer_fault(self, rank, code):
        if code == FAULT_LEFT:
            raise BarrierTimeoutError(
                f"rank {self.tp_rank} of {self.name!r}: rank {rank} of the group closed its "
                f"client, so this step cannot complete; close this client too and build the "
                f"whole group again")
        if code == _FAULT_OTHER:
            raise BarrierTimeoutError(
                f"rank {self.tp_rank} of {self.name!r}: rank {rank} of the group stopped at an "
                f"error (its own exception says which), so this step cannot complete; close "
                f"this client and build the whole group again")
        cls = _FAULT_CLASSES.get(code, EngineRejectedError)
        if cls is EngineClosedError and (self._close_seq is None
                                         or self._taken < self._close_seq):
            return  # our own CLOSE is on its way, or we still have batches to take
        self._error = cls(f"rank {self.tp_rank} of {self.name!r}: rank {rank} of the group "
                          f"stopped at {cls.__name__} about the engine at {self.endpoint} "
                          f"(its exception says why), so this step cannot complete")
        self._raise_error()

    def _publish_own_fault(self, err) -> bool:
        """Tell the group this rank stopped at ``err``: peers waiting for it raise at once
        (the same kind of error for an engine-side one, instead of "rank N exited"). False
        (nothing published) for ``ClosedError`` (close() says LEFT itself) and for an
        engine CLOSE while this rank still has batches to take."""
        if isinstance(err, ClosedError):
            return False
        code = _FAULT_OTHER
        for cls, cls_code in _FAULT_CODES:
            if isinstance(err, cls):
                if cls is EngineClosedError and self._taken < (self._close_seq or 0):
                    return False
                code = cls_code
                break
        self._group.publish_fault(code)
        self._own_fault = True
        return True

    def _raise_error(self):
        """Raise what ``_error`` holds, in this client's terms; return (raise nothing) for
        an engine CLOSE while this rank still has batches it was sent to take. An
        engine-side error is first published to the group, so that peers blocked in the
        barrier raise the same kind of error instead of "rank N exited"."""
        err = self._error
        if isinstance(err, ClosedError):
            raise ClosedError(str(err))
        if isinstance(err, EngineClosedError) and self._taken < (self._close_seq or 0):
            return
        if not self._own_fault:
            self._publish_own_fault(err)
        if isinstance(err, _RAISED_AS_IS):
            raise type(err)(str(err))
        if not self.async_prefetch and not self._error_raised:
            self._error_raised = True
            raise err
        where = ("the prefetch thread (or a decode at a take)" if self.async_prefetch else
                 "an earlier receive or decode")
        raise PrefetchError(f"TaskClient {self.name} rank {self.tp_rank}: {where} failed: "
                            f"{err}") from err
