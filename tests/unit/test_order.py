"""shm.order: release stores and acquire loads on shared memory words.

The message-passing test is the litmus test of the helper: a writer process publishes
four data words and then a flag with ``store_release``; a reader process that sees the flag
with ``load_acquire`` must see data at least that new. On a weakly ordered host (aarch64)
it catches a missing or misplaced fence; on x86-64 (which keeps store->store and
load->load order) it checks the helper's values and indices across processes."""

import mmap
import multiprocessing
import threading
import time

from fastdeploy_sync.shm import order

FORK = multiprocessing.get_context("fork")
_ROUNDS = 20000


def _words(n):
    return memoryview(mmap.mmap(-1, n * 8)).cast("q")


def test_a_release_store_and_an_acquire_load_move_the_value():
    w = _words(8)
    order.store_release(w, 3, -(1 << 62))
    assert w[3] == -(1 << 62) and order.load_acquire(w, 3) == -(1 << 62)
    assert [w[i] for i in range(8) if i != 3] == [0] * 7
    order.fence()


def test_fences_from_many_threads_neither_deadlock_nor_lose_stores():
    """The fence shares one lock: threads fencing at once each pass, and every thread's
    release store lands in its own word."""
    w = _words(8)
    errors = []

    def run(i):
        try:
            for n in range(1, 5001):
                order.store_release(w, i, n)
                if order.load_acquire(w, i) != n:
                    errors.append((i, n))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a fence blocked"
    assert not errors, errors[:5]
    assert [w[i] for i in range(8)] == [5000] * 8


def _writer(words):
    for n in range(1, _ROUNDS + 1):
        for i in range(1, 5):
            words[i] = n
        order.store_release(words, 0, n)


def test_a_reader_that_sees_the_flag_sees_the_data_it_publishes():
    w = _words(8)
    proc = FORK.Process(target=_writer, args=(w,), daemon=True)
    proc.start()
    try:
        stale, seen = [], 0
        deadline = time.monotonic() + 120
        while seen < _ROUNDS and proc.exitcode in (None, 0) and time.monotonic() < deadline:
            flag = order.load_acquire(w, 0)
            if flag == seen:
                if proc.exitcode is not None:
                    break
                continue
            data = [w[i] for i in range(1, 5)]
            if min(data) < flag:
                stale.append((flag, data))
            seen = flag
        proc.join(timeout=60)
        assert proc.exitcode == 0, proc.exitcode
        assert order.load_acquire(w, 0) == _ROUNDS
        assert not stale, f"saw the flag before its data: {stale[:5]}"
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
