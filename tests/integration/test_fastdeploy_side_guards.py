"""The drop-in's side channels (cache infos, finished requests, connect-rdma, disaggregated
tasks, the lock, the barriers) under the task path's guards: a peer that streams a message
it never finishes is cut and the memory comes back, whatever a request's argument raises
(even ``SystemExit``) is answered and the service goes on, a server that dies of an
uncaught exception leaves no socket file, and a barrier wait that runs out breaks that
round only. Real server processes, raw ZMTP peers, real clients."""

import glob
import os
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from engine_peers import endless_peer
from fastdeploy_sync import envs
from fastdeploy_sync.fastdeploy import EngineWorkerQueue
from fastdeploy_sync.fastdeploy.links import RemoteLink
from fastdeploy_sync.wire.endpoints import default_endpoint, ipc_path
from fd_workers import barrier_messager
from workers import wait_until

RESULT_TIMEOUT_S = 60

# A drop-in server whose own process asks its side channels (over the socket, as another
# process would) every 10 ms and prints "<anon RSS MiB> <answers>" every 0.1 s until killed.
_SERVER = textwrap.dedent("""
    import sys, threading, time
    from fastdeploy_sync.fastdeploy import EngineWorkerQueue
    from fastdeploy_sync.fastdeploy.links import RemoteLink
    from fastdeploy_sync.wire.endpoints import default_endpoint
    from fastdeploy_sync.wire.sockets import anon_rss_bytes
    name = sys.argv[1]
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=1, name=name)
    link = RemoteLink(default_endpoint(name, 0, "side"), timeout=30)
    answers = [0]
    def ask():
        while True:
            link.call("num_cache_infos", 0, 0)
            answers[0] += 1
            time.sleep(0.01)
    threading.Thread(target=ask, daemon=True).start()
    while True:
        time.sleep(0.1)
        print(anon_rss_bytes() >> 20, answers[0], flush=True)
    """)


