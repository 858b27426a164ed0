"""fastdeploy-sync status: read a live group's watermarks without joining it."""

import subprocess
import sys

from fastdeploy_sync import TaskQueue

from workers import collect, hold_group_rank, take_n_rank, wait_until


def _status(name, *extra):
    return subprocess.run([sys.executable, "-m", "fastdeploy_sync.cli", "status", name, *extra],
                          capture_output=True, text=True, timeout=30)


def _rows(stdout):
    """The shared-memory table's rows (rank, pid, alive, received, consumed, ...)."""
    return [line.split() for line in stdout.splitlines()
            if line.strip()[:1].isdigit() and line.split()[1].isdigit()]


def _engine_rows(stdout):
    """The engine table's rows (rank, state, consumed, silent, worker, reason)."""
    return [line.split() for line in stdout.splitlines()
            if line.strip()[:1].isdigit() and not line.split()[1].isdigit()]


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
    assert f"engine {name!r} dp_id=0 tp_size=2" in out.stdout and "last seq 3" in out.stdout
    assert [(r[0], r[1]) for r in _engine_rows(out.stdout)] == [("0", "connected"),
                                                                ("1", "connected")]


def test_status_asks_the_engine_whatever_the_coordinator(name, procs, results, monkeypatch):
    """A TP=1 group on a tcp endpoint has no node-local shared memory: the engine's view is
    still there (the same path serves paddle-coordinated groups)."""
    monkeypatch.setenv("FD_SYNC_INSECURE_TCP", "1")
    with TaskQueue(name, 1, endpoint="tcp://127.0.0.1:0") as queue:
        procs(take_n_rank, results, 0, name, 1, 2, endpoint=queue.endpoint)
        for i in range(2):
            queue.put_tasks(i, timeout=5)
        collect(results, "taken", 1)
        assert wait_until(lambda: queue.stats()["consumed"] == [2])
        out = _status(name, "--endpoint", queue.endpoint)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no node-local group segment" in out.stdout
    # the rank's process exits once it took its batches: the engine may already know
    rows = _engine_rows(out.stdout)
    assert [(r[0], r[2]) for r in rows] == [("0", "2")]
    assert rows[0][1] in ("connected", "disconnected"), rows


def test_status_of_no_group(name):
    out = _status(name, "--timeout", "0.5")
    assert out.returncode == 1
    assert "no TaskQueue answered" in out.stdout and "no node-local group segment" in out.stdout
