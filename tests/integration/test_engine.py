"""TaskQueue: backpressure, bad input, garbage on the endpoint, endpoints, start order."""

import os
import signal
import socket
import struct
import time

import numpy as np
import pytest
import zmq

from conftest import SPAWN
from engine_peers import RawRank, engine_closing_on_a_reader_that_stopped
from fastdeploy_sync import EndpointInUseError, TaskQueue, TaskSyncError, names
from fastdeploy_sync.wire.codec import ACK, pack_header
from workers import (
    collect,
    hold_engine,
    hold_group_rank,
    make_batch,
    step_until_error_rank,
    take_n_rank,
    wait_until,
)

pytestmark = pytest.mark.usefixtures("loopback_tcp")


def test_put_blocks_then_times_out_naming_the_ranks_behind(name):
    with TaskQueue(name, 2, max_inflight=3) as queue:
        for i in range(3):
            assert queue.put_tasks(i, timeout=1) == i + 1
        assert queue.num_tasks() == 3 and queue.exist_tasks()
        with pytest.raises(TimeoutError) as info:
            queue.put_tasks(99, timeout=0.2)
        message = str(info.value)
        assert "rank 0" in message and "rank 1" in message and "never connected" in message
        assert "max_inflight=3" in message
        assert queue.num_tasks() == 3  # the refused batch was not enqueued


def test_timeout_message_says_which_ranks_connected(name, procs, results):
    """Rank 0 is up, rank 1 never started: nothing can be taken (a step needs every rank
    to hold the batch), and the error says who is there and who is not."""
    with TaskQueue(name, 2, max_inflight=2) as queue:
        leave = SPAWN.Event()  # rank 0 stays connected until the error was read
        procs(hold_group_rank, results, 0, name, 2, 120.0, leave)
        collect(results, "ready", 1)
        assert wait_until(lambda: queue.stats().get("hellos", 0) == 1)
        queue.put_tasks("a", timeout=5)
        queue.put_tasks("b", timeout=5)
        with pytest.raises(TimeoutError) as info:
            queue.put_tasks("c", timeout=0.3)
        leave.set()
    assert "rank 0 consumed up to seq 0 of 2 (connected)" in str(info.value)
    assert "rank 1 consumed up to seq 0 of 2 (never connected)" in str(info.value)


def test_unpicklable_batch_is_refused_and_nothing_accepted_is_lost(name, procs, results):
    with TaskQueue(name, 1) as queue:
        queue.put_tasks("before", timeout=5)
        with pytest.raises(TypeError, match="not picklable"):
            queue.put_tasks(lambda: None)
        with pytest.raises(TypeError, match="not picklable"):
            queue.put_tasks({"sock": socket.socket()})
        queue.put_tasks("after", timeout=5)
        procs(take_n_rank, results, 0, name, 1, 2)
        assert collect(results, "taken", 1)[0] == ["before", "after"]
        assert queue.stats()["last_seq"] == 2


def test_garbage_on_the_endpoint_is_counted_and_dropped(name, procs, results):
    n = 50
    with TaskQueue(name, 2) as queue:
        for rank in range(2):
            procs(take_n_rank, results, rank, name, 2, n)
        ctx = zmq.Context()
        try:
            vandal = ctx.socket(zmq.DEALER)
            vandal.setsockopt(zmq.LINGER, 0)
            vandal.connect(queue.endpoint)
            for i in range(n):
                queue.put_tasks(make_batch(i), timeout=10)
                if i % 10 == 0:
                    vandal.send(os.urandom(40))  # not even a header
                    vandal.send_multipart([b"FDSY" + os.urandom(24), b"x"])  # bad version/kind
                    vandal.send(pack_header(ACK, rank=7, tp_size=2, seq=1))  # rank out of range
                    # well-formed, but bound to no engine, group or worker it knows
                    vandal.send(pack_header(ACK, rank=0, tp_size=2, seq=10**9))
            taken = collect(results, "taken", 2)
        finally:
            ctx.destroy(linger=0)
        stats = queue.stats()
    for rank in range(2):
        assert [batch_id for batch_id, _ in taken[rank]] == list(range(n))
    assert stats["garbage_frames"] == 3 * 5
    assert stats["stale"] >= 5
    assert stats["consumed"] == [n, n]


