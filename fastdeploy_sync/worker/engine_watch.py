"""Is the engine there? One rank's judgement of the engine it is bound to (``wire.liveness``).

The engine is *gone* when the watched connection (a socket of the background thread's that
never carries a batch) is down (disconnected, or a handshake that never completes) and
has not been re-established to the same engine instance within the heartbeat timeout, or
when nothing was heard on it for that long while it is down (libzmq dropped it for missing
ZMTP heartbeats: the engine was frozen that long already); it is *hung* after
``stall_timeout`` of application silence on a live connection. Silence alone, for less
than ``stall_timeout``, is never death: libzmq's own I/O thread keeps a connection alive
with ZMTP heartbeats while a Python thread on either side holds the GIL (a long C call, a
compile, a huge pickle). Before the first WELCOME the engine is *unreachable* after the
connect timeout.

Written by the thread that receives (the background thread; the event loop in sync mode
for the data socket), read by the background thread that judges; the step API reads
only ``engine`` and ``close_seq``.
"""

import time
from typing import Optional

from ..errors import EngineGoneError, EngineUnreachableError
from ..wire.endpoints import ipc_path

__all__ = ["EngineWatch"]


class EngineWatch:
    """What one rank knows of its engine: which instance it is bound to (``engine``, 0
    before the first WELCOME; ``bound`` once welcomed), when it last heard from it, whether
    the watched connection is down, and the engine's last seq once it said CLOSE
    (``close_seq``, None before)."""

    def __init__(self, who: str, endpoint: str, heartbeat, connect_timeout: float):
        self._who = who  # "rank R of 'name'", for messages
        self.endpoint = endpoint
        self.heartbeat = heartbeat
        self.connect_timeout = connect_timeout
        self.engine = 0
        self.bound = False
        self.close_seq = None
        self.started = self.last_heard = time.monotonic()
        # When the watched connection went down, None while up or before the first
        # connection; whether any connection was ever made.
        self.down_since: Optional[float] = None
        self.ever_connected = False

    def heard(self) -> None:
        """A message of the bound engine arrived: it is there, and so is the connection."""
        self.last_heard = time.monotonic()
        self.down_since = None

    def connected(self) -> None:
        self.ever_connected = True

    def connection_down(self) -> None:
        """The watched connection went down (disconnected, or a handshake that never
        completed)."""
        if self.down_since is None:
            self.down_since = time.monotonic()

    def deadline(self) -> float:
        """When the watching thread must wake to judge the engine (``check``)."""
        if self.close_seq is not None:
            return float("inf")
        if not self.bound:
            return self.started + self.connect_timeout + 0.001
        timeout = self.heartbeat.timeout
        if self.down_since is not None:
            return min(self.down_since, self.last_heard) + timeout + 0.001
        if self.heartbeat.stall_timeout:
            return self.last_heard + self.heartbeat.stall_timeout + 0.001
        return float("inf")

    def check(self, now: float) -> None:
        """The liveness contract on this side (module docstring): raises
        ``EngineUnreachableError`` (never welcomed within the connect bound) or
        ``EngineGoneError`` (connection lost and not re-established in time; or silent
        past the stall timeout on a live connection). Never blocks."""
        if self.close_seq is not None:
            return
        if not self.bound:
            waited = now - self.started
            if waited > self.connect_timeout:
                raise EngineUnreachableError(self._unreachable_message(waited))
            return
        timeout = self.heartbeat.timeout
        silent = now - self.last_heard
        down = self.down_since
        if down is not None and (now - down > timeout or silent > timeout):
            raise EngineGoneError(
                f"{self._who}: the connection to the engine at {self.endpoint} was lost "
                f"{now - down:.1f} s ago and not re-established to the same engine (nothing "
                f"heard for {silent:.1f} s; heartbeat timeout {timeout:g} s): it died, is "
                f"frozen, or the network to it is down; restart the worker group once the "
                f"engine is back (FD_SYNC_HEARTBEAT_TIMEOUT sets the bound)")
        if down is None and self.heartbeat.stalled(silent):
            raise EngineGoneError(
                f"{self._who}: the engine at {self.endpoint} keeps its connection alive but "
                f"has sent nothing for {silent:.1f} s (stall timeout "
                f"{self.heartbeat.stall_timeout:g} s): it hangs; restart it and the worker "
                f"group (FD_SYNC_STALL_TIMEOUT sets the bound)")

    def silent_s(self) -> float:
        return time.monotonic() - self.last_heard

    def _unreachable_message(self, waited) -> str:
        if ipc_path(self.endpoint) is not None:
            check = ("is the engine (TaskQueue) running on this node with the same name, "
                     "dp_id and FD_SYNC_IPC_DIR?")
        else:
            check = ("is the engine (TaskQueue) running and listening there, and can this "
                     "node reach it (firewall, address)?")
        if self.ever_connected:
            what = ("a connection was made, but nothing there welcomed this rank (another "
                    "program holds the endpoint, or the engine refuses to serve a second "
                    "worker group while another one is alive)")
        else:
            what = "no connection could be made"
        return (f"{self._who}: no engine welcomed this worker at {self.endpoint} within "
                f"{waited:.1f} s ({what}): {check} (FD_SYNC_CONNECT_TIMEOUT="
                f"{self.connect_timeout:g} s sets the bound; the engine may start after the "
                f"workers, within it)")
