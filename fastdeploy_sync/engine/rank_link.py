"""What the engine knows of each rank of its current worker group (``RankLink``): the
connection's state (``NEVER``, ``CONNECTED``, ``DISCONNECTED``), when it was last heard
from, what was sent to it, and when its silence retires the group under the rules of
``wire.liveness``. Engine only: the I/O thread keeps one per rank (``membership``)."""

import time
from typing import Optional

from ..wire.liveness import Heartbeat, id_tag

__all__ = ["RankLink", "NEVER", "CONNECTED", "DISCONNECTED"]

NEVER = "never connected"
CONNECTED = "connected"
DISCONNECTED = "disconnected"


class RankLink:
    """What the engine knows of one rank of its current worker group (I/O thread only,
    except ``describe``/``snapshot``, which read plain attributes).

    ``state`` is ``NEVER`` until the rank's HELLO is accepted, ``CONNECTED`` while its
    connection is up, ``DISCONNECTED`` once the connection went away (``since`` and
    ``reason`` say when and why; ``gone_at`` is when the engine saw it, monotonic). A
    rank that reconnects (HELLO from the same worker) is ``CONNECTED`` again.
    """

    __slots__ = ("rank", "state", "worker", "identity", "since", "last_heard", "sent",
                 "reason", "gone_at", "probed_at")

    def __init__(self, rank: int):
        self.rank = rank
        self.state = NEVER
        self.worker = 0  # the worker instance id that holds this rank (a secret: id_tag)
        # its data socket's ZeroMQ routing id, None when unreachable
        self.identity: Optional[bytes] = None
        self.since: Optional[float] = None  # wall-clock time of the last state change
        self.last_heard = 0.0  # monotonic time of the last message from this worker
        self.sent = 0  # highest (global) seq sent to this rank's data socket
        self.reason = ""
        self.gone_at: Optional[float] = None  # monotonic time the engine saw the connection go
        self.probed_at = 0.0  # monotonic time of the last probe (a send that fails if gone)

    def connect(self, identity: bytes, worker: int, now: float) -> None:
        if self.state != CONNECTED or self.worker != worker:
            self.since = time.time()
        self.state, self.worker, self.identity, self.last_heard = CONNECTED, worker, identity, now
        self.reason, self.gone_at = "", None

    def heard(self, now: float) -> None:
        self.last_heard = now

    def disconnect(self, reason: str, now: Optional[float] = None) -> None:
        """The connection went away (or the rank is no longer served)."""
        if self.state == CONNECTED:
            self.state, self.since, self.reason = DISCONNECTED, time.time(), reason
        if self.identity is not None:
            self.identity = None
            self.gone_at = time.monotonic() if now is None else now

    def silent_for(self, now: float) -> float:
        return now - self.last_heard

    def retire_at(self, heartbeat: Heartbeat) -> float:
        """When (monotonic) this rank's state retires its group unless something is heard
        first: connection gone and nothing heard for ``timeout`` (at the earliest one
        ``interval`` after the engine saw it go); connection up and nothing heard for
        ``stall_timeout`` (never when that is 0). ``inf`` for a rank never connected."""
        if self.state == NEVER:
            return float("inf")
        if self.identity is None:
            return max(self.last_heard + heartbeat.timeout,
                       (self.gone_at or 0.0) + heartbeat.interval)
        if heartbeat.stall_timeout:
            return self.last_heard + heartbeat.stall_timeout
        return float("inf")

    def describe(self) -> str:
        if self.state == NEVER:
            return NEVER
        if self.state == CONNECTED:
            return CONNECTED
        return f"disconnected since {time.strftime('%H:%M:%S', time.localtime(self.since))} ({self.reason})"

    def snapshot(self, now: float) -> dict:
        return {"rank": self.rank, "state": self.state, "since": self.since,
                "silent_s": None if self.state == NEVER else round(now - self.last_heard, 3),
                "worker": id_tag(self.worker) if self.worker else None,
                "reason": self.reason or None}
