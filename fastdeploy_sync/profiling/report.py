"""Figures from a profile run: ``summarize`` (JSON-ready) and ``format_table`` (terminal);
``plot`` draws the same figures (``plot.py``).

Every definition the figures follow is in ``DEFINITIONS``: the terminal prints it, the JSON
stores it, and the plot's titles and labels use the same phrases (``DELIVERY`` above all).
Vocabulary: a *mode* (none, async, sync, fd-manager) is what is compared and only ever a
row label; a *step kind* (python, paddle, ...) is the simulated model step; the figures
are the *critical path*, the *interruption* of the model step, the step-time *inflation*,
*delivery* and *idle CPU*. Every figure a verdict rests on comes with an interval from
paired rounds (``intervals``).
"""

import os
import platform

import numpy as np

from .intervals import (LEVEL, MIN_ROUNDS, RESAMPLES, WORDS, Bootstrap, pooled_mean,
                        pooled_median, ragged_median, verdict)
from .loops import IDLE_WARMUP_STEPS, REFERENCE
from ..step_profiler import SECTIONS, distribution_us

__all__ = ["summarize", "format_table", "parameters_line", "plot", "DEFINITIONS", "DELIVERY",
           "SCHEMA"]

SCHEMA = "fastdeploy-sync-profile/2"

DELIVERY = "put_tasks() called -> the last rank's get_tasks() returned the batch"

# What each step kind does with the GIL: the delivery note and the plot say it.
STEP_KIND_GIL = {
    "python": "holds the GIL for the whole step (pure-Python work)",
    "numpy": "releases the GIL inside each numpy call",
    "paddle": "releases the GIL inside every paddle op, as GPU kernel launches do",
    "sleep": "sleeps: no CPU, no GIL",
}
_HOLDS_GIL = {"python"}

# The reference configuration (any step kind): targets are judged on any run but
# were set for this one (format_table says which it is).
REFERENCE_CONFIG = {"step_ms": 2.0, "rate": 100.0, "batch": 64, "prompt_len": 512, "tp": 2,
                    "tokens": "numpy"}

# The delivery of a batch in three parts that add up to it (``_boundaries_and_parts``).
DELIVERY_PARTS = ("to_first_boundary", "boundaries_passed", "taking_step")
_DELIVERY_PART_WORDS = {"to_first_boundary": "put -> first boundary",
                        "boundaries_passed": "boundaries passed",
                        "taking_step": "the taking step"}

DEFINITIONS = {
    "round": "every mode once, back to back, under the same machine conditions (the "
             "modes' order rotates from round to round); the unit of evidence",
    "placement": "a block of consecutive rounds run by freshly started engine and worker "
                 "processes (--placements blocks per run): where the OS placed them, and "
                 "which rank came out faster, lasts as long as the processes",
    "interval": f"{LEVEL:.0%} percentile bootstrap, two-stage: the placements resampled with "
                f"replacement, then whole rounds within each ({RESAMPLES} resamples, "
                f"seeded); a figure comparing two modes uses the same resampled rounds for "
                f"both (paired); with one placement, a bootstrap over rounds",
    "verdict": f"met or MISSED only when the interval lies wholly on one side of the target, "
               f"otherwise inconclusive; fewer than {MIN_ROUNDS} rounds give no interval and "
               f"every verdict is inconclusive; the inflation is also inconclusive when the "
               f"model step ran faster than in none beyond its interval (task sync cannot "
               f"do that: the loops did not meet the same machine)",
    "step": "one iteration of rank 0's loop: check (exist_tasks), barrier, take (get_tasks), "
            "then the model step",
    "model_step": "the calibrated work of the step kind, then the model's TP collective "
                  "(a shared-memory barrier standing in for the all-reduce)",
    "critical_path": "check + barrier + take on rank 0's event loop, per step, as the "
                     "StepProfiler recorded them; the barrier part includes waiting for a "
                     "late rank",
    "inflation": "100 * (M - R) / R; M: the mode's mean step, R: none's (the same loop "
                 "without task sync), over the same rounds",
    "critical_path_share": "100 * C / R; C: the mode's mean critical path per step",
    "model_slowdown": "inflation - critical path share: the model step and its collective "
                      "ran slower than in none (CPU or GIL taken from them) or, negative, "
                      "faster (the barrier absorbed waiting that none spends in the "
                      "collective, or noise)",
    "off_cpu": "during the model step's work (not its collective), rank 0's event-loop "
               "thread: wall time minus the thread's own CPU time (time.thread_time_ns)",
    "run_queue": "part of off-CPU: runnable but not running, another thread or process had "
                 "the core (sched_info run_delay in /proc/self/task/<tid>/schedstat, ns)",
    "gil_wait": "time rank 0's event-loop thread waited for the GIL another thread of the "
                "process held during the model step's work (async: the prefetch thread; "
                "sync: the heartbeat thread; none: no other thread), as two bounds. Lower: "
                "the time it was blocked, i.e. off-CPU - run queue in steps where it switched "
                "out of its own accord (a voluntary context switch; the work does no I/O and "
                "takes no lock, so what it blocks on is the GIL). Upper: all off-CPU time of "
                "those steps (every GIL wait blocks at least once; a waiter that wakes to "
                "busy cores waits in the run queue). Close on an idle machine, apart under "
                "load. Resolution ~+-2 us per step (the clocks are read one after another); "
                "checked against a thread holding the GIL for known times "
                "(scripts/gil_wait_check.py); the meter costs ~6 us per step, in every mode",
    "gil_wait_added": "100 * (G - G0) / R; G, G0: the mode's and none's mean GIL wait per "
                      "step, over the same rounds, for each bound; the target's interval runs "
                      "from the lower bound's low end to the upper bound's high end",
    "context_switches": "of the event-loop thread during the model step's work, per step "
                        "(getrusage RUSAGE_THREAD): involuntary = preempted, voluntary = "
                        "blocked (here: waiting for the GIL)",
    "delivery": DELIVERY + " (the engine stamps the batch just before put_tasks(), so a wait "
                           "for room counts)",
    "boundaries": "rank 0's step boundaries (checks) from put_tasks() to the take, the take's "
                  "included (1 = taken at the first boundary after the put): the share of "
                  "batches taken at the first, and the mean; batches taken in measured steps",
    "delivery_parts": "a batch's delivery in three parts that add up to it, means over the "
                      "batches taken in measured steps (ms): to_first_boundary (put_tasks() "
                      "called -> rank 0's first check after it), boundaries_passed (-> the "
                      "check of the step that took it), taking_step (-> the last rank's "
                      "get_tasks() returned it: the barrier waiting for the last rank, and "
                      "the take)",
    "loaded_cpu": "while the engine puts: the engine process (all threads) and a worker's "
                  "prefetch thread, % of one core",
    "idle_cpu": "rate 0 (nothing put; FastDeploy's loop sleeps 1 ms per iteration): worker "
                "process CPU (all threads) over wall time, max over ranks, % of one core; "
                "the prefetch thread's alone where there is one. Each segment opens its "
                f"window after {IDLE_WARMUP_STEPS} iterations, in every mode: the steady "
                "idle loop, without the start-up of the client the segment built",
    "idle_above_none": "the mode's idle worker CPU minus none's (the same 1 ms loop without "
                       "task sync) in the same rounds, percentage points",
    "ranks_agree": "in every segment every rank took the same batch ids at the same steps, "
                   "ids 0..put-1 in order (none lost, none twice)",
}