def test_second_engine_on_the_same_name_is_refused(name):
    with TaskQueue(name, 1):
        with pytest.raises(EndpointInUseError, match="in use"):
            TaskQueue(name, 1)


def test_stale_ipc_file_of_a_crashed_engine_is_reclaimed(name):
    from fastdeploy_sync import envs
    from fastdeploy_sync.wire.endpoints import default_endpoint, ipc_path, private_dir

    private_dir(envs.ipc_dir())
    path = ipc_path(default_endpoint(name, 0))
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)  # a socket file with no listener: what a killed engine leaves
    stale.close()
    assert os.path.exists(path)
    with TaskQueue(name, 1) as queue:
        assert queue.put_tasks("x", timeout=1) == 1
    assert not os.path.exists(path)


def test_close_is_idempotent_and_later_puts_fail(name):
    queue = TaskQueue(name, 1)
    queue.close()
    queue.close()
    with pytest.raises(Exception, match="closed"):
        queue.put_tasks("x", timeout=1)


def test_tcp_endpoint(name, procs, results):
    with TaskQueue(name, 2, endpoint="tcp://127.0.0.1:0") as queue:
        assert queue.endpoint.startswith("tcp://127.0.0.1:")
        for rank in range(2):
            procs(take_n_rank, results, rank, name, 2, 20, None, queue.endpoint)
        for i in range(20):
            queue.put_tasks(make_batch(i), timeout=10)
        taken = collect(results, "taken", 2)
    assert [b for b, _ in taken[0]] == [b for b, _ in taken[1]] == list(range(20))


def test_workers_started_before_the_engine_lose_nothing(name, procs, results):
    for rank in range(2):
        procs(take_n_rank, results, rank, name, 2, 30)
    collect(results, "ready", 2)
    time.sleep(0.3)  # the workers are connecting to a socket file that does not exist yet
    with TaskQueue(name, 2) as queue:
        for i in range(30):
            queue.put_tasks(make_batch(i), timeout=10)
        taken = collect(results, "taken", 2)
    assert [b for b, _ in taken[0]] == [b for b, _ in taken[1]] == list(range(30))


def test_batches_put_before_the_workers_exist_reach_them(name, procs, results):
    """Nothing is lost to ZeroMQ's slow joiner: retained batches are replayed on HELLO,
    by the engine's I/O thread, while the engine's own thread is busy elsewhere."""
    with TaskQueue(name, 2, max_inflight=8) as queue:
        for i in range(8):
            queue.put_tasks(make_batch(i), timeout=1)
        for rank in range(2):
            procs(take_n_rank, results, rank, name, 2, 8)
        time.sleep(0.5)  # "busy elsewhere": no engine call while the workers join
        taken = collect(results, "taken", 2)
        assert wait_until(lambda: queue.num_tasks() == 0)
    for rank in range(2):
        got = taken[rank]
        assert [b for b, _ in got] == list(range(8))
        np.testing.assert_array_equal(got[3][1], make_batch(3)[1])


def test_node_local_acks_go_through_shared_memory(name, procs, results):
    """ipc endpoint: ranks acknowledge on the ack board (no ACK message); tcp: by message."""
    n = 40
    with TaskQueue(name, 2, max_inflight=2) as queue:  # a tight bound: puts need the acks
        # the ranks stay until the engine has read their acks: a rank's BYE retires the
        # group, and a retirement sets "consumed" to the last seq without any ack
        leave = SPAWN.Event()
        for rank in range(2):
            procs(take_n_rank, results, rank, name, 2, n, leave=leave)
        for i in range(n):
            queue.put_tasks(make_batch(i), timeout=10)
        collect(results, "taken", 2)
        assert wait_until(lambda: queue.stats()["consumed"] == [n, n], 60)
        stats = queue.stats()
        assert stats.get("acks", 0) == 0 and stats.get("groups_retired", 0) == 0, stats
        leave.set()
    with TaskQueue(name, 1, max_inflight=2, endpoint="tcp://127.0.0.1:0") as queue:
        procs(take_n_rank, results, 0, name, 1, n, None, queue.endpoint)
        for i in range(n):
            queue.put_tasks(make_batch(i), timeout=10)
        collect(results, "taken", 1)
        assert wait_until(lambda: queue.stats()["consumed"] == [n])
        assert queue.stats()["acks"] > 0  # by message: a tcp engine has no board


