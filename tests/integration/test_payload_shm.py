"""Large batches through node-local shared memory (payload_shm, batch_encoder): identical
on every rank, read-only, in order; the pool's regions reused only once every rank freed
its arrays; batches that do not fit take a segment of their own or the socket; names
unlinked at close, after a retired group and after a killed engine; views outlive the
names; tcp never uses it."""

import gc
import glob
import os
import signal
import threading
import time

import numpy as np
import pytest
import xxhash

from conftest import SPAWN
from fastdeploy_sync import GroupLostError, ProtocolError, TaskClient, TaskQueue, names
from fastdeploy_sync.engine import encoder as batch_encoder
from fastdeploy_sync.shm import payload as payload_shm
from fastdeploy_sync.shm.pool import PayloadPool
from fastdeploy_sync.testing.processes import report_errors
from fastdeploy_sync.wire import codec
from workers import collect, wait_until

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


def _listed(name, kind):
    """(path, names.Parsed) of each ``names.SHM_DIR`` entry of queue ``name``, DP group 0,
    of ``kind`` (a key of ``names.KINDS``), from one listing, sorted; read back by the
    library's own parser, so the test follows the library's naming."""
    found = []
    for entry in sorted(os.listdir(names.SHM_DIR)):
        parsed = names.parse_shm_entry(entry)
        if parsed is not None and parsed.name == name and parsed.dp_id == 0 \
                and parsed.kind == kind:
            found.append((os.path.join(names.SHM_DIR, entry), parsed))
    return found


def shm_names(name):
    """Shared batches and pools (not the worker groups' rings: ring_names)."""
    return [path for path, _ in _listed(name, "payload")]


def ring_names(name):
    return [path for path, _ in _listed(name, "ring")]


def pool_names(name):
    """Pools: held locked for their life (a batch's own segment is not)."""
    return [path for path, parsed in _listed(name, "payload") if parsed.locked]


def segment_names(name):
    """Batches' own segments, from one listing: a pool retired with its group may be
    unlinked between two listings (a rank's BYE retires the group meanwhile)."""
    return [path for path, parsed in _listed(name, "payload") if not parsed.locked]


def shm_stats(queue):
    return {k: v for k, v in queue.stats().items() if k.startswith("shm_")}


def _take_described(client, n, deadline_s=60.0, hold=()):
    """Take n batches, describing each as it is taken and freeing its arrays at once,
    except those whose id is in ``hold`` (returned as {id: batch})."""
    got, held = [], {}
    deadline = time.monotonic() + deadline_s
    while len(got) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {client.tp_rank}: took {len(got)}/{n} batches")
        tasks = client.sync_step(timeout=30)
        while tasks:
            batch = tasks.pop(0)
            got.append(describe(batch))
            if batch[0] in hold:
                held[batch[0]] = batch
            del batch  # freed now: its region may be reused
        time.sleep(0.0005)
    return got, held


@report_errors
def take_and_describe(out, rank, name, tp, n, async_prefetch, endpoint=None, leave=None):
    """With ``leave`` (an Event), close only once it is set: a rank that closes says BYE
    and the engine retires the group, and its pool with it."""
    with TaskClient(name, tp, rank, async_prefetch=async_prefetch, endpoint=endpoint) as client:
        out.put(("ready", rank, None))
        got, _ = _take_described(client, n)
        out.put(("taken", rank, (got, client.stats().get("shared_batches", 0))))
        if leave is not None:
            leave.wait(30)


@pytest.mark.parametrize("tp,async_prefetch", [(2, True), (2, False), (4, True), (4, False)],
                         ids=["tp2-async", "tp2-sync", "tp4-async", "tp4-sync"])
def test_batches_above_and_below_the_threshold_arrive_identical(name, procs, results,
                                                                 small_threshold, tp,
                                                                 async_prefetch):
    n = 8
    leave = SPAWN.Event()  # the ranks stay in the group until the pool was looked at
    with TaskQueue(name, tp, max_inflight=n) as queue:
        for rank in range(tp):
            procs(take_and_describe, results, rank, name, tp, n, async_prefetch, leave=leave)
        try:
            for i in range(n):
                queue.put_tasks(make_batch(i), timeout=30)
            taken = collect(results, "taken", tp)
            assert wait_until(lambda: queue.num_tasks() == 0, 10)
            # one pool for the group, no segment of their own: every shared batch fit in it
            assert len(pool_names(name)) == 1 and segment_names(name) == []
            assert shm_stats(queue)["shm_pool_batches"] == n // 2
        finally:
            leave.set()
    for rank, (batches, shared) in taken.items():
        assert batches == [expected(i) for i in range(n)], f"rank {rank}"
        assert shared == n // 2, f"rank {rank} mapped {shared} shared batches"
    assert shm_names(name) == []  # close() unlinked the pool


