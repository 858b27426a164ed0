"""Process bodies and helpers that the tests and the scripts (soaks, floods, benchmarks)
share: a child reports to a multiprocessing queue as ``(tag, rank, payload)``, and an
exception it raises is reported as ``("error", rank, repr)`` (``report_errors``) rather
than lost in its stderr; ``collect`` waits for the reports. Module-level functions, so
that the "spawn" start method can import them in a child.
"""

import functools
import os
import random
import signal
import time
import traceback
import weakref
from typing import Any

from ..errors import PrefetchError
from ..worker.client import TaskClient

__all__ = ["report_errors", "collect", "make_batch", "take_checked", "consistency_rank",
           "put_with_pauses", "check_consistency", "engine_cause", "reap", "children",
           "main_thread_state"]


def report_errors(fn):
    """Wrap a child process's body ``fn(out, rank, ...)``: what it raises is put on ``out``
    as ``("error", rank, repr and traceback)`` (``collect`` raises it in the parent)
    instead of being lost in the child's stderr. The wrapper never raises."""
    @functools.wraps(fn)  # keeps the qualified name, so spawn can pickle the wrapper
    def wrapper(out, rank, *args, **kwargs):
        try:
            fn(out, rank, *args, **kwargs)
        except BaseException as exc:
            out.put(("error", rank, f"{exc!r}\n{traceback.format_exc()}"))
    return wrapper


# Messages a collect() call received but did not ask for, per queue: a later collect()
# for their tag gets them. Children report asynchronously (each through its own feeder
# thread), so one rank's next-phase message can overtake another rank's current one.
_SET_ASIDE: "weakref.WeakKeyDictionary[Any, list]" = weakref.WeakKeyDictionary()


def collect(queue, tag, count, timeout=60.0):
    """Wait for ``count`` messages tagged ``tag``; return {rank: payload}.

    Fails at once with the child's traceback if a child reported an error, and with a
    clear message if the messages do not arrive within ``timeout`` seconds. Messages of
    other tags are kept for a later ``collect()`` on the same queue, never dropped.
    """
    import queue as queue_mod

    aside = _SET_ASIDE.setdefault(queue, [])
    got = {}
    for item in list(aside):
        kind, rank, payload = item
        if kind == tag and rank not in got and len(got) < count:
            got[rank] = payload
            aside.remove(item)
    deadline = time.monotonic() + timeout
    while len(got) < count:
        remaining = deadline - time.monotonic()
        try:
            kind, rank, payload = queue.get(timeout=max(remaining, 0.01))
        except queue_mod.Empty:
            raise AssertionError(
                f"waited {timeout}s for {count} {tag!r} messages, got {sorted(got)}") from None
        if kind == "error":
            raise AssertionError(f"rank {rank} failed: {payload}")
        if kind == tag and rank not in got:
            got[rank] = payload
        else:
            aside.append((kind, rank, payload))
    return got


def make_batch(batch_id):
    """A batch whose content can be checked on arrival (see consistency_rank)."""
    import numpy as np

    return batch_id, np.arange(batch_id, batch_id + 64 + batch_id % 7, dtype=np.int64)


def take_checked(client) -> list:
    """``get_tasks()``, each batch checked against ``make_batch``; the batch ids taken."""
    ids = []
    for batch_id, tokens in client.get_tasks()[0]:
        assert int(tokens[0]) == batch_id and len(tokens) == 64 + batch_id % 7
        ids.append(batch_id)
    return ids


@report_errors
def consistency_rank(out, rank, name, tp, n_batches, async_prefetch, seed, skip_every=0,
                     max_step_ms=2.0, deadline_s=90.0, endpoint=None, coordinator=None,
                     alternate_wait=False):
    """A FastDeploy-shaped loop with random step times.

    Records, per barrier step, the batch ids taken, and reports ("steps", rank, steps).
    With ``skip_every`` > 0, every ``skip_every``-th step calls exist_tasks() on rank 0 but
    no rank calls get_tasks() (FastDeploy's loop does that when it is not ready to take),
    decided identically on every rank from the step index. With ``alternate_wait``, rank
    0 alternates, step by step, between the blocking ``wait_for_tasks()`` (random timeouts
    of 0-5 ms, some of which pass) and ``exist_tasks()``, and the report is
    ("steps", rank, (steps, waits)), waits being rank 0's (returned True, returned False)
    counts, None on other ranks.

    ``deadline_s`` bounds a stall, not the run: the rank raises ``TimeoutError`` once it
    has taken nothing for that long (a loaded machine may make the whole run slow; only a
    hang stops batches).
    """
    rng = random.Random(seed * 1000 + rank)
    steps = []  # (step index, [batch ids])
    taken = 0
    waits = [0, 0]
    deadline = time.monotonic() + deadline_s
    with TaskClient(name, tp, rank, async_prefetch=async_prefetch, endpoint=endpoint,
                    coordinator=coordinator) as client:
        step = 0
        while taken < n_batches:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: took {taken}/{n_batches} batches, then none "
                                   f"for {deadline_s} s")
            skip = skip_every and step % skip_every == skip_every - 1
            if rank == 0 and alternate_wait and not step % 2:
                waits[not client.wait_for_tasks(rng.random() * 0.005)] += 1
            elif rank == 0:
                client.exist_tasks()
            client.barrier(timeout=30)
            if not skip:
                # a slow rank: the others may already be at the next step's check
                if rng.random() < 0.2:
                    time.sleep(rng.random() * max_step_ms / 1000)
                ids = take_checked(client)
                if ids:
                    steps.append((step, ids))
                    taken += len(ids)
                    deadline = time.monotonic() + deadline_s
            time.sleep(rng.random() * max_step_ms / 1000)  # the model step
            step += 1
        out.put(("steps", rank, (steps, tuple(waits) if rank == 0 else None)
                 if alternate_wait else steps))


def put_with_pauses(queue, n, seed):
    """Put batches 0..n-1; now and then the engine pauses for up to 10 ms."""
    rng = random.Random(seed)
    for i in range(n):
        queue.put_tasks(make_batch(i), timeout=30)
        if rng.random() < 0.05:  # the engine is busy elsewhere now and then
            time.sleep(rng.random() * 0.01)


def check_consistency(steps_by_rank, tp, n):
    """Every rank took identical batches at identical steps, 0..n-1 in order, once each."""
    reference = steps_by_rank[0]
    for rank in range(1, tp):
        assert steps_by_rank[rank] == reference, f"rank {rank} took different batches than rank 0"
    flat = [batch_id for _, ids in reference for batch_id in ids]
    assert flat == list(range(n)), "batches lost, duplicated or out of put order"


def engine_cause(exc):
    """The engine-side condition behind a step call's exception (async mode wraps it in
    PrefetchError)."""
    if isinstance(exc, PrefetchError) and exc.__cause__ is not None:
        return exc.__cause__
    return exc


def reap(pid: int, timeout: float) -> "int | None":
    """Wait for ``pid``, a child this process forked, for up to ``timeout`` seconds.

    Returns its wait status (``os.waitpid``'s), or None when it had not exited by then: it
    is then SIGKILLed and reaped, so no child outlives the call either way. Blocks about
    ``timeout`` seconds at most, plus the killed child's exit."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def children(pid: int) -> list:
    """The pids of ``pid``'s children, from ``/proc`` ([] once it is gone). Never blocks."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def main_thread_state(pid: int) -> str:
    """The scheduler state of ``pid``'s main thread, from ``/proc`` (``S``: blocked,
    ``R``: running). ``FileNotFoundError`` once it is gone. Never blocks."""
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]
