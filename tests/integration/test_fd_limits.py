"""File descriptors: an engine started under the common soft limit of 1024 survives 1000
producers connecting at once (libzmq aborted it: "Too many open files"), serves its group
throughout, refuses producers beyond its bound with a clear error, and serves producers
again once they are gone. A real engine process, real connections. And the limit stays
the application's: raised while a queue is open, given back by close(), so children
started afterwards read the application's own."""

import gc
import multiprocessing
import os
import resource
import select
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from fastdeploy_sync import TaskProducer, TaskQueue, names
from fastdeploy_sync.engine.producer_endpoint import MAX_PRODUCERS
from fastdeploy_sync.testing.processes import reap
from fastdeploy_sync.wire.endpoints import default_endpoint, ipc_path
from workers import wait_until

# An engine under a soft limit of 1024 with a TP=1 rank in the same process: it prints
# its soft limit once, then "<batches taken>" every 0.1 s, putting a batch every 10 ms.
_ENGINE = textwrap.dedent("""
    import resource, sys, threading, time
    from fastdeploy_sync import TaskClient, TaskQueue
    name = sys.argv[1]
    taken = [0]
    with TaskQueue(name, 1) as queue, TaskClient(name, 1, 0) as client:
        print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], flush=True)
        def take():
            while True:
                taken[0] += len(client.sync_step(timeout=30))
                time.sleep(0.002)
        threading.Thread(target=take, daemon=True).start()
        while True:
            for _ in range(10):
                queue.put_tasks(b"x", timeout=30)
                time.sleep(0.01)
            print(taken[0], flush=True)
    """)


def _soft_1024():
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))


@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 4096,
                    reason="the hard limit of open files is below 4096: nothing to raise to")
def test_a_thousand_producers_at_once_under_a_soft_limit_of_1024(name):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))  # this side's
    engine = subprocess.Popen([sys.executable, "-c", _ENGINE, name], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, preexec_fn=_soft_1024)
    lines = []
    reader = threading.Thread(target=lambda: [lines.append(int(line)) for line in engine.stdout],
                              daemon=True)
    reader.start()
    conns = []
    try:
        wait_until(lambda: len(lines) >= 3, timeout=30, interval=0.05,
                   what="the engine's first three fd-count lines",
                   seen=lambda: (lines, engine.stderr.read() if engine.poll() is not None else ""))
        assert lines[0] > 1024  # raised to the hard limit at start
        taken = lines[-1]
        path = ipc_path(default_endpoint(name, 0, "put"))
        for _ in range(1000):  # at once, as fast as connect() goes
            conn = socket.socket(socket.AF_UNIX)
            conn.connect(path)
            conns.append(conn)
        time.sleep(0.5)
        assert engine.poll() is None, engine.stderr.read()  # before: SIGABRT
        with pytest.raises(ConnectionRefusedError, match=f"at most {MAX_PRODUCERS} producer"):
            TaskProducer(name, timeout=5)
        for conn in conns:
            conn.close()
        conns.clear()
        time.sleep(1.5)  # the refused ones cut, the others closed
        with TaskProducer(name, timeout=5) as producer:
            assert producer.put_tasks(b"from a producer", timeout=5) > 0
        assert engine.poll() is None, engine.stderr.read()
        assert lines[-1] - taken >= 100  # the group was served throughout
    finally:
        for conn in conns:
            conn.close()
        engine.kill()
        engine.wait(timeout=30)
        reader.join(timeout=10)
        engine.stdout.close()
        engine.stderr.close()
        for path in [ipc_path(default_endpoint(name, 0)), ipc_path(default_endpoint(name, 0, "put"))]:
            if os.path.exists(path):
                os.unlink(path)
        for leftover in os.listdir(names.SHM_DIR):  # the killed engine's segments, semaphores
            parsed = names.parse_shm_entry(leftover)
            if parsed is not None and parsed.name == name:
                os.unlink(os.path.join(names.SHM_DIR, leftover))


# -- the limit stays the application's ---------------------------------------------------

_PRINT_SOFT = "import resource; print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])"


def _soft():
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _started_child_soft():
    """The soft limit a child the application starts now (``subprocess``) reads."""
    out = subprocess.run([sys.executable, "-c", _PRINT_SOFT], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def _forked_child_soft():
    """The soft limit a child forked now reads (it writes it on a pipe and exits)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(w, str(_soft()).encode())
        finally:
            os._exit(0)
    os.close(w)
    deadline = time.monotonic() + 30
    try:
        with os.fdopen(r, "rb") as f:
            assert select.select([f], [], [], 30)[0], "the forked child did not write"
            return int(f.read())  # EOF when the child exits: at once
    finally:
        reap(pid, max(0.0, deadline - time.monotonic()))


@pytest.fixture
def low_soft_limit():
    """The test process's soft limit of open files set to 1024 (below its hard limit) for
    the test, and the one it had put back afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip(f"the hard limit of open files is {hard}: nothing to raise to")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    yield 1024
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_close_gives_the_application_its_limit_back(name, low_soft_limit):
    """Before: building a TaskQueue raised the soft limit to the hard limit for good: it
    stayed raised after close(), and every child started afterwards (subprocess, spawn)
    inherited it."""
    gc.disable()  # close() gives it back, not the garbage collector
    try:
        queue = TaskQueue(name, 1)
        try:
            assert _soft() > low_soft_limit  # raised while open: libzmq must not run out
            assert _forked_child_soft() == low_soft_limit  # a forked child: its own at once
        finally:
            queue.close(timeout=0)
        assert _soft() == low_soft_limit
        assert _started_child_soft() == low_soft_limit
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            assert pool.apply_async(_soft).get(timeout=60) == low_soft_limit
    finally:
        gc.enable()


def test_the_limit_is_given_back_when_the_last_queue_closes(name, low_soft_limit):
    first = TaskQueue(name, 1)
    try:
        second = TaskQueue(name, 1, dp_id=1)
        try:
            raised = _soft()
            assert raised > low_soft_limit
        finally:
            second.close(timeout=0)
        assert _soft() == raised  # the first queue is still open
    finally:
        first.close(timeout=0)
    assert _soft() == low_soft_limit


def test_a_limit_the_application_changed_meanwhile_stays_its_own(name, low_soft_limit):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    with TaskQueue(name, 1) as queue:
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))  # the application's call
        queue.close(timeout=0)
    assert _soft() == 2048