_INTERRUPTION_FIELDS = (("off_cpu", "off_cpu_ns"), ("run_queue", "runq_ns"),
                        ("gil_wait", "gil_ns"), ("gil_wait_upper", "gil_upper_ns"),
                        ("other", "other_ns"))


def _ms(d):
    return {k.replace("_us", "_ms"): (None if v is None else v / 1e3) if k.endswith("_us") else v
            for k, v in d.items()}


def _rank(segment, rank):
    return next(w for w in segment["workers"] if w["rank"] == rank)


def _ratio_stat(a, b):
    def stat(idx):
        with np.errstate(divide="ignore", invalid="ignore"):
            return a(idx) / b(idx)
    return stat


class _KindRounds:
    """One step kind's load segments, per mode, as per-round arrays (rank 0 unless said)."""

    def __init__(self, raw, kind, modes):
        self.segments = {}
        for mode in modes:
            segs = [s for s in raw["segments"] if s["phase"] == "load" and s["kind"] == kind
                    and s["mode"] == mode]
            self.segments[mode] = sorted(segs, key=lambda s: s["round"])

    def rank0(self, mode, key):
        return np.stack([np.asarray(_rank(s, 0)[key], dtype=float) for s in self.segments[mode]])

    def critical_path(self, mode, section="step"):
        return np.stack([np.asarray(_rank(s, 0)["sync_ns"][section], dtype=float)
                         for s in self.segments[mode]])

    def interruption(self, mode, field):
        values = [_rank(s, 0)["interruption"] for s in self.segments[mode]]
        if any(v is None or v.get(field) is None for v in values):
            return None
        return np.stack([np.asarray(v[field], dtype=float) for v in values])


# -- summary ---------------------------------------------------------------------------------

def summarize(raw) -> dict:
    """Every figure of the run, JSON-ready (plain floats, ints, lists, dicts)."""
    options = raw["options"]
    kinds, modes = options["step_kinds"], options["modes"]
    boot = Bootstrap(options["rounds"], placements=options.get("placements", 1))
    out = {"schema": SCHEMA,
           "parameters": {**{k: v for k, v in options.items() if k != "modes"},
                          "modes": modes, "units_per_step": raw["units"],
                          "calibration": raw["calibration"],
                          "engine_cpus": raw.get("engine_cpus"),
                          "collective_spin_us": raw.get("collective_spin_us")},
           "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                       "platform": platform.platform()},
           "elapsed_s": raw["elapsed_s"], "definitions": DEFINITIONS,
           "intervals": {"level": LEVEL, "resamples": RESAMPLES, "rounds": options["rounds"],
                         "placements": boot.placements,
                         "min_rounds": MIN_ROUNDS, "method": DEFINITIONS["interval"]},
           "step_kinds": {}}
    targets, notes = [], []
    for kind in kinds:
        rounds = _KindRounds(raw, kind, [REFERENCE] + modes)
        summary, kind_targets, kind_notes = _summarize_kind(raw, kind, rounds, modes, boot)
        out["step_kinds"][kind] = summary
        targets += kind_targets
        notes += kind_notes
    idle_segments = [s for s in raw["segments"] if s["phase"] == "idle"]
    out["idle"] = None
    if idle_segments:
        out["idle"], idle_targets, idle_notes = _summarize_idle(idle_segments, modes,
                                                                options["tp"], boot)
        targets += idle_targets
        notes += idle_notes
    out["targets"] = targets
    out["notes"] = notes
    out["verdicts"] = _count_verdicts(targets, boot)
    out["machine_load"] = _machine_load(raw, out)
    out["reference_config"] = all(options.get(k) == v for k, v in REFERENCE_CONFIG.items())
    out["correct"] = all(m["ranks_agree"] and m["batches"]["all_delivered"]
                         for k in out["step_kinds"].values()
                         for name, m in k["modes"].items() if name != REFERENCE)
    return out


