"""The processes ``fastdeploy-sync profile`` starts: one engine and one worker per TP rank.

Each is driven by the runner through its own ``multiprocessing`` Pipe. The pipe is the
control plane only (segment start and stop, results back); nothing timed goes through it.

A *segment* is one mode for a number of steps. In each segment the worker runs FastDeploy's
``event_loop_normal`` reduced to what touches the engine, the same loop for every mode::

    rank 0:    exist_tasks()        the check
    all ranks: barrier()            the TP barrier
    all ranks: get_tasks()          the take (identical batches on every rank)
    all ranks: model step           fixed work, then the model's TP collective

The modes:

    none        no task sync at all: only the model step (the reference for inflation)
    async       TaskClient with its prefetch thread (DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM=0)
    sync        TaskClient polling from the loop       (DISABLE_ENGINE_WORKER_ASYNC_TASK_COMM=1)
    fd-manager  FDManagerQueue, the FastDeploy-style multiprocessing.managers queue

The model's TP collective: a real TP forward ends in all-reduces, and the host waits for
the device by spinning (CUDA's default), so the ranks leave a step within microseconds of
each other. The simulated step ends in a shared-memory barrier standing in for that: it
spins up to ``COLLECTIVE_SPIN_US`` before blocking, so that the ranks leave it together
rather than one semaphore wake-up apart, which the next barrier would otherwise charge
to task sync. It is part of the model step in every mode, ``none``
included, so it cancels out of the inflation. FastDeploy's protocol needs the lock-step:
without it, rank 0 can re-signal a batch a slow rank has not yet read. Every rank runs
the same amount of work per step (the runner sends one calibration to all).

The spin needs a core per process: with fewer cores than processes (the engine and the
ranks), a rank spinning for a descheduled peer takes the core that peer needs, and the
reference loop, whose ranks meet only in this collective, would run slower than the loops
with task sync. There the runner asks for ``COLLECTIVE_SPIN_SHARED_US`` instead (the
library's own barrier default). A rank that blocked then wakes one semaphore wake-up after
its partner left, and that skew would be charged to the next barrier, for a whole run,
since which rank is faster, and so blocks, stays the same. So every rank leaves the
collective ``COLLECTIVE_RELEASE_NS`` after the last rank arrived, spinning to that instant:
the ranks leave together, as a device all-reduce releases them, whatever each waited in.
(docs/profiling.md gives the figures that led to both.)

The ``load`` phase runs the model step every iteration (requests always running); the
``idle`` phase puts nothing and sleeps 1 ms per iteration instead, as FastDeploy's loop
does when nothing runs. Its figure is a worker's steady idle CPU, which it keeps for as long
as nothing runs: every segment builds a new client, so each idle segment first runs
``IDLE_WARMUP_STEPS`` iterations outside its window, in every mode, for the client's
start-up not to be counted as idle CPU (docs/profiling.md, Idle CPU).

A worker builds and calibrates one model step per step kind of the run (``--step``), and
each load segment names the kind it runs. Around the model step's work (not its collective,
which blocks on purpose) every rank measures how long its event-loop thread was kept off
the CPU and why (``interruption.ThreadInterruption``: run queue, GIL wait, context
switches), in every mode, the reference included, so the meter's own cost cancels out.

The fd-manager queue is built once per run and reused by every fd-manager segment: building
one takes seconds (each of its manager proxies opens a connection whose handshake waits on
TCP delayed acknowledgements), which FastDeploy pays once per server, not per batch. A
segment ends with every batch read by every rank, the state a new queue starts in.

Each segment's result says how many threads its process ran at the end of the measured
steps (Python threads and the kernel's count, which includes libzmq's and the frameworks'
own): the report's regime line compares them with the cores.
"""

import os
import threading
import time
import traceback

import numpy as np

from ..engine.queue import TaskQueue
from ..tp import ShmBarrier
from ..worker.client import TaskClient
from ..worker.step_profiler import StepProfiler
from .fd_baseline import FDManagerQueue
from .interruption import ThreadInterruption
from .options import IDLE_WARMUP_STEPS, MODES, REFERENCE
from .workload import ModelStep, RequestPool

__all__ = ["MODES", "REFERENCE", "engine_main", "worker_main", "FDManagerSteps",
           "thread_counts"]

