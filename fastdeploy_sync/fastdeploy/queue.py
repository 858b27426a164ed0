"""``EngineWorkerQueue``: FastDeploy's class, its signature and every method and attribute
FastDeploy's engine, workers, splitwise connector and cache messager use.

The task path (``put_tasks``, ``get_tasks``, ``exist_tasks``, ``num_tasks``,
``set_exist_tasks``, ``clear_data``, ``read_finish_flag``, ``worker_process_tp_barrier``) runs
on the library's fast path: one ``TaskQueue`` per DP group on the server, a ``TaskClient``
per TP rank (``worker_side``), the engine side in ``engine_side``. Everything else
(cache infos, finished requests, disaggregated and RDMA connect tasks, prefill instances,
the cache messager's barriers, ``lock``) goes to the server's side-channel service
(``channels``, ``links``, ``channel_api``), off every step's critical path.

Roles. FastDeploy's constructor arguments do not say which side a client is on: the
engine's clients, the cache messager (one per TP rank, ``client_id=rank``), the splitwise
connector (``client_id=0``) and TP rank ``client_id`` are all built alike. So:
  * ``is_server=True``: the server (``server.Server``); it is also the engine side of DP
    group ``local_data_parallel_id``.
  * a client in the server's process: the engine's (FastDeploy's ``client_id=0`` instance
    of ``start_queue_service``); it puts into the server's queue directly.
  * any other client decides at its first call: ``put_tasks()`` makes it the engine's (it
    puts through the queue's node-local producer endpoint, ``TaskProducer``);
    ``get_tasks()``, ``read_finish_flag`` or ``worker_process_tp_barrier`` make it TP rank
    ``client_id`` of its DP group, which it joins then (a ``TaskClient``); side-channel calls
    decide nothing. A cache messager or connector therefore never takes a TP rank.
  * ``exist_tasks()``/``num_tasks()``, which FastDeploy's engine and its TP rank 0 both
    call first, make it TP rank ``client_id`` when a role hint says this process is one
    (``roles``: ``client_id > 0``, a process paddle.distributed's launcher started, or a
    server whose process holds the engine's own client of this DP group). Otherwise they
    read False/0 and decide nothing (an engine in a process of its own then puts), and
    ``clear_data()``/``set_exist_tasks()`` do nothing: nothing was put or held. A client
    polled undecided for a second says so, once, in the log, naming the fix; TP rank 0
    joining in ``get_tasks()`` after such polls raises ``ProtocolError`` saying so (its
    check for that call was never made).
  * ``role="engine"``/``"worker"`` (or ``FD_SYNC_QUEUE_ROLE``) decides at construction.
A forked child of the server's process (FastDeploy's DP-1 engine under EP + DP) never acts
on the server object it inherited (see ``server``): its clients are other processes'. More
generally, an instance inherited across fork (any role) refuses every call in the child
with ``ForkedProcessError`` and its ``cleanup()`` does nothing (``after_fork_in_child``):
the child builds its own.

Addresses (``address``): ``("0.0.0.0", port)`` or a unix socket path (FastDeploy's
``FD_ENGINE_TASK_QUEUE_WITH_SHM``) mean one node: private ipc endpoints named ``fdq<port>``;
another host means ``tcp://host:(port + i)`` for DP group i and the side channels on
``port + 4096`` (see ``address``), with CURVE keys (``keys_dir=`` or ``FD_SYNC_KEYS_DIR``;
without keys tcp refuses to start unless ``FD_SYNC_INSECURE_TCP=1``). ``authkey`` is
accepted for FastDeploy's signature and not used: CURVE authenticates tcp peers, a 0700
directory the ipc ones; a shared password would add nothing and would be one more secret
on the command line.

Where FastDeploy's semantics are not kept (each would break step consistency or adds
nothing here):
  * ``get_tasks()`` is a take, not a peek: a rank cannot re-read the current batch; one
    calling it more often than its peers gets ``ProtocolError`` instead of diverging.
  * ``exist_tasks()`` is derived: on the engine "``put_tasks()`` would wait, or what
    ``clear_data()`` retired is not yet drained"; on worker rank 0 "every rank holds a
    batch not yet taken". ``set_exist_tasks(True)`` creates no
    batch; ``set_exist_tasks(False)`` makes the engine's ``exist_tasks()`` read False until
    the next put, but the workers still take what was put (``clear_data()`` drops it).
  * ``put_tasks()`` does not convert multimodal numpy inputs to paddle tensors (arrays
    travel zero-copy as numpy and are read-only on the worker); ``to_tensor``/``to_numpy``
    are there for callers that want it.
  * Every wait is bounded (the side channels': ``channel_api.DEFAULT_WAIT_S``).
"""

