"""TaskClient: failures are loud, idle costs nothing, payloads are zero-copy, misuse is caught."""

import time

import numpy as np
import pytest
import zmq

from fastdeploy_sync import (
    EngineClosedError,
    EngineRejectedError,
    PrefetchError,
    TaskClient,
    TaskQueue,
)
from fastdeploy_sync.wire import codec
from workers import (
    Exploding,
    collect,
    failing_prefetch_rank,
    idle_rank,
    make_batch,
    scripted_rank,
    wait_until,
)

pytestmark = pytest.mark.usefixtures("loopback_tcp")


@pytest.mark.parametrize("async_prefetch", [True, False], ids=["async", "sync"])
def test_a_batch_that_does_not_decode_fails_loudly(name, procs, results, async_prefetch):
    from conftest import SPAWN

    leave = SPAWN.Event()
    with TaskQueue(name, 2) as queue:
        for rank in range(2):
            procs(failing_prefetch_rank, results, rank, name, 2, async_prefetch, leave)
        collect(results, "ready", 2)  # both in the group before rank 0 can fail and leave
        queue.put_tasks(Exploding(), timeout=5)
        try:
            raised = collect(results, "raised", 2)
        finally:
            leave.set()
    for rank in range(2):
        errors, logged = raised[rank]
        # reported once: by the raise (the original error, with its traceback, chained as
        # __cause__), not also by a logged traceback
        assert logged == 0
        assert all(e[3] for e in errors if e[1]), "the original error lost its traceback"
        # A rank waiting in the barrier may first learn that its peer stopped (it will
        # never arrive) before its own prefetch thread has decoded the batch; its own
        # failure is raised by the next call, and by every call after it.
        own = [e for e in errors if e[0] != "BarrierTimeoutError"]
        assert len(own) == 2 and errors[-2:] == own, f"rank {rank} raised {errors}"
        for peer_stopped in errors[:-2]:
            assert f"rank {1 - rank} of the group stopped at an error" in peer_stopped[2]
        if async_prefetch:
            # every call after the failure raises, chained to the original error
            assert all(e[:2] == ("PrefetchError", "ProtocolError") for e in own), errors
        else:
            # sync mode: the failing call raises the original, later calls PrefetchError
            assert own[0][0] == "ProtocolError", errors
            assert all(e[:2] == ("PrefetchError", "ProtocolError") for e in own[1:]), errors
        assert "cannot be rebuilt" in own[-1][2] or "does not decode" in own[-1][2]


def test_idle_worker_burns_no_cpu(name, procs, results):
    """The prefetch thread blocks in poll (GIL released): no busy loop. Robust bound: the
    thread itself is expected at ~0 ticks; 5 % of a core would already be a spinning bug."""
    from conftest import SPAWN

    seconds = 2.0
    leave = SPAWN.Event()
    with TaskQueue(name, 2):
        for rank in range(2):
            procs(idle_rank, results, rank, name, 2, seconds, leave)
        try:
            cpu = collect(results, "cpu", 2)
        finally:
            leave.set()
    for rank, (thread_s, process_s, wall_s) in cpu.items():
        assert thread_s <= 0.05 * wall_s, f"rank {rank} prefetch thread used {thread_s}s"
        assert process_s <= 0.05 * wall_s, f"rank {rank} process used {process_s}s"


def test_numpy_payloads_decode_zero_copy():
    requests = [{"id": i, "tokens": np.arange(512, dtype=np.int64) + i} for i in range(64)]
    frames = codec.encode_payload((requests, 64))
    assert len(frames) == 3  # body, offsets, one data frame holding every array
    ctx = zmq.Context()
    try:
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        a.bind("inproc://zero-copy")
        b.connect("inproc://zero-copy")
        a.send_multipart(frames)
        assert b.poll(5000)
        received = b.recv_multipart(copy=False)
        decoded, bsz = codec.decode_payload(received)
        offsets = np.frombuffer(received[1].buffer, dtype=np.int64)
        assert all(offsets[0::2] % 64 == 0)  # each array starts on a cache line of the frame
        assert bsz == 64
        for i, request in enumerate(decoded):
            tokens = request["tokens"]
            np.testing.assert_array_equal(tokens, requests[i]["tokens"])
            assert not tokens.flags.writeable, "zero-copy views must be read-only"
            assert not tokens.flags.owndata
            # the array's memory is the received frame's memory: no copy was made
            frame = np.frombuffer(received[2].buffer, dtype=np.uint8)
            assert np.shares_memory(tokens, frame)
    finally:
        ctx.destroy(linger=0)


