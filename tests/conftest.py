import glob
import json
import multiprocessing
import os
import pathlib
import select
import shutil
import subprocess
import sys
import tempfile
import uuid

import pytest

SPAWN = multiprocessing.get_context("spawn")
# tests/ (the helper modules and scripts the tests start) and the checkout's root
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


@pytest.fixture
def name():
    """A unique group name per test; after the test, nothing of it may remain on disk."""
    n = "t" + uuid.uuid4().hex[:12]
    yield n
    from fastdeploy_sync import envs  # the default ipc directory, as the library computes it
    leftovers = glob.glob(f"/dev/shm/*{n}*") + glob.glob(os.path.join(envs.ipc_dir(), f"fdsync-{n}-*"))
    for path in leftovers:  # clean up so one failure does not cascade, then fail
        os.unlink(path)
    assert not leftovers, f"left behind: {leftovers}"


@pytest.fixture
def procs():
    """Start processes through this list; every one is killed and joined after the test."""
    started = []

    def start(target, *args, **kwargs):
        p = SPAWN.Process(target=target, args=args, kwargs=kwargs, daemon=True)
        p.start()
        started.append(p)
        return p

    yield start
    for p in started:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


@pytest.fixture
def results():
    q = SPAWN.Queue()
    yield q
    q.close()
    q.join_thread()


@pytest.fixture
def doomed():
    """The queue for a child the test will SIGKILL. Its own queue, because a child killed
    just after its message was read may still hold the queue's shared write lock (its
    feeder thread releases it after the send), and any later writer would then block."""
    q = SPAWN.Queue()
    yield q
    q.close()


@pytest.fixture
def socket_delivery(monkeypatch):
    """A node-local engine that sends every batch over its socket, as a tcp engine does
    and as a node-local one does for a batch that fits no ring slot: for tests of that
    path (raw protocol peers, the socket's send and receive) on a node-local endpoint."""
    monkeypatch.setenv("FD_SYNC_SHM_RING_KB", "off")


@pytest.fixture
def loopback_tcp(monkeypatch):
    """Tests about the protocol, not authentication, run tcp on loopback without keys
    (tests/integration/test_auth.py and tests/integration/test_trust.py cover CURVE)."""
    monkeypatch.setenv("FD_SYNC_INSECURE_TCP", "1")


@pytest.fixture
def ipc_env(monkeypatch):
    """A private ipc directory of its own, no FD_SYNC_IPC_DIR or XDG_RUNTIME_DIR set: short,
    since pytest's tmp_path can push a socket path past the 107-byte unix limit."""
    monkeypatch.delenv("FD_SYNC_IPC_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    path = tempfile.mkdtemp(prefix="fdsp-", dir="/tmp")
    yield pathlib.Path(path)
    shutil.rmtree(path, ignore_errors=True)


def _unshare_pid_namespace_allowed():
    try:
        return subprocess.run(["unshare", "-p", "-f", "--mount-proc", "true"],
                              capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# For tests that run a process in a pid namespace of its own (a container sharing /dev/shm)
needs_pid_namespace = pytest.mark.skipif(
    not _unshare_pid_namespace_allowed(),
    reason="this machine does not allow a new pid namespace (unshare -p -f --mount-proc)")


@pytest.fixture
def foreign_names():
    """Another program's live names in /dev/shm and the default ipc directory, held by a
    process of its own for the whole test (``tests/foreign_names.py``: names that look
    like this library's, owner locks held, and names that do not). Yields their paths; a
    test that looks at a directory as a whole proves with it that it judges only the names
    it created. After the test every one of them must still be there: a test must not
    remove another program's names."""
    holder = subprocess.Popen([sys.executable, os.path.join(TESTS, "foreign_names.py")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    paths = []
    try:
        ready, _, _ = select.select([holder.stdout], [], [], 60)
        assert ready, "tests/foreign_names.py printed no names within 60 s"
        paths = json.loads(holder.stdout.readline())
        yield paths
        gone = [p for p in paths if not os.path.lexists(p)]
        assert not gone, f"the test removed another program's names: {gone}"
    finally:
        holder.stdin.close()
        try:
            holder.wait(timeout=30)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait(timeout=10)
        holder.stdout.close()
        for path in paths:  # what a killed holder could not remove
            if os.path.lexists(path):
                os.unlink(path)
