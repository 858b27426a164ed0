"""``StepProfiler``: the critical-path time of a worker's task-sync calls, step by step,
cheap enough to leave on in production.

A step is what a worker's event loop does once per iteration::

    check    rank 0's exist_tasks()        (0 on other ranks)
    barrier  barrier()                     (includes waiting for a slower rank)
    take     get_tasks()                   (ends the step: the step is recorded here)

Memory is fixed at construction: a ring of the last ``capacity`` steps (three ``int64``
per step, in ``array.array`` buffers) plus lifetime counters. Recording a step stores
three integers and updates four counters; nothing is allocated except the integers
``perf_counter_ns`` returns (docs/profiling.md has the overhead per step).

Enable it on a ``TaskClient`` with ``FD_SYNC_PROFILE=1`` (or ``TaskClient(profile=True)``);
the client's ``profiler`` attribute then holds one. With ``FD_SYNC_PROFILE_DIR`` set,
``TaskClient.close()`` also writes the summary to
``{dir}/fdsync-profile-{name}-dp{dp}-r{rank}-{pid}.json``. Any other loop (the
FastDeploy-style baseline in ``profile``) can call :meth:`StepProfiler.record` itself.
"""

import array
import json
import os
import time
from typing import Any, Optional

import numpy as np

__all__ = ["StepProfiler", "SECTIONS", "distribution_us"]

SECTIONS = ("check", "barrier", "take")


