"""File descriptors: an engine started under the common soft limit of 1024 survives 1000
producers connecting at once (libzmq aborted it: "Too many open files"), serves its group
throughout, refuses producers beyond its bound with a clear error, and serves producers
again once they are gone. A real engine process, real connections."""

import os
import resource
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from fastdeploy_sync import TaskProducer
from fastdeploy_sync.engine.producer_endpoint import MAX_PRODUCERS
from fastdeploy_sync.wire.endpoints import default_endpoint, ipc_path

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
        deadline = time.monotonic() + 30
        while len(lines) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(lines) >= 3, engine.stderr.read() if engine.poll() is not None else ""
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
        for leftover in os.listdir("/dev/shm"):
            if f"fdsync.{name}." in leftover:
                os.unlink("/dev/shm/" + leftover)