def hold_pool_creation(monkeypatch):
    """Make every pool creation in this process wait for ``finish`` (set it, or 30 s pass)
    after setting ``creating``: (creating, finish)."""
    creating, finish = threading.Event(), threading.Event()
    real_create = PayloadPool.create

    def slow_create(*args, **kwargs):
        creating.set()
        finish.wait(30)
        return real_create(*args, **kwargs)

    monkeypatch.setattr(PayloadPool, "create", slow_create)
    return creating, finish


def in_thread(fn):
    """Run ``fn`` in a daemon thread: (the thread, a list that gets what fn returned)."""
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


def test_the_engine_answers_while_its_first_shared_batch_creates_the_pool(
        name, procs, results, small_threshold, monkeypatch):
    """The first shared batch of a group creates the pool (0.17 s for 256 MiB here, longer
    on a loaded node). Only that put may wait for it: num_tasks(), the I/O thread freeing
    what the ranks consumed, and another producer's put (its large batch takes a segment
    of its own meanwhile) go on."""
    creating, finish = hold_pool_creation(monkeypatch)
    with TaskQueue(name, 2, max_inflight=8) as queue:
        for rank in range(2):
            procs(take_and_describe, results, rank, name, 2, 3, True)
        collect(results, "ready", 2)
        try:
            first, seqs = in_thread(lambda: queue.put_tasks(make_batch(0), timeout=30))
            assert creating.wait(10)
            queue.put_tasks(make_batch(1), timeout=10)  # below the threshold
            # the ranks take it and the engine frees it while the pool is being created
            answered, counts = in_thread(
                lambda: wait_until(lambda: queue.num_tasks() == 0, 20))
            answered.join(25)
            assert counts == [True], "num_tasks() waited for the pool's creation"
            other, other_seq = in_thread(lambda: queue.put_tasks(make_batch(2), timeout=10))
            other.join(15)
            assert other_seq, "a second producer's put waited for the pool's creation"
            assert not finish.is_set() and first.is_alive()  # the pool is still being made
        finally:
            finish.set()
        first.join(30)
        taken = collect(results, "taken", 2)
        stats = shm_stats(queue)
    assert seqs and other_seq[0] < seqs[0]
    for rank, (batches, shared) in taken.items():
        assert batches == [expected(1), expected(2), expected(0)], f"rank {rank}"
        assert shared == 2, f"rank {rank}"
    assert stats["shm_pool_batches"] == 1 and stats["shm_segment_batches"] == 1, stats


def test_close_during_the_pools_creation_leaves_no_name(name, monkeypatch):
    """close() does not wait for a pool being created; the pool is unlinked once its
    creation ends, and the put that created it gets no shared memory (its put raises
    ClosedError). The name fixture checks that nothing is left in /dev/shm."""
    monkeypatch.setenv("FD_SYNC_SHM_PAYLOAD_MIN_KB", str(THRESHOLD_KB))
    creating, finish = hold_pool_creation(monkeypatch)
    encoder = batch_encoder.BatchEncoder(name, 0, 2, node_local=True,
                                         max_message_bytes=1 << 30)
    put, out = in_thread(lambda: encoder.encode(make_batch(0)))
    try:
        assert creating.wait(10)
        closer, _ = in_thread(encoder.kept.close)
        closer.join(10)
        assert not closer.is_alive(), "close() waited for the pool's creation"
        assert put.is_alive()
    finally:
        finish.set()
    put.join(30)
    (batch,) = out
    assert batch.shared is None
    assert shm_names(name) == []


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
            assert len(pool_names(name)) == shared_expected
            (batches, shared), = collect(results, "taken", 1).values()
        assert batches == [(0, "big", [(xxhash.xxh3_64_hexdigest(big[1]["arrays"][0].tobytes()),
                                        "<i8", (1 << 17,), False)])]
        assert shared == shared_expected


@report_errors
def hold_batch_zero(out, rank, name, tp, phases, control):
    """Take ``phases`` rounds of batches (each round's count from the test), freeing every
    batch at once except, on rank 1, batch 0, which it holds until told to free it; then
    report that batch's description as read at the end."""
    with TaskClient(name, tp, rank) as client:
        held_batches = {}
        for phase, n in enumerate(phases):
            got, held = _take_described(client, n, hold=(0,) if rank == 1 else ())
            held_batches.update(held)
            del held
            out.put((f"phase{phase}", rank, got))
            if phase == 0 and rank == 1:
                assert control.get(timeout=60) == "free"
                still = describe(held_batches.pop(0))
                gc.collect()
                out.put(("freed", rank, still))


