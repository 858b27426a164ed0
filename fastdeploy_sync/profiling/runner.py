"""Runs a profile: starts the engine and worker processes, drives interleaved segments
(``options.ProfileOptions.schedule``), collects what they measured. ``report`` turns the
result into figures.

The rounds are split into ``placements`` blocks of consecutive rounds, and each block is run
by freshly started engine and worker processes: where the OS places processes relative to
each other, and which rank of a pair comes out faster, last as long as the processes and
moved figures between runs by more than their intervals within one run (``intervals``
resamples the placements too). Within a block the processes stay up (each segment opens and
closes its own queue and clients under a fresh name; the fd-manager queue is built once per
engine, see ``loops``); every block runs the first block's calibration, so every block
does the same work per step.
"""

import contextlib
import multiprocessing as mp
import multiprocessing.connection
import os
import time
import uuid
from dataclasses import asdict

from . import contention
from .fd_baseline import remove_stale_flags
from .intervals import placement_blocks
from .loops import COLLECTIVE_SPIN_SHARED_US, COLLECTIVE_SPIN_US, engine_main, worker_main
from .options import REFERENCE, ProfileOptions

__all__ = ["ProfileOptions", "ProfileError", "run_profile", "collective_spin_us"]

# Threads a profiled process may start for numeric work: 1, so that the processes share
# the cores the way a real TP group's ranks share their devices, not by oversubscription.
_CHILD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "GLOG_minloglevel": "2", "FD_SYNC_PROFILE": "0"}
_START_TIMEOUT_S = 180.0  # process start, imports (paddle: seconds), calibration
_SEGMENT_TIMEOUT_S = 600.0
_TICK_S = 0.2  # progress bar refresh while waiting
# Every process's exit, together: a process killed before its cleanup leaves its shared
# memory behind, and the fd-manager's server shutdown and paddle's teardown take seconds.
_EXIT_TIMEOUT_S = 60.0


class ProfileError(RuntimeError):
    """A profiled process failed or went silent; the message says which and why."""


def collective_spin_us(options: ProfileOptions) -> float:
    """The model collective's spin: long only when the engine and every rank have a core
    to themselves (pinned to distinct cores, or enough cores unpinned); see ``loops``."""
    if options.cpus is not None:
        own = len(set(options.cpus)) == len(options.cpus)
    else:
        own = len(options.cores()) >= options.tp + 1
    return COLLECTIVE_SPIN_US if own else COLLECTIVE_SPIN_SHARED_US


