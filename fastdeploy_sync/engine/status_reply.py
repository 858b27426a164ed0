"""The engine's side of STATUS (``StatusReply``): what a queue says of itself to whoever
asks (``fastdeploy-sync status``, scrapers; the asker's side is ``status_client``).

The reply carries no ids (only their ``liveness.id_tag``), and is rebuilt at most every
``_STATUS_CACHE_S``: a flood of requests must not cost a JSON encoding each.
"""

import json
import time

__all__ = ["StatusReply"]

# A STATUS reply is rebuilt at most this often (a status is for people and scrapers).
_STATUS_CACHE_S = 0.2


class StatusReply:
    """The queue's STATUS reply: ``status()`` (a callable returning the queue's status
    dict) as JSON, rebuilt at most every ``_STATUS_CACHE_S``. I/O thread only."""

    def __init__(self, status):
        self._status = status
        self._cache = (float("-inf"), b"")  # (when, the JSON)

    def __call__(self) -> bytes:
        now = time.monotonic()
        when, raw = self._cache
        if now - when >= _STATUS_CACHE_S:
            raw = json.dumps(self._status()).encode()
            self._cache = (now, raw)
        return raw
