"""Large batches through node-local shared memory (payload_shm): identical on every rank,
read-only, in order; names unlinked once consumed, at close and after a killed engine;
views outlive the names; tcp never uses it."""

import glob
import os
import signal
import time

import numpy as np
import pytest
import xxhash

from fastdeploy_sync import ProtocolError, TaskClient, TaskQueue, codec, payload_shm

from workers import _report_errors, collect, wait_until

pytestmark = pytest.mark.usefixtures("loopback_tcp")

THRESHOLD_KB = 64  # small batches keep the tests fast; the path is the same at 1 MiB


@pytest.fixture
def small_threshold(monkeypatch):
    monkeypatch.setenv("FD_SYNC_SHM_PAYLOAD_MIN_KB", str(THRESHOLD_KB))


def make_batch(i):
    """Even ids: ~136 KiB of arrays (above the threshold); odd ids: 4 KiB (below, still
    out of band). Content depends on the id, so a mixed-up batch is caught."""
    if i % 2 == 0:
        arrays = [np.arange(12_000, dtype=np.int64) * (i + 1),
                  np.full(10_000 + i, i, dtype=np.float32)]
    else:
        arrays = [np.arange(256, dtype=np.int64) + i, np.full(300, -i, dtype=np.float32)]
    return i, {"prompt": f"request {i}", "arrays": arrays}


def describe(batch):
    i, req = batch
    return (i, req["prompt"], [(xxhash.xxh3_64_hexdigest(a.tobytes()), a.dtype.str, a.shape,
                                bool(a.flags.writeable)) for a in req["arrays"]])


def expected(i):
    i, req, arrays = describe(make_batch(i))
    return i, req, [(digest, dtype, shape, False) for digest, dtype, shape, _ in arrays]


def shm_names(name):
    return sorted(glob.glob(f"/dev/shm/fdsync.{name}.dp0.b*"))


def _take(client, n, deadline_s=60.0):
    got = []
    deadline = time.monotonic() + deadline_s
    while len(got) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {client.tp_rank}: took {len(got)}/{n} batches")
        tasks = client.sync_step(timeout=30)
        got.extend(tasks)
        if not tasks:
            time.sleep(0.0005)
    return got


@_report_errors
def take_and_describe(out, rank, name, tp, n, async_prefetch, endpoint=None):
    with TaskClient(name, tp, rank, async_prefetch=async_prefetch, endpoint=endpoint) as client:
        out.put(("ready", rank, None))
        got = _take(client, n)
        out.put(("taken", rank, ([describe(b) for b in got],
                                 client.stats().get("shared_batches", 0))))


@_report_errors
def hold_first_view(out, rank, name, tp, n):
    """Take n batches, keep batch 0's arrays, wait until the engine unlinked its segment,
    then read them."""
    with TaskClient(name, tp, rank) as client:
        got = _take(client, n)
        held = got[0]
        del got
        gone = wait_until(lambda: not glob.glob(f"/dev/shm/fdsync.{name}.dp0.b1.*"), 20)
        out.put(("held", rank, (gone, describe(held))))


@pytest.mark.parametrize("tp,async_prefetch", [(2, True), (2, False), (4, True), (4, False)],
                         ids=["tp2-async", "tp2-sync", "tp4-async", "tp4-sync"])
def test_batches_above_and_below_the_threshold_arrive_identical(name, procs, results,
                                                                 small_threshold, tp,
                                                                 async_prefetch):
    n = 8
    with TaskQueue(name, tp, max_inflight=n) as queue:
        for rank in range(tp):
            procs(take_and_describe, results, rank, name, tp, n, async_prefetch)
        for i in range(n):
            queue.put_tasks(make_batch(i), timeout=30)
        taken = collect(results, "taken", tp)
        assert wait_until(lambda: queue.num_tasks() == 0, 10)
        assert shm_names(name) == []  # consumed by every rank: unlinked
    for rank, (batches, shared) in taken.items():
        assert batches == [expected(i) for i in range(n)], f"rank {rank}"
        assert shared == n // 2, f"rank {rank} mapped {shared} shared batches"


