"""profiling.contention: who took the run's cores, and what a contended run's verdicts say."""

import os
import subprocess
import sys
import time

import pytest

from fastdeploy_sync.profiling import contention
from workers import wait_until

linux = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads /proc")


def _burn(cpu_s):
    """Spend ``cpu_s`` seconds of this thread's CPU (whatever the machine's load)."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


@linux
def test_cpu_outside_the_run_is_counted_as_taken():
    # The "run" is a sleeping child; this process, outside its tree, burns 0.5 s of CPU.
    cores = sorted(os.sched_getaffinity(0))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        before = contention.snapshot(cores, root=child.pid)
        _burn(0.5)
        after = contention.snapshot(cores, root=child.pid)
    finally:
        child.kill()
        child.wait(timeout=10)
    taken_s = contention.foreign_cores(before, after) * (after.at - before.at)
    # every jiffy this process ran is busy time outside the run (a few ticks of sampling)
    assert taken_s >= 0.4, taken_s


@linux
def test_the_run_counts_its_own_children():
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.thread_time() + 0.4\n"
                              "while time.thread_time() < end: pass\ntime.sleep(60)"])
    try:
        first = contention.snapshot([0], root=os.getpid())
        ran = lambda: contention.snapshot([0], root=os.getpid()).ours - first.ours  # noqa: E731
        # until the child has burnt its 0.4 s (most of it seen: a few ticks of sampling)
        wait_until(lambda: ran() >= 0.3 * os.sysconf("SC_CLK_TCK"), timeout=60, interval=0.05,
                   what="the child to burn its CPU", seen=ran)
    finally:
        child.kill()
        child.wait(timeout=10)


def _segments(per_round_cores, cores=2):
    return [{"round": r, "foreign_cores": v, "cores": cores}
            for r, values in enumerate(per_round_cores) for v in values]


def test_a_quiet_run_keeps_its_verdicts():
    summary = contention.summarize(_segments([[0.0, 0.1], [0.05, 0.05]]), rounds=2)
    assert not summary["contended"]
    assert summary["per_round_pct"] == pytest.approx([2.5, 2.5])
    rows = [{"verdict": "met", "met": True, "reason": None},
            {"verdict": "MISSED", "met": False, "reason": None}]
    contention.withhold_verdicts(summary, rows)
    assert [r["verdict"] for r in rows] == ["met", "MISSED"]


def test_a_contended_run_judges_nothing_and_says_why():
    summary = contention.summarize(_segments([[0.5, 0.3], [0.4, None], [0.1]]), rounds=3)
    assert summary["contended"] and summary["rounds_above"] == 2
    assert summary["max_pct"] == pytest.approx(20.0)
    assert "not comparable" in summary["line"] and "quieter machine" in summary["line"]
    rows = [{"verdict": "met", "met": True, "reason": None},
            {"verdict": "MISSED", "met": False, "reason": "already a reason"},
            {"verdict": "inconclusive", "met": None, "reason": None},
            {"verdict": "n/a", "met": None, "reason": None}]
    contention.withhold_verdicts(summary, rows)
    assert [r["verdict"] for r in rows] == ["inconclusive", "inconclusive", "inconclusive",
                                            "n/a"]
    assert rows[0]["reason"].startswith("contended: other processes took")
    assert rows[1]["reason"].startswith("already a reason; contended")
    assert rows[2]["reason"] is None


def test_no_reading_is_unknown_not_quiet():
    summary = contention.summarize(_segments([[None], [None]]), rounds=2)
    assert summary["mean_pct"] is None and not summary["contended"]
    assert "unknown" in summary["line"]
    assert contention.foreign_cores(None, None) is None