PHASES = ("load", "idle")

BARRIER_TIMEOUT_S = 30.0  # every blocking call of a profiled process is bounded
CONTROL_TIMEOUT_S = 600.0  # the runner's longest silence (a long segment) before giving up
DRAIN_TIMEOUT_S = 60.0
COLLECTIVE_SPIN_US = 3000.0  # every process has a core of its own
COLLECTIVE_SPIN_SHARED_US = 50.0  # fewer cores than processes: do not spin the peer off its core
# Every rank leaves the model collective this long after the last rank arrived (then
# spins to that instant): longer than a blocked rank's semaphore wake-up, so the ranks
# leave together as a device all-reduce releases them (module docstring)
COLLECTIVE_RELEASE_NS = 150_000
IDLE_SLEEP_S = 0.001  # FastDeploy's loop sleeps 1 ms when nothing is running
_PUT_RETRY_S = 0.05  # a put blocked by backpressure re-checks for "stop" this often


class ControlError(RuntimeError):
    """The runner sent something unexpected, or went silent."""


def _recv(conn, expect=None, timeout=CONTROL_TIMEOUT_S):
    if not conn.poll(timeout):
        raise ControlError(f"no word from the runner for {timeout:.0f} s")
    cmd, arg = conn.recv()
    if expect is not None and cmd != expect:
        raise ControlError(f"expected {expect!r} from the runner, got {cmd!r}")
    return cmd, arg


def _report_failure(conn, who):
    try:
        conn.send(("error", f"{who}:\n{traceback.format_exc()}"))
    except (OSError, EOFError):  # the runner is gone; it will see the exit code
        pass


# -- engine ----------------------------------------------------------------------------------

def thread_counts(children: bool = False) -> dict:
    """This process's threads now: ``python`` (``threading.active_count()``) and ``os``
    (the kernel's count, ``/proc/self/task``: libzmq's and the frameworks' threads too;
    None without /proc); with ``children``, ``children_os``: the kernel's count for each
    child process (the fd-manager's server), a list."""
    def tasks(pid="self"):
        try:
            return len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            return None

    out = {"python": threading.active_count(), "os": tasks()}
    if children:
        try:
            with open(f"/proc/self/task/{os.getpid()}/children") as f:
                pids = f.read().split()
        except OSError:
            pids = []
        out["children_os"] = [tasks(pid) for pid in pids]
    return out