class StepProfiler:
    """Per-step critical-path timings in fixed memory.

    ``record(check_ns, barrier_ns, take_ns)`` adds one step. ``attach(client)`` instead
    times a ``TaskClient``'s step calls by wrapping them on that instance (the class and
    other clients are untouched, and a client without a profiler pays nothing).

    Percentiles (``summary()``) cover the last ``capacity`` steps (the ring; 65 536 steps
    is about two minutes of 2 ms steps); ``count``, ``mean`` and ``max`` of the whole
    step cover every step since construction or ``reset()``.

    Not thread-safe: record from the event loop thread only. ``summary()``/``samples()``
    from another thread may see a step half-written; call them from the loop, or accept
    that one step of the window may be torn.
    """

    # The parts of a step, in order: ``summary()``'s and ``samples()``' keys.
    SECTIONS = SECTIONS

    def __init__(self, capacity: int = 1 << 16):
        if not isinstance(capacity, int) or capacity < 1 or capacity & (capacity - 1):
            raise ValueError(f"capacity={capacity!r}: expected a power of two >= 1")
        self.capacity = capacity
        self._mask = capacity - 1
        zeros = bytes(8 * capacity)
        self._rings = tuple(array.array("q", zeros) for _ in SECTIONS)
        self.reset()

    def reset(self) -> None:
        """Forget every step recorded so far (the buffers are reused, not reallocated)."""
        self.count = 0
        self._folded_total_ns = 0
        self._folded_max_ns = 0
        # Partial sums of the step in progress, filled by attach()'s wrappers.
        self._check_ns = 0
        self._barrier_ns = 0

    def record(self, check_ns: int, barrier_ns: int, take_ns: int) -> None:
        """Add one step's three critical-path times (nanoseconds)."""
        i = self.count & self._mask
        check, barrier, take = self._rings
        check[i] = check_ns
        barrier[i] = barrier_ns
        take[i] = take_ns
        self.count += 1
        if i == self._mask:
            self._fold_ring()

    def _fold_ring(self) -> None:
        # Lifetime sum and max are folded in once per lap of the ring (one numpy pass per
        # `capacity` steps) instead of being updated at every step, whose budget is small.
        step = self._ring_step_ns()
        self._folded_total_ns += int(step.sum())
        self._folded_max_ns = max(self._folded_max_ns, int(step.max()))

    def _ring_step_ns(self, n: Optional[int] = None) -> np.ndarray:
        """Per-step sums of the first ``n`` ring slots (all of them for None)."""
        check, barrier, take = (np.frombuffer(ring, dtype=np.int64)[:n] for ring in self._rings)
        return check + barrier + take

    @property
    def total_ns(self) -> int:
        """Sum of every step's critical-path time since construction or ``reset()``."""
        partial = self.count & self._mask
        return self._folded_total_ns + int(self._ring_step_ns(partial).sum())

    @property
    def max_ns(self) -> int:
        """The longest step since construction or ``reset()`` (0 before the first)."""
        partial = self.count & self._mask
        current = int(self._ring_step_ns(partial).max()) if partial else 0
        return max(self._folded_max_ns, current)

    def attach(self, client: Any) -> "StepProfiler":
        """Time ``client.exist_tasks``, ``barrier`` and ``get_tasks`` from now on.

        Replaces the three bound methods on this instance with timing wrappers (and so
        ``sync_step``, which calls them). ``get_tasks`` ends a step: the step is recorded
        then, with whatever ``exist_tasks``/``barrier`` took since the previous one.
        A call that raises is not recorded. Returns self.
        """
        # Every name the wrappers touch is a closure variable or a local: each attribute or
        # method lookup would be a noticeable share of the profiler's budget per step.
        now = time.perf_counter_ns
        exist_tasks, barrier, get_tasks = client.exist_tasks, client.barrier, client.get_tasks
        record = self.record
        profiler = self

        def timed_exist_tasks() -> bool:
            t0 = now()
            result = exist_tasks()
            profiler._check_ns += now() - t0
            return result

        def timed_barrier(timeout: Optional[float] = None) -> None:
            t0 = now()
            barrier(timeout)
            profiler._barrier_ns += now() - t0

        def timed_get_tasks() -> Any:
            t0 = now()
            result = get_tasks()
            take = now() - t0
            record(profiler._check_ns, profiler._barrier_ns, take)
            profiler._check_ns = profiler._barrier_ns = 0
            return result

        wrapper: Any  # a function: its __wrapped__ is set below
        for wrapper, original in ((timed_exist_tasks, exist_tasks), (timed_barrier, barrier),
                                  (timed_get_tasks, get_tasks)):
            wrapper.__name__ = original.__name__
            wrapper.__doc__ = original.__doc__
            wrapper.__wrapped__ = original
        client.exist_tasks = timed_exist_tasks
        client.barrier = timed_barrier
        client.get_tasks = timed_get_tasks
        return self

    # -- reading ---------------------------------------------------------------------------

    def samples(self) -> dict:
        """The ring's steps, oldest first: ``{"check": ndarray, "barrier": ..., "take": ...,
        "step": their sum}``, int64 nanoseconds (copies)."""
        n = min(self.count, self.capacity)
        start = self.count & self._mask if self.count > self.capacity else 0
        out = {}
        for section, ring in zip(SECTIONS, self._rings):
            values = np.frombuffer(ring, dtype=np.int64)
            out[section] = np.concatenate([values[start:], values[:start]])[:n].copy()
        out["step"] = out["check"] + out["barrier"] + out["take"]
        return out

    def summary(self) -> dict:
        """JSON-ready figures in microseconds.

        ``{"count", "window", "mean_us", "max_us", "step": {p50_us, p99_us, mean_us, max_us},
        "check": {...}, "barrier": {...}, "take": {...}}``: ``count``/``mean_us``/``max_us``
        over every step, the per-section figures over the last ``window`` steps."""
        out: dict  # counts, figures, and a dict per section
        out = {"count": self.count, "window": min(self.count, self.capacity),
               "mean_us": self.total_ns / self.count / 1e3 if self.count else None,
               "max_us": self.max_ns / 1e3 if self.count else None}
        for section, values in self.samples().items():
            out[section] = distribution_us(values)
        return out

    def dump(self, path: str) -> None:
        """Write ``summary()`` as JSON to ``path``, atomically: the file appears complete
        (written beside it, then renamed), so a collector watching the directory never
        reads half a profile."""
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.summary(), f, indent=1)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    @staticmethod
    def distribution_us(values_ns: Any) -> dict:
        """p50/p99/mean/max (microseconds) and count of an array of nanoseconds; the figures
        are None for an empty array."""
        values = np.asarray(values_ns, dtype=np.float64)
        if values.size == 0:
            return {"count": 0, "p50_us": None, "p99_us": None, "mean_us": None, "max_us": None}
        p50, p99 = np.percentile(values, [50, 99]) / 1e3
        return {"count": int(values.size), "p50_us": float(p50), "p99_us": float(p99),
                "mean_us": float(values.mean() / 1e3), "max_us": float(values.max() / 1e3)}


# the module's name for it, as before
distribution_us = StepProfiler.distribution_us