def test_a_region_is_reused_only_once_every_rank_freed_its_arrays(name, procs, results,
                                                                   small_threshold,
                                                                   monkeypatch):
    """A 1 MiB pool holds ~7 of these batches. Rank 1 keeps batch 0's arrays while 20
    more shared batches go through: the ring cannot pass that region, so no batch is
    written over it (rank 1 reads it unchanged at the end) and the batches that find
    the ring full take segments of their own. Once rank 1 frees the arrays, the next
    20 batches all reuse the pool."""
    import multiprocessing

    monkeypatch.setenv("FD_SYNC_SHM_POOL_MB", "1")
    # The pool alone: with the batch ring on, where batch 0 goes (a ring slot or the pool)
    # depends on whether the group's ring was open when it was put, i.e. on how fast the
    # ranks started, and the pool is pinned only in the second case.
    monkeypatch.setenv("FD_SYNC_SHM_RING_KB", "off")
    control = multiprocessing.get_context("spawn").Queue()
    first = [2 * i for i in range(21)]  # all above the threshold
    second = [2 * i for i in range(21, 41)]
    try:
        with TaskQueue(name, 2, max_inflight=2) as queue:
            for rank in range(2):
                procs(hold_batch_zero, results, rank, name, 2, (len(first), len(second)),
                      control)
            for i in first:
                queue.put_tasks(make_batch(i), timeout=30)
            phase0 = collect(results, "phase0", 2)
            after_first = shm_stats(queue)
            assert 2 <= after_first["shm_pool_batches"] < len(first)
            assert after_first["shm_segment_batches"] == len(first) - after_first["shm_pool_batches"]
            control.put("free")
            still = collect(results, "freed", 1)[1]
            for i in second:
                queue.put_tasks(make_batch(i), timeout=30)
            phase1 = collect(results, "phase1", 2)
            after_second = shm_stats(queue)
        for rank in range(2):
            assert phase0[rank] == [expected(i) for i in first], f"rank {rank}"
            assert phase1[rank] == [expected(i) for i in second], f"rank {rank}"
        assert still == expected(0)  # held through 20 batches: never written over
        assert after_second["shm_pool_batches"] - after_first["shm_pool_batches"] == len(second)
        assert after_second["shm_segment_batches"] == after_first["shm_segment_batches"]
    finally:
        control.close()
        control.join_thread()


@report_errors
def hold_until_queue_closed(out, rank, name, tp, n):
    with TaskClient(name, tp, rank) as client:
        got, held = _take_described(client, n, hold=(0,))
        prefix = names.shm_path(names.payload_prefix(name, 0))  # batches, pools and rings
        gone = wait_until(lambda: not glob.glob(prefix + "*"), 30)
        out.put(("held", rank, (gone, describe(held[0]))))


def test_a_view_outlives_the_pools_name(name, procs, results, small_threshold):
    tp, n = 2, 4
    queue = TaskQueue(name, tp, max_inflight=n)
    try:
        for rank in range(tp):
            procs(hold_until_queue_closed, results, rank, name, tp, n)
        for i in range(n):
            queue.put_tasks(make_batch(2 * i), timeout=30)
        assert wait_until(lambda: queue.num_tasks() == 0, 30)
    finally:
        queue.close(timeout=5)  # unlinks the pool while the ranks hold batch 0's arrays
    held = collect(results, "held", tp)
    for rank, (gone, batch) in held.items():
        assert gone, f"rank {rank} still saw the pool's name"
        assert batch == expected(0), f"rank {rank} read changed memory"


def test_batches_larger_than_the_pool_or_with_no_pool_take_a_segment_of_their_own(
        name, procs, results, small_threshold, monkeypatch):
    """The pool (1 MiB here) takes what fits; a 2 MiB batch gets its own segment, which is
    unlinked once consumed. FD_SYNC_SHM_POOL_MB=off: every shared batch gets its own."""
    big = (0, {"prompt": "big", "arrays": [np.arange(1 << 18, dtype=np.int64)]})  # 2 MiB
    for pool_mb, expect in (("1", {"shm_pool_batches": 1, "shm_segment_batches": 1}),
                            ("off", {"shm_segment_batches": 2})):
        monkeypatch.setenv("FD_SYNC_SHM_POOL_MB", pool_mb)
        with TaskQueue(name, 2) as queue:
            for rank in range(2):
                procs(take_and_describe, results, rank, name, 2, 2, True)
            queue.put_tasks(make_batch(0), timeout=10)
            queue.put_tasks(big, timeout=10)
            taken = collect(results, "taken", 2)
            assert wait_until(lambda: queue.num_tasks() == 0, 10)
            assert segment_names(name) == []  # consumed: unlinked
            stats = shm_stats(queue)
            assert {k: stats.get(k, 0) for k in expect} == expect, stats
            assert stats.get("shm_socket_fallbacks", 0) == 0
        for rank, (batches, shared) in taken.items():
            assert batches[0] == expected(0) and batches[1][0] == 0, f"rank {rank}"
            assert shared == 2