def test_a_killed_engine_leaves_nothing_the_next_one_trips_on(name, procs, results, doomed):
    p = procs(hold_engine, doomed, 0, name, 1, 60)
    collect(doomed, "ready", 1)
    os.kill(p.pid, signal.SIGKILL)
    p.join(timeout=10)
    assert os.path.exists(names.shm_path(names.ack_board(name, 0)))
    with TaskQueue(name, 1) as queue:  # reclaims the socket file and the ack board
        queue.put_tasks("fresh", timeout=1)
        procs(take_n_rank, results, 0, name, 1, 1)
        assert collect(results, "taken", 1)[0] == ["fresh"]


def test_a_bogus_value_on_the_ack_board_is_ignored(name):
    from fastdeploy_sync import TaskClient
    from fastdeploy_sync.shm.ack_board import EPOCH_SHIFT, AckBoard

    with TaskQueue(name, 1, max_inflight=1) as queue, TaskClient(name, 1, 0) as client:
        queue.put_tasks("a", timeout=1)
        assert wait_until(lambda: client.num_tasks() == 1)
        board = AckBoard.attach(name, 0, 1, queue.instance)
        try:
            board.publish(0, (1 << EPOCH_SHIFT) | 10**6)  # claims batches never put
            assert queue.num_tasks() == 1
            assert queue.stats()["garbage_acks"] >= 1
            board.publish(0, (7 << EPOCH_SHIFT) | 1)  # another group's epoch: ignored
            assert queue.num_tasks() == 1
        finally:
            board.close()
        with pytest.raises(TimeoutError):
            queue.put_tasks("b", timeout=0.1)


def test_a_worker_attaches_only_the_ack_board_of_the_engine_that_welcomed_it(name):
    """The board is found by name, and the next engine of the name makes a new one: a worker
    that reads its WELCOME late (its engine died meanwhile) must not attach the successor's
    board, where its acks, tagged with its own engine's epochs, would count for a group of
    the same epoch number (the rebuild storm freed a ring slot a rank had not read: "the
    slot of seq 2 holds stamp 11, not 1"). Before: attached whatever board had the name."""
    from fastdeploy_sync.shm.ack_board import AckBoard

    with TaskQueue(name, 1) as queue:
        other = queue.instance ^ (1 << 40)  # the engine that welcomed the worker, gone
        assert AckBoard.attach(name, 0, 1, other) is None
        board = AckBoard.attach(name, 0, 1, queue.instance)
        assert board is not None
        board.close()


