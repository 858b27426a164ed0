"""StepProfiler: fixed-memory per-step timings, and TaskClient's FD_SYNC_PROFILE switch."""

import glob
import json
import os

import pytest

from fastdeploy_sync import TaskClient, TaskQueue
from workers import collect, profiled_rank, wait_until


def test_fd_sync_profile_times_every_step_of_a_real_group(name, procs, results, monkeypatch,
                                                          tmp_path):
    """Two ranks built without a profile argument: FD_SYNC_PROFILE=1 gives each a profiler
    that counted every step, and FD_SYNC_PROFILE_DIR gets one JSON per rank at close."""
    monkeypatch.setenv("FD_SYNC_PROFILE", "1")
    monkeypatch.setenv("FD_SYNC_PROFILE_DIR", str(tmp_path))
    with TaskQueue(name, 2) as queue:
        for rank in range(2):
            procs(profiled_rank, results, rank, name, 2, 5)
        collect(results, "ready", 2)
        for i in range(5):
            queue.put_tasks(i, timeout=10)
        reports = collect(results, "profiled", 2)
    for rank, (steps, summary) in reports.items():
        assert summary is not None and summary["count"] == steps >= 1
        assert summary["step"]["p50_us"] > 0
        if rank != 0:  # only rank 0 checks
            assert summary["check"]["max_us"] == 0
    pattern = str(tmp_path / f"fdsync-profile-{name}-dp0-r*.json")
    # the files appear when the children close their clients
    wait_until(lambda: len(glob.glob(pattern)) == 2, timeout=10, interval=0.1,
               what="both ranks' profile files", seen=lambda: glob.glob(pattern))
    dumped = glob.glob(pattern)
    assert sorted(os.path.basename(p).split("-")[4] for p in dumped) == ["r0", "r1"]
    assert {json.load(open(p))["count"] for p in dumped} == {s for s, _ in reports.values()}


def test_profiling_is_off_by_default(name, monkeypatch):
    monkeypatch.delenv("FD_SYNC_PROFILE", raising=False)
    with TaskQueue(name, 1), TaskClient(name, 1, 0) as client:
        assert client.profiler is None
        assert client.exist_tasks.__func__ is TaskClient.exist_tasks  # nothing wrapped
    monkeypatch.setenv("FD_SYNC_PROFILE", "maybe")
    with pytest.raises(ValueError, match="FD_SYNC_PROFILE"):
        TaskClient(name, 1, 0)
