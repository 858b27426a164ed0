"""How long a waiting rank spins before it blocks: the barrier asks the loop's recent history.

Spinning releases ranks that arrive together at once but burns the CPU for as long as the
partner is late; blocking costs no CPU but a semaphore's wake-up. Which one pays depends
on what the loop does between barriers, so the policy asks two questions, not the queue:

  * is the loop busy? The share of the wall time since this rank last asked that its
    thread wanted a CPU: ran on one (``time.thread_time_ns``), or, when that share is
    between ``_SLEPT_SHARE`` and ``_BUSY_SHARE``, also waited in the run queue for one (a
    thread preempted on a loaded machine is still busy; one that sleeps is not: its
    ``/proc/.../schedstat``). A decode loop computes between barriers (near 1); an idle
    loop sleeps (FastDeploy's 1 ms loop: near 0.01). Whether a batch is in flight says
    nothing about it: a decode loop runs for many steps without a new batch. It is asked
    only on the waiting path, after a first ``FIRST_SPIN_S`` of spinning (ranks that
    arrive together never pay it), at most once per ``_BUSY_SPAN_NS`` while busy and once
    per ``_REASK_NS`` while idle (each question is a tax on an idle iteration; a loop that
    becomes busy is recognised within ``_REASK_NS``).
  * how late were the partners? The caller remembers how late they were at its last two
    barriers and passes the larger (0 when it came last).

A busy loop spins the whole window (``spin_s``), then blocks: a barrier that blocks wakes
its rank a semaphore's wake-up after the last arrival, and in a busy loop that skew is
carried into the next barrier, where it costs again. An idle loop spins only
``cheap_s`` (less CPU than a sleep and a wake-up), and only when the partners came within
that at both of the last two barriers; otherwise it blocks at once, without spinning or
asking: there the skew meets the loop's own sleep, not a waiting partner.
"""

import os
import threading
import time
from typing import Optional

__all__ = ["SpinPolicy", "FIRST_SPIN_S", "CHEAP_SPIN_US"]

# An idle loop's barrier spins this many µs at most, and only when its partners came within
# that (a sleep and a wake-up cost the waiter more CPU), so that ranks arriving together
# are released at once.
CHEAP_SPIN_US = 8.0
# Every wait first spins this long before asking whether the loop is busy (which costs a
# system call): partners arriving together never pay for the question.
FIRST_SPIN_S = 2e-6
# The loop is busy when its thread was on a CPU at least this share of the time since the
# last question; spans shorter than _BUSY_SPAN_NS keep the last answer (a tight loop).
_BUSY_SHARE = 0.5
_BUSY_SPAN_NS = 200_000
# Below this share the thread slept (an idle 1 ms loop's is near 0.01): the run-queue wait,
# which only a loaded machine makes large, is not worth reading.
_SLEPT_SHARE = 0.1
# An idle loop asks whether it is still idle at most this often (and one whose partners
# came later than the cheap spin blocks at once, without spinning, until then), so that a
# loop that became busy is recognised within this long.
_REASK_NS = 10_000_000


class _RunQueueWait:
    """Nanoseconds the calling thread has waited on a run queue (runnable, but another
    thread had the CPU) since it started, from its ``/proc/.../schedstat``: one descriptor,
    kept open and re-read, reopened if another thread asks; 0 where schedstat is missing.
    (Its first field, the CPU time, lags by up to a scheduler tick: the CPU time comes
    from ``time.thread_time_ns``, which is exact.)"""

    def __init__(self):
        self._tid = None
        self._fd = -1

    def read(self) -> int:
        tid = threading.get_native_id()
        if tid != self._tid:
            self.close()
            self._tid = tid
            try:
                self._fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._fd = -1
        if self._fd >= 0:
            try:
                # "<ns on a CPU> <ns waiting on a run queue> <timeslices>"
                return int(os.pread(self._fd, 96, 0).split()[1])
            except (OSError, ValueError, IndexError):
                pass
        return 0

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


class SpinPolicy:
    """One rank's answer to "spin or block?" (see the module docstring). ``spin_s``: the
    longest spin (``FD_SYNC_BARRIER_SPIN_US``). Used by the waiting thread only."""

    def __init__(self, spin_s: float):
        self.spin_s = spin_s
        spin_ns = int(spin_s * 1e9)
        self.cheap_ns = int(min(CHEAP_SPIN_US * 1e3, spin_ns))
        # the last answer, and the thread CPU and monotonic clocks when it was given
        self.busy = False
        self._runq = _RunQueueWait()
        self._cpu_at = time.thread_time_ns()
        self._runq_at: Optional[int] = self._runq.read()
        self._wall_at = time.monotonic_ns()

    def may_spin(self, arrived_at: int, late: int) -> bool:
        """Whether a wait that began at ``arrived_at`` (monotonic ns), after partners that
        were ``late`` ns late, may spin at all; False: block at once, asking nothing (what
        spinning or asking costs an idle loop is a tax on every iteration)."""
        return self.busy or late <= self.cheap_ns or arrived_at - self._wall_at >= _REASK_NS

    def budget_s(self, now_ns: int, late: int) -> float:
        """How long to spin before blocking: the window while the loop is busy; up to the
        cheap spin while it is idle, if the partners came within that (``late``); else 0."""
        if self.loop_busy(now_ns):
            return self.spin_s
        return self.cheap_ns * 1e-9 if late <= self.cheap_ns else 0.0

    def loop_busy(self, now_ns: int) -> bool:
        """Did this rank's thread want a CPU at least ``_BUSY_SHARE`` of the time since the
        last answer? A busy loop asks at most once per ``_BUSY_SPAN_NS`` (it is waiting
        anyway), an idle one once per ``_REASK_NS``; in between the last answer stands."""
        span = now_ns - self._wall_at
        if span < (_BUSY_SPAN_NS if self.busy else _REASK_NS):
            return self.busy
        cpu = time.thread_time_ns()
        wanted = cpu - self._cpu_at
        if _SLEPT_SHARE * span <= wanted < _BUSY_SHARE * span:
            # short of CPU: on a loaded machine it may have been preempted, which is busy
            # (the run-queue clock is read only here: after a span that did not read it,
            # its delta would cover more than this span, so this span counts CPU alone)
            runq = self._runq.read()
            if self._runq_at is not None:
                wanted += runq - self._runq_at
            self._runq_at = runq
        else:
            self._runq_at = None
        self.busy = wanted >= _BUSY_SHARE * span
        self._cpu_at, self._wall_at = cpu, now_ns
        return self.busy

    def close(self) -> None:
        self._runq.close()