def pin_to(cpu):
    """Pin the calling process to core ``cpu`` (None: leave it as started); return the
    cores it may run on afterwards, as the kernel reports them. Children started later
    (the fd-manager's server process) inherit the pinning."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    return sorted(os.sched_getaffinity(0))


def engine_main(conn, tp_size, batch, prompt_len, tokens, max_inflight, cpu=None):
    """The engine process: opens each segment's queue, puts batches at a rate, closes it.
    ``cpu``: the core to pin it to (``--cpus``), or None.

    Commands: ("ready", {"cpus"}) first; ("open", {"mode", "name"}) -> ("opened", address);
    ("go", rate) -> puts until ("stop") -> ("stopped", {"put", "cpu_s", "wall_s", "threads"});
    ("close") -> ("closed", stats); ("exit"). ``cpu_s`` is the engine process's CPU time
    (all its threads) while putting. The fd-manager queue is opened once and kept until
    "exit" (see the module docstring); "close" then only waits until every rank read.
    """
    queue = fd_queue = None
    try:
        cpus = pin_to(cpu)
        pool = RequestPool(batch, prompt_len, tokens)
        conn.send(("ready", {"cpus": cpus}))
        while True:
            cmd, arg = _recv(conn)
            if cmd == "open":
                if arg["mode"] == "fd-manager":
                    if fd_queue is None:
                        fd_queue = FDManagerQueue(is_server=True, tp_size=tp_size)
                    queue = fd_queue
                    conn.send(("opened", fd_queue.address))
                else:
                    queue = TaskQueue(arg["name"], tp_size, max_inflight=max_inflight)
                    conn.send(("opened", None))
            elif cmd == "go":
                cpu0, wall0 = time.process_time(), time.perf_counter()
                n = _put_at_rate(queue, pool, arg, conn)
                conn.send(("stopped", {"put": n, "threads": thread_counts(children=True),
                                       "cpu_s": time.process_time() - cpu0,
                                       "wall_s": time.perf_counter() - wall0}))
            elif cmd == "close":
                stats = _drain_engine_queue(queue)
                if queue is not fd_queue:
                    queue.close()
                queue = None
                conn.send(("closed", stats))
            elif cmd == "exit":
                return
            else:
                raise ControlError(f"unknown command {cmd!r}")
    except BaseException:
        _report_failure(conn, "engine")
    finally:
        for q in {id(q): q for q in (queue, fd_queue) if q is not None}.values():
            q.close()


def _put_at_rate(queue, pool, rate, conn) -> int:
    """Put batches 0, 1, ... every 1/rate s until the runner says stop; return how many.

    A put blocked by backpressure is retried (the batch keeps the stamp of its first try,
    so delivery latency includes the wait); a late put is not followed by a burst."""
    period = 1.0 / rate if rate > 0 else None
    n = 0
    due = time.perf_counter()
    while True:
        wait = CONTROL_TIMEOUT_S if period is None else max(0.0, due - time.perf_counter())
        if conn.poll(wait):
            _recv(conn, "stop")
            return n
        if period is None:
            raise ControlError(f"no 'stop' from the runner for {CONTROL_TIMEOUT_S:.0f} s")
        batch = pool.batch(n)
        while True:
            try:
                queue.put_tasks(batch, timeout=_PUT_RETRY_S)
                break
            except TimeoutError:
                if conn.poll(0):
                    _recv(conn, "stop")
                    return n
        n += 1
        due = max(due + period, time.perf_counter())


def _drain_engine_queue(queue) -> dict:
    """Wait (bounded) until every rank has consumed everything; return the queue's stats."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while queue.num_tasks() and time.monotonic() < deadline:
        time.sleep(0.005)
    left = queue.num_tasks()
    stats = queue.stats() if isinstance(queue, TaskQueue) else {}
    stats["unconsumed_at_close"] = left
    return stats


# -- worker ----------------------------------------------------------------------------------

class FDManagerSteps:
    """FastDeploy's task calls in ``event_loop_normal`` (one node), on the FastDeploy-style
    manager queue, behind the three methods a ``TaskClient`` has, so that one loop and one
    ``StepProfiler`` serve both. Round trips (RT) per call are those of ``fd_baseline``."""

    def __init__(self, address, tp_size, tp_rank):
        self.queue = FDManagerQueue(address=tuple(address), tp_size=tp_size, tp_rank=tp_rank,
                                    connect_timeout=BARRIER_TIMEOUT_S)
        self.profiler = StepProfiler().attach(self)

    def exist_tasks(self) -> bool:
        """Rank 0: the shared-memory "tasks exist" flag (0 RT); when a batch waits, set the
        group's ``exist_task_signal`` (0 RT)."""
        if self.queue.exist_tasks():
            self.queue.set_exist_task_signal(True)
            return True
        return False

    def barrier(self, timeout=None):
        """The manager's barrier (1 RT held open until every rank arrives)."""
        self.queue.barrier(timeout)

    def get_tasks(self):
        """``exist_task_signal or read_finish_flag.get()`` (0 RT when the signal is set, else
        1 RT); if either, ``get_tasks()`` (tp + 9, the last reader tp + 10 RT), and the last
        reader clears the signal (0 RT)."""
        queue = self.queue
        if queue.exist_task_signal() or queue.get_read_finish_flag():
            tasks, last = queue.get_tasks()
            if last:
                queue.set_exist_task_signal(False)
            return tasks, last
        return [], False

    def close(self):
        self.queue.close()