def test_process_exit_without_close_leaves_nothing(name):
    """An engine and a rank 0 that exit without close(): the name fixture checks that no
    socket file, segment or semaphore of theirs remains."""
    import subprocess
    import sys

    code = ("import fastdeploy_sync as fs\n"
            f"queue = fs.TaskQueue({name!r}, 2)\n"
            f"client = fs.TaskClient({name!r}, 2, 0)\n"
            "queue.put_tasks('x', timeout=5)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_producer_in_another_process_puts_through_the_queue(name, procs, results):
    """TaskProducer: the same bound, order and delivery as put_tasks(); a full queue times
    out without enqueueing; a corrupted batch is refused before any worker sees it; a closed
    queue says so; no queue at all fails fast."""
    from fastdeploy_sync import ClosedError, TaskProducer
    from fastdeploy_sync.wire.codec import P_INVALID, PUT, PUT_REPLY, unpack_header

    with pytest.raises(ConnectionError, match="no TaskQueue"):
        TaskProducer(name, timeout=0.3)
    queue = TaskQueue(name, 1, max_inflight=2)
    try:
        # producer's replies are bounded for a hang only (a 1 s bound failed in CI: the
        # queue's I/O thread got no core in time to say "not enqueued"); after_close, with
        # the default bound, asks the closed queue, which answers nothing: the bound ends
        # that wait, and both outcomes (ClosedError, TaskSyncError) are right
        with TaskProducer(name, timeout=30.0) as producer, TaskProducer(name) as after_close:
            assert [producer.put_tasks(i, timeout=5) for i in range(2)] == [1, 2]
            assert producer.num_tasks() == 2 and queue.num_tasks() == 2
            with pytest.raises(TimeoutError, match="not enqueued"):
                producer.put_tasks(99, timeout=0.2)
            assert queue.stats()["last_seq"] == 2
            ctx = zmq.Context()
            try:  # a batch whose checksum does not match: refused, nothing enqueued
                raw = ctx.socket(zmq.DEALER)
                raw.connect(producer.endpoint)
                raw.send_multipart([pack_header(PUT, seq=7, aux=1000, check=12345), b"\x80\x05."])
                assert raw.poll(5000)
                reply = unpack_header(raw.recv_multipart()[0])
                assert (reply.kind, reply.seq, reply.aux) == (PUT_REPLY, 7, P_INVALID)
            finally:
                ctx.destroy(linger=0)
            procs(take_n_rank, results, 0, name, 1, 3)
            assert producer.put_tasks(2, timeout=10) == 3  # room once the rank takes
            assert collect(results, "taken", 1)[0] == [0, 1, 2]
            queue.close(timeout=5)
            with pytest.raises((ClosedError, TaskSyncError)):
                after_close.put_tasks(3, timeout=0.2)
    finally:
        queue.close(timeout=0)


def test_queries_after_close_with_a_connected_group_from_any_thread(name, procs, results):
    """close() with a group still connected: afterwards put_tasks/num_tasks/exist_tasks
    raise ClosedError, and ranks/stats/status describe the final state, from any thread
    (they raised TypeError once the ack board was unmapped)."""
    import threading

    from fastdeploy_sync import ClosedError
    from workers import step_until_error_rank

    n = 3
    queue = TaskQueue(name, 2)
    for rank in range(2):
        procs(step_until_error_rank, results, rank, name, 2, True, report_after=n)
    for i in range(n):
        queue.put_tasks(i, timeout=30)
    collect(results, "took_n", 2)
    assert queue.close(timeout=10) == []
    raised = collect(results, "raised", 2, timeout=30)
    assert [raised[r]["cause"] for r in range(2)] == ["EngineClosedError"] * 2

    failures = []

    def ask():
        try:
            for call in (queue.num_tasks, queue.exist_tasks, lambda: queue.put_tasks(9)):
                with pytest.raises(ClosedError, match="closed"):
                    call()
            ranks = queue.ranks()
            assert [r["consumed"] for r in ranks] == [n, n]
            assert [r["state"] for r in ranks] == ["disconnected"] * 2, ranks
            assert all(r["reason"] == "the queue closed" for r in ranks), ranks
            stats = queue.stats()
            assert stats["last_seq"] == n and stats["consumed"] == [n, n]
            status = queue.status()
            assert status["closed"] is True and status["last_seq"] == n
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    ask()
    thread = threading.Thread(target=ask)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert not failures, failures
    assert queue.close() == []  # idempotent


def test_every_waiting_producer_put_gets_its_timeout_on_time(name):
    """A PUT that waits forever at the head of the producers' line must not hold back the
    timeout of a PUT behind it (it was answered only when the head left, and then enqueued
    after its producer had given up)."""
    import threading

    from fastdeploy_sync import ClosedError, TaskProducer

    with TaskQueue(name, 1, max_inflight=1) as queue:
        queue.put_tasks("fills the queue", timeout=1)
        forever = TaskProducer(name, timeout=2.0)
        impatient = TaskProducer(name, timeout=2.0)
        try:
            outcome = []

            def put_forever():
                try:
                    outcome.append(forever.put_tasks("head", timeout=None))
                except Exception as exc:  # the queue closes under it at the end
                    outcome.append(exc)

            head = threading.Thread(target=put_forever, daemon=True)
            head.start()
            assert wait_until(lambda: len(queue._io._producers.pending) == 1)
            start = time.monotonic()
            with pytest.raises(TimeoutError, match="not enqueued"):
                impatient.put_tasks("behind", timeout=0.3)
            assert time.monotonic() - start < 2.0  # its own bound, not the reply timeout
            assert queue.stats()["last_seq"] == 1
        finally:
            queue.close(timeout=0)
            head.join(timeout=10)
            forever.close()
            impatient.close()
        assert not head.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], ClosedError), outcome