@report_errors
def engine_that_gets_killed(out, rank, name, n):
    os.environ["FD_SYNC_SHM_PAYLOAD_MIN_KB"] = str(THRESHOLD_KB)
    os.environ["FD_SYNC_SHM_POOL_MB"] = "1"
    queue = TaskQueue(name, 2, max_inflight=n + 1)
    for i in range(n):
        queue.put_tasks(make_batch(2 * i), timeout=10)  # no worker: all stay retained
    # larger than the pool: a segment of its own
    queue.put_tasks((99, [np.zeros(1 << 18, dtype=np.int64)]), timeout=10)
    out.put(("put", rank, os.getpid()))
    time.sleep(60)


def test_a_killed_engines_pool_and_segments_are_reclaimed(name, procs, doomed):
    n = 3
    engine = procs(engine_that_gets_killed, doomed, 0, name, n)
    collect(doomed, "put", 1, timeout=30)
    left = shm_names(name)
    assert len(pool_names(name)) == 1 and len(segment_names(name)) == 1, left
    assert all(path.endswith(f".{engine.pid}") for path in left), left
    ring = ring_names(name)
    ring_name = names.ring(name, 0, 1, engine.pid)
    sems = [names.semaphore_path(names.ring_semaphore(ring_name, r)) for r in range(2)]
    listed = [path for path, _ in _listed(name, "ring semaphore")]
    assert ring == [names.shm_path(ring_name)] and listed == sems, (ring, listed)
    os.kill(engine.pid, signal.SIGKILL)
    engine.join(timeout=10)
    assert shm_names(name) == left  # nobody removed them: SIGKILL runs no finalizer
    with TaskQueue(name, 2):
        assert shm_names(name) == []
        # the killed engine's ring and semaphores are gone; the new engine has its own
        assert ring_names(name) == [names.shm_path(names.ring(name, 0, 1))]
        assert not any(os.path.exists(path) for path in sems)
    # the name fixture checks that nothing else of the name is left either


def test_a_live_pool_is_never_reclaimed(name, small_threshold):
    """reclaim_stale skips a pool whose owner's lock is held, whatever its pid says."""
    with TaskQueue(name, 2) as queue:
        queue.put_tasks(make_batch(0), timeout=10)
        (pool,) = pool_names(name)
        assert payload_shm.reclaim_stale(name, 0) == []
        assert pool_names(name) == [pool]


@report_errors
def engine_that_exits_without_close(out, rank, name, n):
    os.environ["FD_SYNC_SHM_PAYLOAD_MIN_KB"] = str(THRESHOLD_KB)
    os.environ["FD_SYNC_SHM_POOL_MB"] = "1"
    queue = TaskQueue(name, 2, max_inflight=n + 1)
    for i in range(n):
        queue.put_tasks(make_batch(2 * i), timeout=10)
    queue.put_tasks((99, [np.zeros(1 << 18, dtype=np.int64)]), timeout=10)
    out.put(("put", rank, shm_names(name) + ring_names(name)))
    # returns without close(): the interpreter's exit runs the queue's finalizer


def test_an_engine_that_exits_without_close_leaves_nothing(name, procs, results):
    engine = procs(engine_that_exits_without_close, results, 0, name, 2)
    (left,) = collect(results, "put", 1, timeout=30).values()
    assert len(left) == 3  # the pool, one segment and the group's ring
    engine.join(timeout=20)
    assert engine.exitcode == 0
    assert shm_names(name) == []
    assert [entry for entry in os.listdir(names.SHM_DIR)  # nor the ring's semaphores
            if (parsed := names.parse_shm_entry(entry)) is not None and parsed.semaphore
            and parsed.name == name] == []


def test_close_unlinks_unconsumed_batches(name, small_threshold, monkeypatch):
    monkeypatch.setenv("FD_SYNC_SHM_POOL_MB", "1")
    queue = TaskQueue(name, 2, max_inflight=4)
    for i in range(3):
        queue.put_tasks(make_batch(2 * i), timeout=10)
    queue.put_tasks((99, [np.zeros(1 << 18, dtype=np.int64)]), timeout=10)
    assert len(pool_names(name)) == 1 and len(segment_names(name)) == 1
    assert queue.close(timeout=0.1) == [1, 2, 3, 4]
    assert shm_names(name) == []


