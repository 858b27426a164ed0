"""How much a thread was kept off its CPU while it ran a piece of work, and why.

``ThreadInterruption`` measures, for the calling thread, between ``begin()`` and ``end()``:

    wall        perf_counter_ns                      the interval
    on-CPU      time.thread_time_ns()                the thread's own CPU time (the kernel
                                                     brings a running thread's clock up to
                                                     date when it is read)
    off-CPU     wall - on-CPU                        every reason together; split into:
    run queue   /proc/self/task/<tid>/schedstat      runnable but not running: another thread
                field 2 (sched_info run_delay, ns)   or process had the core (never more than
                                                     the interval's off-CPU time)
    GIL wait    off-CPU - run queue, in intervals    *blocked* (asleep, not runnable). For a
                with a voluntary context switch      step that does no I/O and takes no lock
                                                     of its own, what it can block on is the
                                                     GIL another thread of the process holds
                                                     (a lower bound; see below for the upper)
    other       the rest                             off-CPU time the kernel did not see as a
                                                     wait of this thread: the hypervisor ran
                                                     another virtual CPU (steal), or a wait
                                                     counted in a neighbouring interval
    switches    getrusage(RUSAGE_THREAD)             involuntary (preempted: the core was
                ru_nivcsw / ru_nvcsw                 taken) and voluntary (blocked: for such a
                                                     step, one per GIL wait)

Why "with a voluntary context switch": a thread can only block by switching out of its own
accord, so an interval without a voluntary switch has no blocked time, whatever the clocks'
difference says. On a virtual machine under load that difference is off now and then (time
stolen by the hypervisor counts in neither the thread's CPU time nor its run queue; a
run-queue wait now and then lands in the next interval), and the rule keeps those errors
out of the GIL figure.

The GIL wait comes as two bounds. CPython's GIL wait is a 5 ms timed wait: a waiter that
wakes (on the timeout, or when the GIL is handed over) and finds the cores taken spends
that part of its wait in the run queue, so when the cores are busy the blocked time alone
is a *lower* bound. Every wait for the GIL blocks at least once, so it lies inside the
intervals that have a voluntary switch: all their off-CPU time is an *upper* bound (it also
holds whatever preemption by other processes fell into those intervals). On an idle
machine the two nearly meet; under load they part (``scripts/tools/gil_wait_check.py`` prints
both beside the holding time of a thread that holds the GIL for known times, and
docs/profiling.md quotes it).

Resolution: the clocks count nanoseconds; ``begin()``/``end()`` read them one after the
other, so an interval's split is good to the time between those reads (a few
microseconds). Nothing here releases the GIL (see ``_pread_holding_the_gil``). Cost:
``begin()`` + ``end()`` make a pread of the schedstat file, two clock reads and one
getrusage each; the profile pays it in every mode, its reference loop included, so it
cancels out of the step-time inflation.

Linux only for the run-queue split (``available`` is False elsewhere: run queue, GIL wait
and other are then None; off-CPU and switches still count). Not thread-safe: one meter per
thread, used from that thread.
"""

import array
import ctypes
import os
import resource
import threading
import time

import numpy as np

__all__ = ["ThreadInterruption", "FIELDS"]

# Per-interval figures ``end()`` stores, in this order (int64 each).
FIELDS = ("wall_ns", "cpu_ns", "runq_ns", "involuntary", "voluntary")


def _pread_holding_the_gil():
    """libc's pread, called *without* releasing the GIL (ctypes.PyDLL), or None.

    ``os.pread`` releases the GIL around the system call. Measuring a step that never
    releases the GIL must not add a release point to it: a thread waiting for the GIL would
    take it there, at once, instead of after the interpreter's switch interval, and the
    profile would measure a friendlier step than the one it claims to."""
    try:
        pread = ctypes.PyDLL(None).pread
    except (OSError, AttributeError):
        return None
    pread.restype = ctypes.c_ssize_t
    pread.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64)
    return pread