class _ExitsWhenUnpickled:
    """Pickles fine; unpickling it raises SystemExit (a batch whose decoding ends the
    thread that decodes it)."""

    def __reduce__(self):
        import sys

        return sys.exit, ("a batch ended the thread that unpickled it",)


def test_a_batch_that_exits_when_decoded_cannot_kill_the_io_thread(name, socket_delivery):
    """The engine decodes a retired group's unfinished batches for GroupLost on its I/O
    thread; one that raises SystemExit there ended the thread silently (and every later
    batch was never sent)."""
    from engine_peers import RawRank
    from fastdeploy_sync import Heartbeat, ProtocolError
    from fastdeploy_sync.wire.codec import DATA, decode_payload

    with TaskQueue(name, 1, heartbeat=Heartbeat(0.2, 1.0)) as queue:
        first = RawRank(queue.endpoint, name, 1, 0).join()
        seq = queue.put_tasks(_ExitsWhenUnpickled(), timeout=5)
        first.expect(DATA)
        first.close()  # gone without a word: the group is retired, the batch handed back
        event = queue.group_events.get(timeout=15)
        assert [b.seq for b in event.unfinished] == [seq]
        error = event.unfinished[0].tasks
        assert isinstance(error, ProtocolError) and isinstance(error.__cause__, SystemExit)
        second = RawRank(queue.endpoint, name, 1, 0).join()  # the I/O thread lives on
        queue.put_tasks("next", timeout=5)
        _, frames = second.expect(DATA)
        assert decode_payload(frames) == "next"
        second.close()
        queue.close(timeout=0)


def test_an_io_thread_failure_is_raised_to_put_tasks_callers(name, monkeypatch):
    """Whatever ends the I/O thread (here SystemExit from its liveness tick) is raised,
    chained, by put_tasks: a caller blocked for room is woken, none waits forever."""
    import threading

    from fastdeploy_sync import Heartbeat

    with TaskQueue(name, 1, max_inflight=1, heartbeat=Heartbeat(0.2, 1.0)) as queue:
        queue.put_tasks("fills the queue", timeout=1)
        outcome = []

        def blocked_put():
            try:
                queue.put_tasks("waits for room", timeout=5)
            except BaseException as exc:
                outcome.append(exc)

        waiter = threading.Thread(target=blocked_put)
        waiter.start()

        def die(now):
            raise SystemExit("the liveness tick ended the I/O thread")

        monkeypatch.setattr(queue._io._members, "tick", die)
        waiter.join(timeout=30)
        assert not waiter.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], TaskSyncError), outcome
        assert isinstance(outcome[0].__cause__, SystemExit)
        with pytest.raises(TaskSyncError, match="I/O thread failed"):
            queue.put_tasks("later", timeout=1)
        queue.close(timeout=0)