def _summarize_kind(raw, kind, rounds, modes, boot):
    """(summary, target rows, notes) of one step kind."""
    tp = raw["options"]["tp"]
    calibration = raw["calibration"][kind]
    ref_iter = pooled_mean(rounds.rank0(REFERENCE, "iter_ns"))
    out = {"gil": STEP_KIND_GIL.get(kind, ""), "units_per_step": raw["units"][kind],
           "calibration": calibration, "modes": {}}
    stats = {}  # per mode: the statistics targets and notes are built from
    for mode in [REFERENCE] + modes:
        m, st = {}, {}
        iter_ns = rounds.rank0(mode, "iter_ns")
        st["iter"] = pooled_mean(iter_ns)
        m["step_ms"] = _ms(distribution_us(iter_ns.ravel()))
        m["model_step_ms"] = float(rounds.rank0(mode, "compute_ns").mean()) / 1e6
        m["collective_ms"] = float(rounds.rank0(mode, "collective_ns").mean()) / 1e6
        m["round_means_ms"] = (iter_ns.mean(axis=1) / 1e6).tolist()
        m["interruption"] = intr = {}
        for name, field in _INTERRUPTION_FIELDS:
            values = rounds.interruption(mode, field)
            if values is None:
                intr[f"{name}_us"] = None
                continue
            st[name] = pooled_mean(values)
            intr[f"{name}_us"] = _scaled(boot.figure(st[name]), 1e-3)
        for name in ("involuntary", "voluntary"):
            values = rounds.interruption(mode, name)
            intr[f"{name}_switches_per_step"] = (None if values is None else
                                                 boot.figure(pooled_mean(values)))
        if mode != REFERENCE:
            _summarize_sync_mode(m, st, rounds, mode, tp, ref_iter, boot)
        stats[mode] = st
        out["modes"][mode] = m
    for mode in modes:  # what each mode adds to none's GIL wait (paired by round)
        intr = out["modes"][mode]["interruption"]
        for bound in ("gil_wait", "gil_wait_upper"):
            g, g0 = stats[mode].get(bound), stats[REFERENCE].get(bound)
            intr[f"{bound.replace('gil_wait', 'gil_wait_added')}_pct"] = None if g is None \
                else boot.figure(lambda idx, g=g, g0=g0: 100 * (g(idx) - g0(idx)) / ref_iter(idx))
        if "fd-manager" in modes and mode != "fd-manager":
            out["modes"][mode]["critical_path_p50_vs_fd_manager"] = boot.figure(
                _ratio_stat(stats["fd-manager"]["p50"], stats[mode]["p50"]))
    targets = _kind_targets(kind, out, stats, modes, boot)
    notes = _kind_notes(kind, out, modes, targets)
    return out, targets, notes


def _summarize_sync_mode(m, st, rounds, mode, tp, ref_iter, boot):
    crit = rounds.critical_path(mode)
    st["p50"] = pooled_median(crit)
    st["crit_mean"] = pooled_mean(crit)
    m["critical_path_us"] = distribution_us(crit.ravel())
    m["critical_path_p50_us"] = _scaled(boot.figure(st["p50"]), 1e-3)
    m["critical_path_by_section_us"] = {
        k: distribution_us(rounds.critical_path(mode, k).ravel()) for k in SECTIONS}
    m["critical_path_by_rank_us"] = [
        distribution_us(np.concatenate([_rank(s, r)["sync_ns"]["step"]
                                        for s in rounds.segments[mode]])) for r in range(tp)]
    m["critical_path_samples_us"] = np.round(crit.ravel() / 1e3, 2).tolist()
    inflation = lambda idx: 100 * (st["iter"](idx) / ref_iter(idx) - 1)  # noqa: E731
    share = lambda idx: 100 * st["crit_mean"](idx) / ref_iter(idx)  # noqa: E731
    m["inflation_pct"] = boot.figure(inflation)
    m["inflation_pct"]["per_round"] = inflation(np.arange(boot.rounds)[:, None]).tolist()
    m["critical_path_share_pct"] = boot.figure(share)
    m["model_slowdown_pct"] = boot.figure(lambda idx: inflation(idx) - share(idx))
    m.update(_delivery(rounds.segments[mode], tp))
    per_round = m.pop("_delivery_rounds_ns")
    st["delivery_p50"] = ragged_median(per_round)
    m["delivery_p50_ms"] = _scaled(boot.figure(st["delivery_p50"]), 1e-6)
    m["load_cpu_pct"] = _load_cpu(rounds.segments[mode], tp)


def _scaled(figure, factor):
    v, i = figure["value"], figure["interval"]
    return {"value": None if v is None else v * factor,
            "interval": None if i is None else [i[0] * factor, i[1] * factor]}