class ThreadInterruption:
    """Per-interval interruption of the thread that built it, in fixed preallocated arrays.

    ``begin()`` then ``end()`` around each interval; ``start(n)`` (re)allocates room for
    ``n`` intervals and forgets earlier ones; intervals past ``n`` are measured but not kept.
    Neither call blocks, releases the GIL or allocates beyond the integers it reads.
    """

    def __init__(self, capacity: int = 0):
        self.tid = threading.get_native_id()
        self._pread = _pread_holding_the_gil()
        self._fd = None
        if self._pread is not None:
            try:
                self._fd = os.open(f"/proc/self/task/{self.tid}/schedstat", os.O_RDONLY)
            except OSError:  # no /proc schedstat (not Linux): no run-queue split
                pass
        self.available = self._fd is not None
        self._buf = ctypes.create_string_buffer(64)
        self._mark = (0, 0, 0, 0, 0)
        self.start(capacity)

    def start(self, capacity: int) -> None:
        # One flat array.array, FIELDS interleaved: storing into it costs a fraction of
        # numpy item assignment (the cost is paid at every step).
        self._values = array.array("q", bytes(8 * len(FIELDS) * capacity))
        self.capacity = capacity
        self.count = 0

    def _runq_ns(self) -> int:
        if self._fd is None:
            return 0
        # "<on-cpu ns> <run-queue wait ns> <timeslices>\n". The first field is brought up to
        # date only at scheduler events, hence thread_time_ns() for the on-CPU time.
        n = self._pread(self._fd, self._buf, 64, 0)
        return int(self._buf.raw[:n].split()[1])

    def begin(self) -> None:
        # The order matters, and is the same in end(): run queue, wall, CPU, switches.
        # Reading the thread's CPU clock updates its runtime, and when its time slice is
        # used up the kernel preempts it right there, at the return from that system call
        # (with other busy processes on the cores, often). A wait that falls after the
        # run-queue and wall samples lands outside the interval in end() and inside it in
        # begin(), for both figures alike; read in the other order, it counted in one of
        # them only and made negative GIL waits.
        runq = self._runq_ns()
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        self._mark = (wall, cpu, runq, usage.ru_nivcsw, usage.ru_nvcsw)

    def end(self) -> None:
        runq = self._runq_ns()
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        i = self.count
        if i < self.capacity:
            w0, c0, r0, inv0, vol0 = self._mark
            v, k = self._values, 5 * i
            v[k] = wall - w0
            v[k + 1] = cpu - c0
            v[k + 2] = runq - r0
            v[k + 3] = usage.ru_nivcsw - inv0
            v[k + 4] = usage.ru_nvcsw - vol0
            self.count = i + 1

    def arrays(self) -> dict:
        """The kept intervals as int64 arrays (copies), nanoseconds or counts:
        ``wall_ns``, ``cpu_ns``, ``off_cpu_ns`` = wall - CPU, and its parts ``runq_ns``,
        ``gil_ns`` (the GIL wait's lower bound), ``other_ns``; ``gil_upper_ns`` (the
        upper bound: the off-CPU time of intervals with a voluntary switch); ``involuntary``,
        ``voluntary``. The run-queue split and both GIL bounds are None where ``available``
        is False. ``off_cpu_ns`` and ``other_ns`` are signed: the reading skew (a few
        microseconds) can make a near-zero interval slightly negative, and clamping them would
        bias every mean upwards."""
        v = np.frombuffer(self._values, dtype=np.int64).reshape(-1, len(FIELDS))[:self.count]
        out = {name: v[:, k].copy() for k, name in enumerate(FIELDS)}
        off = out["off_cpu_ns"] = out["wall_ns"] - out["cpu_ns"]
        if not self.available:
            out["runq_ns"] = out["gil_ns"] = out["gil_upper_ns"] = out["other_ns"] = None
            return out
        blocked = out["voluntary"] > 0
        runq = out["runq_ns"] = np.clip(out["runq_ns"], 0, np.maximum(off, 0))
        out["gil_ns"] = np.where(blocked, np.maximum(off - runq, 0), 0)
        out["gil_upper_ns"] = np.where(blocked, np.maximum(off, 0), 0)
        out["other_ns"] = off - runq - out["gil_ns"]
        return out

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
