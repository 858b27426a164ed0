"""A process the engine (or rank 0) forks never holds their ownership: after the parent is
SIGKILLed while its forked child lives on, the next engine of the same name starts and
reclaims the old pool; and a forked child that exits normally removes nothing of its
parent's. Real processes, real fork; every wait is bounded."""

import glob
import os
import signal
import subprocess
import sys
import textwrap

from fastdeploy_sync import TaskQueue, envs

from workers import free_ports

# An engine that makes a pool (a 2 MiB batch), forks a child that sleeps (as a helper
# FastDeploy forks would), prints "ready <child pid>" and waits to be killed.
_FORKING_ENGINE = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from fastdeploy_sync import TaskQueue
    name, endpoint = sys.argv[1], sys.argv[2] or None
    queue = TaskQueue(name, 1, endpoint=endpoint)
    queue.put_tasks([np.ones(1 << 18)], timeout=10)
    child = os.fork()
    if child == 0:
        print("forked", flush=True)  # the after-fork hooks have run in this child
        time.sleep(60)
        os._exit(0)
    print("ready", child, flush=True)
    time.sleep(60)
    """)


def _names(name):
    return sorted(glob.glob(f"/dev/shm/*fdsync.{name}.*")
                  + glob.glob(os.path.join(envs.ipc_dir(), f"fdsync-{name}-*")))


def _start_forking_engine(name, endpoint=""):
    p = subprocess.Popen([sys.executable, "-c", _FORKING_ENGINE, name, endpoint],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # both lines, in either order: the parent's "ready" can come before the child has run
    # its after-fork hooks (a loaded machine: the test then killed the engine while the
    # child still held the inherited listener)
    lines = [p.stdout.readline().split() for _ in range(2)]
    ready = [line for line in lines if line and line[0] == "ready"]
    if not ready or ["forked"] not in lines:
        p.kill()
        raise AssertionError(f"engine not ready ({lines}): {p.communicate(timeout=30)[1]}")
    return p, int(ready[0][1])


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_a_killed_engines_forked_child_does_not_keep_its_name(name):
    """Before: EndpointInUseError (the child held the ipc listener) and the old pool was
    never reclaimed (the child held its flock)."""
    engine, child = _start_forking_engine(name)
    try:
        old_pool = [n for n in _names(name) if ".dp0.bp" in n]
        assert old_pool, _names(name)
        engine.kill()
        engine.wait(timeout=30)
        assert os.path.exists(f"/proc/{child}")  # the helper lives on
        with TaskQueue(name, 1) as queue:  # starts: the endpoint is free
            assert not any(os.path.exists(n) for n in old_pool)  # the old pool reclaimed
            queue.put_tasks("after the crash", timeout=5)
            queue.close(timeout=0)
    finally:
        _kill(child)
        engine.kill()
        engine.communicate(timeout=30)


def test_a_killed_tcp_engines_forked_child_does_not_keep_its_port(name, loopback_tcp):
    port = free_ports(1)[0]
    endpoint = f"tcp://127.0.0.1:{port}"
    engine, child = _start_forking_engine(name, endpoint)
    try:
        engine.kill()
        engine.wait(timeout=30)
        with TaskQueue(name, 1, endpoint=endpoint) as queue:  # before: Address in use
            assert queue.endpoint == endpoint
            queue.close(timeout=0)
    finally:
        _kill(child)
        engine.kill()
        engine.communicate(timeout=30)


# A parent that owns an engine with a pool and rank 0 of a TP group, forks a child that
# exits normally (atexit and finalizers run there), then reports what is left of its names.
_EXITING_CHILD = textwrap.dedent("""
    import glob, os, sys
    import numpy as np
    from fastdeploy_sync import TaskQueue, envs
    from fastdeploy_sync.tp.shm_group import ShmTPGroup
    name = sys.argv[1]
    def names():
        return sorted(glob.glob(f"/dev/shm/*fdsync.{name}.*")
                      + glob.glob(os.path.join(envs.ipc_dir(), f"fdsync-{name}-*")))
    queue = TaskQueue(name, 2)
    queue.put_tasks([np.ones(1 << 18)], timeout=10)
    group = ShmTPGroup(name, 0, 2, 0, attach_timeout=5)
    before = names()
    child = os.fork()
    if child == 0:
        sys.exit(0)  # a helper that returns normally: atexit, finalizers
    _, status = os.waitpid(child, 0)
    after = names()
    print("status", status)
    print("before", " ".join(before))
    print("after", " ".join(after))
    group.close()
    queue.close(timeout=0)
    """)


def test_a_forked_child_that_exits_normally_removes_nothing_of_its_parent(name):
    """Before: the child's exit ran the parent's finalizers and unlinked the live engine's
    pool and socket files and rank 0's semaphores."""
    out = subprocess.run([sys.executable, "-c", _EXITING_CHILD, name], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert lines["status"] == "0"
    before, after = lines["before"].split(), lines["after"].split()
    assert any(".dp0.bp" in n for n in before) and any("sem." in n for n in before), before
    assert any(n.endswith(".ipc") for n in before), before
    assert after == before