def _delivery(segments, tp):
    """Delivery latency per batch (the last rank's take), step boundaries to the take,
    counts and the agreement check, over the rounds' segments."""
    per_round, boundaries, parts, put, taken, problems = [], [], [], 0, [0] * tp, []
    for s in segments:
        put += s["put"]
        ranks = [_rank(s, r)["taken"] for r in range(tp)]
        for r, t in enumerate(ranks):
            taken[r] += len(t)
        steps_ids = [[(step, bid) for step, bid, _, _ in t] for t in ranks]
        ids = [bid for _, bid in steps_ids[0]]
        if any(x != steps_ids[0] for x in steps_ids[1:]):
            first = next(r for r in range(1, tp) if steps_ids[r] != steps_ids[0])
            problems.append(f"round {s['round']}: rank {first} took different batches or at "
                            f"different steps than rank 0")
        if ids != list(range(s["put"])):
            problems.append(f"round {s['round']}: rank 0 took {len(ids)} batches, expected ids "
                            f"0..{s['put'] - 1} in order")
        last_take = {}  # batch id -> (put_ns, the last rank's take_ns)
        for t in ranks:
            for _, bid, put_ns, take_ns in t:
                last_take[bid] = (put_ns, max(last_take.get(bid, (0, 0))[1], take_ns))
        per_round.append(np.asarray([t - p for p, t in last_take.values()], dtype=float))
        rank_boundaries, rank_parts = _boundaries_and_parts(_rank(s, 0), last_take)
        boundaries += rank_boundaries
        parts += rank_parts
    lat = np.concatenate(per_round) if per_round else np.zeros(0)
    b = np.asarray(boundaries, dtype=float)
    parts = np.asarray(parts, dtype=float).reshape(-1, 3) / 1e6
    return {"delivery_ms": _ms(distribution_us(lat)),
            "delivery_samples_ms": np.round(lat / 1e6, 3).tolist(),
            "delivery_boundaries": {"p50": float(np.median(b)) if b.size else None,
                                    "mean": float(b.mean()) if b.size else None,
                                    "share_first": float(np.mean(b <= 1)) if b.size else None,
                                    "count": int(b.size)},
            "delivery_parts_mean_ms": {
                name: float(parts[:, k].mean()) if len(parts) else None
                for k, name in enumerate(DELIVERY_PARTS)},
            "_delivery_rounds_ns": per_round,
            "batches": {"put": put, "taken_per_rank": taken,
                        "all_delivered": all(t == put for t in taken)},
            "ranks_agree": not problems, "problems": problems}


def _boundaries_and_parts(worker, last_take):
    """For each batch rank 0 took in a measured step: how many of its step boundaries
    (checks) passed from the put to the take, the take's included; and its delivery in
    the three ``DELIVERY_PARTS`` (ns; they add up to the delivery): the put to the first
    boundary after it, the boundaries that passed without taking it, and the step that
    took it (rank 0's check to the last rank's take, from ``last_take``)."""
    iter_ns = np.asarray(worker["iter_ns"], dtype=np.int64)
    starts = worker["start_ns"] + np.concatenate([[0], np.cumsum(iter_ns)[:-1]])
    counts, parts = [], []
    for step, bid, put_ns, _ in worker["taken"]:
        if step < len(starts):
            first = min(int(np.searchsorted(starts, put_ns, side="left")), step)
            counts.append(step - first + 1)
            at_first, at_take = int(starts[first]), int(starts[step])
            parts.append((at_first - put_ns, at_take - at_first,
                          last_take[bid][1] - at_take))
    return counts, parts


def _cpu_pct(segments, tp):
    """Per rank, over ``segments``: the worker process's CPU (all threads) and its prefetch
    thread's (None without one), in % of one core."""
    process, thread = [], []
    for rank in range(tp):
        ws = [_rank(s, rank) for s in segments]
        wall = sum(w["wall_s"] for w in ws)
        process.append(100 * sum(w["cpu_s"] for w in ws) / wall)
        t = [w["prefetch_cpu_s"] for w in ws]
        thread.append(None if None in t else 100 * sum(t) / wall)
    return process, thread


def _load_cpu(segments, tp):
    process, thread = _cpu_pct(segments, tp)
    out = {"worker_process": process, "prefetch_thread": thread, "engine_process": None}
    putting = [s["engine_putting"] for s in segments if s.get("engine_putting")]
    if putting:
        out["engine_process"] = (100 * sum(e["cpu_s"] for e in putting)
                                 / sum(e["wall_s"] for e in putting))
    return out


def _summarize_idle(segments, modes, tp, boot):
    """Idle CPU per mode with intervals, the async target and its note."""
    out, stats = {}, {}
    for mode in [REFERENCE] + modes:
        segs = sorted((s for s in segments if s["mode"] == mode), key=lambda s: s["round"])
        cpu = np.array([[_rank(s, r)["cpu_s"] for r in range(tp)] for s in segs])
        wall = np.array([[_rank(s, r)["wall_s"] for r in range(tp)] for s in segs])

        def stat(idx, cpu=cpu, wall=wall):  # max over ranks of each rank's CPU share
            return (100 * cpu[idx].sum(axis=1) / wall[idx].sum(axis=1)).max(axis=1)
        stats[mode] = stat
        process, thread = _cpu_pct(segs, tp)
        out[mode] = {"worker_cpu_pct": boot.figure(stat), "worker_cpu_pct_by_rank": process,
                     "prefetch_thread_cpu_pct": thread,
                     "iterations": sum(s["steps"] for s in segs),
                     # per segment, every rank the same (loops.IDLE_WARMUP_STEPS)
                     "warmup_iterations": sum(_rank(s, 0).get("warmup_steps", 0)
                                              for s in segs)}
    for mode in modes:
        out[mode]["above_none_points"] = boot.figure(
            lambda idx, s=stats[mode]: s(idx) - stats[REFERENCE](idx))
    targets, notes = [], []
    if "async" in modes:
        targets.append(_target(None, "async idle worker CPU <= 1 % of a core",
                               out["async"]["worker_cpu_pct"], 1.0, "below", "%"))
        # What task sync itself adds: the row above also holds the bare loop's own CPU,
        # which alone can exceed 1 % (1.5-2.2 % of a core here on 2026-11-26)
        targets.append(_target(None, "async idle CPU <= 0.5 points above none's",
                               out["async"]["above_none_points"], 0.5, "below", "points"))
        none, above = out[REFERENCE]["worker_cpu_pct"], out["async"]["above_none_points"]
        note = (f"idle: none (FastDeploy's 1 ms sleep loop without task sync) used "
                f"{_fig(none, '%', 2)} of a core by itself; async adds {_fig(above, 'points', 2, sign=True)}")
        if targets[0]["verdict"] != "met":
            note += (". For less, let rank 0 block in client.wait_for_tasks(timeout) instead of "
                     "polling exist_tasks() and sleeping 1 ms (docs: Sleeping while idle; "
                     "scripts/bench_idle.py measures both loops)")
        notes.append(note)
    return {"modes": out}, targets, notes