@pytest.mark.parametrize("payload", [
    [os.urandom(200)],  # not a pickle at all
    [b"\x80\x05K\x01.", b"x" * 8],  # two payload frames: neither form
    [b"\x80\x05K\x01.", struct.pack("<qq", 4, 16), b"x" * 8],  # an array outside the data
    [b"\x80\x05K\x01.", b"\x00" * 15, b"x" * 8],  # offsets that are not (start, length) pairs
], ids=["random", "two-frames", "buffer-outside", "bad-offsets"])
def test_a_producer_put_that_workers_would_refuse_is_refused(name, payload):
    """A PUT whose checksum matches its own bytes but which the workers' checks before
    unpickling would refuse (so that every rank would fail and the group be retired) is
    refused with P_INVALID before it is enqueued; the queue goes on."""
    from fastdeploy_sync.wire.codec import (
        P_ACCEPTED,
        P_INVALID,
        PUT,
        PUT_REPLY,
        encode_payload,
        payload_checksum,
        unpack_header,
    )

    with TaskQueue(name, 1) as queue:
        ctx = zmq.Context()
        try:
            raw = ctx.socket(zmq.DEALER)
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(queue.producer_endpoint)

            def put(frames, request):
                raw.send_multipart([pack_header(PUT, seq=request, aux=1000,
                                                check=payload_checksum(frames)), *frames])
                while True:  # skipping the endpoint's liveness checks (request id 0)
                    assert raw.poll(5000)
                    reply = unpack_header(raw.recv_multipart()[0])
                    if reply.seq:
                        break
                assert (reply.kind, reply.seq) == (PUT_REPLY, request)
                return reply.aux

            assert put(payload, 1) == P_INVALID
            assert queue.stats()["last_seq"] == 0 and queue.stats()["puts_invalid"] == 1
            assert put(encode_payload(make_batch(3)), 2) == P_ACCEPTED
            assert queue.stats()["last_seq"] == 1
        finally:
            ctx.destroy(linger=0)
        queue.close(timeout=0)


def test_close_before_any_worker_connected_waits_for_a_group_to_come_and_drain(
        name, procs, results):
    """close(timeout) called before any worker connected: it used to return every seq
    at once, and workers started a moment later waited forever. Now it waits up to
    timeout for a group to come, lets it take everything, and returns []; the workers
    then see the queue closed."""
    from workers import step_until_error_rank

    queue = TaskQueue(name, 2)
    try:
        for i in range(3):
            queue.put_tasks(i, timeout=5)
        for rank in range(2):  # they connect while close() waits
            procs(step_until_error_rank, results, rank, name, 2, True)
        assert queue.close(timeout=60) == []
    finally:
        queue.close(timeout=0)
    raised = collect(results, "raised", 2, timeout=30)
    for rank in range(2):
        assert raised[rank]["cause"] == "EngineClosedError", raised[rank]
        assert raised[rank]["taken"] == [0, 1, 2]


def test_close_returns_at_once_when_the_served_group_has_gone(name, socket_delivery):
    """The group being served has no rank connected any more (its workers closed their
    sockets): close() does not wait for them, it returns what they did not take."""
    from engine_peers import RawRank
    from fastdeploy_sync import Heartbeat
    from fastdeploy_sync.wire.codec import DATA

    queue = TaskQueue(name, 1, heartbeat=Heartbeat(1.0, 30.0))
    try:
        rank = RawRank(queue.endpoint, name, 1, 0).join()
        queue.put_tasks("never taken", timeout=5)
        rank.expect(DATA)
        rank.close()
        assert wait_until(lambda: queue.ranks()[0]["state"] == "disconnected", timeout=10)
        start = time.monotonic()
        assert queue.close(timeout=20) == [1]
        assert time.monotonic() - start < 2.0
    finally:
        queue.close(timeout=0)