def test_a_timed_out_put_gives_its_region_back(name, small_threshold, monkeypatch):
    monkeypatch.setenv("FD_SYNC_SHM_POOL_MB", "1")
    with TaskQueue(name, 2, max_inflight=1) as queue:
        queue.put_tasks(make_batch(0), timeout=10)
        held = shm_stats(queue)["shm_pool_held_bytes"]
        for _ in range(20):  # more than the pool holds, were the regions not given back
            with pytest.raises(TimeoutError):
                queue.put_tasks(make_batch(2), timeout=0.01)
        stats = shm_stats(queue)
        assert stats["shm_pool_held_bytes"] == held
        assert stats["shm_pool_batches"] == 21 and stats.get("shm_segment_batches", 0) == 0
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


def _pool_batch(name, pool, i, data_hash=True):
    """Write batch ``i`` into a region of ``pool``; return (frames, check, region)."""
    parts = codec.encode_parts(make_batch(i))
    region = pool.allocate(parts.data_size)
    region.write_payload(parts)
    ref = payload_shm.pack_ref(pool.name, parts.data_size, parts.offsets, stamp=region.stamp,
                               start=region.start,
                               data_hash=parts.data_hash() if data_hash else 0)
    assert parts.data_hash() == xxhash.xxh3_64(parts.frames()[2]).intdigest()
    return [parts.body, ref], codec.payload_checksum([parts.body, ref]), region


def test_a_reference_is_checked_before_anything_is_mapped_or_unpickled(name):
    pool = PayloadPool.create(names.pool(name, 0, 1), 2, 1 << 20)
    try:
        frames, check, region = _pool_batch(name, pool, 0)
        reader = payload_shm.PayloadReader(name, 0, 2, 1)
        tasks = reader.decode(*frames, check)
        assert describe(tasks) == expected(0)
        with pytest.raises(ValueError):  # read-only all the way down
            tasks[1]["arrays"][0][0] = 1
        body, ref = frames

        def decode(body, ref, check=None, tp=2, queue=name):
            check = codec.payload_checksum([body, ref]) if check is None else check
            return payload_shm.PayloadReader(queue, 0, tp, 0).decode(body, ref, check)

        def ref_with(**changes):
            r = payload_shm.unpack_ref(ref)
            fields = dict(stamp=r.stamp, start=r.start, data_hash=r.data_hash)
            fields.update({k: v for k, v in changes.items() if k in fields})
            return payload_shm.pack_ref(changes.get("name", r.name), changes.get("size", r.size),
                                        bytes(r.offsets), **fields)

        # the checksum covers body and reference: a flipped byte in either is caught first
        for bad_body, bad_ref in ((body[:-2] + b"\x00.", ref), (body, ref[:-1] + b"X")):
            with pytest.raises(ProtocolError, match="checksum mismatch"):
                decode(bad_body, bad_ref, check)
        # (a sender that recomputes the checksum) another queue's name, a region outside
        # the pool, a stamp the region does not hold, a group of another size, a truncated
        # or foreign reference
        with pytest.raises(ProtocolError, match="outside this queue"):
            decode(body, ref, queue=name + "x")
        with pytest.raises(ProtocolError, match="outside its"):
            decode(body, ref_with(start=(1 << 20) - 64))
        with pytest.raises(ProtocolError, match="holds stamp"):
            decode(body, ref_with(stamp=region.stamp + 1))
        with pytest.raises(ProtocolError, match="tp_size"):
            decode(body, ref, tp=4)
        for bad in (ref[:-1], ref[:10], b"XXXX" + ref[4:]):
            with pytest.raises(ProtocolError):
                decode(body, bad)
        # the shared bytes: one flipped byte is caught by their hash before unpickling
        data = pool._data
        pos = region.start + 3
        data[pos] ^= 1
        with pytest.raises(ProtocolError, match="hash to"):
            decode(body, ref)
        data[pos] ^= 1
        assert describe(decode(body, ref)) == expected(0)
        # a segment of its own that is gone: the group was retired or the queue closed
        with pytest.raises(GroupLostError):
            decode(body, ref_with(name=names.batch_segment(name, 0, 7), stamp=0, start=0))
    finally:
        pool.close()
    assert shm_names(name) == []
    assert describe(tasks)[2][0][0] == expected(0)[2][0][0]  # still mapped after the unlink


