"""The drop-in's server (``EngineWorkerQueue(is_server=True)``): one ``TaskQueue`` per local DP
group, the engine side of each, and the side channels' service; and the registry of this
process's servers, through which the engine's client instances in the same process put
directly.

Fork. FastDeploy builds the server in the engine process and then forks helpers (the DP-1
engine of EP + DP: ``start_data_parallel_service``). A forked child inherits a copy of the
server object, whose queues' threads, sockets and locks belong to the parent: acting on it
would hang (a ``put_tasks()`` that never returns) or close the parent's live endpoints. So at
fork (``os.register_at_fork``) the child forgets the registry: its clients reach the parent's
server as any other process does. The inherited objects are kept referenced for the child's
whole life (their finalizers would remove the parent's names) and refuse every call.
"""

import logging
import os
import socket
import threading

from ..engine.queue import TaskQueue
from ..errors import ClosedError, ForkedProcessError
from .channels import ChannelState
from .engine_side import EngineSide, queue_capacity
from .links import LocalLink, SideService
from .watch import GroupWatch

__all__ = ["Server", "lookup"]

log = logging.getLogger(__name__)

# This process's servers, by address key.
_SERVERS: dict = {}
_SERVERS_LOCK = threading.Lock()
# Servers inherited across fork: never used, never finalized here (see the module docstring).
_INHERITED: list = []


def lookup(key):
    """This process's live server for address ``key``, or None."""
    with _SERVERS_LOCK:
        return _SERVERS.get(key)


def _after_fork_in_child():
    global _SERVERS_LOCK
    _SERVERS_LOCK = threading.Lock()  # another thread may have held it at fork
    for server in _SERVERS.values():
        server.inherited = True
        _INHERITED.append(server)
    _SERVERS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Server:
    """What ``EngineWorkerQueue(is_server=True)`` owns. Thread-safe.

    The constructor binds every endpoint (a DP group's task endpoint, the side channels)
    or raises, releasing what it took: ``EndpointInUseError`` when a live server holds the
    name, ``AuthenticationError`` for tcp without keys, ``ValueError`` for bad sizes."""

    def __init__(self, address, name, num_client, dp_size, max_inflight, keys_dir):
        if type(dp_size) is not int or dp_size < 1:
            raise ValueError(f"local_data_parallel_size={dp_size!r}: expected an int >= 1")
        self.num_client, self.dp_size, self.max_inflight = num_client, dp_size, max_inflight
        self.inherited = False
        self.closed = False
        self.queues, self.engine_sides = [], []
        self.engine_clients = [0] * max(1, dp_size)  # engine client instances built here
        self._reserved = None
        self._service = None
        port = address.port
        try:
            if address.single_node and port == 0 and not address.path_name:
                # No TCP port is bound for ipc; hold one so the number (and so the name)
                # is ours alone on this node while the server lives.
                self._reserved = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                self._reserved.bind(("127.0.0.1", 0))
                port = self._reserved.getsockname()[1]
            elif port == 0:
                # the name is derived from the port (workers only know the port): learn a
                # free one first; group i then binds port + i
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                    probe.bind((address.host, 0))
                    port = probe.getsockname()[1]
            self.address = address.with_port(port)
            self.name = name or address.default_name(port)
            for i in range(dp_size):
                q = TaskQueue(self.name, num_client, dp_id=i,
                              endpoint=self.address.task_endpoint(i),
                              max_inflight=queue_capacity(max_inflight), keys_dir=keys_dir)
                self.queues.append(q)
                watch = GroupWatch(q, lambda i=i: self.where(i), q.heartbeat.timeout)
                self.engine_sides.append(EngineSide(q, max_inflight, watch,
                                                    lambda i=i: self.where(i)))
            self.channels = ChannelState(num_client, dp_size,
                                         {"max_inflight": max_inflight, "name": self.name})
            self.channels.connected = lambda dp: self.engine_sides[dp].connected()
            self.channels.engine_here = lambda dp: self.engine_clients[dp] > 0
            self._service = SideService(self.channels, self.address.side_endpoint(self.name),
                                        keys_dir=keys_dir)
            self.link = LocalLink(self.channels, self._service.endpoint)
        except BaseException:
            self.close(0.0)
            raise
        with _SERVERS_LOCK:
            _SERVERS[self.address.key] = self
        log.info("EngineWorkerQueue server started at %s: %d DP group(s) x %d TP rank(s) (%s; "
                 "side channels %s)", self.address, dp_size, num_client,
                 ", ".join(q.endpoint for q in self.queues), self._service.endpoint)

    def where(self, dp_id) -> str:
        return f"EngineWorkerQueue{self.address} DP group {dp_id}"

    def usable(self):
        """Raise unless this server may be used from this process."""
        if self.inherited:
            raise ForkedProcessError(
                f"EngineWorkerQueue{self.address}: this server was built in the parent of "
                f"this process (pid {os.getpid()} is a forked child): a child never acts on "
                f"its parent's server; build your own in the child (a client, "
                f"is_server=False)")
        if self.closed:
            raise ClosedError(f"EngineWorkerQueue{self.address}: its server is cleaned up")

    def engine_side(self, dp_id, *, client=False) -> EngineSide:
        """DP group ``dp_id``'s engine side. ``client=True``: for an engine client instance
        of this process (FastDeploy's engine builds one beside its server), which the
        server then reports to undecided clients elsewhere (``engine_here``): the engine
        of that group is here, so they are its TP ranks."""
        self.usable()
        if not 0 <= dp_id < len(self.engine_sides):
            raise ValueError(f"local_data_parallel_id={dp_id}: the server at {self.address} "
                             f"serves {len(self.engine_sides)} DP group(s)")
        if client:
            self.engine_clients[dp_id] += 1
        return self.engine_sides[dp_id]

    def close(self, timeout) -> None:
        """Close every DP group's queue (workers take what they were sent, then raise
        ``EngineClosedError``), the side channels, and release the port. Idempotent. In a
        forked child: does nothing (the parent's server is not this process's)."""
        if self.inherited or self.closed:
            return
        self.closed = True
        with _SERVERS_LOCK:
            if _SERVERS.get(getattr(self, "address", None) and self.address.key) is self:
                del _SERVERS[self.address.key]
        for q in self.queues:
            q.close(timeout=timeout)
        if self._service is not None:
            self._service.close()
        if self._reserved is not None:
            self._reserved.close()