def test_a_producer_told_busy_sends_again_within_its_timeout(name, procs, results):
    """When other producers' PUTs already fill the waiting room (P_BUSY), TaskProducer
    sends its batch again until it is taken in, within its own timeout; the waiting PUTs
    of a producer that went away are dropped, never enqueued."""
    import threading

    import numpy as np

    from fastdeploy_sync import TaskProducer
    from fastdeploy_sync.wire.codec import PUT, encode_payload, payload_checksum

    with TaskQueue(name, 1, max_inflight=1) as queue:
        queue.put_tasks("first", timeout=5)  # full
        ctx = zmq.Context()
        hog = ctx.socket(zmq.DEALER)
        hog.setsockopt(zmq.LINGER, 0)
        hog.connect(queue.producer_endpoint)
        frames = encode_payload(np.zeros(3 << 17, dtype=np.int64))  # 3 MiB each
        for request in range(1, 5):  # 12 MiB: more than the waiting room holds
            hog.send_multipart([pack_header(PUT, seq=request, aux=60_000,
                                            check=payload_checksum(frames)), *frames])
        assert wait_until(lambda: queue.stats().get("puts_busy", 0) >= 1)
        outcome = []
        with TaskProducer(name, timeout=2.0) as producer:
            def put():
                try:
                    outcome.append(producer.put_tasks("patient", timeout=30))
                except Exception as exc:
                    outcome.append(exc)

            putter = threading.Thread(target=put)
            putter.start()
            time.sleep(0.5)
            assert not outcome and queue.stats()["puts_busy"] >= 2  # told busy, sent again
            ctx.destroy(linger=0)  # the hog goes away: its waiting PUTs are dropped
            assert wait_until(lambda: queue.stats().get("puts_dropped_gone", 0) >= 2)
            procs(take_n_rank, results, 0, name, 1, 2)
            putter.join(timeout=30)
        assert outcome == [2], outcome
        assert [t for t in collect(results, "taken", 1)[0]] == ["first", "patient"]
        assert queue.stats().get("puts_remote", 0) == 1


def test_a_bye_is_not_counted_as_an_ack_message(name):
    """stats()["acks"] counts ACK messages (a node-local rank sends none: it writes the ack
    board); the seq a BYE carries is applied but is not one of them."""
    from fastdeploy_sync import TaskClient

    with TaskQueue(name, 1) as queue:
        with TaskClient(name, 1, 0) as client:
            queue.put_tasks("a", timeout=5)
            wait_until(client.sync_step, timeout=10, interval=0.001,
                       what="the client to take the batch")
        assert wait_until(lambda: queue.stats().get("byes", 0) == 1)
        assert queue.stats().get("acks", 0) == 0


def test_close_survives_a_rank_that_stopped_reading_then_talks_and_hangs_up(name, procs,
                                                                             results, socket_delivery):
    """The engine closes while a batch to a rank is still unwritten (the rank stopped
    reading), and that rank then sends a message and hangs up. With the workers' socket
    closed on a linger, libzmq 4.3.5 aborted the engine process at the connection's next
    ZMTP heartbeat ("Assertion failed: !_io_error"), every time. Now the engine reads its
    socket until its ranks answer CLOSE (this one never does: 1 s), then closes without
    lingering, and the process closes cleanly."""
    engine = procs(engine_closing_on_a_reader_that_stopped, results, name, 0.1)
    endpoint = collect(results, "ready", 1)[0]
    peer = RawRank(endpoint, name, 1, 0, options={zmq.RCVHWM: 1, zmq.RCVBUF: 4096})
    try:
        peer.join(timeout=10)
        collect(results, "closing", 1, timeout=30)
        deadline = time.monotonic() + 0.6  # past the 0.3 s drain: the socket closes
        while time.monotonic() < deadline:
            peer.ping()
            time.sleep(0.02)
    finally:
        peer.close()  # hangs up
    engine.join(timeout=20)
    assert engine.exitcode == 0, f"the engine process ended with {engine.exitcode}"
    assert collect(results, "closed", 1, timeout=5)[0] == [1, 2, 3, 4]


def test_put_tasks_sends_its_batch_itself_while_the_io_thread_is_held(name, procs, results,
                                                                     socket_delivery):
    """put_tasks() sends a new batch from the calling thread when no I/O pass holds the
    socket, instead of waking the I/O thread (a thread wake-up, ~90 µs on these machines,
    before the batch could leave): here the I/O thread is held, between its poll and its
    pass, and the batch reaches the rank all the same."""
    import threading

    with TaskQueue(name, 1) as queue:
        procs(take_n_rank, results, 0, name, 1, 2)
        queue.put_tasks(make_batch(0), timeout=10)
        assert wait_until(lambda: queue.stats().get("sent", 0) >= 1, timeout=30)
        held, release = threading.Event(), threading.Event()
        drain = queue._io._wake.drain

        def held_drain():
            held.set()
            release.wait(30)
            drain()

        queue._io._wake.drain = held_drain
        try:
            queue._io._wake.wake()
            assert held.wait(10), "the I/O thread did not wake"
            queue.put_tasks(make_batch(1), timeout=10)
            taken = collect(results, "taken", 1, timeout=15)[0]
            assert not release.is_set()  # still held: nobody but put_tasks() sent it
            assert queue.stats()["sent_by_put"] >= 1
        finally:
            queue._io._wake.drain = drain
            release.set()
    assert [b for b, _ in taken] == [0, 1]


