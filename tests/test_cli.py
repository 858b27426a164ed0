"""fastdeploy-sync status: read a live group's watermarks without joining it."""

import subprocess
import sys

from fastdeploy_sync import TaskQueue

from workers import collect, hold_group_rank, wait_until


def _status(name):
    return subprocess.run([sys.executable, "-m", "fastdeploy_sync.cli", "status", name],
                          capture_output=True, text=True, timeout=30)


def _rows(stdout):
    return [line.split() for line in stdout.splitlines() if line.strip()[:1].isdigit()]


def test_status_of_a_live_group(name, procs, results):
    """Two ranks that receive 3 batches and take none: status shows them holding 3."""
    with TaskQueue(name, 2) as queue:
        for rank in range(2):
            procs(hold_group_rank, results, rank, name, 2, 3.0)
        pids = collect(results, "ready", 2)
        for i in range(3):
            queue.put_tasks(i, timeout=5)
        assert wait_until(lambda: [r[3] for r in _rows(_status(name).stdout)] == ["3", "3"])
        out = _status(name)
    assert out.returncode == 0, out.stderr
    assert "tp_size=2" in out.stdout and f"owner pid {pids[0]} (alive)" in out.stdout
    rows = _rows(out.stdout)
    assert [(r[0], r[1], r[2], r[4]) for r in rows] == [
        ("0", str(pids[0]), "True", "0"), ("1", str(pids[1]), "True", "0")]


def test_status_of_no_group(name):
    out = _status(name)
    assert out.returncode == 1 and "no such group" in out.stdout
