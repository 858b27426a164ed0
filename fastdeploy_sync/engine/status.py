"""What a queue says of itself to whoever asks (``fastdeploy-sync status``, scrapers): the
engine's STATUS reply (``StatusReply``) and the asker's side (``query_status``).

A STATUS request is answered to anyone past authentication (CURVE on tcp, the private
directory on ipc): the same people who could run a worker. It carries no ids (only their
``liveness.id_tag``), and is rebuilt at most every ``_STATUS_CACHE_S``: a flood of requests
must not cost a JSON encoding each. The asker checks everything it is answered: a peer's
bytes are not trusted to be a status.
"""

import json
import time

import zmq

from ..errors import ProtocolError
from ..wire import codec
from ..wire.auth import ClientAuth
from ..wire.endpoints import check_ipc_endpoint, ipc_path
from ..wire.sockets import anon_rss_bytes, new_socket, trim_heap

__all__ = ["StatusReply", "query_status"]

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


# What query_status accepts: a STATUS reply is a few KiB (a TP=8 queue: ~2 KiB); a frame
# beyond this drops the connection, and a reply that makes this process hold more than
# _STATUS_INPUT_BOUND without completing (a peer that never sends its last frame, which
# libzmq buffers out of our sight) is abandoned.
_STATUS_MAX_BYTES = 4 << 20
_STATUS_INPUT_BOUND = 64 << 20
_STATUS_MAX_RANKS = 1 << 16


def query_status(endpoint: str, *, keys_dir: str = None, insecure_tcp: bool = None,
                 timeout: float = 2.0) -> dict:
    """Ask the live ``TaskQueue`` at ``endpoint`` for its ``status()``; the engine knows
    every rank's state and watermark whatever the TP coordinator (shared memory or
    paddle.distributed). tcp endpoints need the worker keys (``keys_dir`` or
    ``FD_SYNC_KEYS_DIR``), exactly as a ``TaskClient`` would.

    Blocks at most ``timeout`` seconds; raises ``TimeoutError`` naming the endpoint when no
    engine answers (none running, or the handshake failed), ``ProtocolError`` for a reply
    that is not a status: another message kind, more than two frames, a frame over 4 MiB,
    JSON that does not parse (or nests too deep), or a value that is not a status of the
    shape ``TaskQueue.status()`` gives (the result has every field the CLI prints, of the
    right type). A peer that streams a reply without ever finishing it makes this process
    hold at most ~64 MiB before the call gives up (``ProtocolError``), and that memory is
    given back."""
    path = ipc_path(endpoint)
    if path is not None:
        check_ipc_endpoint(path)
    auth = ClientAuth.load(endpoint, keys_dir, insecure_tcp)
    ctx = zmq.Context(io_threads=1)
    overrun = False
    try:
        sock = new_socket(ctx, zmq.DEALER)
        sock.setsockopt(zmq.MAXMSGSIZE, _STATUS_MAX_BYTES)
        if auth is not None:
            auth.apply(sock)
        sock.connect(endpoint)
        sock.send(codec.pack_header(codec.STATUS))
        deadline = time.monotonic() + timeout
        held = anon_rss_bytes()
        # in short slices: what an unfinished reply makes libzmq buffer is seen only as
        # memory, and a local peer can fill it at the memory's speed (a longer slice lets a
        # loaded machine's client hold far more than the bound before it looks)
        while not sock.poll(2):
            if anon_rss_bytes() - held > _STATUS_INPUT_BOUND:
                overrun = True
                raise ProtocolError(f"{endpoint} sent more than {_STATUS_INPUT_BOUND >> 20} MiB "
                                    f"without finishing a reply: not a fastdeploy_sync engine")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no TaskQueue answered at {endpoint} within {timeout:g} s "
                                   f"(none running there, or keys that do not match)")
        frames = [sock.recv()]
        while sock.getsockopt(zmq.RCVMORE):  # one frame at a time: the count is bounded too
            if len(frames) == 2:
                raise ProtocolError(f"{endpoint} answered with more than 2 frames")
            frames.append(sock.recv())
        header = codec.unpack_header(frames[0])
        if header.kind != codec.STATUS_REPLY or len(frames) != 2:
            raise ProtocolError(f"{endpoint} answered with message kind {header.kind} in "
                                f"{len(frames)} frame(s), not a status")
        try:
            status = json.loads(frames[1])
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise ProtocolError(f"{endpoint} answered with a status that is not JSON: "
                                f"{type(exc).__name__}") from None
        _check_status(status, endpoint)
        return status
    finally:
        ctx.destroy(linger=0)
        if overrun:
            trim_heap()


# The fields of a status the CLI reads, and their types (JSON: int, float, str, None).
_STATUS_FIELDS = {"name": str, "dp_id": int, "tp_size": int, "endpoint": str, "engine": str,
                  "pid": int, "last_seq": int, "retained": int, "max_inflight": int,
                  "group": (str, type(None)), "ranks": list}
_RANK_FIELDS = {"rank": int, "state": str, "consumed": int,
                "silent_s": (int, float, type(None)), "worker": (str, type(None)),
                "reason": (str, type(None))}


def _check_status(status, endpoint) -> None:
    """``ProtocolError`` unless ``status`` has the shape ``TaskQueue.status()`` gives."""
    def bad(what):
        return ProtocolError(f"{endpoint} answered with a status that is not a TaskQueue's: "
                             f"{what}")

    if not isinstance(status, dict):
        raise bad(f"a JSON {type(status).__name__}, not an object")
    for key, kind in _STATUS_FIELDS.items():
        if not isinstance(status.get(key), kind) or isinstance(status.get(key), bool):
            raise bad(f"field {key!r} missing or of the wrong type")
    if len(status["ranks"]) > _STATUS_MAX_RANKS:
        raise bad(f"{len(status['ranks'])} ranks")
    for rank in status["ranks"]:
        if not isinstance(rank, dict):
            raise bad("a rank that is not an object")
        for key, kind in _RANK_FIELDS.items():
            if not isinstance(rank.get(key), kind) or isinstance(rank.get(key), bool):
                raise bad(f"a rank's field {key!r} missing or of the wrong type")