# -- targets, notes, header ------------------------------------------------------------------

def _target(kind, name, figure, threshold, better, unit):
    word = verdict(figure["interval"], threshold, better) if figure["value"] is not None \
        else "n/a"
    return {"step_kind": kind, "target": name, "measured": figure["value"],
            "interval": figure["interval"], "threshold": threshold, "better": better,
            "unit": unit, "verdict": word, "met": {"met": True, "MISSED": False}.get(word),
            "reason": None}


def _kind_targets(kind, out, stats, modes, boot):
    if "async" not in modes:
        return []
    a = out["modes"]["async"]
    rows = [_target(kind, "async critical path p50 <= 30 us", a["critical_path_p50_us"], 30.0,
                    "below", "us")]
    if "fd-manager" in modes:
        rows.append(_target(kind, "async critical path p50 >= 20x below fd-manager's",
                            a["critical_path_p50_vs_fd_manager"], 20.0, "above", "x"))
    if "sync" in modes:
        rows.append(_target(kind, "async critical path p50 >= 5x below sync mode's",
                            boot.figure(_ratio_stat(stats["sync"]["p50"], stats["async"]["p50"])),
                            5.0, "above", "x"))
    rows.append(_target(kind, "async step-time inflation <= 3 % of none's step",
                        a["inflation_pct"], 3.0, "below", "%"))
    slowdown = a["model_slowdown_pct"]["interval"]
    if slowdown is not None and slowdown[1] < 0:
        # The model step (and its collective) ran faster than in the loop without task
        # sync, beyond the interval: task sync cannot do that, so the two loops did not
        # meet the same machine and the inflation says nothing about task sync.
        rows[-1].update(verdict="inconclusive", met=None,
                        reason=f"the model step ran faster than in none (model slowdown "
                               f"{_interval(slowdown, '%', 1)}): none is no like-for-like "
                               f"reference on this machine")
    low, high = (a["interruption"][k] for k in ("gil_wait_added_pct",
                                                 "gil_wait_added_upper_pct"))
    if low is not None:
        # Judged on both bounds at once: met only if even the upper bound's interval is
        # below the target, MISSED only if even the lower bound's is above it.
        bounded = high is not None and None not in (low["interval"], high["interval"])
        both = {"value": low["value"], "interval": [low["interval"][0], high["interval"][1]]
                if bounded else None}
        rows.append(_target(kind, "async GIL wait added <= 3 % of none's step", both, 3.0,
                            "below", "%"))
    if "sync" in modes:
        ratio = boot.figure(_ratio_stat(stats["async"]["delivery_p50"],
                                        stats["sync"]["delivery_p50"]))
        a["delivery_p50_vs_sync"] = ratio
        rows.append(_target(kind, "async delivery p50 <= sync mode's (ratio <= 1)", ratio,
                            1.0, "below", "x"))
    return rows


def _kind_notes(kind, out, modes, targets):
    """Why a row reads as it does and what to do, from this run's figures."""
    notes = []
    modes_out = out["modes"]
    by_name = {t["target"]: t for t in targets}
    if "async" in modes and "sync" in modes:
        notes.append(_delivery_note(kind, modes_out["async"], modes_out["sync"],
                                    by_name["async delivery p50 <= sync mode's (ratio <= 1)"]))
    if "async" in modes:
        a = modes_out["async"]
        sec = a["critical_path_by_section_us"]
        p50 = a["critical_path_us"]["p50_us"]
        barrier = sec["barrier"]["p50_us"]
        if p50 and barrier is not None and barrier > p50 / 2:
            notes.append(
                f"{kind}: async critical path p50 {_num(p50)} us is mostly the barrier "
                f"(p50 {_num(barrier)} us; check {_num(sec['check']['p50_us'])} us, take "
                f"{_num(sec['take']['p50_us'])} us): rank 0 waited for the other rank, whose "
                f"step, scheduling and GIL set when it arrives. On shared cores that wait is "
                f"the ranks' skew, not rank 0's work; a core per process (--cpus, tp + 1 free "
                f"cores) separates the two")
        infl = by_name.get("async step-time inflation <= 3 % of none's step")
        if infl is not None and infl["reason"]:
            notes.append(f"{kind}: step-time inflation inconclusive: {infl['reason']}. The "
                         f"interruption table measures the model step's losses directly")
        elif infl is not None and infl["verdict"] == "inconclusive":
            ref = modes_out[REFERENCE]["round_means_ms"]
            notes.append(
                f"{kind}: the step-time inflation is not resolved on this machine ("
                f"{_interval(infl['interval'], '%', 1)}; none's own round means ranged "
                f"{min(ref):.2f}-{max(ref):.2f} ms). The interruption table measures the "
                f"model step's losses directly: GIL wait is what our threads took from it, "
                f"run queue what other processes did")
    return notes