def test_puts_from_many_threads_reach_every_rank_in_order_while_acks_arrive(name, procs,
                                                                           results):
    """Threads put at once, each sending its batch itself when it can, while the I/O
    thread receives the ranks' acknowledgements over tcp (the same socket): every rank
    takes every batch once, the same list, each thread's batches in its order, and no send
    failed or was dropped."""
    import threading

    threads, per_thread = 4, 40
    n = threads * per_thread
    with TaskQueue(name, 2, endpoint="tcp://127.0.0.1:0", max_inflight=4) as queue:
        for rank in range(2):
            procs(take_n_rank, results, rank, name, 2, n, None, queue.endpoint)
        failures = []

        def put(first):
            try:
                for i in range(first, n, threads):
                    queue.put_tasks(make_batch(i), timeout=30)
            except BaseException as exc:
                failures.append(exc)

        putters = [threading.Thread(target=put, args=(t,)) for t in range(threads)]
        for thread in putters:
            thread.start()
        for thread in putters:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in putters) and not failures, failures
        taken = collect(results, "taken", 2)
        stats = queue.stats()
    ids = [b for b, _ in taken[0]]
    assert ids == [b for b, _ in taken[1]]
    assert sorted(ids) == list(range(n))
    for t in range(threads):
        assert [i for i in ids if i % threads == t] == list(range(t, n, threads))
    assert stats["sent"] == 2 * n  # each rank sent each batch once: no reconnect
    assert stats.get("send_errors", 0) == 0 and stats.get("sends_dropped_full", 0) == 0
    assert stats.get("acks", 0) > 0  # the I/O thread kept receiving


@pytest.mark.parametrize("path", ["ring", "socket"])
def test_close_from_another_thread_while_threads_put(name, procs, results, monkeypatch, path):
    """close() from its own thread while three threads put (each publishing into the ring,
    or sending its batches itself when it can): every put either returns a seq or raises
    ClosedError, every batch accepted reaches both ranks in seq order before they learn
    the engine closed, and no send failed on a socket closed under it."""
    import threading

    from fastdeploy_sync import ClosedError

    if path == "socket":
        monkeypatch.setenv("FD_SYNC_SHM_RING_KB", "off")

    with TaskQueue(name, 2, max_inflight=4) as queue:
        for rank in range(2):
            procs(step_until_error_rank, results, rank, name, 2)
        collect(results, "ready", 2)
        accepted, failures = {}, []

        def put(t):
            try:
                for k in range(100000):
                    seq = queue.put_tasks(t * 100000 + k, timeout=10)
                    accepted[seq] = t * 100000 + k
            except ClosedError:
                return
            except BaseException as exc:
                failures.append(exc)

        putters = [threading.Thread(target=put, args=(t,)) for t in range(3)]
        for thread in putters:
            thread.start()
        assert wait_until(lambda: len(accepted) >= 50, timeout=30)
        unconsumed = []
        closer = threading.Thread(target=lambda: unconsumed.extend(queue.close(timeout=10)))
        closer.start()
        closer.join(timeout=30)
        for thread in putters:
            thread.join(timeout=30)
        assert not closer.is_alive() and not any(thread.is_alive() for thread in putters)
        assert not failures, failures
        stats = queue.stats()
    raised = collect(results, "raised", 2)
    assert unconsumed == []
    expected = [accepted[seq] for seq in sorted(accepted)]
    for rank in range(2):
        assert raised[rank]["type"] == "EngineClosedError", raised[rank]
        assert raised[rank]["taken"] == expected
    assert stats.get("send_errors", 0) == 0
    if path == "socket":
        assert stats["sent"] == 2 * len(expected)
    else:
        assert stats["shm_ring_batches"] >= len(expected) and "sent" not in stats