def test_default_threshold_and_off(name, procs, results, monkeypatch):
    """1 MiB of arrays crosses the default threshold; FD_SYNC_SHM_PAYLOAD_MIN_KB=off
    sends it over the socket."""
    big = (0, {"prompt": "big", "arrays": [np.arange(1 << 17, dtype=np.int64)]})  # 1 MiB
    for setting, shared_expected in ((None, 1), ("off", 0)):
        if setting is None:
            monkeypatch.delenv("FD_SYNC_SHM_PAYLOAD_MIN_KB", raising=False)
        else:
            monkeypatch.setenv("FD_SYNC_SHM_PAYLOAD_MIN_KB", setting)
        with TaskQueue(name, 1) as queue:
            procs(take_and_describe, results, 0, name, 1, 1, True)
            queue.put_tasks(big, timeout=10)
            assert len(shm_names(name)) == shared_expected
            (batches, shared), = collect(results, "taken", 1).values()
        assert batches == [(0, "big", [(xxhash.xxh3_64_hexdigest(big[1]["arrays"][0].tobytes()),
                                        "<i8", (1 << 17,), False)])]
        assert shared == shared_expected


def test_a_view_outlives_the_segment_name(name, procs, results, small_threshold):
    tp, n = 2, 4
    with TaskQueue(name, tp, max_inflight=n) as queue:
        for rank in range(tp):
            procs(hold_first_view, results, rank, name, tp, n)
        for i in range(n):
            queue.put_tasks(make_batch(2 * i), timeout=30)  # all above the threshold
        # the engine folds the ranks' acknowledgements in (and unlinks) when asked
        assert wait_until(lambda: queue.num_tasks() == 0 and not shm_names(name), 30), \
            f"left: {shm_names(name)}, {queue.num_tasks()} in flight"
        held = collect(results, "held", tp)
    for rank, (gone, batch) in held.items():
        assert gone, f"rank {rank} still saw batch 0's segment"
        assert batch == expected(0), f"rank {rank} read changed memory"


@_report_errors
def engine_that_gets_killed(out, rank, name, n):
    os.environ["FD_SYNC_SHM_PAYLOAD_MIN_KB"] = str(THRESHOLD_KB)
    queue = TaskQueue(name, 2, max_inflight=n)
    for i in range(n):
        queue.put_tasks(make_batch(2 * i), timeout=10)  # no worker: all stay retained
    out.put(("put", rank, os.getpid()))
    time.sleep(60)


def test_a_killed_engines_batches_are_reclaimed(name, procs, doomed):
    n = 3
    engine = procs(engine_that_gets_killed, doomed, 0, name, n)
    collect(doomed, "put", 1, timeout=30)
    left = shm_names(name)
    assert len(left) == n and all(path.endswith(f".{engine.pid}") for path in left), left
    os.kill(engine.pid, signal.SIGKILL)
    engine.join(timeout=10)
    assert shm_names(name) == left  # nobody removed them: SIGKILL runs no finalizer
    with TaskQueue(name, 2):
        assert shm_names(name) == []
    # the name fixture checks that nothing else of the name is left either


@_report_errors
def engine_that_exits_without_close(out, rank, name, n):
    os.environ["FD_SYNC_SHM_PAYLOAD_MIN_KB"] = str(THRESHOLD_KB)
    queue = TaskQueue(name, 2, max_inflight=n)
    for i in range(n):
        queue.put_tasks(make_batch(2 * i), timeout=10)
    out.put(("put", rank, shm_names(name)))
    # returns without close(): the interpreter's exit runs the queue's finalizer


def test_an_engine_that_exits_without_close_leaves_nothing(name, procs, results):
    engine = procs(engine_that_exits_without_close, results, 0, name, 2)
    (left,) = collect(results, "put", 1, timeout=30).values()
    assert len(left) == 2
    engine.join(timeout=20)
    assert engine.exitcode == 0
    assert shm_names(name) == []


def test_close_unlinks_unconsumed_batches(name, small_threshold):
    queue = TaskQueue(name, 2, max_inflight=4)
    for i in range(3):
        queue.put_tasks(make_batch(2 * i), timeout=10)
    assert len(shm_names(name)) == 3
    assert queue.close(timeout=0.1) == [1, 2, 3]
    assert shm_names(name) == []


def test_a_timed_out_put_leaves_no_segment(name, small_threshold):
    with TaskQueue(name, 2, max_inflight=1) as queue:
        queue.put_tasks(make_batch(0), timeout=10)
        with pytest.raises(TimeoutError):
            queue.put_tasks(make_batch(2), timeout=0.05)
        assert len(shm_names(name)) == 1


