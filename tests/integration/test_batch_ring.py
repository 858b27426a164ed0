"""The node-local ring (batch_ring): slots reused only once every view is freed, a full ring
falls back to the socket in order, and what another process of this user does to the ring
(overwrites, truncates) is an error or nothing, never a wrong batch or a SIGBUS."""

import glob
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from conftest import TESTS
from fastdeploy_sync import ProtocolError, TaskClient, TaskQueue, names
from fastdeploy_sync.shm.sealed import SealedSegment
from workers import wait_until


def _take(client, timeout=10):
    assert wait_until(client.exist_tasks, timeout=timeout), "no batch became takeable"
    client.barrier(timeout=timeout)
    return client.get_tasks()[0]


def _ring_paths(name, epoch=1):
    """The files of queue ``name``'s batch ring of worker group ``epoch`` (DP group 0), of
    any engine pid: what the library names so (``names.ring``), read back by its parser."""
    found = []
    for entry in sorted(os.listdir(names.SHM_DIR)):
        parsed = names.parse_shm_entry(entry)
        if parsed is not None and parsed.kind == "ring" and parsed.name == name \
                and "/" + entry == names.ring(name, 0, epoch, parsed.pid):
            found.append(names.shm_path("/" + entry))
    return found


def _ring_name(name):
    (path,) = _ring_paths(name)
    return "/" + os.path.basename(path)


@pytest.mark.parametrize("async_prefetch", [True, False], ids=["async", "sync"])
def test_a_slot_is_reused_only_once_every_view_of_it_is_freed(name, async_prefetch):
    """max_inflight=1: a ring of 4 slots. The first batch's array stays held while 12 more
    pass: they take the 3 other slots in turn, and the held array never changes."""
    with TaskQueue(name, 1, max_inflight=1) as queue, \
            TaskClient(name, 1, 0, async_prefetch=async_prefetch) as client:
        queue.put_tasks({"ids": np.full(4096, 7, dtype=np.int64)}, timeout=5)
        (first,) = _take(client)
        held = first["ids"]
        assert not held.flags.writeable
        for i in range(12):
            queue.put_tasks({"ids": np.full(4096, 100 + i, dtype=np.int64)}, timeout=5)
            (batch,) = _take(client)
            assert (batch["ids"] == 100 + i).all()
            del batch
        assert (held == 7).all(), "a slot was written while a rank still viewed it"
        stats = queue.stats()
        assert stats["shm_ring_batches"] == 13 and stats.get("sent", 0) == 0, stats


def test_a_full_ring_falls_back_to_the_socket_in_order(name):
    """Every slot held by arrays the rank keeps: the next batches travel over the socket,
    and the rank takes them all, in put order; once the arrays are freed, the ring again."""
    with TaskQueue(name, 1, max_inflight=1) as queue, \
            TaskClient(name, 1, 0, async_prefetch=True) as client:
        kept = []
        for i in range(8):
            queue.put_tasks({"i": i, "ids": np.full(1024, i, dtype=np.int64)}, timeout=5)
            (batch,) = _take(client)
            assert batch["i"] == i and (batch["ids"] == i).all()
            kept.append(batch)
        stats = queue.stats()
        assert stats["shm_ring_batches"] == 4 and stats["sent"] == 4, stats
        kept.clear()  # every view freed: the slots come back
        queue.put_tasks({"i": 8, "ids": np.zeros(1024, dtype=np.int64)}, timeout=5)
        assert _take(client)[0]["i"] == 8
        assert queue.stats()["shm_ring_batches"] == 5


def test_an_overwritten_batch_is_refused_before_it_is_unpickled(name):
    """Another process of this user writes into a slot after the engine published the
    batch: the checksum over the pickle body fails before anything is unpickled. (Sync
    mode: no prefetch thread decodes the batch before the overwrite; both threads decode
    through the same checks.)"""
    with TaskQueue(name, 1) as queue, TaskClient(name, 1, 0, async_prefetch=False) as client:
        assert wait_until(lambda: client.num_tasks() >= 0 and client.stats()["ring"],
                          timeout=10)
        queue.put_tasks({"ids": np.arange(512, dtype=np.int64), "tag": "x" * 64}, timeout=5)
        seg = SealedSegment.attach(_ring_name(name))  # the ring's memory, as a rank maps it
        try:
            words = seg.view
            slot_bytes, descs, data_offset = words[5], words[6], words[10]
            desc = 16 + (1 % descs) * 8  # seq 1's descriptor: kind | slot << 8, ..., lengths
            slot, body_len, offsets_len, data_len = words[desc + 1] >> 8, *words[desc + 5:desc + 8]
            body = data_offset + slot * slot_bytes + data_len + offsets_len
            raw = words.cast("B")
            raw[body + body_len // 2] ^= 0xFF  # one byte in the middle of the pickle body
            del raw, words
        finally:
            seg.close()
        with pytest.raises(ProtocolError, match="checksum"):
            _take(client)


_TRUNCATE = textwrap.dedent("""
    import glob, os, sys, time
    import numpy as np
    sys.path.insert(0, {tests!r})
    from fastdeploy_sync import TaskClient, TaskQueue, TaskSyncError, names
    from workers import wait_until
    name = {name!r}
    with TaskQueue(name, 1) as queue, TaskClient(name, 1, 0, async_prefetch=False) as client:
        wait_until(lambda: client.num_tasks() >= 0 and client.stats()["ring"], timeout=10)
        path = names.shm_path(names.ring(name, 0, 1))  # this process is the engine
        queue.put_tasks({{"ids": np.arange(4096, dtype=np.int64)}}, timeout=5)
        os.truncate(path, 8192)  # the header survives, the slots do not
        try:
            wait_until(client.exist_tasks, timeout=5)
            client.barrier(timeout=5)
            client.get_tasks()
            print("TOOK")
        except TaskSyncError as exc:
            print("RAISED", type(exc).__name__, exc)
        # the engine's next put must not write into the missing pages either
        try:
            queue.put_tasks({{"ids": np.arange(4096, dtype=np.int64)}}, timeout=2)
            print("PUT", queue.stats().get("sent", 0))
        except Exception as exc:
            print("PUT RAISED", type(exc).__name__)
""")


def test_truncating_the_rings_file_does_not_reach_the_ring(name):
    """Another process of this user truncates the ring's file in /dev/shm between the put
    and the take: that file is only the ring's anchor (its memory is a sealed memfd), so
    the rank takes the batch and the engine's next put still goes through the ring;
    nobody dies of SIGBUS."""
    tests = TESTS
    code = _TRUNCATE.format(tests=tests, name=name)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ))
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "TOOK" in proc.stdout and "PUT 0" in proc.stdout, proc.stdout