def _delivery_note(kind, a, s, row):
    """Async vs sync delivery with this step kind: what was measured, and why when async
    was slower (the explanation follows the figures, so it holds for whatever the code
    does when the profile runs)."""
    ab, sb = a["delivery_boundaries"], s["delivery_boundaries"]
    where = (f"p50 {_fig(a['delivery_p50_ms'], 'ms', 2)} vs {_fig(s['delivery_p50_ms'], 'ms', 2)}"
             f"; taken at the first step boundary after the put: {_pct(ab['share_first'])} vs "
             f"{_pct(sb['share_first'])} of the batches, {_num(ab['mean'], 2)} vs "
             f"{_num(sb['mean'], 2)} boundaries on average")
    if row["verdict"] == "met":
        return f"{kind}: async delivered faster than sync ({where})"
    if row["verdict"] != "MISSED":
        return (f"{kind}: async and sync delivery not told apart ({where}; the ratio's "
                f"interval {_interval(row['interval'], 'x', 2)} holds 1)")
    # Do the boundaries account for the gap? Each boundary more costs about a step; if
    # the batches were taken at about the same boundary in both modes, the gap lies
    # within the steps and the GIL story below would not be what the figures say.
    gap_ms = a["delivery_p50_ms"]["value"] - s["delivery_p50_ms"]["value"]
    by_boundaries_ms = (None if ab["mean"] is None or sb["mean"] is None
                        else (ab["mean"] - sb["mean"]) * a["step_ms"]["mean_ms"])
    later = by_boundaries_ms is not None and by_boundaries_ms >= 0.5 * gap_ms
    if kind in _HOLDS_GIL and later:
        return (f"{kind}: async delivered slower than sync ({where}). The {kind} step "
                f"{STEP_KIND_GIL[kind]}. The prefetch thread needs the GIL to decode a batch it "
                f"has received and gets it only when the step blocks (at its TP collective) or "
                f"after the interpreter's 5 ms switch interval, so fewer batches are ready for "
                f"the first boundary after the put; the sync loop receives and decodes at the "
                f"boundary itself. A step that releases the GIL lets the prefetch thread "
                f"decode while the step runs")
    if by_boundaries_ms is not None and not later:
        return (f"{kind}: async delivered slower than sync ({where}) with a step that "
                f"{STEP_KIND_GIL.get(kind, 'runs')}. The batches were taken at about the "
                f"same step boundary in both modes, which accounts for "
                f"{_val(max(0.0, by_boundaries_ms), 'ms', 2)} "
                f"of the {_val(gap_ms, 'ms', 2)} at p50: the gap is not the prefetch thread "
                f"waiting for the GIL before the boundary. {_parts_gap(a, s)}")
    return (f"{kind}: async delivered slower than sync ({where}) with a step that "
            f"{STEP_KIND_GIL.get(kind, 'runs')}; the boundaries do not point at the GIL")


def _parts_gap(a, s) -> str:
    """Where async's mean delivery differs from sync's, part by part (DELIVERY_PARTS)."""
    pa, ps = a["delivery_parts_mean_ms"], s["delivery_parts_mean_ms"]
    if any(pa[k] is None or ps[k] is None for k in DELIVERY_PARTS):
        return "No batch was taken in a measured step: the parts are not known"
    diff = {k: pa[k] - ps[k] for k in DELIVERY_PARTS}
    worst = max(DELIVERY_PARTS, key=lambda k: diff[k])
    why = {"to_first_boundary": "the puts fell earlier in a step (the engine shares the "
                                "cores with the ranks and puts when it gets one)",
           "boundaries_passed": "more boundaries passed before the take",
           "taking_step": "the step that took a batch waited longer for the last rank (rank "
                          "0's check waits for a peer still receiving it; a peer whose "
                          "prefetch thread is decoding it waits for that thread, which "
                          "needs the GIL)"}[worst]
    listed = ", ".join(f"{_DELIVERY_PART_WORDS[k]} {diff[k]:+.2f} ms" for k in DELIVERY_PARTS)
    return (f"Mean delivery, async minus sync, part by part: {listed}; the largest: {why}")


def _in_placements(placements) -> str:
    return f" in {placements} process placements" if placements > 1 else ""


def _pct(share):
    return "-" if share is None else f"{100 * share:.0f} %"


def _count_verdicts(targets, boot):
    counts = {w: sum(t["verdict"] == w for t in targets) for w in WORDS}
    counts["n/a"] = sum(t["verdict"] == "n/a" for t in targets)
    basis = (f"{LEVEL:.0%} intervals from a bootstrap over {boot.rounds} paired rounds"
             f"{_in_placements(boot.placements)}; met or "
             f"MISSED only where the interval excludes the target" if boot.has_intervals else
             f"only {boot.rounds} round(s): no intervals (--rounds {MIN_ROUNDS} or more), so "
             f"every verdict is inconclusive")
    words = ", ".join(f"{counts[w]} {w}" for w in (*WORDS, "n/a") if counts[w] or w in WORDS)
    return {**counts, "header": f"verdicts: {words} ({basis})"}