class TPModel:
    """A TP rank's simulated model steps: the calibrated work of each step kind, then the
    model's collective.

    ``use(kind, n)`` selects the kind for a segment and allocates room for ``n`` steps;
    ``step()`` is the load phase's model step: it records how long the work and the
    collective wait took and the work's interruption (steps past ``n``, i.e. the drain, are
    not recorded). ``idle()`` is the idle phase's 1 ms sleep.
    """

    def __init__(self, models, collective):
        self.models, self.collective = models, collective
        self.meter = ThreadInterruption()
        self.use(None, 0)

    def use(self, kind, n):
        self.model = None if kind is None else self.models[kind]
        self.compute_ns = np.zeros(n, dtype=np.int64)
        self.collective_ns = np.zeros(n, dtype=np.int64)
        self.meter.start(n)
        self._i = 0

    def step(self):
        now, meter = time.perf_counter_ns, self.meter
        t0 = now()
        meter.begin()
        self.model()
        meter.end()
        t1 = now()
        if self.collective is not None:
            self.collective.wait(BARRIER_TIMEOUT_S)
            # every rank leaves at one instant after the last arrival (module docstring)
            release = self.collective.last_arrival_ns() + COLLECTIVE_RELEASE_NS
            while time.monotonic_ns() < release:
                pass
        i = self._i
        if i < len(self.compute_ns):
            self.compute_ns[i] = t1 - t0
            self.collective_ns[i] = now() - t1
            self._i = i + 1

    @staticmethod
    def idle():
        time.sleep(IDLE_SLEEP_S)

    def close(self):
        self.meter.close()


def worker_main(conn, run_name, tp_size, tp_rank, step_kinds, step_ms, progress, cpu=None,
                spin_us=COLLECTIVE_SPIN_US, gpu_backend="auto"):
    """One TP rank: calibrates a model step of each of ``step_kinds``, then runs the
    segments the runner sends. ``cpu``: the core to pin it to (``--cpus``), or None; the
    calibration it reports holds the cores it runs on (``"cpus"``). ``spin_us``: the model
    collective's spin. ``gpu_backend``: the ``gpu`` step's backend (``gpu_step.resolve``);
    this rank runs on GPU ``tp_rank % count``.

    Commands: ("units", {kind: n}) once, after it reported its calibrations
    ({kind: calibration}); then ("segment", spec) -> ("ready") ... ("go") ... ("measured")
    ... ("drain", n) -> ("result", dict); ("exit"). ``progress`` (a shared int) is rank 0's
    step count in the current segment, for the runner's progress bar.
    """
    collective = tp_model = None
    kept = {}  # the fd-manager client, kept across segments (see the module docstring)
    try:
        cpus = pin_to(cpu)  # before calibrating: the calibration must run where the steps do
        models = {kind: ModelStep(kind, step_ms, rank=tp_rank, gpu_backend=gpu_backend)
                  for kind in step_kinds}
        if tp_size > 1:
            collective = ShmBarrier(f"{run_name}m", tp_size, tp_rank, spin_us=spin_us)
        conn.send(("calibrated", {kind: {**m.calibrate(), "cpus": cpus}
                                  for kind, m in models.items()}))
        _, units = _recv(conn, "units")
        for kind, n in units.items():
            models[kind].units = n
        tp_model = TPModel(models, collective)
        while True:
            cmd, spec = _recv(conn)
            if cmd == "exit":
                return
            if cmd != "segment":
                raise ControlError(f"unknown command {cmd!r}")
            conn.send(("result", _run_segment(conn, spec, tp_size, tp_rank, tp_model,
                                              progress, kept)))
    except BaseException:
        _report_failure(conn, f"worker rank {tp_rank}")
    finally:
        # Shared memory first: it outlives a process that is killed before it finishes
        # (the fd-manager client's close makes several manager round trips).
        if collective is not None:
            collective.close()
        if tp_model is not None:
            tp_model.close()
        for steps in kept.values():
            steps.close()


def _open_steps(spec, tp_size, tp_rank, kept):
    mode = spec["mode"]
    if mode == REFERENCE:
        return None
    if mode == "fd-manager":
        steps = kept.get("fd-manager")
        if steps is None:
            steps = kept["fd-manager"] = FDManagerSteps(spec["address"], tp_size, tp_rank)
        steps.profiler.reset()
        return steps
    return TaskClient(spec["name"], tp_size, tp_rank, async_prefetch=(mode == "async"),
                      profile=True)