def test_a_rank_releases_a_region_when_its_last_array_is_freed(name):
    pool = PayloadPool.create(names.pool(name, 0, 1), 2, 1 << 20)
    try:
        frames, check, region = _pool_batch(name, pool, 0, data_hash=False)
        pool.kept(region)
        pool.consumed(region)
        readers = [payload_shm.PayloadReader(name, 0, 2, rank) for rank in range(2)]
        decoded = [reader.decode(*frames, check) for reader in readers]
        arrays = decoded[1][1]["arrays"]
        del decoded[1]
        gc.collect()
        assert pool.allocate(pool.data_size) is None  # both ranks still hold arrays
        del decoded[0]
        gc.collect()
        assert pool.allocate(pool.data_size) is None  # rank 1 holds two arrays
        arrays.pop()
        gc.collect()
        assert pool.allocate(pool.data_size) is None  # and still one
        del arrays
        gc.collect()
        assert pool.allocate(pool.data_size) is not None  # every rank freed everything
    finally:
        pool.close()


@report_errors
def take_then_hang(out, rank, name, tp, n):
    from fastdeploy_sync import Heartbeat

    with TaskClient(name, tp, rank, heartbeat=Heartbeat(0.2, 1.0)) as client:
        _take_described(client, n)
        out.put(("took", rank, os.getpid()))
        time.sleep(60)


def test_a_retired_groups_shared_batches_come_back_and_its_pool_is_unlinked(
        name, procs, doomed, small_threshold, monkeypatch):
    from fastdeploy_sync import Heartbeat

    monkeypatch.setenv("FD_SYNC_SHM_POOL_MB", "1")
    with TaskQueue(name, 1, heartbeat=Heartbeat(0.2, 1.0)) as queue:
        worker = procs(take_then_hang, doomed, 0, name, 1, 1)
        queue.put_tasks(make_batch(0), timeout=10)
        collect(doomed, "took", 1, timeout=30)
        os.kill(worker.pid, signal.SIGKILL)
        queue.put_tasks(make_batch(2), timeout=10)  # never taken: the group is dead
        queue.put_tasks(make_batch(3), timeout=10)  # below the threshold
        queue.put_tasks((4, {"prompt": "own segment", "arrays": [np.ones(1 << 18)]}),
                        timeout=10)  # larger than the pool
        event = queue.group_events.get(timeout=15)
        assert [b.seq for b in event.unfinished] == [2, 3, 4]
        assert shm_names(name) == []  # retired: nothing retained, nothing named
        # decoded from the unlinked pool and segment, which the arrays keep mapped
        lost = [b.tasks for b in event.unfinished]
        assert [describe(t) for t in lost[:2]] == [expected(2), expected(3)]
        assert lost[2][1]["arrays"][0].sum() == 1 << 18
        # the next group's first shared batch gets a new pool
        queue.put_tasks(make_batch(6), timeout=10)
        assert len(pool_names(name)) == 1 and shm_stats(queue)["shm_pools_created"] == 2


def _mapped_shm(name):
    """The shared batches and pools of queue ``name`` this process has mapped (deleted or
    not)."""
    with open("/proc/self/maps") as maps:
        return sorted({line.split(None, 5)[5].strip() for line in maps
                       if names.shm_path(names.payload_prefix(name, 0)) in line})


def test_a_held_group_lost_event_holds_its_batches_not_the_retired_pool(
        name, procs, doomed, small_threshold, monkeypatch):
    """Each held GroupLost event used to pin its retired group's whole pool (the decoded
    arrays viewed the pool's mapping): 1.5 GiB after six groups of a 256 MiB pool. The
    event's batches are now private copies: once retired, neither the pool nor a batch's
    own segment stays mapped while the event (and its arrays) are held."""
    from fastdeploy_sync import Heartbeat

    monkeypatch.setenv("FD_SYNC_SHM_POOL_MB", "4")
    with TaskQueue(name, 1, heartbeat=Heartbeat(0.2, 1.0)) as queue:
        worker = procs(take_then_hang, doomed, 0, name, 1, 1)
        queue.put_tasks(make_batch(0), timeout=10)
        collect(doomed, "took", 1, timeout=30)
        os.kill(worker.pid, signal.SIGKILL)
        queue.put_tasks(make_batch(2), timeout=10)  # in the pool, never taken
        queue.put_tasks((4, {"prompt": "own segment", "arrays": [np.ones(1 << 20)]}),
                        timeout=10)  # 8 MiB, larger than the pool: a segment of its own
        assert any(".dp0.bp" in n for n in _mapped_shm(name)), _mapped_shm(name)
        event = queue.group_events.get(timeout=15)
        assert [b.seq for b in event.unfinished] == [2, 3]
        lost = [b.tasks for b in event.unfinished]
        assert describe(lost[0]) == expected(2)
        assert lost[1][1]["arrays"][0].sum() == 1 << 20
        assert not lost[0][1]["arrays"][0].flags.writeable  # still read-only, as documented
        gc.collect()
        # mapped still: only the next group's ring (epoch 2), which the engine made for it
        assert wait_until(lambda: [n for n in _mapped_shm(name) if ".dp0.br2." not in n]
                          == [], 10), _mapped_shm(name)
        assert describe(lost[0]) == expected(2)  # the event's data is intact