import logging
import os
import threading
from typing import Any, Optional, Union

from .. import envs
from ..engine.producer import TaskProducer
from ..errors import ClosedError
from ..forks import refuse_calls
from ..shm.ownership import on_fork
from . import tensors
from .address import parse_address
from .channel_api import ChannelMethods, PrefillInstances, SideLock, make_barriers
from .engine_side import EngineSide
from .links import RemoteLink
from .processes import Role
from .roles import UndecidedRole, hints_apply, late_rank0_error
from .server import Server, lookup
from .watch import GroupWatch
from .worker_side import WorkerSide

__all__ = ["EngineWorkerQueue"]

log = logging.getLogger(__name__)

class EngineWorkerQueue(ChannelMethods):
    """FastDeploy's ``EngineWorkerQueue``; see the module docstring for roles, addresses,
    security and the differences from FastDeploy.

    ``EngineWorkerQueue(address=("0.0.0.0", 5000), authkey=b"secret_key", is_server=False,
    num_client=1, client_id=-1, local_data_parallel_size=1, local_data_parallel_id=0)``:
    FastDeploy's signature and defaults. Keyword-only extras:

    * ``max_inflight`` (server, default 1): batches put and not yet taken by every rank
      before ``put_tasks()`` blocks. 1 is FastDeploy's one batch at a time.
    * ``connect_timeout`` (clients, default ``FD_SYNC_CONNECT_TIMEOUT`` or 15 s,
      FastDeploy's 5 retries x 3 s): how long the constructor waits for the server's
      answer, and a joining worker for the engine's welcome, before ``ConnectionError``.
    * ``name`` (default ``fdq<port>``): the queue name the endpoints and shared memory are
      derived from; every side must agree (the default does).
    * ``role``: ``None`` (decided at the first call), ``"engine"`` or ``"worker"``.
    * ``keys_dir``: CURVE keys for ``tcp://`` (None: ``FD_SYNC_KEYS_DIR``).

    The constructor blocks: a server until its endpoints are bound; a client until the
    server answered (or ``ConnectionError``); with ``role="worker"`` until the engine
    welcomed this rank, ranks other than 0 also until their rank 0 exists
    (``FD_SYNC_ATTACH_TIMEOUT``). Threading: the engine side and the side channels are
    thread-safe; a worker is used from its event loop thread.
    """

    # Each decided role is recorded for ``fastdeploy-sync status`` (``processes``).
    role = Role()

    @classmethod
    def to_tensor(cls, tasks: Any) -> None:
        """FastDeploy's class method: multimodal numpy inputs of ``tasks`` to paddle tensors,
        in place, when FastDeploy's switches say so (``tensors.to_tensor``)."""
        tensors.to_tensor(tasks)

    @classmethod
    def to_numpy(cls, tasks: Any) -> None:
        """FastDeploy's class method: the reverse, for a list of batches
        (``tensors.to_numpy``)."""
        tensors.to_numpy(tasks)

    def __init__(self, address: Union[tuple[str, int], str] = ("0.0.0.0", 5000),
                 authkey: bytes = b"secret_key",
                 is_server: bool = False, num_client: int = 1, client_id: int = -1,
                 local_data_parallel_size: int = 1, local_data_parallel_id: int = 0, *,
                 max_inflight: int = 1, connect_timeout: Optional[float] = None,
                 name: Optional[str] = None, role: Optional[str] = None,
                 keys_dir: Optional[str] = None) -> None:
        addr = parse_address(address)
        self.address = addr.key
        self.authkey = authkey  # not used: see the module docstring
        self.is_server = bool(is_server)
        self.num_client = num_client
        self.client_id = client_id
        self.local_data_parallel_size = local_data_parallel_size
        self.local_data_parallel_id = local_data_parallel_id
        self.is_single_node = addr.single_node
        if type(max_inflight) is not int or max_inflight < 1:
            raise ValueError(f"max_inflight={max_inflight!r}: expected an int >= 1")
        if role not in (None, "engine", "worker"):
            raise ValueError(f"role={role!r}: expected None, 'engine' or 'worker'")
        self.max_inflight = max_inflight
        self.role = None  # "server", "engine", "worker"; None until the first call decides
        self._addr, self._keys_dir = addr, keys_dir
        self._connect_timeout = (envs.connect_timeout_s() if connect_timeout is None
                                 else float(connect_timeout))
        self._closed = False
        self._server: Optional[Server] = None  # this process's (ours, or the one we put into)
        self._engine: Optional[EngineSide] = None  # once this is the engine's
        self._worker: Optional[WorkerSide] = None  # once this is a TP rank
        self._producer: Optional[TaskProducer] = None  # an engine client's, in another process
        self._link = None  # to the side channels
        self._role_lock = threading.Lock()
        self._undecided: Optional[UndecidedRole] = None  # once a client polls undecided
        self.read_finish_flag = _ReadFinishFlag(self)
        self.connected_client_counter = _ConnectedCounter(self)
        self.worker_process_tp_barrier = _TPBarrier(self)
        self.exist_tasks_intra_signal = _ExistSignal(self) if addr.single_node else None
        self.lock = SideLock(self)
        self.available_prefill_instances = PrefillInstances(self)
        for attr, barrier in make_barriers(self).items():
            setattr(self, attr, barrier)
        self._owner_pid = os.getpid()
        on_fork(self)

        if self.is_server:
            if not 0 <= local_data_parallel_id < max(1, local_data_parallel_size):
                raise ValueError(f"local_data_parallel_id={local_data_parallel_id} is not in "
                                 f"[0, {local_data_parallel_size})")
            self._server = Server(addr, name, num_client, local_data_parallel_size,
                                  max_inflight, keys_dir)
            self.address, self._name = self._server.address.key, self._server.name
            self._link = self._server.link
            self._engine = self._server.engine_side(local_data_parallel_id)
            self.role = "server"
            return
        if not (type(client_id) is int and 0 <= client_id < num_client):
            raise ValueError(f"client_id={client_id!r}, num_client={num_client!r}: a client "
                             f"needs 0 <= client_id < num_client (its TP rank)")
        server = lookup(addr.key)
        if server is not None and role != "worker":
            self._server, self._name, self._link = server, server.name, server.link
            self._engine = server.engine_side(local_data_parallel_id, client=True)
            self.max_inflight = server.max_inflight
            self.role = "engine"
            return
        self._name = name or addr.default_name()
        if role is None and "FD_SYNC_QUEUE_ROLE" in os.environ:
            role = envs.queue_role()
        if role == "engine":  # first: its error says there is no queue on this node
            self._producer = TaskProducer(self._name, dp_id=local_data_parallel_id,
                                          timeout=self._connect_timeout)
        try:
            self._link = RemoteLink(addr.side_endpoint(self._name), keys_dir=keys_dir)
            hello = self._link.call("hello", local_data_parallel_id, client_id,
                                    timeout=self._connect_timeout)
            if hello["num_client"] != num_client:
                raise ValueError(f"num_client={num_client}: the server at {self.address} "
                                 f"serves {hello['num_client']} TP rank(s) per DP group")
            self.max_inflight = hello["max_inflight"]
            if self._producer is not None:  # role "engine", made above
                self._engine = self._engine_over(self._producer)
                self.role = "engine"
            elif role == "worker":
                self._worker = self._join()
                self.role = "worker"
        except BaseException:
            self._release()
            raise

    # -- roles -------------------------------------------------------------------------------

    def _engine_over(self, producer: TaskProducer) -> EngineSide:
        watch = GroupWatch(producer, self._where, envs.heartbeat_timeout_s())
        return EngineSide(producer, self.max_inflight, watch, self._where)

    def _join(self) -> WorkerSide:
        return WorkerSide(self._name, self._addr, self.num_client, self.client_id,
                          self.local_data_parallel_id, keys_dir=self._keys_dir,
                          connect_timeout=self._connect_timeout)

    def _as_engine(self, what: str) -> EngineSide:
        """This instance's engine side; an undecided client becomes the engine's here."""
        engine = self._engine
        if engine is not None:
            if self._server is not None:
                self._server.usable()
            return engine
        with self._role_lock:
            self._check_open()
            if self._worker is not None:
                raise RuntimeError(f"{what} is an engine-side call: this EngineWorkerQueue is "
                                   f"TP rank {self.client_id} of a worker group")
            if self._engine is None:
                self._producer = TaskProducer(self._name, dp_id=self.local_data_parallel_id,
                                              timeout=self._connect_timeout)
                self._engine = self._engine_over(self._producer)
                self.role = "engine"
                log.info("%s: engine side (first call: %s)", self._where(), what)
            return self._engine

    def _as_worker(self, what: str) -> WorkerSide:
        """This instance's worker side; an undecided client joins its TP group here.

        Raises ``ProtocolError`` when TP rank 0 joins in ``get_tasks()`` after its
        ``exist_tasks()``/``num_tasks()`` read False undecided: its check for this call
        was never made, and its peers would otherwise blame the loop."""
        worker = self._worker
        if worker is not None:
            return worker
        with self._role_lock:
            self._check_open()
            if self._engine is not None:
                raise RuntimeError(f"{what} is a worker-side call: this EngineWorkerQueue is "
                                   f"the engine's ({self.role})")
            if self._worker is None:
                undecided = self._undecided
                late = (what == "get_tasks" and self.client_id == 0 and undecided is not None
                        and undecided.polled_since is not None)
                try:
                    # joins even then: its peers attach to the group rank 0 creates and
                    # raise at once (their get_tasks() finds no check) instead of waiting
                    worker = self._join()
                except BaseException as exc:
                    if late:  # the cause, whatever the join met (peers leaving first...)
                        raise late_rank0_error(self._where()) from exc
                    raise
                self._worker, self.role = worker, "worker"
                log.info("%s: TP rank %d (first worker call: %s)", self._where(),
                         self.client_id, what)
                if late:
                    raise late_rank0_error(self._where())
            return self._worker

    def _count_elsewhere(self, what: str, undecided: Any) -> Any:
        """``exist_tasks()``/``num_tasks()`` (``what``) of a client that is not (yet) a TP
        rank: the engine side's answer, or, while the role is undecided, the rank's it
        joined as, else ``undecided``."""
        engine = self._engine
        if engine is not None:
            if self._server is not None:
                self._server.usable()
            return getattr(engine, what)()
        worker = self._undecided_poll(what)
        return getattr(worker, what)() if worker is not None else undecided

    def _undecided_poll(self, what: str) -> Optional[WorkerSide]:
        """``exist_tasks()``/``num_tasks()`` on a client whose role is not decided: the
        ``WorkerSide`` it joined as when a role hint says it is a TP rank (``roles``), or
        None (still undecided: the caller reads False/0)."""
        self._check_open()
        if self._undecided is None:
            self._undecided = UndecidedRole(
                self._link, self.local_data_parallel_id, self.client_id, self._where,
                hints=hints_apply(self._addr.single_node, self.num_client))
        if self._undecided.poll(what):
            return self._as_worker(what)
        return None

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"EngineWorkerQueue{self.address} is cleaned up")

    def _where(self) -> str:
        return f"EngineWorkerQueue{self.address} DP group {self.local_data_parallel_id}"

    def _side(self) -> tuple:
        """(link, dp_id, client_id) for ``channel_api``."""
        self._check_open()
        if self._server is not None:
            self._server.usable()
        return self._link, self.local_data_parallel_id, self.client_id

    # -- FastDeploy's task path --------------------------------------------------------------

    def get_server_port(self) -> int:
        """The port the server serves (the real one when built with port 0). Server only:
        ``RuntimeError`` elsewhere, as FastDeploy."""
        server = self._server
        if not self.is_server or server is None:
            raise RuntimeError("Only the server instance can provide the port.")
        return server.address.port

    def put_tasks(self, tasks: Any, timeout: Optional[float] = None) -> None:
        """Engine side: enqueue one batch (typically ``(requests, real_bsz)``) for every TP
        rank of this DP group. Blocks, as FastDeploy, while ``max_inflight`` batches are
        not yet taken by every rank (polling ever less often, up to FastDeploy's own 1 ms
        sleep).
        ``timeout`` (seconds, None = forever) raises ``TimeoutError`` with nothing
        enqueued. Raises ``GroupLostError`` (nothing enqueued), at once or while it waits,
        when the worker group is lost (see ``exist_tasks``). Thread-safe: threads putting
        together never exceed ``max_inflight``. Numpy arrays travel zero-copy; see
        ``TaskQueue.put_tasks`` for the other errors. A worker raises ``RuntimeError``."""
        self._as_engine("put_tasks").put_tasks(tasks, timeout)

    def get_tasks(self) -> tuple[list, bool]:
        """Worker side: ``(tasks, all_client_read)``. Never blocks on the engine.

        ``tasks``: the batches rank 0's check latched for this call, in put order,
        identical on every rank (``[]`` if none). ``all_client_read``: True on exactly one
        rank per call, the last of the group to make it (FastDeploy's last reader, which
        resets the loop's signal). Batches cleared by ``clear_data()`` are dropped here, on
        every rank alike (``cleared`` counts them). A call made before the step its
        batches are meant for (the overlap scheduler's race, see ``worker_side``) returns
        ``([], False)`` and changes nothing.

        A call that takes nothing raises what the engine side learned, as
        ``exist_tasks()`` does (``EngineClosedError`` once rank 0's check saw the server's
        ``cleanup()``: every rank raises it in the same call).

        Differs from FastDeploy: a take, not a peek. Raises ``ProtocolError`` if this
        rank's calls disagree with rank 0's decisions. The first call joins the TP group
        (see the module docstring)."""
        worker = self._worker or self._as_worker("get_tasks")
        return worker.get_tasks()

    def exist_tasks(self) -> bool:
        """Engine side: True while ``put_tasks()`` would wait (``max_inflight`` batches not
        yet taken by every rank, those ``clear_data()`` retired excepted) and, as
        FastDeploy's flag, while batches ``clear_data()`` retired are not yet drained by
        every rank; False after ``set_exist_tasks(False)`` until the next put. Raises
        ``GroupLostError`` when the worker group is lost (retired by the engine, or a rank
        disconnected for longer than the heartbeat timeout) until a new group has every
        rank connected; the error names the ranks, why, and carries the batches the group
        did not finish (``.unfinished``).

        Worker side: True when every rank of the group holds a batch not yet taken; on
        rank 0 it also latches what the group's next ``get_tasks()`` takes. A flag read in
        async mode; never blocks. Raises engine-side errors (``PrefetchError``...) as
        ``TaskClient.exist_tasks``; the engine's close, on rank 0, reads True instead and
        every rank raises ``EngineClosedError`` in the step's ``get_tasks()`` (or
        ``read_finish_flag.get()``), so that no rank leaves its peers waiting in the
        loop's barrier.

        Undecided client (see the module docstring): joins as TP rank ``client_id`` when a
        role hint says it is one (then as above; joining blocks as the constructor with
        ``role="worker"``), else False."""
        worker = self._worker
        if worker is not None:  # the step's path: one attribute read, one call
            return worker.exist_tasks()
        return self._count_elsewhere("exist_tasks", False)

    def num_tasks(self) -> int:
        """Engine side: batches not yet taken by every rank, those ``clear_data()`` retired
        excepted (at most ``max_inflight``); raises ``GroupLostError`` as ``exist_tasks()``.

        Worker side, TP rank 0: the batches every rank holds and the group's next
        ``get_tasks()`` takes, and, like ``exist_tasks()``, it latches them for that call,
        so ``if num_tasks() > 0:`` (FastDeploy 2.x's check) works exactly as
        ``if exist_tasks():``. Called after the step's barrier (a log line) it only reads,
        and returns this rank's own count. Other ranks: batches this rank holds and has not
        taken. Never blocks. Undecided client: as ``exist_tasks()`` (0 while undecided)."""
        worker = self._worker
        if worker is not None:
            return worker.num_tasks()
        return self._count_elsewhere("num_tasks", 0)

    def set_exist_tasks(self, flag: bool) -> None:
        """Engine side: ``False`` makes ``exist_tasks()`` read False until the next put
        (the workers still take the batch: ``clear_data()`` drops it); ``True`` lets the
        flag follow the queue again (it creates no batch). Elsewhere: nothing."""
        if self._engine is not None:
            self._engine.set_exist_tasks(flag)

    def clear_data(self) -> None:
        """Engine side: retire what is pending. ``num_tasks()`` reads 0 right after and the
        engine may put again at once; ``exist_tasks()`` reads True until every rank
        drained the retired batches (FastDeploy's flag stays set until the workers' next
        read; ``set_exist_tasks(False)`` clears it). The retired batches travel on with a
        marker and every rank drops them in the same ``get_tasks()`` call, so every rank
        drops exactly the same batches and none is ever returned; batches a rank already
        took are not affected. Never waits for the workers; a second call with nothing
        put in between adds nothing.

        Worker side: every batch this rank holds now is dropped when the group takes it,
        by every rank alike (the bound is sealed into the decisions rank 0 latches, so the
        ranks agree whatever the timing; FastDeploy's workers call it together after a
        weight update). Across nodes it drops nothing (logged).

        Undecided client: nothing (nothing was put or held)."""
        if self._worker is not None:
            self._worker.clear_data()
        elif self._engine is not None:
            self._as_engine("clear_data").clear_data()
        else:
            self._check_open()

    def num_connected_clients(self) -> int:
        """TP ranks of this DP group connected to the engine now (FastDeploy logs its
        ``connected_client_counter``); asked of the server from any client."""
        if self._engine is not None:
            return self._as_engine("num_connected_clients").connected()
        link, dp, cid = self._side()
        return link.call("connected", dp, cid)

    @property
    def cleared(self) -> int:
        """Worker: batches dropped by ``clear_data()`` (the engine's or the workers')."""
        return self._worker.cleared if self._worker is not None else 0

    @property
    def coordinator(self) -> Optional[str]:
        """Worker: ``"shm"`` (one node) or ``"paddle"`` (across nodes); None elsewhere."""
        return self._worker.coordinator if self._worker is not None else None

    @property
    def task_queues(self) -> list:
        """The server's ``TaskQueue`` per local DP group (index = ``local_data_parallel_id``),
        for what the core offers beyond FastDeploy's calls: ``stats()``, ``status()``,
        ``group_events``, and metrics (``fastdeploy_sync.metrics.register(registry,
        *server.task_queues)``). An engine client in the server's process sees its server's;
        an empty list elsewhere (the server's process exports them)."""
        return list(self._server.queues) if self._server is not None else []

    _queues = task_queues

    def cleanup(self, timeout: float = 0.0) -> None:
        """Server: close every DP group's queue (workers take what they were sent, then raise
        ``EngineClosedError``) and the side channels, release the endpoints. ``timeout``:
        how long to wait for the workers to take what is pending first (FastDeploy's
        shutdown does not wait). Worker: close the client and the group's shared memory.
        Other clients: close their sockets. Idempotent."""
        if self._closed:
            return
        with self._role_lock:
            self._closed = True
        if self.is_server and self._server is not None:  # a server always has one
            self._server.close(timeout)
        self._release()

    def _release(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._producer is not None:
            self._producer.close()
        if self._link is not None and not self.is_server and self._server is None:
            self._link.close()

    def after_fork_in_child(self) -> None:
        """In a child forked from this instance's process: the instance is the parent's
        (its server, engine side, TP rank, producer and links): every call raises
        ``ForkedProcessError``, also through the attribute objects (``read_finish_flag``,
        the barriers, ``lock``...: they reach the role through the methods refused here),
        and ``cleanup()`` does nothing. The role's objects stay referenced, never reached
        (their finalizers are pid-checked; their own hooks refuse them too)."""
        self._inherited = (self._engine, self._worker)
        self._engine = self._worker = None  # every path to a role goes through _as_*
        refuse_calls(self, f"EngineWorkerQueue{self.address} ({self.role or 'undecided'}, "
                           f"client_id {self.client_id}, DP group "
                           f"{self.local_data_parallel_id})", self._owner_pid,
                     idle={"cleanup": None},
                     private=("_side", "_as_engine", "_as_worker", "_check_open"))

    def __enter__(self) -> "EngineWorkerQueue":
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    @property
    def name(self) -> str:
        """The queue name its endpoints and shared memory derive from (``fdq<port>`` unless
        ``name=`` was given): ``fastdeploy-sync status NAME``."""
        return self._name

    def __repr__(self) -> str:
        return (f"EngineWorkerQueue(address={self.address}, role={self.role}, "
                f"num_client={self.num_client}, client_id={self.client_id}, "
                f"dp={self.local_data_parallel_id})")


# -- FastDeploy's attribute objects ----------------------------------------------------------

class _ReadFinishFlag:
    """FastDeploy's ``read_finish_flag`` (a manager ``Value``): ``get()`` / ``set(v)``, and
    ``value``. A worker-side object: its first use joins the TP group.

    One node: shared by the TP group (node-local shared memory). Across nodes (FastDeploy's
    ``nnode > 1`` loop, where rank 0 sets the flag instead of its node-local signal):
    ``get()`` is the step's one paddle.distributed all-reduce and returns 1 on every rank
    iff the group takes a batch this step; ``set()`` changes nothing there. Every rank
    must then call ``get()`` exactly once per step, as that loop does; a rank calling it
    more or less often than its peers hangs in the collective until gloo's 30 s timeout,
    then raises ``BarrierTimeoutError`` naming the ranks and nodes."""

    def __init__(self, owner: "EngineWorkerQueue") -> None:
        self._owner = owner

    def _worker(self) -> WorkerSide:
        owner = self._owner
        return owner._worker or owner._as_worker("read_finish_flag")

    def get(self) -> int:
        return self._worker().flag_get()

    def set(self, value: int) -> None:
        self._worker().flag_set(value)

    value = property(get, set)


class _ConnectedCounter:
    """FastDeploy's ``connected_client_counter``: ``get()`` = TP ranks of this DP group
    connected to the engine now."""

    def __init__(self, owner: "EngineWorkerQueue") -> None:
        self._owner = owner

    def get(self) -> int:
        return self._owner.num_connected_clients()


class _TPBarrier:
    """FastDeploy's ``worker_process_tp_barrier``: ``wait(timeout=None)`` is the TP group's
    node-local shared-memory barrier (``TaskClient.barrier``), which also raises
    engine-side errors while waiting. Its first use joins the TP group."""

    def __init__(self, owner: "EngineWorkerQueue") -> None:
        self._owner = owner

    def wait(self, timeout: Optional[float] = None) -> None:
        owner = self._owner
        (owner._worker or owner._as_worker("worker_process_tp_barrier")).barrier(timeout)


class _ExistSignal:
    """FastDeploy's ``exist_tasks_intra_signal`` (an ``IPCSignal`` on one node):
    ``value[0]`` reads ``exist_tasks()``, ``value[0] = v`` is ``set_exist_tasks(v)``."""

    def __init__(self, owner: "EngineWorkerQueue") -> None:
        self._owner = owner
        self.value = self

    def __getitem__(self, index: int) -> int:
        if index != 0:
            raise IndexError(index)
        return int(self._owner.exist_tasks())

    def __setitem__(self, index: int, value: object) -> None:
        if index != 0:
            raise IndexError(index)
        self._owner.set_exist_tasks(bool(value))
