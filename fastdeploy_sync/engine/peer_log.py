"""What the engine says in its log about peers: rate-limited per peer address, so that a
peer that reconnects in a loop, or floods garbage, cannot flood the log."""

import logging

import zmq

from ..logs import RateLimitedLog

__all__ = ["PeerLog"]

log = logging.getLogger(__name__)


class PeerLog:
    """The log lines of one queue (``name``) about its peers. ``current``: the first frame
    (routing id) of the message being handled, set by whoever receives it (the I/O
    thread), so that a line names where the message came from. ``counters``: the queue's
    ``stats()`` counters (``garbage_frames``)."""

    def __init__(self, name, counters):
        self.name = name
        self.current = None
        self._counters = counters
        self._log = RateLimitedLog(log)

    def peer(self) -> str:
        """The address the current message came from (tcp: its IP; ipc: "local")."""
        try:
            return self.current.get("Peer-Address") or "local"
        except (zmq.ZMQError, AttributeError):
            return "unknown"

    def log(self, key, level, msg, *args) -> bool:
        """Log ``msg % args`` unless a line of ``key`` was logged within the interval."""
        return self._log.log(key, level, msg, *args)

    def garbage(self, exc) -> None:
        """The current message does not decode (``exc`` says why): counted, dropped, and
        logged at most once per interval and peer address."""
        self._counters["garbage_frames"] += 1
        peer = self.peer()
        self._log.log(("garbage", peer), logging.WARNING,
                      "TaskQueue %s: dropped an undecodable message from %s (%d so far): %s",
                      self.name, peer, self._counters["garbage_frames"], exc)