@pytest.mark.parametrize("setting,hashed", [(None, False), ("1", True)],
                         ids=["default-unhashed", "FD_SYNC_SHM_CHECKSUM=1"])
def test_shared_bytes_are_hashed_only_when_asked(name, procs, results, small_threshold,
                                                 monkeypatch, setting, hashed):
    """By default the reference carries no hash of the shared bytes (body and reference
    are checked); FD_SYNC_SHM_CHECKSUM=1 hashes them. Batches arrive identical either way."""
    if setting is None:
        monkeypatch.delenv("FD_SYNC_SHM_CHECKSUM", raising=False)
    else:
        monkeypatch.setenv("FD_SYNC_SHM_CHECKSUM", setting)
    seen = []
    import fastdeploy_sync.engine.encoder as be

    real = be.payload.pack_ref

    def spy(*args, **kwargs):
        seen.append(kwargs["data_hash"])
        return real(*args, **kwargs)

    monkeypatch.setattr(be.payload, "pack_ref", spy)
    with TaskQueue(name, 2, max_inflight=4) as queue:
        for rank in range(2):
            procs(take_and_describe, results, rank, name, 2, 4, True)
        for i in range(4):
            queue.put_tasks(make_batch(i), timeout=30)
        taken = collect(results, "taken", 2)
    assert len(seen) == 2 and all((h != 0) == hashed for h in seen), seen
    for batches, shared in taken.values():
        assert batches == [expected(i) for i in range(4)] and shared == 2


@report_errors
def mutate_references(out, rank, name, inputs, seed):
    """Decode ``inputs`` mutations of a pool batch's body and reference, the checksum
    recomputed each time (what a buggy sender could produce): count the outcomes."""
    import random

    rng = random.Random(seed)
    pool = PayloadPool.create(names.pool(name, 0, 1), 2, 1 << 20)
    outcomes = {"decoded": 0, "ProtocolError": 0, "GroupLostError": 0}
    try:
        (body, ref), _, _ = _pool_batch(name, pool, 0, data_hash=rng.random() < 0.5)
        reader = payload_shm.PayloadReader(name, 0, 2, 1)
        for _ in range(inputs):
            mutated = bytearray(ref)
            kind = rng.random()
            if kind < 0.5:  # flip bytes anywhere: header fields, offsets, name
                for _ in range(rng.randint(1, 4)):
                    mutated[rng.randrange(len(mutated))] ^= 1 << rng.randrange(8)
            elif kind < 0.8:  # a plausible field with a hostile value
                field = rng.choice((8, 20, 24, 32, 40, 48, 56))
                value = rng.choice((0, 1, -1, 1 << 20, (1 << 63) - 1, -(1 << 63),
                                    rng.randrange(-(1 << 40), 1 << 40)))
                mutated[field:field + 8] = value.to_bytes(8, "little", signed=True)
            else:  # cut or extend
                mutated = mutated[:rng.randrange(len(mutated))] if rng.random() < 0.5 else \
                    mutated + bytes(rng.randrange(1, 64))
            frames = [body, bytes(mutated)]
            try:
                reader.decode(*frames, codec.payload_checksum(frames))
                outcomes["decoded"] += 1
            except (ProtocolError, GroupLostError) as exc:
                outcomes[type(exc).__name__] += 1
    finally:
        pool.close()
    out.put(("outcomes", rank, outcomes))


def test_mutated_references_are_refused_cleanly(name, procs, results):
    """Decoding stays total on the shared-memory path too: 3000 mutated references with
    a recomputed checksum, in a child process, give ProtocolError or GroupLostError (or
    decode a batch with different array contents), never another exception, a crash or
    a large allocation."""
    inputs = 3000
    child = procs(mutate_references, results, 0, name, inputs, 20261124)
    outcomes = collect(results, "outcomes", 1, timeout=120)[0]
    child.join(timeout=30)
    assert child.exitcode == 0, f"the decoding child exited with {child.exitcode}"
    assert sum(outcomes.values()) == inputs, outcomes
    assert outcomes["ProtocolError"] > inputs // 2, outcomes


