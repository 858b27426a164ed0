"""Rate-limited logging for what peers make us say.

A peer that sends garbage or keeps getting rejected must not be able to flood the log
(each line costs the engine's I/O thread time and fills disks). One line per key (a peer,
a kind of problem) and interval; the lines that were held back are counted in the next
one. Exact counts always live in the owner's ``stats()``.
"""

import logging
import time

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """``log(key, level, msg, *args)`` emits at most one line per ``key`` every
    ``interval`` seconds, suffixed with how many were suppressed since the last one.
    Remembers at most ``max_keys`` keys (the oldest are forgotten), so a peer that keeps
    changing its identity cannot make this grow without bound. Not thread-safe: one per
    owning thread."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0, max_keys: int = 1024):
        self._logger = logger
        self._interval = interval
        self._max_keys = max_keys
        self._last: dict = {}  # key -> [monotonic time of the last line, suppressed since]

    def log(self, key, level: int, msg: str, *args) -> bool:
        """Log unless ``key`` logged within the interval; True if a line was written."""
        now = time.monotonic()
        entry = self._last.get(key)
        if entry is not None and now - entry[0] < self._interval:
            entry[1] += 1
            return False
        suppressed = entry[1] if entry is not None else 0
        if entry is None and len(self._last) >= self._max_keys:
            self._last.pop(next(iter(self._last)))
        self._last[key] = [now, 0]
        if suppressed:
            msg += f" ({suppressed} similar message(s) suppressed in the last {self._interval:g} s)"
        self._logger.log(level, msg, *args)
        return True