def _machine_load(raw, out):
    """What the machine did to the no-sync loop (context for the intervals, not a verdict)."""
    step_ms = raw["options"]["step_ms"]
    lines, per_kind = [], {}
    for kind, k in out["step_kinds"].items():
        none = k["modes"][REFERENCE]
        unit_us = [c.get("unit_us") for c in k["calibration"]]
        mismatch = (max(unit_us) / min(unit_us)) if None not in unit_us and min(unit_us) > 0 \
            else 1.0
        contention = none["model_step_ms"] / step_ms
        means = none["round_means_ms"]
        per_kind[kind] = {"contention_factor": contention, "calibration_mismatch": mismatch,
                          "reference_round_means_ms": means}
        lines.append(f"{kind} step: the calibrated {step_ms:g} ms work ran at "
                     f"{none['model_step_ms']:.2f} ms in none ({contention:.2f}x: other "
                     f"processes on these cores); none's round means "
                     f"{min(means):.2f}-{max(means):.2f} ms; ranks' calibrations differ "
                     f"{mismatch:.2f}x")
    return {"step_kinds": per_kind, "lines": lines}


# -- terminal --------------------------------------------------------------------------------

def _num(v, digits=1):
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}"


def _val(v, unit, digits=1):
    """``v unit``, or ``-`` (no unit) when there is no value."""
    return "-" if v is None else f"{_num(v, digits)} {unit}"


def _interval(interval, unit, digits=1):
    if interval is None:
        return "[no interval]"
    return f"[{_num(interval[0], digits)}, {_num(interval[1], digits)}] {unit}"


def _fig(figure, unit, digits=1, sign=False):
    """``value unit [low, high] unit`` of a figure."""
    if figure is None or figure["value"] is None:
        return "-"
    v = figure["value"]
    text = f"{v:+.{digits}f}" if sign else _num(v, digits)
    i = figure["interval"]
    if i is None:
        return f"{text} {unit} [no interval]"
    lo, hi = ((f"{i[0]:+.{digits}f}", f"{i[1]:+.{digits}f}") if sign else
              (_num(i[0], digits), _num(i[1], digits)))
    return f"{text} {unit} [{lo}, {hi}]"


def parameters_line(summary) -> str:
    """The run's parameters in one line (the terminal's first line, the plot's title)."""
    p, m = summary["parameters"], summary["machine"]
    pinned = ("" if not p.get("cpus") else
              f"; pinned: engine cpu {p['cpus'][0]}, ranks cpus {','.join(map(str, p['cpus'][1:]))}")
    per_round = p["steps"] // p["rounds"]
    idle = (f", idle {p['rounds']} x {p['idle_steps'] // p['rounds']} iterations "
            f"(after {IDLE_WARMUP_STEPS})" if p["idle_steps"] else "")
    return (f"fastdeploy-sync profile: tp {p['tp']}, {p['rate']:g} batches/s of {p['batch']} x "
            f"{p['prompt_len']} token ids ({p['tokens']}), model step kinds "
            f"{' and '.join(p['step_kinds'])} of {p['step_ms']:g} ms (calibrated), "
            f"{p['rounds']} paired rounds{_in_placements(p.get('placements', 1))} x "
            f"{per_round} steps per mode and step kind{idle}; "
            f"python {m['python']}, {m['cpus']} cpus, {summary['elapsed_s']:.0f} s{pinned}")


def format_table(summary) -> str:
    """The terminal report: parameters, the verdict count, per step kind the critical
    path, the interruption, the effect on the loop and delivery; idle CPU; the targets with
    their intervals; notes; the definitions."""
    p = summary["parameters"]
    lines = [parameters_line(summary), summary["verdicts"]["header"],
             *(f"machine: {line}" for line in summary["machine_load"]["lines"])]
    for kind, k in summary["step_kinds"].items():
        lines += ["", f"== {kind} step: {k['gil']} ==", *_kind_tables(k, p["modes"])]
    if summary["idle"]:
        lines += ["", "== idle (rate 0) ==", *_idle_table(summary["idle"], p["modes"])]
    if summary["targets"]:
        where = ("this is the reference configuration" if summary["reference_config"] else
                 "NOT the reference configuration (--step-ms 2 --rate 100 --batch 64 "
                 "--prompt-len 512 --tp 2 --tokens numpy): indicative only")
        lines += ["", f"targets ({LEVEL:.0%} interval over {p['rounds']} paired rounds"
                      f"{_in_placements(p.get('placements', 1))}; {where}):",
                  f"  {'step':<7}{'target':<52}{'measured':>12}  {'interval':<24}verdict"]
        for t in summary["targets"]:
            unit = t["unit"]
            lines.append(f"  {t['step_kind'] or 'idle':<7}{t['target']:<52}"
                         f"{_num(t['measured'], 2) + ' ' + unit:>12}  "
                         f"{_interval(t['interval'], unit, 2):<24}{t['verdict']}"
                         + (" (see notes)" if t["reason"] else ""))
    problems = [f"  {kind} {mode}: {problem}" for kind, k in summary["step_kinds"].items()
                for mode, m in k["modes"].items() for problem in m.get("problems", [])]
    if problems:
        lines += ["", "correctness problems:", *problems]
    if summary["notes"]:
        lines += ["", "notes:", *(f"  - {n}" for n in summary["notes"])]
    lines += ["", "definitions:", *(f"  {k}: {v}" for k, v in summary["definitions"].items())]
    return "\n".join(lines)