@pytest.mark.serial
def test_an_endless_message_to_the_side_channels_is_cut(name):
    """3 s of an unfinished message at full speed to the side endpoint: the server's heap
    stays within a few hundred MiB of its start (before: it grew by the peer's whole
    stream, 1.5 GiB in 5 s), the peer is cut, the heap comes back, and the side channels
    answer throughout. The bound: the task path's 128 MiB of unfinished input (whatever
    FD_SYNC_MAX_MESSAGE_MB, 1 GiB by default, allows per message)."""
    server = subprocess.Popen([sys.executable, "-c", _SERVER, name], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    samples = []
    reader = threading.Thread(target=lambda: [samples.append(tuple(map(int, line.split())))
                                              for line in server.stdout], daemon=True)
    reader.start()
    try:
        wait_until(lambda: len(samples) >= 5, timeout=30, interval=0.05,
                   what="five heap samples from the server",
                   seen=lambda: (samples, server.stderr.read() if server.poll() is not None else ""))
        start_heap, start_answers = samples[-1]
        sent, cut = endless_peer(ipc_path(default_endpoint(name, 0, "side")), 60000, 3.0)
        during = list(samples)
        time.sleep(1.5)  # the cut peer's buffers freed and trimmed
        assert server.poll() is None, server.stderr.read()
        peak = max(heap for heap, _ in during) - start_heap
        print(f"side channels: sent {sent} MiB, heap peak +{peak} MiB, after "
              f"+{samples[-1][0] - start_heap} MiB, {samples[-1][1] - start_answers} answers")
        assert cut, f"sent {sent} MiB and was never cut; heap +{peak} MiB"
        assert peak < 768, f"heap grew by {peak} MiB while {sent} MiB were sent"
        assert samples[-1][0] - start_heap < 64, (samples[-1], start_heap)
        assert during[-1][1] > start_answers  # answered during the stream
        assert samples[-1][1] > during[-1][1]  # and after it
    finally:
        server.kill()
        server.wait(timeout=30)
        reader.join(timeout=10)
        server.stdout.close()
        server.stderr.close()
        for path in glob.glob(os.path.join(envs.ipc_dir(), f"fdsync-{name}-*")):
            os.unlink(path)
        for leftover in os.listdir("/dev/shm"):
            if name in leftover:
                os.unlink("/dev/shm/" + leftover)


class _ExitsWhenUnpickled:
    """Pickles fine; unpickling it raises SystemExit."""

    def __reduce__(self):
        return sys.exit, ("a side-channel request ended the thread that unpickled it",)


class _InterruptsWhenIndexed:
    """Decodes fine; the operation's first look at it raises KeyboardInterrupt."""

    def __getitem__(self, index):
        raise KeyboardInterrupt("an argument's method interrupted the side channels")


class _ExitsWhenSentBack:
    """Pickles fine until ``armed``; then pickling it (the reply that carries it) raises
    SystemExit."""

    armed = False

    def __reduce__(self):
        if type(self).armed:
            raise SystemExit("a side-channel reply ended the thread that encoded it")
        return _ExitsWhenSentBack, ()


def test_whatever_a_request_raises_the_service_answers_the_next(name):
    """A request whose argument raises SystemExit when unpickled (before: it ended the
    service thread, and every later side-channel call of every client failed after its
    wait with "no answer ... is the server running?"), one whose argument raises
    KeyboardInterrupt inside the operation, one whose result raises SystemExit when
    encoded: each is answered with an error, and the next request is served."""
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=1, name=name)
    link = RemoteLink(default_endpoint(name, 0, "side"), timeout=10)
    try:
        with pytest.raises(RuntimeError, match="SystemExit"):
            link.call("put_disaggregated_tasks", 0, 0, _ExitsWhenUnpickled())
        assert link.call("num_cache_infos", 0, 0) == 0
        with pytest.raises(RuntimeError, match="KeyboardInterrupt"):
            link.call("put_finished_req", 0, 0, _InterruptsWhenIndexed())
        assert link.call("disaggregate_queue_empty", 0, 0) is True
        link.call("put_disaggregated_tasks", 0, 0, _ExitsWhenSentBack())
        _ExitsWhenSentBack.armed = True
        with pytest.raises(TypeError, match="SystemExit"):
            link.call("get_disaggregated_tasks", 0, 0)
        link.call("put_disaggregated_tasks", 0, 0, "still served")
        assert server.get_disaggregated_tasks() == ["still served"]
    finally:
        _ExitsWhenSentBack.armed = False
        link.close()
        server.cleanup()


def test_over_tcp_nothing_an_unauthenticated_peer_sends_is_decoded(tmp_path):
    """Across nodes the side channels are CURVE-authenticated before anything is decoded:
    a peer without CURVE (a plain ZeroMQ DEALER, as any host that reaches the port could
    run) sends a well-formed request carrying a pickle that would end the thread that
    unpickles it; it gets no answer, nothing of it reaches a channel, and a client with
    the keys is served."""
    import zmq

    from fastdeploy_sync.fastdeploy.channels import OPERATIONS
    from fastdeploy_sync.wire.auth import create_keys
    from fastdeploy_sync.wire.codec import encode_payload, payload_checksum

    keys = tmp_path / "keys"
    create_keys(keys)
    server = EngineWorkerQueue(address=("127.0.0.1", 0), is_server=True, num_client=1,
                               keys_dir=str(keys))
    ctx = zmq.Context()
    try:
        endpoint = f"tcp://127.0.0.1:{server.get_server_port() + 4096}"
        frames = encode_payload(_ExitsWhenUnpickled())
        header = struct.pack("<4sHhiQQ", b"FDS1", OPERATIONS.index("put_disaggregated_tasks"),
                             0, 0, 1, payload_checksum(frames))  # links' request header
        plain = ctx.socket(zmq.DEALER)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(endpoint)
        plain.send_multipart([header, *frames])
        assert not plain.poll(1000)
        link = RemoteLink(endpoint, keys_dir=str(keys), timeout=10)
        try:
            assert link.call("disaggregate_queue_empty", 0, 0) is True
            link.call("put_disaggregated_tasks", 0, 0, "from a client with the keys")
        finally:
            link.close()
        assert server.get_disaggregated_tasks() == ["from a client with the keys"]
    finally:
        ctx.destroy(linger=0)
        server.cleanup()


