"""ThreadInterruption: the profile's per-step off-CPU / run-queue / GIL-wait split.

Orderings, not timings: a thread that deliberately holds the GIL must show up as GIL wait
in a pure-Python step (clearly above zero), and without it the GIL wait stays near zero;
the meter itself must not release the GIL (it would hand a waiting thread a free switch
and make the measured step friendlier than the real one)."""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import TESTS
from fastdeploy_sync.profiling.interruption import ThreadInterruption

pytestmark = pytest.mark.skipif(not os.path.exists(f"/proc/self/task/{os.getpid()}/schedstat"),
                                reason="needs Linux /proc/<pid>/task/<tid>/schedstat")

STEPS = 150
MAX_STEPS, MIN_HOLDS = 10000, 3


def _python_work():
    """~1 ms of bytecode that never releases the GIL and does no I/O."""
    x = 1
    for i in range(8000):
        x = (x * 1103515245 + i) & 0xFFFFFFFF
    return x


def _gil_holder(stop, held_ns):
    """Sleep 2 ms (GIL released), then spin 1 ms in Python (GIL held), until stopped."""
    while not stop.is_set():
        time.sleep(0.002)
        c0 = time.thread_time_ns()
        end = time.perf_counter_ns() + 1_000_000
        while time.perf_counter_ns() < end:
            pass
        held_ns.append(time.thread_time_ns() - c0)


def _measure(with_holder):
    """``STEPS`` measured steps; with the holder, more (up to ``MAX_STEPS``) until the
    steps blocked on the GIL ``MIN_HOLDS`` times (intervals with a voluntary switch and
    off-CPU time beyond the run queue): on a machine whose cores other processes keep
    busy, the holder may not be scheduled at all for ``STEPS`` steps, or may take and
    give back the GIL while the main thread waits for a core (then the wait is run-queue
    time, rightly not counted as GIL wait), and steps it never contended with prove
    nothing."""
    meter = ThreadInterruption(MAX_STEPS)
    stop, held = threading.Event(), []
    holder = threading.Thread(target=_gil_holder, args=(stop, held), daemon=True)
    if with_holder:
        holder.start()

    def blocked_steps():
        a = meter.arrays()
        return int(((a["voluntary"] > 0) & (a["gil_ns"] > 0)).sum())
    try:
        for i in range(MAX_STEPS):
            if i >= STEPS and (not with_holder or i % 50 == 0 and blocked_steps() >= MIN_HOLDS):
                break
            meter.begin()
            _python_work()
            meter.end()
        if with_holder:
            assert blocked_steps() >= MIN_HOLDS, (
                f"{MAX_STEPS} steps blocked on the GIL {blocked_steps()} times; the holder "
                f"thread held it {len(held)} times")
    finally:
        stop.set()
        if with_holder:
            holder.join(timeout=10)
        meter.close()
    return meter.arrays(), held


def _in_fresh_interpreter(test_name):
    """Run ``test_name``'s body in a child interpreter: threads left running by earlier
    tests in this process (queue feeders, I/O threads being torn down) also take the GIL
    and would make "no other thread" untrue here."""
    code = (f"import sys; sys.path[:0] = [{os.path.dirname(__file__)!r}, {TESTS!r}]; "
            f"import test_interruption as t; t._{test_name}(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.serial
def test_gil_wait_is_clearly_above_zero_with_a_gil_holding_thread_and_near_zero_without():
    _in_fresh_interpreter("gil_wait_with_and_without_a_holder")


def test_the_meter_does_not_release_the_gil():
    _in_fresh_interpreter("meter_does_not_release_the_gil")


def _gil_wait_with_and_without_a_holder():
    alone, _ = _measure(with_holder=False)
    holder, _ = _measure(with_holder=True)  # the holder held the GIL while it stepped
    # Without another thread there is nothing to block on: no voluntary switch, so no
    # GIL wait at all by construction, whatever the machine does.
    assert alone["voluntary"].sum() == 0
    assert alone["gil_ns"].sum() == 0
    # With the holder the step blocked on the GIL, and the blocked time is far above the
    # zero of the quiet case.
    assert holder["voluntary"].sum() > 0
    assert holder["gil_ns"].sum() > 0
    # The parts add up to the whole in every interval; the upper bound is above the lower.
    for a in (alone, holder):
        assert np.array_equal(a["runq_ns"] + a["gil_ns"] + a["other_ns"], a["off_cpu_ns"])
        assert (a["runq_ns"] >= 0).all() and (a["gil_ns"] >= 0).all()
        assert (a["gil_upper_ns"] >= a["gil_ns"]).all()
    assert len(alone["wall_ns"]) == STEPS <= len(holder["wall_ns"])
    assert alone["gil_upper_ns"].sum() == 0 < holder["gil_upper_ns"].sum()


def _meter_does_not_release_the_gil():
    """A thread that re-takes the GIL whenever it is released. With the switch interval at
    1 s the interpreter forces no switch inside a 0.3 s window, so while the main thread
    runs only the meter the spinner gets a turn only if the meter releases the GIL; while
    the main thread calls os.pread, which releases it, the spinner gets a turn per call.
    Counts of what the code does, not of what the scheduler allows: a busy machine only
    makes the second part take longer."""
    turns_wanted = 100

    def turns_while(body, until):
        stop, count = threading.Event(), [0]

        def spinner():
            while not stop.is_set():
                count[0] += 1
                time.sleep(0)  # releases the GIL; running again needs it back
        t = threading.Thread(target=spinner, daemon=True)
        t.start()
        time.sleep(0.01)  # the spinner runs, then waits for the GIL from here on
        count[0] = 0
        end = time.perf_counter() + until
        while time.perf_counter() < end and count[0] < turns_wanted:
            body()
        n = count[0]
        stop.set()
        t.join(timeout=10)
        return n

    meter = ThreadInterruption(0)
    fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        with_meter = turns_while(lambda: (meter.begin(), meter.end()), 0.3)
        with_os_pread = turns_while(lambda: os.pread(fd, 64, 0), 60.0)
    finally:
        sys.setswitchinterval(previous)
        os.close(fd)
        meter.close()
    # A forced switch needs the spinner to have waited a whole second: none fits in the
    # 0.3 s window (one, should the OS stall the main thread for most of a second).
    assert with_meter <= 1, (with_meter, with_os_pread)
    # The control: the same spinner does get turns from a call that releases the GIL.
    assert with_os_pread >= turns_wanted, (with_meter, with_os_pread)