@contextlib.contextmanager
def _child_environment():
    """The environment spawned children inherit (restored afterwards)."""
    saved = {k: os.environ.get(k) for k in _CHILD_ENV}
    os.environ.update(_CHILD_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _Processes:
    """The engine and the workers, each with its control pipe; every wait is bounded and
    notices a process that died."""

    def __init__(self, options, run_name):
        ctx = mp.get_context("spawn")
        self.progress = ctx.RawValue("q", 0)
        self.procs, self.conns, self.names = [], [], []
        with _child_environment():
            cpus = options.cpus or [None] * (options.tp + 1)
            self._start(ctx, "engine", engine_main, options.tp, options.batch,
                        options.prompt_len, options.tokens, options.max_inflight, cpus[0])
            for rank in range(options.tp):
                progress = self.progress if rank == 0 else ctx.RawValue("q", 0)
                self._start(ctx, f"worker rank {rank}", worker_main, run_name, options.tp, rank,
                            options.step_kinds, options.step_ms, progress, cpus[rank + 1],
                            collective_spin_us(options), options.gpu_backend)

    def _start(self, ctx, name, target, *args):
        ours, theirs = ctx.Pipe()
        # Not daemonic: the engine starts the fd-manager's server process. A child whose
        # runner dies sees its pipe close and exits; close() below joins or kills each one.
        proc = ctx.Process(target=target, args=(theirs, *args), name=f"fdsync-profile {name}")
        proc.start()
        theirs.close()
        self.procs.append(proc)
        self.conns.append(ours)
        self.names.append(name)

    @property
    def engine(self):
        return 0

    @property
    def workers(self):
        return list(range(1, len(self.procs)))

    def send(self, who, message):
        for i in who:
            self.conns[i].send(message)

    def expect(self, who, kind, timeout, tick=None):
        """Wait for message ``kind`` from each of ``who``; return their args, in order.
        ``tick()`` runs every ~0.2 s while waiting."""
        pending, got = set(who), {}
        deadline = time.monotonic() + timeout
        while pending:
            if time.monotonic() > deadline:
                raise ProfileError(f"no {kind!r} within {timeout:.0f} s from "
                                   f"{', '.join(self.names[i] for i in sorted(pending))}")
            ready = mp.connection.wait([self.conns[i] for i in pending] +
                                       [self.procs[i].sentinel for i in pending], _TICK_S)
            for i in sorted(pending):
                conn = self.conns[i]
                if conn in ready or conn.poll(0):
                    try:
                        got_kind, arg = conn.recv()
                    except EOFError:  # it exited; its exit code says more than the pipe
                        self.procs[i].join(timeout=5)
                        raise ProfileError(f"{self.names[i]} exited (code "
                                           f"{self.procs[i].exitcode}) while the runner "
                                           f"waited for {kind!r}") from None
                    if got_kind == "error":
                        raise ProfileError(arg)
                    if got_kind != kind:
                        raise ProfileError(f"{self.names[i]} sent {got_kind!r}, expected {kind!r}")
                    got[i] = arg
                    pending.discard(i)
                elif self.procs[i].exitcode is not None:
                    raise ProfileError(f"{self.names[i]} exited (code {self.procs[i].exitcode}) "
                                       f"while the runner waited for {kind!r}")
            if tick is not None:
                tick()
        return [got[i] for i in who]

    def close(self):
        """Ask every process to exit, wait for all of them together for at most
        ``_EXIT_TIMEOUT_S``, then kill whatever is left (``_sweep`` then removes what a
        killed process left of this run)."""
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send(("exit", None))
                except (OSError, BrokenPipeError):
                    pass
        deadline = time.monotonic() + _EXIT_TIMEOUT_S
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()
        # An engine killed before its cleanup leaves its fd-manager server's flags segment
        # (not a name of this run: the server's port names it); only a server that is
        # gone has its segment removed, never a live one's.
        remove_stale_flags()


def run_profile(options: ProfileOptions, progress_bar=None) -> dict:
    """Run the whole schedule; return the raw result (``report.summarize`` reads it).

    ``progress_bar``: a tqdm-like object (``total``, ``update(n)``, ``set_description``)
    or None. Raises ``ValueError`` for bad options, ``ProfileError`` if a process fails.
    """
    options.validate()
    run_name = f"prof{uuid.uuid4().hex[:10]}"
    schedule = options.schedule()
    if progress_bar is not None:
        progress_bar.total = sum(steps for *_, steps in schedule)
        progress_bar.refresh()
    started = time.time()
    # filled in by RunOptions.__post_init__
    assert options.placements is not None and options.step_kinds is not None
    block_of = {r: b for b, rounds in enumerate(placement_blocks(options.rounds,
                                                                  options.placements))
                for r in rounds}
    calibration = units = engine_cpus = None
    segments, pids = [], []
    for block in range(options.placements):
        block_name = f"{run_name}p{block}"
        mine = [k for k, (*_, rnd, _steps) in enumerate(schedule) if block_of[rnd] == block]
        procs = _Processes(options, block_name)
        try:
            (engine,) = procs.expect([procs.engine], "ready", _START_TIMEOUT_S)
            by_rank = procs.expect(procs.workers, "calibrated", _START_TIMEOUT_S)
            if units is None:
                calibration = {kind: [c[kind] for c in by_rank] for kind in options.step_kinds}
                # One amount of work for every rank (the median rank's calibration): TP
                # ranks run the same model, and unequal steps would show up as barrier
                # waits. Later placements get the same, so every block does the same work.
                units = {kind: sorted(c["units"] for c in cs)[len(cs) // 2]
                         for kind, cs in calibration.items()}
                engine_cpus = engine["cpus"]
            procs.send(procs.workers, ("units", units))
            pids.append([proc.pid for proc in procs.procs])
            for k in mine:
                mode, kind, phase, rnd, steps = schedule[k]
                if progress_bar is not None:
                    progress_bar.set_description(f"{kind or 'idle'} {mode}")
                segments.append(_run_segment(procs, options, f"{run_name}s{k}", mode, kind,
                                             phase, rnd, steps, progress_bar))
        finally:
            procs.close()
            _sweep([f"{block_name}m"] + [f"{run_name}s{k}" for k in mine])
    return {"options": asdict(options), "run_name": run_name, "started": started,
            "elapsed_s": time.time() - started, "calibration": calibration, "units": units,
            "engine_cpus": engine_cpus, "collective_spin_us": collective_spin_us(options),
            "cores": options.cores(), "pinned": options.cpus is not None,
            "placement_pids": pids, "segments": segments}


def _sweep(names):
    """Remove what this run's processes left behind when ``close()`` had to kill them
    before their own cleanup (a loaded machine can make an exit take longer than
    ``_EXIT_TIMEOUT_S``): stale names of this run only, each checked again; never a live
    owner's, never another run's."""
    from ..cleanup import remove, scan

    for name in names:
        remove(scan(name))


def _run_segment(procs, options, name, mode, kind, phase, rnd, steps, bar):
    uses_engine = mode != REFERENCE
    address = None
    if uses_engine:
        procs.send([procs.engine], ("open", {"mode": mode, "name": name}))
        (address,) = procs.expect([procs.engine], "opened", _START_TIMEOUT_S)
    spec = {"mode": mode, "kind": kind, "phase": phase, "round": rnd, "steps": steps,
            "name": name, "address": address}
    procs.send(procs.workers, ("segment", spec))
    procs.expect(procs.workers, "ready", _START_TIMEOUT_S)
    if uses_engine:
        procs.send([procs.engine], ("go", options.rate if phase == "load" else 0.0))
    procs.send(procs.workers, ("go", None))
    cores = options.cores()
    before = contention.snapshot(cores)

    shown = 0

    def tick():
        nonlocal shown
        if bar is not None:
            done = min(procs.progress.value, steps)
            bar.update(done - shown)
            shown = done

    procs.expect(procs.workers, "measured", _SEGMENT_TIMEOUT_S, tick)
    foreign = contention.foreign_cores(before, contention.snapshot(cores))
    put, putting = 0, None
    if uses_engine:
        procs.send([procs.engine], ("stop", None))
        (putting,) = procs.expect([procs.engine], "stopped", _START_TIMEOUT_S)
        put = putting["put"]
    procs.send(procs.workers, ("drain", put))
    workers = procs.expect(procs.workers, "result", _SEGMENT_TIMEOUT_S)
    engine = {}
    if uses_engine:
        procs.send([procs.engine], ("close", None))
        (engine,) = procs.expect([procs.engine], "closed", _START_TIMEOUT_S)
    if bar is not None:
        bar.update(steps - shown)
    return {"mode": mode, "kind": kind, "phase": phase, "round": rnd, "steps": steps,
            "name": name, "put": put, "engine_putting": putting, "engine": engine,
            "workers": workers, "foreign_cores": foreign, "cores": len(cores)}