_DIES = textwrap.dedent("""
    import sys
    from fastdeploy_sync.fastdeploy import EngineWorkerQueue
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=1,
                               name=sys.argv[1])
    print("built", flush=True)
    raise RuntimeError("the engine failed")
    """)


def test_a_server_that_dies_of_an_uncaught_exception_leaves_nothing(name):
    """docs/index.md: normal process exit removes every name; an uncaught exception is one
    (its exit handlers run). Before: the side-channel socket file stayed."""
    done = subprocess.run([sys.executable, "-c", _DIES, name], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip() == "built", done.stderr
    assert done.returncode == 1 and "the engine failed" in done.stderr, done.stderr
    left = (glob.glob(os.path.join(envs.ipc_dir(), f"fdsync-{name}-*"))
            + glob.glob(f"/dev/shm/*{name}*"))
    assert not left, left


def test_a_barrier_wait_that_runs_out_breaks_that_round_only(name, procs, results,
                                                             monkeypatch):
    """Two cache messagers; one arrives at round 1 after the other's wait ran out
    (FD_SYNC_SIDE_WAIT_S=1), and the one on time goes on to round 2 at once. Round 1 is
    broken for both (the late one learns it when it comes), rounds 2 and 3 pass for both:
    no party is a round off and nobody resets the barrier (FastDeploy never does). Before:
    the barrier stayed broken, every later round failed."""
    monkeypatch.setenv("FD_SYNC_SIDE_WAIT_S", "1")
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=2, name=name)
    try:
        address = ("0.0.0.0", server.get_server_port())
        procs(barrier_messager, address, 2, 0, results, name=name)
        procs(barrier_messager, address, 2, 1, results, name=name, late_s=3.0)
        outcomes = {}
        for _ in range(2):
            kind, _, rank, value = results.get(timeout=RESULT_TIMEOUT_S)
            assert kind == "barrier", value
            outcomes[rank] = value
        assert outcomes[0] == outcomes[1] == ["ok", "broken", "ok", "ok"], outcomes
    finally:
        server.cleanup()


def test_a_late_party_fills_its_round_and_reset_still_breaks_it(name):
    """In one process, with explicit timeouts: a party that gave up on a round and waits
    again is counted in the next round, not the open one; the late party's arrival ends
    the broken round; ``reset()`` breaks the open round for its waiter and the next one
    passes; ``abort()`` breaks every round until ``reset()``."""
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=2, name=name)
    try:
        address = ("0.0.0.0", server.get_server_port())
        a, b = (EngineWorkerQueue(address=address, num_client=2, client_id=r, name=name)
                for r in range(2))
        ba, bb = a.finish_send_cache_barrier, b.finish_send_cache_barrier
        out = []

        def party_a():  # a party is a thread: its rounds are its waits
            out.append(_broken(ba.wait, 0.1))  # round 0: b does not come in time
            out.append(ba.wait(30))  # round 1, at once: counted there, not in round 0

        t = threading.Thread(target=party_a)
        t.start()
        wait_until(lambda: out, timeout=30, what="the waiter on the broken barrier to return")
        assert out == [True] and bb.broken
        with pytest.raises(threading.BrokenBarrierError):
            bb.wait(30)  # round 0, late: broken for it too, at once
        assert not bb.broken
        bb.wait(30)  # round 1, with a
        t.join(30)
        assert not t.is_alive() and out[1] in (0, 1)

        failed = []
        t = threading.Thread(target=lambda: failed.append(_broken(ba.wait, 30)))
        t.start()
        wait_until(lambda: bb.n_waiting == 1, timeout=30, what="one thread waiting in bb",
                   seen=lambda: bb.n_waiting)
        bb.reset()
        t.join(30)
        assert failed == [True]
        t = threading.Thread(target=lambda: out.append(ba.wait(30)))
        t.start()
        bb.wait(30)  # the round after the reset passes
        t.join(30)
        assert len(out) == 3

        ba.abort()
        assert bb.broken and _broken(bb.wait, 30) and _broken(ba.wait, 30)
        ba.reset()
        assert not bb.broken
    finally:
        server.cleanup()


def _broken(wait, timeout):
    try:
        wait(timeout)
    except threading.BrokenBarrierError:
        return True
    return False
