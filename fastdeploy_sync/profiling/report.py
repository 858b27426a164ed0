"""Figures from a profile run (``summarize``: JSON-ready), from the raw result
``runner.run_profile`` returns. ``terminal.format_table`` writes them for a person and
``plot`` draws them; ``vocabulary.DEFINITIONS`` defines each (the JSON stores them).

Every figure a verdict rests on comes with an interval from paired rounds (``intervals``);
the targets and their verdicts are ``targets``'; the headline (the whole cost per step) is
``headline``'s; the regime line and the notes that depend on it are ``regime``'s.
"""

import os
import platform

import numpy as np

from ..worker.step_profiler import StepProfiler
from . import formatting as fmt
from .contention import summarize as summarize_others
from .contention import withhold_verdicts
from .headline import kind_headline
from .intervals import (
    LEVEL,
    MIN_ROUNDS,
    RESAMPLES,
    Bootstrap,
    pooled_mean,
    pooled_median,
    ragged_median,
)
from .options import REFERENCE
from .regime import attach_notes, describe
from .targets import (
    THRESHOLDS,
    count_verdicts,
    idle_targets,
    kind_targets,
    ratio_stat,
    reference_config,
    targets_for,
)
from .vocabulary import (
    DEFINITIONS,
    DELIVERY_PART_WORDS,
    DELIVERY_PARTS,
    HOLDS_GIL,
    SCHEMA,
    SCHEMA_CHANGES,
    STEP_KIND_GIL,
)

# the step's parts and how a distribution is written: the public StepProfiler's
SECTIONS, distribution_us = StepProfiler.SECTIONS, StepProfiler.distribution_us

__all__ = ["summarize"]

_INTERRUPTION_FIELDS = (("off_cpu", "off_cpu_ns"), ("run_queue", "runq_ns"),
                        ("gil_wait", "gil_ns"), ("gil_wait_upper", "gil_upper_ns"),
                        ("other", "other_ns"))


def _ms(d):
    return {k.replace("_us", "_ms"): (None if v is None else v / 1e3) if k.endswith("_us") else v
            for k, v in d.items()}


def _rank(segment, rank):
    return next(w for w in segment["workers"] if w["rank"] == rank)


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
    out = {"schema": SCHEMA, "schema_changes": SCHEMA_CHANGES,
           "parameters": {**{k: v for k, v in options.items() if k != "modes"},
                          "modes": modes, "units_per_step": raw["units"],
                          "calibration": raw["calibration"],
                          "engine_cpus": raw.get("engine_cpus"),
                          "collective_spin_us": raw.get("collective_spin_us")},
           "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                       "platform": platform.platform()},
           "elapsed_s": raw["elapsed_s"], "run_name": raw.get("run_name"),
           "definitions": DEFINITIONS,
           "intervals": {"level": LEVEL, "resamples": RESAMPLES, "rounds": options["rounds"],
                         "placements": boot.placements,
                         "min_rounds": MIN_ROUNDS, "method": DEFINITIONS["interval"]},
           "step_kinds": {}}
    out["reference_config"] = reference_config(options)
    out["targets_for"] = targets_for(options)
    thresholds = THRESHOLDS[out["targets_for"]]
    targets, notes = [], []
    out["headline"] = {}
    for kind in kinds:
        rounds = _KindRounds(raw, kind, [REFERENCE] + modes)
        summary, rows, kind_notes, headline = _summarize_kind(raw, kind, rounds, modes, boot,
                                                              thresholds)
        out["step_kinds"][kind] = summary
        out["headline"][kind] = headline
        targets += rows
        notes += kind_notes
    idle_segments = [s for s in raw["segments"] if s["phase"] == "idle"]
    out["idle"] = None
    if idle_segments:
        out["idle"], rows, idle_notes = _summarize_idle(idle_segments, modes, options["tp"],
                                                        boot)
        targets += rows
        notes += idle_notes
    out["regime"] = describe(raw)
    notes += attach_notes(out["regime"], targets)
    out["machine_load"] = _machine_load(raw, out)
    withhold_verdicts(out["machine_load"]["others"], targets)
    out["targets"] = targets
    out["notes"] = notes
    out["verdicts"] = count_verdicts(targets, boot)
    if out["machine_load"]["others"]["contended"]:
        others = out["machine_load"]["others"]
        out["verdicts"]["header"] += (f"; not comparable: other processes took "
                                      f"{others['mean_pct']:.1f} % of the cores, none judged")
    out["correct"] = all(m["ranks_agree"] and m["batches"]["all_delivered"]
                         for k in out["step_kinds"].values()
                         for name, m in k["modes"].items() if name != REFERENCE)
    return out