def test_tcp_never_uses_shared_memory(name, procs, results, small_threshold):
    n = 4
    with TaskQueue(name, 2, endpoint="tcp://127.0.0.1:0", max_inflight=n) as queue:
        for rank in range(2):
            procs(take_and_describe, results, rank, name, 2, n, True, queue.endpoint)
        for i in range(n):
            queue.put_tasks(make_batch(i), timeout=30)
            assert shm_names(name) == []
        taken = collect(results, "taken", 2)
    for rank, (batches, shared) in taken.items():
        assert batches == [expected(i) for i in range(n)], f"rank {rank}"
        assert shared == 0


def test_a_reference_is_checked_before_anything_is_mapped_or_unpickled(name):
    parts = codec.encode_parts(make_batch(0))
    seg = payload_shm.payload_name(name, 0, 1)
    shared = payload_shm.SharedPayload.create(seg, parts.data_size)
    try:
        for (start, _), raw in zip(parts.layout, parts.buffers):
            shared.write(start, raw)
        shared.seal()
        check = parts.checksum()
        assert check == codec.payload_checksum(parts.frames())  # streamed == framed
        ref = payload_shm.pack_ref(seg, parts.data_size, parts.offsets)
        got_name, size, offsets = payload_shm.unpack_ref(ref)
        mapped = payload_shm.map_payload(got_name, size, payload_shm.payload_prefix(name, 0))
        tasks = codec.decode_payload([parts.body, offsets, mapped.view], check)
        assert describe(tasks) == expected(0)
        with pytest.raises(ValueError):  # read-only all the way down
            tasks[1]["arrays"][0][0] = 1
        # another queue's prefix, a wrong size, a truncated or foreign reference
        with pytest.raises(ProtocolError, match="outside this queue"):
            payload_shm.map_payload(seg, size, payload_shm.payload_prefix(name + "x", 0))
        with pytest.raises(ProtocolError, match="reference says"):
            payload_shm.map_payload(seg, size + 1, payload_shm.payload_prefix(name, 0))
        for bad in (ref[:-1], ref[:10], b"XXXX" + ref[4:]):
            with pytest.raises(ProtocolError):
                payload_shm.unpack_ref(bad)
        # the checksum covers the shared bytes: one flipped byte is caught before unpickling
        pos = parts.layout[1][0]
        shared_rw = payload_shm.SharedPayload(seg, size, os.open(f"/dev/shm{seg}", os.O_RDWR))
        shared_rw.write(pos, bytes([mapped.view[pos] ^ 1]))
        shared_rw.seal()
        with pytest.raises(ProtocolError, match="checksum mismatch"):
            codec.decode_payload([parts.body, offsets, mapped.view], check)
    finally:
        shared.release()
    assert shm_names(name) == []
    assert describe(tasks)[2][0][0] == expected(0)[2][0][0]  # still mapped after the unlink


@_report_errors
def take_then_hang(out, rank, name, tp, n):
    from fastdeploy_sync import Heartbeat

    with TaskClient(name, tp, rank, heartbeat=Heartbeat(0.2, 1.0)) as client:
        _take(client, n)
        out.put(("took", rank, os.getpid()))
        time.sleep(60)


def test_a_retired_groups_shared_batches_come_back_and_are_unlinked(name, procs, doomed,
                                                                   small_threshold):
    from fastdeploy_sync import Heartbeat

    with TaskQueue(name, 1, heartbeat=Heartbeat(0.2, 1.0)) as queue:
        worker = procs(take_then_hang, doomed, 0, name, 1, 1)
        queue.put_tasks(make_batch(0), timeout=10)
        collect(doomed, "took", 1, timeout=30)
        os.kill(worker.pid, signal.SIGKILL)
        queue.put_tasks(make_batch(2), timeout=10)  # never taken: the group is dead
        queue.put_tasks(make_batch(3), timeout=10)  # below the threshold
        event = queue.group_events.get(timeout=15)
        assert [b.seq for b in event.unfinished] == [2, 3]
        assert shm_names(name) == []  # retired: nothing retained, nothing named
        # decoded from the unlinked segment, which the arrays keep mapped
        assert [describe(b.tasks) for b in event.unfinished] == [expected(2), expected(3)]
