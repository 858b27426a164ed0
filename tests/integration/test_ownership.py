"""Ownership of shared names survives pid reuse and pid namespaces: a name is alive while
its owner holds a lock on it, whatever pid it had and whichever pid namespace looks at it
(containers sharing /dev/shm with --ipc=host)."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import SPAWN, needs_pid_namespace
from fastdeploy_sync import BarrierTimeoutError, TaskQueue
from fastdeploy_sync.names import ack_board as ack_board_name
from fastdeploy_sync.names import group_segment as group_shm_name
from fastdeploy_sync.shm.segment import OWNER_PID, Segment, owner_alive
from fastdeploy_sync.tp.layout import R_PID, RANK_BASE, RANK_STRIDE
from fastdeploy_sync.tp.shm_group import ShmTPGroup
from workers import collect, hold_engine, hold_group_rank


@pytest.fixture
def live_stranger():
    """A live process that has nothing to do with us: the pid a dead owner's pid was
    reused by."""
    p = subprocess.Popen(["sleep", "60"])
    yield p.pid
    p.kill()
    p.wait()


def _write_slot(shm_name, slot, value):
    seg = Segment.attach(shm_name)
    try:
        seg.view[slot] = value
    finally:
        seg.close()


def _kill(p):
    os.kill(p.pid, signal.SIGKILL)
    p.join(timeout=10)


def test_a_stale_group_whose_owner_pid_was_reused_is_reclaimed(name, procs, doomed,
                                                                live_stranger):
    p = procs(hold_group_rank, doomed, 0, name, 2, 60)
    collect(doomed, "ready", 1)
    _kill(p)
    shm_name = group_shm_name(name, 0)
    _write_slot(shm_name, OWNER_PID, live_stranger)  # the dead rank 0's pid, reused
    rank0 = ShmTPGroup(name, 0, 2, 0)  # reclaims: the pid is alive, the owner is not
    try:
        assert owner_alive(shm_name) is True
    finally:
        rank0.close()


def test_a_stale_engine_whose_pid_was_reused_is_replaced(name, procs, doomed, live_stranger):
    p = procs(hold_engine, doomed, 0, name, 2, 60)
    collect(doomed, "ready", 1)
    _kill(p)
    _write_slot(ack_board_name(name, 0), OWNER_PID, live_stranger)
    with TaskQueue(name, 2) as queue:  # was EndpointInUseError: the board's pid looked alive
        queue.put_tasks("after the crash", timeout=5)


def test_a_rank_whose_pid_was_reused_is_reported_exited(name, procs, doomed, live_stranger):
    rank0 = ShmTPGroup(name, 0, 2, 0)
    try:
        p = procs(hold_group_rank, doomed, 1, name, 2, 60)
        collect(doomed, "ready", 1)
        _kill(p)
        _write_slot(group_shm_name(name, 0), RANK_BASE + RANK_STRIDE + R_PID, live_stranger)
        with pytest.raises(BarrierTimeoutError, match=rf"rank 1 \(pid {live_stranger}\) exited"):
            rank0.barrier(timeout=10)  # at once: its lock is free, whoever has its pid now
    finally:
        rank0.close()


@needs_pid_namespace
def test_a_live_owner_in_another_pid_namespace_is_never_stolen_from(name, procs, results):
    """The group's rank 0 lives in this pid namespace; a rank 0 of the same name starts in
    another one that shares /dev/shm (as containers with --ipc=host do). The owner's pid
    means nothing there (or another process): it must still refuse, not take the name."""
    # the owner stays until the other namespace's rank 0 has tried (with 5 s, it could
    # leave first on a loaded machine, and the name was then free to take)
    leave = SPAWN.Event()
    owner = procs(hold_group_rank, results, 0, name, 2, 120.0, leave)
    collect(results, "ready", 1)
    code = textwrap.dedent(f"""
        import os, sys
        from fastdeploy_sync import GroupInUseError
        from fastdeploy_sync.tp.shm_group import ShmTPGroup
        from fastdeploy_sync.shm.ownership import pid_alive
        print("pid", os.getpid(), file=sys.stderr)
        try:
            group = ShmTPGroup({name!r}, 0, 2, 0)
        except GroupInUseError as exc:
            print("refused:", exc)
            sys.exit(0)
        group.close()
        print("took the live group's name")
        sys.exit(3)
        """)
    run = subprocess.run(["unshare", "-p", "-f", "--mount-proc", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=60)
    assert "pid 1" in run.stderr, run.stderr  # it did run in a pid namespace of its own
    assert run.returncode == 0, run.stdout + run.stderr
    assert "refused:" in run.stdout and "owned by live process" in run.stdout
    assert owner_alive(group_shm_name(name, 0)) is True  # and the owner still has it
    leave.set()
    owner.join(timeout=20)  # it leaves, removing its names