def _run_segment(conn, spec, tp_size, tp_rank, tp_model, progress, kept) -> dict:
    steps = _open_steps(spec, tp_size, tp_rank, kept)
    load = spec["phase"] == "load"
    tp_model.use(spec["kind"], spec["steps"] if load else 0)
    try:
        conn.send(("ready", None))
        _recv(conn, "go")
        taken: list = []
        warmup = 0 if load else IDLE_WARMUP_STEPS
        if warmup:  # every rank runs as many: their barriers pair up
            _run_steps(steps, tp_size, tp_rank, tp_model.idle, warmup, taken, progress)
            if steps is not None:
                steps.profiler.reset()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        thread0 = _prefetch_cpu(steps)
        start_ns, iter_ns = _run_steps(steps, tp_size, tp_rank,
                                       tp_model.step if load else tp_model.idle, spec["steps"],
                                       taken, progress)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        thread_cpu = None if thread0 is None else _prefetch_cpu(steps) - thread0
        sync_ns = None if steps is None else steps.profiler.samples()
        interruption = tp_model.meter.arrays() if load else None
        threads = thread_counts()
        conn.send(("measured", None))
        _, total = _recv(conn, "drain")
        drain_steps = _drain(steps, tp_size, tp_rank, tp_model.step, spec["steps"], taken, total)
    finally:
        if steps is not None and steps is not kept.get("fd-manager"):
            steps.close()
    return {"mode": spec["mode"], "kind": spec["kind"], "phase": spec["phase"],
            "round": spec["round"], "rank": tp_rank, "pid": os.getpid(),
            "steps": spec["steps"], "warmup_steps": warmup, "start_ns": start_ns,
            "iter_ns": iter_ns, "sync_ns": sync_ns,
            "compute_ns": tp_model.compute_ns,
            "collective_ns": tp_model.collective_ns, "interruption": interruption,
            "taken": taken, "drain_steps": drain_steps, "cpu_s": cpu, "wall_s": wall,
            "prefetch_cpu_s": thread_cpu, "threads": threads}


def _prefetch_cpu(steps):
    return steps.prefetch_cpu_seconds() if isinstance(steps, TaskClient) else None


def _task_step(steps, tp_size, tp_rank, taken):
    """One step's task sync, as FastDeploy's loop does it: ``task_step(i)`` checks (rank 0),
    passes the barrier (none at TP=1, as in FastDeploy) and takes, appending
    ``(i, batch_id, put_ns, take_ns)`` to ``taken`` for every batch taken."""
    exist_tasks, barrier, get_tasks = steps.exist_tasks, steps.barrier, steps.get_tasks
    rank0, tp, now = tp_rank == 0, tp_size > 1, time.perf_counter_ns

    def task_step(i):
        if rank0:
            exist_tasks()
        if tp:
            barrier(BARRIER_TIMEOUT_S)
        tasks, _ = get_tasks()
        if tasks:
            t = now()
            for batch in tasks:
                taken.append((i, batch["batch_id"], batch["put_ns"], t))
    return task_step


def _run_steps(steps, tp_size, tp_rank, work, n, taken, progress):
    """The measured loop, ``n`` steps; returns ``(start_ns, iter_ns)``: when the first
    iteration began and each iteration's wall time (ns); iteration ``i`` begins (its check)
    at ``start_ns + iter_ns[:i].sum()``. With ``steps`` None it is the reference: the same
    loop without task sync."""
    now = time.perf_counter_ns
    task_step = None if steps is None else _task_step(steps, tp_size, tp_rank, taken)
    iter_ns = np.zeros(n, dtype=np.int64)
    progress.value = 0
    start_ns = t_prev = now()
    for i in range(n):
        if task_step is not None:
            task_step(i)
        work()
        t = now()
        iter_ns[i] = t - t_prev
        t_prev = t
        if not i & 63:
            progress.value = i
    progress.value = n
    return start_ns, iter_ns


def _drain(steps, tp_size, tp_rank, work, first_step, taken, total) -> int:
    """Keep stepping (untimed) until this rank has taken all ``total`` batches the engine
    put; every rank stops at the same step because every rank takes the same batches."""
    if steps is None or len(taken) >= total:
        return 0
    task_step = _task_step(steps, tp_size, tp_rank, taken)
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    step = first_step
    while len(taken) < total:
        if time.monotonic() > deadline:
            raise TimeoutError(f"took {len(taken)} of {total} batches; the rest did not "
                               f"arrive within {DRAIN_TIMEOUT_S:.0f} s")
        task_step(step)
        work()
        step += 1
    return step - first_step
