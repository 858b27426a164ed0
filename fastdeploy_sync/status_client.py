"""Asking a queue for its status: what ``fastdeploy-sync status`` and scrapers run
(``query_status``, and ``query_status_isolated``: the same ask in a capped child process).
Not the engine: the engine's side of STATUS is ``engine.status_reply``.

A STATUS request is answered to anyone past authentication (CURVE on tcp, the private
directory on ipc): the same people who could run a worker. It carries no ids (only their
``liveness.id_tag``). The asker checks everything it is answered: a peer's bytes are not
trusted to be a status.
"""

import json
import os
import resource
import select
import signal
import time
from typing import Any, Optional

import zmq

from .errors import ProtocolError, TaskSyncError
from .wire import codec
from .wire.auth import ClientAuth
from .wire.endpoints import check_ipc_endpoint, ipc_path
from .wire.sockets import anon_rss_bytes, new_socket, trim_heap

__all__ = ["query_status", "query_status_isolated"]

# What query_status accepts: a STATUS reply is a few KiB (a TP=8 queue: ~2 KiB); a frame
# beyond this drops the connection, and a reply that makes this process hold more than
# _STATUS_INPUT_BOUND without completing (a peer that never sends its last frame, which
# libzmq buffers out of our sight) is abandoned.
_STATUS_MAX_BYTES = 4 << 20
_STATUS_INPUT_BOUND = 64 << 20
# An ask that got no reply while this process's peak memory rose by more than this (two
# maximum frames and libzmq's own, with room) was sent a reply that was dropped unfinished.
_STATUS_ABANDONED_BOUND = 32 << 20
_STATUS_MAX_RANKS = 1 << 16


def query_status(endpoint: str, *, keys_dir: Optional[str] = None,
                 insecure_tcp: Optional[bool] = None, timeout: float = 2.0) -> dict:
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
        peak = _peak_rss_bytes()
        # in short slices: what an unfinished reply makes libzmq buffer is seen only as
        # memory, and a local peer can fill it at the memory's speed (a longer slice lets a
        # loaded machine's client hold far more than the bound before it looks)
        while not sock.poll(2):
            if anon_rss_bytes() - held > _STATUS_INPUT_BOUND:
                overrun = True
                raise ProtocolError(f"{endpoint} sent more than {_STATUS_INPUT_BOUND >> 20} MiB "
                                    f"without finishing a reply: not a fastdeploy_sync engine")
            if time.monotonic() >= deadline:
                grown = _peak_rss_bytes() - peak
                if grown > _STATUS_ABANDONED_BOUND:
                    # a reply grew this process and was dropped unfinished (the peer hung
                    # up, or libzmq's allocation was refused under query_status_isolated's
                    # cap): not a quiet endpoint
                    overrun = True
                    raise ProtocolError(f"{endpoint} sent {grown >> 20} MiB or more without "
                                        f"finishing a reply, then it was dropped: not a "
                                        f"fastdeploy_sync engine")
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


# query_status_isolated's child may grow its data segment by this much past what it holds
# when it forks: query_status's own bound, libzmq's I/O thread and its buffers, with room.
_CHILD_DATA_HEADROOM = 192 << 20