def test_a_retired_pool_closed_by_a_discard_still_decodes_its_lost_batches(name, monkeypatch):
    """_retire decodes the retired group's batches outside the engine's mutex; a put
    timing out in another thread meanwhile discards the last pending region of that pool,
    which closes it. The LostBatch decode must still find the bytes."""
    from fastdeploy_sync.engine.encoder import BatchEncoder

    monkeypatch.setenv("FD_SYNC_SHM_PAYLOAD_MIN_KB", str(THRESHOLD_KB))
    encoder = BatchEncoder(name, 0, 2, node_local=True, max_message_bytes=1 << 30)
    try:
        kept = encoder.encode(make_batch(0))
        frames, _ = encoder.kept.enqueue(1, 1, kept)
        pending = encoder.encode(make_batch(2))  # a put still waiting for room
        dropped = encoder.kept.drop_all(2)  # the group is retired
        encoder.kept.discard(pending)  # the waiting put times out: the retired pool is idle
        assert pool_names(name) == []  # ... and unlinked
        assert describe(encoder.kept.decode_retained(frames, dropped[1])) == expected(0)
        encoder.kept.forget(dropped)
    finally:
        encoder.kept.close()


def test_the_engine_writes_into_a_new_pool_without_page_faults(name):
    """The pool's pages are reserved and mapped when it is created (posix_fallocate, then
    MAP_POPULATE), so the engine's copy of a batch never takes a page fault, even on the
    ring's first lap: the property the pool exists for (issue 16). Without MAP_POPULATE
    these 4 MiB took 1 026 minor faults."""
    import resource

    pool = PayloadPool.create(names.pool(name, 0, 1), 2, 8 << 20)
    try:
        parts = codec.encode_parts({"ids": np.arange(1 << 17, dtype=np.int64)})  # 1 MiB
        regions = []
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(4):  # 4 MiB of never-written pool pages
            region = pool.allocate(parts.data_size)
            region.write_payload(parts)
            regions.append(region)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert faults < 64, f"{faults} minor faults writing 4 MiB (1024 pages) into the pool"
    finally:
        for region in regions:
            pool.discarded(region)
        pool.close()


# One process holds the engine and a sync-mode rank (it decodes when it steps): a shared
# batch is taken and its array kept (it views the pool), the next one is put, another
# process of this user truncates the pool's file, then the rank reads the kept array and
# steps, and the engine puts again. Prints what each side got; a SIGBUS would end the
# process instead.
_TRUNCATED_POOL = """
import glob, os, sys
import numpy as np
from fastdeploy_sync import TaskClient, TaskQueue
name = sys.argv[1]
with TaskQueue(name, 1) as queue, TaskClient(name, 1, 0, async_prefetch=False) as client:
    queue.put_tasks(np.arange(1 << 15), timeout=10)          # 256 KiB: into the pool
    got = []
    while not got:
        got = client.sync_step(timeout=10)
    kept = got[0]                                            # a view of the pool, kept
    queue.put_tasks(np.arange(1 << 15) + 1, timeout=10)      # written into the pool
    [pool] = glob.glob(f"/dev/shm/fdsync.{name}.dp0.bp*")
    os.truncate(pool, 0)                                     # what another process could do
    print("kept", int(kept.sum()), flush=True)
    try:
        (second,) = client.sync_step(timeout=10)
        print("rank took", int(second.sum()))
    except Exception as exc:
        print("rank raised", type(exc).__name__, str(exc)[:200])
    seq = queue.put_tasks(np.arange(1 << 15) + 2, timeout=10)  # the engine writes again
    print("engine put", seq, queue.stats().get("shm_socket_fallbacks", 0))
    queue.close(timeout=0)
"""


def test_truncating_the_pools_file_does_not_reach_the_pool(name, small_threshold, monkeypatch):
    """A same-user process truncates the pool's file under a live group while the rank
    keeps an array of an earlier batch: that file is only the pool's anchor (its memory is
    a sealed memfd), so the kept array reads whole, the rank takes the next batch from the
    pool and the engine's next put still goes into it. Before: the kept array was a SIGBUS
    (and before that, both the rank and the engine died of it)."""
    import subprocess
    import sys

    monkeypatch.setenv("FD_SYNC_SHM_POOL_MB", "4")
    out = subprocess.run([sys.executable, "-c", _TRUNCATED_POOL, name], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr[-2000:])
    lines = out.stdout.splitlines()
    n = 1 << 15
    assert lines[0] == f"kept {n * (n - 1) // 2}", lines
    assert lines[1] == f"rank took {n * (n - 1) // 2 + n}", lines
    assert lines[2] == "engine put 3 0", lines  # into the pool, no socket fallback
