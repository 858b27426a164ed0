"""FastDeploy's queue addresses, and the names and endpoints the drop-in derives from them.

Workers know only the address FastDeploy gives them, so everything a client needs (the
queue name, the task endpoints of each DP group, the side-channel endpoint) is a function
of the address (and of ``name=`` where the caller overrides it).
"""

import os
import re

from ..wire.endpoints import MAX_DP_ID, default_endpoint

__all__ = ["SINGLE_NODE_HOST", "Address", "parse_address", "SIDE_PORT_OFFSET"]

SINGLE_NODE_HOST = "0.0.0.0"
# tcp: DP group i is served on port + i (i <= MAX_DP_ID); the side channels one past them
SIDE_PORT_OFFSET = MAX_DP_ID + 1

_SOCK_PORT_RE = re.compile(r"(\d+)\.sock\Z")
_NAME_UNSAFE_RE = re.compile(r"[^A-Za-z0-9_.-]")


class Address:
    """A parsed FastDeploy queue address.

    ``host``/``port``: for a ``(host, port)`` pair, as given; for a unix socket path
    (FastDeploy's ``FD_ENGINE_TASK_QUEUE_WITH_SHM``: ``/dev/shm/fd_task_queue_<port>.sock``)
    the one-node host and the number in ``<port>.sock`` (0 if none). ``path_name``: the
    path's file name made safe as a queue name ('' for a pair). ``single_node``: the host
    is ``0.0.0.0`` (FastDeploy's one-node convention) or the address is a path. ``key``:
    what both sides of FastDeploy pass (a path stays the path)."""

    __slots__ = ("host", "port", "path_name", "key")

    def __init__(self, host, port, path_name="", key=None):
        self.host, self.port, self.path_name = host, port, path_name
        self.key = key if key is not None else (host, port)

    @property
    def single_node(self) -> bool:
        return self.host == SINGLE_NODE_HOST or bool(self.path_name)

    def with_port(self, port) -> "Address":
        """The same address once a server picked its real port (a path keeps its key)."""
        if self.path_name:
            return self
        return Address(self.host, port)

    def default_name(self, port=None) -> str:
        """The queue name both sides derive (workers know nothing else): ``fdq<port>``, or
        for a path without a port number in it, ``fdq-<file name>``."""
        if self.path_name and self.port == 0:
            return f"fdq-{self.path_name}"
        return f"fdq{self.port if port is None else port}"

    def task_endpoint(self, dp_id: int):
        """DP group ``dp_id``'s task endpoint: None (the queue's private ipc endpoint) on
        one node, ``tcp://host:(port + dp_id)`` otherwise."""
        return None if self.single_node else f"tcp://{self.host}:{self.port + dp_id}"

    def side_endpoint(self, name: str) -> str:
        """The side channels' endpoint: the private ipc file ``fdsync-<name>-dp0.side.ipc``
        on one node; ``tcp://host:(port + SIDE_PORT_OFFSET)`` otherwise (past every DP
        group's port), or ``port - SIDE_PORT_OFFSET`` where that would pass 65535."""
        if self.single_node:
            return default_endpoint(name, 0, "side")
        port = self.port + SIDE_PORT_OFFSET
        if port > 65535:
            port = self.port - SIDE_PORT_OFFSET
        return f"tcp://{self.host}:{port}"

    def __repr__(self):
        return repr(self.key)


def parse_address(address) -> Address:
    """An ``Address`` from a ``(host, port)`` pair or a unix socket path, as FastDeploy
    passes them; ``ValueError`` for anything else. Nothing is created at a path: the
    queue's own private ipc endpoint serves it (a socket in a world-writable directory
    could be taken over by another user)."""
    if isinstance(address, (str, bytes, os.PathLike)):
        path = os.fsdecode(address)
        base = os.path.basename(path)
        if not base:
            raise ValueError(f"address={address!r}: a unix socket path needs a file name")
        match = _SOCK_PORT_RE.search(base)
        return Address(SINGLE_NODE_HOST, int(match.group(1)) if match else 0,
                       _NAME_UNSAFE_RE.sub("_", base)[:48], key=os.fspath(address))
    try:
        host, port = address
        return Address(str(host), int(port))
    except (TypeError, ValueError):
        raise ValueError(f"address={address!r}: expected (host, port) or a unix socket "
                         f"path, as FastDeploy passes") from None