def _kind_tables(k, modes):
    m = k["modes"]
    out = ["critical path per step, rank 0 (check + barrier + take); baseline: the "
           "FastDeploy-style manager queue (mode fd-manager)",
           f"  {'mode':<11}{'p50 [interval]':>32}{'p99':>12}{'mean':>12}"
           f"  {'check / barrier / take p50':>30}  {'baseline p50 / this p50':>32}"]
    for mode in modes:
        x = m[mode]
        d, sec = x["critical_path_us"], x["critical_path_by_section_us"]
        parts = " / ".join(_num(sec[s]["p50_us"]) for s in SECTIONS) + " us"
        vs = x.get("critical_path_p50_vs_fd_manager")
        out.append(f"  {mode:<11}{_fig(x['critical_path_p50_us'], 'us'):>32}"
                   f"{_val(d['p99_us'], 'us'):>12}{_val(d['mean_us'], 'us'):>12}"
                   f"  {parts:>30}  {_fig(vs, 'x') if vs else '-':>32}")
    out += ["interruption of the model step's work, rank 0's event-loop thread, mean per step",
            f"  {'mode':<11}{'model step':>11}{'off-CPU':>11}{'run queue':>11}{'other':>10}"
            f"{'GIL wait: lower [interval]':>32}{'upper':>10}"
            f"{'GIL wait added: lower [interval]':>36}{'upper':>9}"
            f"{'switches invol. / vol.':>25}"]
    for mode in [REFERENCE] + modes:
        x = m[mode]
        i = x["interruption"]
        inv, vol = i["involuntary_switches_per_step"], i["voluntary_switches_per_step"]
        sw = "-" if inv is None else f"{inv['value']:.2f} / {vol['value']:.2f}"
        added, upper = i.get("gil_wait_added_pct"), i.get("gil_wait_added_upper_pct")
        upper = "-" if not upper else f"{upper['value']:+.2f} %"
        out.append(f"  {mode:<11}{_val(x['model_step_ms'], 'ms', 2):>11}"
                   f"{_val((i['off_cpu_us'] or {}).get('value'), 'us'):>11}"
                   f"{_val((i['run_queue_us'] or {}).get('value'), 'us'):>11}"
                   f"{_val((i['other_us'] or {}).get('value'), 'us'):>10}"
                   f"{_fig(i['gil_wait_us'], 'us'):>32}"
                   f"{_val((i['gil_wait_upper_us'] or {}).get('value'), 'us'):>10}"
                   f"{_fig(added, '%', 2, sign=True) if added else '-':>36}"
                   f"{upper:>9}{sw:>25}")
    out += ["effect on the loop, rank 0, % of none's mean step (inflation = critical path share "
            "+ model slowdown)",
            f"  {'mode':<11}{'step mean':>10}{'inflation [interval]':>32}"
            f"{'critical path':>15}{'model slowdown':>16}"]
    for mode in [REFERENCE] + modes:
        x = m[mode]
        if mode == REFERENCE:
            out.append(f"  {mode:<11}{_val(x['step_ms']['mean_ms'], 'ms', 2):>10}"
                       f"{'(the reference)':>32}")
            continue
        out.append(f"  {mode:<11}{_val(x['step_ms']['mean_ms'], 'ms', 2):>10}"
                   f"{_fig(x['inflation_pct'], '%', 1, sign=True):>32}"
                   f"{x['critical_path_share_pct']['value']:>+13.1f} %"
                   f"{x['model_slowdown_pct']['value']:>+14.1f} %")
    out += [f"delivery: {DELIVERY}",
            f"  {'mode':<11}{'p50 [interval]':>32}{'p99':>12}{'1st boundary / mean':>21}"
            f"{'loaded CPU: engine / prefetch thread':>38}{'batches put / taken':>21}"
            f"{'ranks agree':>13}"]
    for mode in modes:
        x = m[mode]
        d, b = x["delivery_ms"], x["batches"]
        cpu = x["load_cpu_pct"]
        th = cpu["prefetch_thread"]
        th = "-" if None in th else f"{max(th):.1f} %"
        eng = "-" if cpu["engine_process"] is None else f"{cpu['engine_process']:.1f} %"
        out.append(f"  {mode:<11}{_fig(x['delivery_p50_ms'], 'ms', 2):>32}"
                   f"{_val(d['p99_ms'], 'ms', 2):>12}"
                   f"{_pct(x['delivery_boundaries']['share_first']) + ' / ' + _num(x['delivery_boundaries']['mean'], 2):>21}"
                   f"{eng + ' / ' + th:>38}{str(b['put']) + ' / ' + str(min(b['taken_per_rank'])):>21}"
                   f"{'yes' if x['ranks_agree'] else 'NO':>13}")
    return out


def _idle_table(idle, modes):
    out = [f"  {'mode':<11}{'worker CPU, max over ranks [interval]':>40}"
           f"{'above the no-sync loop [interval]':>36}{'prefetch thread':>17}"]
    for mode in [REFERENCE] + modes:
        x = idle["modes"][mode]
        th = x["prefetch_thread_cpu_pct"]
        th = "-" if None in th else f"{max(th):.2f} %"
        above = x.get("above_none_points")
        out.append(f"  {mode:<11}{_fig(x['worker_cpu_pct'], '%', 2):>40}"
                   f"{_fig(above, 'points', 2, sign=True) if above else '-':>36}{th:>17}")
    return out


def plot(summary, path) -> None:
    """Write the profile's figure (``plot.figure``) as a PNG at ``path``."""
    from .plot import save

    save(summary, path)