def _summarize_kind(raw, kind, rounds, modes, boot, thresholds):
    """(summary, target rows, notes, headline) of one step kind."""
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
                ratio_stat(stats["fd-manager"]["p50"], stats[mode]["p50"]))
    rows = kind_targets(kind, out, stats, modes, boot, thresholds)
    notes = _kind_notes(kind, out, modes, rows)
    return out, rows, notes, kind_headline(out["modes"], stats, modes, boot)


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
    st["inflation"] = inflation
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
    targets, notes = idle_targets(out), []
    if "async" in modes:
        none, above = out[REFERENCE]["worker_cpu_pct"], out["async"]["above_none_points"]
        note = (f"idle: none (FastDeploy's 1 ms sleep loop without task sync) used "
                f"{fmt.fig(none, '%', 2)} of a core by itself; async adds {fmt.fig(above, 'points', 2, sign=True)}")
        if targets[0]["verdict"] != "met":
            note += (". For less, let rank 0 block in client.wait_for_tasks(timeout) instead of "
                     "polling exist_tasks() and sleeping 1 ms (docs: Sleeping while idle; "
                     "scripts/benchmarks/bench_idle.py measures both loops)")
        notes.append(note)
    return {"modes": out}, targets, notes


# -- notes ----------------------------------------------------------------------------------

def _kind_notes(kind, out, modes, targets):
    """Why a row reads as it does and what to do, from this run's figures."""
    notes = []
    modes_out = out["modes"]
    def row(prefix):
        return next((t for t in targets if t["target"].startswith(prefix)), None)

    if "async" in modes and "sync" in modes:
        notes.append(_delivery_note(kind, modes_out["async"], modes_out["sync"],
                                    row("async delivery p50")))
    if "async" in modes:
        a = modes_out["async"]
        sec = a["critical_path_by_section_us"]
        p50 = a["critical_path_us"]["p50_us"]
        barrier = sec["barrier"]["p50_us"]
        if p50 and barrier is not None and barrier > p50 / 2:
            notes.append(
                f"{kind}: async critical path p50 {fmt.num(p50)} us is mostly the barrier "
                f"(p50 {fmt.num(barrier)} us; check {fmt.num(sec['check']['p50_us'])} us, take "
                f"{fmt.num(sec['take']['p50_us'])} us): rank 0 waited for the other rank, whose "
                f"step, scheduling and GIL set when it arrives. On shared cores that wait is "
                f"the ranks' skew, not rank 0's work; a core per process (--cpus, tp + 1 free "
                f"cores) separates the two")
        infl = row("async step-time inflation")
        if infl is not None and infl["reason"]:
            notes.append(f"{kind}: step-time inflation inconclusive: {infl['reason']}. The "
                         f"interruption table measures the model step's losses directly")
        elif infl is not None and infl["verdict"] == "inconclusive":
            ref = modes_out[REFERENCE]["round_means_ms"]
            notes.append(
                f"{kind}: the step-time inflation is not resolved on this machine ("
                f"{fmt.interval(infl['interval'], '%', 1)}; none's own round means ranged "
                f"{min(ref):.2f}-{max(ref):.2f} ms). The interruption table measures the "
                f"model step's losses directly: GIL wait is what our threads took from it, "
                f"run queue what other processes did")
    return notes


def _delivery_note(kind, a, s, row):
    """Async vs sync delivery with this step kind: what was measured, and why when async
    was slower (the explanation follows the figures, so it holds for whatever the code
    does when the profile runs)."""
    ab, sb = a["delivery_boundaries"], s["delivery_boundaries"]
    where = (f"p50 {fmt.fig(a['delivery_p50_ms'], 'ms', 2)} vs {fmt.fig(s['delivery_p50_ms'], 'ms', 2)}"
             f"; taken at the first step boundary after the put: {fmt.pct(ab['share_first'])} vs "
             f"{fmt.pct(sb['share_first'])} of the batches, {fmt.num(ab['mean'], 2)} vs "
             f"{fmt.num(sb['mean'], 2)} boundaries on average")
    if row["verdict"] == "met":
        return f"{kind}: async delivered faster than sync ({where})"
    if row["verdict"] != "MISSED":
        return (f"{kind}: async and sync delivery not told apart ({where}; the ratio's "
                f"interval {fmt.interval(row['interval'], 'x', 2)} holds 1)")
    # Do the boundaries account for the gap? Each boundary more costs about a step; if
    # the batches were taken at about the same boundary in both modes, the gap lies
    # within the steps and the GIL story below would not be what the figures say.
    gap_ms = a["delivery_p50_ms"]["value"] - s["delivery_p50_ms"]["value"]
    by_boundaries_ms = (None if ab["mean"] is None or sb["mean"] is None
                        else (ab["mean"] - sb["mean"]) * a["step_ms"]["mean_ms"])
    later = by_boundaries_ms is not None and by_boundaries_ms >= 0.5 * gap_ms
    if kind in HOLDS_GIL and later:
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
                f"{fmt.val(max(0.0, by_boundaries_ms), 'ms', 2)} "
                f"of the {fmt.val(gap_ms, 'ms', 2)} at p50: the gap is not the prefetch thread "
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
    listed = ", ".join(f"{DELIVERY_PART_WORDS[k]} {diff[k]:+.2f} ms" for k in DELIVERY_PARTS)
    return (f"Mean delivery, async minus sync, part by part: {listed}; the largest: {why}")


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
    others = summarize_others(raw["segments"], raw["options"]["rounds"])
    return {"step_kinds": per_kind, "others": others, "lines": [others["line"], *lines]}