def test_get_tasks_on_some_ranks_only_is_a_protocol_error(name, procs, results):
    """Rank 1 skips get_tasks() on step 0 while rank 0 takes: at step 1 the ranks' histories
    differ and rank 1 must say so instead of silently taking different batches."""
    with TaskQueue(name, 2) as queue:
        procs(scripted_rank, results, 0, name, 2, 2)
        procs(scripted_rank, results, 1, name, 2, 2, (0,))
        collect(results, "ready", 2)
        queue.put_tasks("first", timeout=5)
        # step 0 is over once rank 0 has taken "first" (rank 1 skips its take)
        assert wait_until(lambda: queue.stats()["consumed"][0] == 1)
        queue.put_tasks("second", timeout=5)
        raised = collect(results, "raised", 2)
    kind, message, _ = raised[1]
    assert kind == "ProtocolError", raised
    assert "get_tasks() must be called on every rank" in message


def test_engine_rejects_a_worker_with_another_tp_size(name):
    with TaskQueue(name, 2):
        with TaskClient(name, 1, 0) as client:
            error = _first_error(client)
    assert isinstance(error, PrefetchError)
    assert isinstance(error.__cause__, EngineRejectedError)
    assert "tp_size=1 does not match" in str(error.__cause__)


def test_engine_rejects_a_worker_with_another_name(name):
    with TaskQueue(name, 1, endpoint="tcp://127.0.0.1:0") as queue:
        with TaskClient(name + "x", 1, 0, endpoint=queue.endpoint) as client:
            error = _first_error(client)
    assert "does not serve the queue name" in str(error.__cause__)


def test_tp1_in_process_round_trip(name):
    with TaskQueue(name, 1) as queue, TaskClient(name, 1, 0) as client:
        queue.put_tasks(make_batch(0), timeout=5)
        queue.put_tasks(make_batch(1), timeout=5)
        assert wait_until(lambda: client.num_tasks() == 2)
        assert client.exist_tasks()
        tasks, read_finished = client.get_tasks()
        assert [b for b, _ in tasks] == [0, 1] and read_finished
        assert client.get_tasks() == ([], True)  # nothing twice
        assert wait_until(lambda: queue.num_tasks() == 0)


def test_async_mode_follows_the_environment(name, monkeypatch):
    monkeypatch.setenv("DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM", "1")
    with TaskClient(name, 1, 0) as client:
        # no prefetch thread: only the heartbeat thread, which never touches the data socket
        assert client.async_prefetch is False and client.prefetch_cpu_seconds() is None
        assert "heartbeat" in client._background.thread.name
    monkeypatch.setenv("DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM", "0")
    with TaskClient(name, 1, 0) as client:
        assert client.async_prefetch is True and client._background.thread.is_alive()
    monkeypatch.setenv("DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM", "maybe")
    with pytest.raises(ValueError, match="DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM"):
        TaskClient(name, 1, 0)


@pytest.mark.parametrize("env,argument,expect_async",
                         [(None, None, True), ("0", None, True), ("1", None, False),
                          ("1", True, True), (None, False, False)],
                         ids=["default", "env-0", "env-1", "argument-true", "argument-false"])
def test_the_barrier_waits_the_way_of_the_mode_however_it_was_chosen(
        name, monkeypatch, env, argument, expect_async):
    """Async mode: the barrier's wait lets the event loop take what its prefetch thread has
    not (on_wait) and never polls the socket itself; sync mode: the wait keeps receiving
    (service). Whether the mode came from the argument or from
    DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM (the default, async_prefetch=None)."""
    from fastdeploy_sync.tp.solo import SoloGroup

    calls = []
    monkeypatch.setattr(SoloGroup, "barrier",
                        lambda self, timeout=None, hooks=None:
                        calls.append((hooks.service, hooks.on_wait)))
    if env is None:
        monkeypatch.delenv("DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM", raising=False)
    else:
        monkeypatch.setenv("DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM", env)
    with TaskClient(name, 1, 0, async_prefetch=argument) as client:
        assert client.async_prefetch is expect_async
        client.barrier(timeout=5)
        ((service, on_wait),) = calls
        if expect_async:
            assert service is None and on_wait == client._receiver.drain
        else:
            assert service == client._receiver.receive_in_wait and on_wait is None


def _first_error(client, timeout=10.0):
    """The first exception ``client.exist_tasks()`` raises (exceptions are truthy)."""
    def raised():
        try:
            client.exist_tasks()
        except Exception as exc:
            return exc
        return None

    return wait_until(raised, timeout=timeout, interval=0.01, what="the client to raise")


