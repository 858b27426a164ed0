"""StepProfiler on its own: the ring, the summaries, the wrappers (a stand-in client)."""

import json
import time

import numpy as np
import pytest

from fastdeploy_sync.worker.step_profiler import StepProfiler


def test_summary_matches_numpy_over_the_window():
    rng = np.random.default_rng(1)
    rows = rng.integers(0, 10_000, size=(50, 3))
    profiler = StepProfiler(capacity=64)
    for check, barrier, take in rows:
        profiler.record(int(check), int(barrier), int(take))
    summary = profiler.summary()
    step = rows.sum(axis=1)
    assert summary["count"] == summary["window"] == 50
    assert summary["step"]["p50_us"] == pytest.approx(np.percentile(step, 50) / 1e3)
    assert summary["step"]["p99_us"] == pytest.approx(np.percentile(step, 99) / 1e3)
    assert summary["barrier"]["max_us"] == pytest.approx(rows[:, 1].max() / 1e3)
    assert summary["mean_us"] == pytest.approx(step.mean() / 1e3)


def test_ring_keeps_the_last_capacity_steps_and_lifetime_totals():
    profiler = StepProfiler(capacity=8)
    for i in range(1, 21):  # 2.5 laps of the ring
        profiler.record(i, 10 * i, 100 * i)
    samples = profiler.samples()
    assert samples["check"].tolist() == list(range(13, 21))  # oldest first
    assert samples["step"].tolist() == [111 * i for i in range(13, 21)]
    assert profiler.count == 20
    assert profiler.total_ns == sum(111 * i for i in range(1, 21))
    assert profiler.max_ns == 111 * 20
    profiler.reset()
    assert profiler.count == 0 and profiler.total_ns == 0 and profiler.summary()["step"]["count"] == 0


@pytest.mark.parametrize("capacity", [0, 3, 1.5, -8])
def test_capacity_must_be_a_power_of_two(capacity):
    with pytest.raises(ValueError, match="power of two"):
        StepProfiler(capacity=capacity)


def test_dump_writes_the_summary(tmp_path):
    profiler = StepProfiler(capacity=4)
    profiler.record(1000, 2000, 3000)
    path = tmp_path / "p.json"
    profiler.dump(str(path))
    loaded = json.loads(path.read_text())
    assert loaded["count"] == 1 and loaded["step"]["p50_us"] == pytest.approx(6.0)


def test_attach_times_each_call_and_records_at_get_tasks():
    class Steps:  # the three calls of a step, each taking a known minimum time
        def exist_tasks(self):
            _busy(200_000)
            return True

        def barrier(self, timeout=None):
            _busy(300_000)

        def get_tasks(self):
            _busy(100_000)
            return ["batch"], True

    steps = Steps()
    profiler = StepProfiler(capacity=16).attach(steps)
    assert steps.exist_tasks() is True
    steps.barrier(5)
    assert profiler.count == 0  # a step is recorded when its take ends
    assert steps.get_tasks() == (["batch"], True)
    steps.barrier()
    steps.get_tasks()  # a step with no check (what ranks other than 0 do)
    s = profiler.samples()
    assert profiler.count == 2
    assert s["check"][0] >= 200_000 and s["barrier"][0] >= 300_000 and s["take"][0] >= 100_000
    assert s["check"][1] == 0 and s["barrier"][1] >= 300_000


def _busy(ns):
    end = time.perf_counter_ns() + ns
    while time.perf_counter_ns() < end:
        pass