class _SlowToLeaveSemaphore:
    """The ring semaphore of a rank, but a waiter woken from it takes 50 ms to leave (a
    thread the scheduler does not run at once): records whether it was closed while a
    waiter was still inside (with a real semaphore: a SIGSEGV in the waiter)."""

    def __init__(self, sem):
        self._sem, self.inside, self.closed_under_a_waiter = sem, 0, False

    def acquire(self, *args):
        self.inside += 1
        try:
            return self._sem.acquire(*args)
        finally:
            time.sleep(0.05)
            self.inside -= 1

    def close(self):
        self.closed_under_a_waiter |= self.inside > 0
        self._sem.close()

    def __getattr__(self, attr):
        return getattr(self._sem, attr)


def test_close_from_another_thread_frees_the_ring_semaphore_only_once_the_waiter_left(name):
    """Sync mode: the event loop's thread waits in wait_for_tasks() on the ring's semaphore
    while another thread closes the client. Before: close() posted the semaphore and closed
    it at once, under the woken waiter (a rank died of SIGSEGV in a CI run:
    test_close_threads.py's wait_for_tasks-sync case). Now it waits for the waiter to leave."""
    import threading

    from fastdeploy_sync import ClosedError

    with TaskQueue(name, 1):
        client = TaskClient(name, 1, 0, async_prefetch=False)
        # sync mode: num_tasks() receives the WELCOME, which attaches the ring
        assert wait_until(lambda: client.num_tasks() == 0 and client._ring.reader is not None)
        reader = client._ring.reader
        sem = reader._sem = _SlowToLeaveSemaphore(reader._sem)
        raised = []

        def loop():
            try:
                while True:
                    client.wait_for_tasks(10)
            except ClosedError as exc:
                raised.append(exc)

        thread = threading.Thread(target=loop)
        thread.start()
        assert wait_until(lambda: sem.inside > 0)
        client.close()
        thread.join(timeout=10)
        assert not thread.is_alive()
        assert raised, "wait_for_tasks() did not raise ClosedError after close()"
        assert not sem.closed_under_a_waiter


_KEEPER = textwrap.dedent("""
    import sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    from fastdeploy_sync import TaskClient, TaskQueue
    from workers import wait_until
    name = {name!r}

    def take(client):
        assert wait_until(client.exist_tasks, timeout=10)
        client.barrier(timeout=10)
        return client.get_tasks()[0]

    with TaskQueue(name, 1) as queue, TaskClient(name, 1, 0, async_prefetch=False) as client:
        queue.put_tasks({{"ids": np.arange(4096, dtype=np.int64)}}, timeout=5)
        (batch,) = take(client)
        assert client.stats()["ring"], client.stats()
        held = batch["ids"]  # kept, as a slot's arrays may be
        print("HELD", flush=True)
        sys.stdin.readline()  # meanwhile another process truncates what it can reach
        print("SUM", int(held.sum()), flush=True)
        queue.put_tasks({{"ids": np.full(4096, 3, dtype=np.int64)}}, timeout=5)
        (batch,) = take(client)
        print("NEXT", int(batch["ids"].sum()), flush=True)
""")


def test_arrays_kept_after_the_take_survive_truncation_of_the_ring(name):
    """A rank keeps the arrays of a batch it took; then another process of this user
    truncates the ring's file in /dev/shm, and every shared-memory file the rank's process
    has open that it can reach: the rank reads its arrays, takes the next batch and exits
    normally (it died of SIGBUS, exit -7, while the ring was a plain /dev/shm file)."""
    code = _KEEPER.format(tests=TESTS, name=name)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ))
    try:
        assert proc.stdout.readline().strip() == "HELD", proc.stderr.read()
        truncated, refused = [], []
        for path in _ring_paths(name):
            os.truncate(path, 0)
            truncated.append(path)
        for link in glob.glob(f"/proc/{proc.pid}/fd/*"):
            try:
                if os.readlink(link).startswith("/memfd:"):
                    os.truncate(link, 0)
                    truncated.append(link)
            except PermissionError:
                refused.append(link)  # sealed: F_SEAL_SHRINK
            except OSError:
                pass  # closed meanwhile
        assert truncated or refused, "found no ring to truncate"
        out, err = proc.communicate("go\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0, (proc.returncode, truncated, refused, err[-2000:])
    assert f"SUM {sum(range(4096))}" in out and f"NEXT {3 * 4096}" in out, out