def query_status_isolated(endpoint: str, *, keys_dir: Optional[str] = None,
                          insecure_tcp: Optional[bool] = None, timeout: float = 2.0) -> dict:
    """``query_status`` in a forked child whose data segment is capped (``RLIMIT_DATA``, what
    it holds plus ~192 MiB): the same result and the same exceptions, but a peer that streams
    a reply it never finishes cannot make this process or the child hold more, however the
    machine schedules the threads. ``query_status`` watches its memory every 2 ms, and a
    local peer fills memory faster than a descheduled watcher looks; libzmq has no bound on
    an unfinished multipart message, and aborts the process when an allocation fails, so the
    hard bound needs a process of its own.

    For single-threaded callers (the CLI): it forks. Blocks at most ``timeout`` + 5 s (the
    child is killed and reaped then, and on any exception here, KeyboardInterrupt
    included). A signal this process handles in Python (Ctrl-C's KeyboardInterrupt) that
    arrives while it forks is held until the fork is done, then raised here as at any other
    moment. Raises what ``query_status`` raises, of the same kind (``TimeoutError``,
    ``ProtocolError``, other ``TaskSyncError``, ``OSError`` and its common subclasses,
    ``ValueError``; anything else as a ``TaskSyncError`` naming it), and ``ProtocolError``
    naming the endpoint when the child ends without an answer (the cap reached)."""
    # The signals this process handles in Python are held (blocked) across the fork: a
    # handler that raises (KeyboardInterrupt on Ctrl-C) must not run inside os.fork, where
    # the modules' at-fork hooks run (logging's, for one) and an exception in a hook is
    # printed as "Exception ignored" and dropped: the Ctrl-C would be lost. Held, the
    # signal is delivered when the mask is restored, in the try below (parent) or in the
    # child's (which then ends, status 1).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())  # the current mask, unchanged
    reader = writer = None
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, _handled_signals())
        reader, writer = os.pipe()
        pid = os.fork()
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for fd in (reader, writer):
            if fd is not None:
                os.close(fd)
        raise
    if pid == 0:  # the child: never returns
        code = 0
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            os.close(reader)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)  # libzmq's "out of memory" line is the parent's to word
            held = _data_bytes()
            if held:
                limit = held + _CHILD_DATA_HEADROOM
                resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
            answer: Any  # the status, or the error's kind and message
            try:
                answer = {"status": query_status(endpoint, keys_dir=keys_dir,
                                                 insecure_tcp=insecure_tcp, timeout=timeout)}
            except MemoryError:
                raise  # the cap: no answer, the parent words it
            except Exception as exc:  # noqa: BLE001 - passed on to the parent by kind
                kind = next((k for k in _FORWARDED if isinstance(exc, _FORWARDED[k])), "")
                answer = {"error": kind or type(exc).__name__, "message": str(exc)}
            view = memoryview(json.dumps(answer).encode())
            while view:
                view = view[os.write(writer, view):]
        except BaseException:  # noqa: BLE001 - the child reports by its exit status only
            code = 1
        finally:
            os._exit(code)
    os.close(writer)
    data = None
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a held Ctrl-C raises here
        data = _read_all(reader, time.monotonic() + timeout + 5.0)
    finally:  # also on KeyboardInterrupt: the child never outlives the call
        os.close(reader)
        if data is None:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    if data is None:
        raise TimeoutError(f"asking {endpoint} did not end within {timeout + 5.0:g} s")
    try:
        answer = json.loads(data)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        code = os.waitstatus_to_exitcode(status)
        raise ProtocolError(f"{endpoint} sent more than the "
                            f"{_CHILD_DATA_HEADROOM >> 20} MiB this asker may hold without "
                            f"finishing a reply: not a fastdeploy_sync engine (the asking "
                            f"process ended without an answer, status {code})")
    if "status" in answer:
        return answer["status"]
    kind, message = str(answer.get("error")), str(answer.get("message"))
    if kind in _FORWARDED:
        raise _FORWARDED[kind](message)
    raise TaskSyncError(f"asking {endpoint} failed: {kind}: {message}")


# What query_status_isolated passes on from its child as the same kind (most specific
# first); anything else becomes a TaskSyncError that names it.
_FORWARDED: dict[str, type]
_FORWARDED = {"TimeoutError": TimeoutError, "ProtocolError": ProtocolError,
              "TaskSyncError": TaskSyncError, "PermissionError": PermissionError,
              "FileNotFoundError": FileNotFoundError, "OSError": OSError,
              "ValueError": ValueError}


def _handled_signals() -> set:
    """The signals whose disposition is a Python handler (SIGINT's default_int_handler,
    whatever the caller installed): those whose handler may raise."""
    return {sig for sig in signal.valid_signals() if callable(signal.getsignal(sig))}


def _peak_rss_bytes() -> int:
    """This process's peak resident memory so far (``ru_maxrss``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10


def _data_bytes() -> int:
    """This process's data segment (``VmData``, what ``RLIMIT_DATA`` counts); 0 if unknown."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmData:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _read_all(fd: int, deadline: float):
    """Everything written to ``fd`` until its writer closes it, or None past ``deadline``."""
    chunks: list = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)  # retried on EINTR (PEP 475)
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


# The fields of a status the CLI reads, and their types (JSON: int, float, str, None).
_STATUS_FIELDS: dict  # field -> the type (or tuple of types) isinstance() accepts
_STATUS_FIELDS = {"name": str, "dp_id": int, "tp_size": int, "endpoint": str, "engine": str,
                  "pid": int, "last_seq": int, "retained": int, "max_inflight": int,
                  "group": (str, type(None)), "ranks": list}
_RANK_FIELDS: dict
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