def test_importing_the_package_does_not_import_paddle(name):
    """paddle costs ~1 s and ~390 MB: only coordinator='paddle' may import it."""
    import subprocess
    import sys

    code = ("import sys, fastdeploy_sync\n"
            f"with fastdeploy_sync.TaskQueue({name!r}, 2) as q:\n"
            "    pass\n"
            "assert 'paddle' not in sys.modules, 'paddle was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("async_prefetch", [True, False], ids=["async", "sync"])
def test_calls_after_close_raise_closed_error(name, async_prefetch):
    from fastdeploy_sync import ClosedError

    with TaskQueue(name, 1):
        client = TaskClient(name, 1, 0, async_prefetch=async_prefetch)
        client.close()
        client.close()  # idempotent
        for call in (client.exist_tasks, client.barrier, client.get_tasks, client.num_tasks,
                     client.sync_step):
            with pytest.raises(ClosedError, match="is closed"):
                call()


@pytest.mark.parametrize("async_prefetch", [True, False], ids=["async", "sync"])
def test_a_closed_engine_is_reported_after_everything_sent_was_taken(name, async_prefetch):
    """close() drains, then tells the workers: they take what was sent, then raise
    EngineClosedError (not EngineGoneError), and a new engine of the same name is never
    spliced into their stream."""
    first = TaskQueue(name, 1)
    try:
        with TaskClient(name, 1, 0, async_prefetch=async_prefetch) as client:
            first.put_tasks("from the first engine", timeout=5)
            assert wait_until(lambda: client.num_tasks() == 1)
            assert client.exist_tasks() and client.get_tasks()[0] == ["from the first engine"]
            assert first.close(timeout=5) == []
            error = _first_error(client)
            assert isinstance(error, EngineClosedError), repr(error)
            with TaskQueue(name, 1) as second:
                second.put_tasks("from the second engine", timeout=5)
                time.sleep(0.3)
                with pytest.raises(EngineClosedError):
                    client.exist_tasks()
                assert second.stats()["consumed"] == [0]  # nothing of it was taken
    finally:
        first.close()


def _stand_in_engine(ctx, endpoint):
    """A ROUTER that speaks just enough of the engine's side to welcome one worker."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    return router


def _recv_from_worker(router, kind, timeout_ms=5000):
    deadline = time.monotonic() + timeout_ms / 1000
    while time.monotonic() < deadline:
        if router.poll(100):
            identity, header, *rest = router.recv_multipart()
            h = codec.unpack_header(header)
            if h.kind == kind:
                return identity, h, rest
    raise AssertionError(f"no message of kind {kind} from the worker")


@pytest.mark.parametrize("async_prefetch", [True, False], ids=["async", "sync"])
def test_close_says_bye_with_the_last_seq_taken(name, async_prefetch):
    """TaskClient.close() tells the engine at once (BYE, with the usual ids and the highest
    seq this rank took), so it need not wait out the heartbeat timeout."""
    engine_id = 0x1234567
    ctx = zmq.Context()
    try:
        router = _stand_in_engine(ctx, "tcp://127.0.0.1:0")
        endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        client = TaskClient(name, 1, 0, endpoint=endpoint, async_prefetch=async_prefetch)
        try:
            identity, hello, _ = _recv_from_worker(router, codec.HELLO)
            ids = dict(engine=engine_id, group=hello.group, worker=hello.worker)
            router.send_multipart([identity, codec.pack_header(codec.WELCOME, 0, 1, aux=1,
                                                               **ids)])
            for seq in (1, 2):
                frames = codec.encode_payload(make_batch(seq))
                router.send_multipart([identity, codec.pack_header(
                    codec.DATA, 0, 1, seq=seq, check=codec.payload_checksum(frames), **ids),
                    *frames])
            assert wait_until(lambda: client.num_tasks() == 2)
            assert client.exist_tasks()
            assert [b for b, _ in client.get_tasks()[0]] == [1, 2]
        finally:
            client.close()
        _, bye, _ = _recv_from_worker(router, codec.BYE, timeout_ms=2000)
        assert (bye.rank, bye.seq, bye.engine, bye.group, bye.worker) == (
            0, 2, engine_id, hello.group, hello.worker)
    finally:
        ctx.destroy(linger=0)


class _RecordingLock:
    """A lock that counts the times a caller waited for it with a timeout."""

    def __init__(self, lock):
        self.lock, self.timed_waits = lock, 0

    def acquire(self, blocking=True, timeout=-1):
        if blocking and timeout != -1:
            self.timed_waits += 1
        return self.lock.acquire(blocking, timeout)

    def release(self):
        self.lock.release()

    def __enter__(self):
        self.lock.acquire()
        return self

    def __exit__(self, *exc):
        self.lock.release()


def test_the_event_loop_does_not_wait_for_a_prefetch_pass_after_it_received_the_batch(
        name, monkeypatch):
    """Batches over the socket (a tcp engine, or a node-local one without a ring, as here).
    A pure-Python step keeps the GIL: the prefetch thread, woken by a batch, waits for it
    (here: held right after its poll), and the event loop receives the batch itself. Until
    that thread polls again its poll result stays set; the checks meanwhile must not wait
    for its pass (which only re-arms the poll: it cost a GIL-holding loop 12.6 µs p50 in
    60 % of its steps without a batch), a batch that arrives meanwhile is still received
    at once, and the thread, let go, polls again without a pass over its sockets."""
    import threading

    monkeypatch.setenv("FD_SYNC_SHM_RING_KB", "off")
    with TaskQueue(name, 1) as queue, TaskClient(name, 1, 0, async_prefetch=True) as client:
        queue.put_tasks(make_batch(0), timeout=5)
        assert wait_until(lambda: client.exist_tasks(), timeout=10)
        assert [b for b, _ in client.get_tasks()[0]] == [0]

        poller = client._receiver.ready
        wait, check_engine = poller.wait, client._watch.check
        events, hold, held, release = [], threading.Event(), threading.Event(), threading.Event()

        def held_wait(timeout_ms):
            events.append("polls")
            wait(timeout_ms)
            if hold.is_set():
                while not poller.ready(0):  # a pong, a wake-up: wait on for the batch
                    client._receiver.wake.drain()
                    wait(10)
                held.set()
                release.wait(30)  # stands in for the GIL a pure-Python step keeps
            events.append("woke")

        def counted_check_engine(now):
            events.append("pass")
            check_engine(now)

        client._watch.check = counted_check_engine
        poller.wait = held_wait
        lock = client._conn.recv_lock = _RecordingLock(client._conn.recv_lock)
        hold.set()
        client._receiver.wake.wake()  # out of the poll it is in: the next one is held_wait's
        try:
            assert wait_until(lambda: "polls" in events, timeout=10)
            queue.put_tasks(make_batch(1), timeout=5)
            assert held.wait(10), "the prefetch thread was not woken by the batch"
            assert client.exist_tasks()  # the event loop receives it itself
            assert [b for b, _ in client.get_tasks()[0]] == [1]
            assert client.stats().get("received_by_loop") == 1
            # the prefetch thread's pass (standing in for it: the lock held elsewhere)
            with lock.lock:
                for _ in range(3):
                    time.sleep(0.001)  # past the relook interval
                    assert not client.exist_tasks()
            assert lock.timed_waits == 0, "a check waited for the prefetch thread's pass"
            queue.put_tasks(make_batch(2), timeout=5)  # arrives while the result is stale
            assert wait_until(lambda: client.exist_tasks(), timeout=10)
            assert [b for b, _ in client.get_tasks()[0]] == [2]
            assert client.stats()["received_by_loop"] == 2
            woke = len(events)
            hold.clear()
        finally:
            release.set()
        # let go: the thread finds the loop emptied the socket and polls again, no pass
        assert wait_until(lambda: len(events) > woke + 1, timeout=10)
        poller.wait = wait
        assert events[woke:woke + 2] == ["woke", "polls"], events  # straight back to its poll
        queue.put_tasks(make_batch(3), timeout=5)  # and it still receives what comes next
        assert wait_until(lambda: client.num_tasks() == 1, timeout=10)
        assert client.stats()["received_by_loop"] == 2


def test_an_ack_that_cannot_be_queued_never_breaks_the_step(name):
    """Over tcp a rank's ACK goes out on a socket of its own. When it cannot be queued
    (zmq.Again: the engine's connection is down, or not read) the step has still taken its
    batches: get_tasks() returns them, the ACK is kept (cumulative: the latest stands for
    all) and sent by the next step call once the connection takes it. Before, zmq.Again
    escaped get_tasks() and the batches it had popped were lost. The ACK socket is swapped
    for a real one that cannot send yet (IMMEDIATE, nothing listening), then for a working
    one."""
    with TaskQueue(name, 1, endpoint="tcp://127.0.0.1:0") as queue:
        client = TaskClient(name, 1, 0, endpoint=queue.endpoint, async_prefetch=False)
        try:
            for i in range(3):
                queue.put_tasks(i, timeout=5)
            assert wait_until(lambda: client.num_tasks() == 3, 10)
            working = client._conn._ack
            blocked = client._conn._ctx.socket(zmq.DEALER)
            blocked.setsockopt(zmq.IMMEDIATE, 1)
            blocked.setsockopt(zmq.LINGER, 0)
            blocked.connect("tcp://127.0.0.1:1")  # nobody listens: every send is zmq.Again
            client._conn._ack = blocked
            assert client.exist_tasks()
            tasks, _ = client.get_tasks()  # before: zmq.Again, and the three batches lost
            assert tasks == [0, 1, 2]
            assert queue.num_tasks() == 3  # the engine has not heard yet
            client._conn._ack = working
            blocked.close()
            client.exist_tasks()  # the next step call sends the kept ACK
            assert wait_until(lambda: queue.num_tasks() == 0, 10)
            assert client.stats()["acks_deferred"] >= 1
        finally:
            client.close()
