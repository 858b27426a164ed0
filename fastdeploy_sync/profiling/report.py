"""Figures from a profile run: ``summarize`` (JSON-ready), ``format_table`` (terminal),
``plot`` (one PNG).

Definitions (the JSON and the table use the same ones):

* sync per step: ``check + barrier + take`` as the ``StepProfiler`` recorded them on
  rank 0 (the rank that also checks), load phase, all rounds pooled. The barrier part
  includes waiting for a rank that is late.
* step: one iteration of the loop on rank 0 (task sync + model step + collective).
* inflation: ``100 * (M - R) / R``, M the mode's mean step and R the reference loop's (no
  task sync), every load-phase step of every round pooled (rounds are equally long).
* of which sync: ``100 * S / R``, S the mean task sync per step above over the same steps;
  of which rest: ``inflation - sync``, i.e. ``100 * (M - S - R) / R``: the model step and
  collective ran slower (CPU and GIL the mode took) or, when negative, faster than in the
  reference, which only noise can do. The two add up to the inflation exactly.
* noise: ``±`` the larger of half the range of the reference's per-round mean step and
  half the range of the mode's per-round inflation, in % of R. Verdict per mode: resolved
  if ``inflation - noise > 0``; inconsistent if ``rest + noise < 0`` (the model step ran
  faster than in the reference beyond the noise: the noise is underestimated); else
  inconclusive. A target within ``±noise`` of the inflation, or an inconsistent one, is
  inconclusive, not met or missed. A negative rest within the noise is expected: the TP
  barrier (part of sync) absorbs waiting for a slower rank that the reference loop spends
  in the model's collective.
* noise verdict (above the tables): that spread, the ranks' calibration mismatch (their
  time per unit of model work, max over min) and the contention factor (the reference's
  mean model step over the calibrated ``step_ms``).
* delivery latency: from the engine stamping a batch (just before ``put_tasks``, so any
  backpressure wait counts) to the moment the *last* rank's ``get_tasks`` returned it.
* idle CPU: CPU time (all threads) of a worker process over wall time, idle phase
  (rate 0, 1 ms sleep per iteration), and of the prefetch thread alone where there is one.
* ranks agree: in every segment every rank took the same batch ids at the same step
  indices, and the ids are exactly 0..put-1 in order (none lost, none twice).
"""

import os
import platform

import numpy as np

from .loops import REFERENCE
from ..step_profiler import SECTIONS, distribution_us

__all__ = ["summarize", "format_table", "plot"]

# The reference configuration; targets are judged on any run but only mean
# something in this one (format_table says so).
REFERENCE_CONFIG = {"step": "python", "step_ms": 2.0, "rate": 100.0, "batch": 64,
                    "prompt_len": 512, "tp": 2, "tokens": "numpy"}


def _ms(d):
    return {k.replace("_us", "_ms"): (None if v is None else v / 1e3) if k.endswith("_us") else v
            for k, v in d.items()}


def _segments(raw, mode, phase):
    return [s for s in raw["segments"] if s["mode"] == mode and s["phase"] == phase]


def _rank(segment, rank):
    return next(w for w in segment["workers"] if w["rank"] == rank)


def _rank0(segments, key):
    """Rank 0's per-step array ``key`` over ``segments``, concatenated."""
    return np.concatenate([_rank(s, 0)[key] for s in segments])


# The definitions as printed under the tables and stored in the JSON ("definitions").
DEFINITIONS = {
    "step": "one iteration of rank 0's loop: task sync + model step + collective",
    "sync_per_step": "check + barrier + take on rank 0, as the StepProfiler recorded them",
    "inflation_pct": "100 * (M - R) / R; M: the mode's mean step, R: the reference loop's "
                     "(no task sync), all load-phase steps of all rounds pooled",
    "sync_pct": "100 * S / R; S: the mean task sync per step over the same steps (part of "
                "the inflation)",
    "rest_pct": "inflation - sync = 100 * (M - S - R) / R: model step and collective slower "
                "(CPU/GIL taken) or faster than in the reference; negative when the TP barrier "
                "(in sync) absorbed waiting for a slower rank that the reference spends in the "
                "model's collective, or by noise",
    "noise_pct": "larger of half the range of the reference's per-round mean step and half "
                 "the range of the mode's per-round inflation, in % of R; verdict: resolved "
                 "if inflation - noise > 0, inconsistent if rest + noise < 0 (the noise is "
                 "underestimated), else inconclusive; a target within +-noise of the inflation, "
                 "or an inconsistent one, is inconclusive",
    "delivery_latency": "engine stamp just before put_tasks -> the last rank's get_tasks "
                        "returned the batch",
    "idle_cpu": "worker process CPU (all threads) / wall time at rate 0, 1 ms sleep per "
                "iteration; and the prefetch thread's alone",
    "ranks_agree": "every rank took the same batch ids at the same steps, ids 0..put-1 in "
                   "order (none lost, none twice)",
}

# Noise-verdict thresholds: below all three the machine resolves ~1 % effects.
QUIET_SPREAD_PCT = 1.0
QUIET_CALIBRATION_MISMATCH = 1.2
QUIET_CONTENTION = 1.3


def summarize(raw) -> dict:
    """Every figure of the run, JSON-ready (plain floats, ints, lists, dicts)."""
    options = raw["options"]
    tp = options["tp"]
    modes = [REFERENCE] + options["modes"]
    out = {"parameters": {**{k: v for k, v in options.items() if k != "modes"},
                          "modes": options["modes"], "units_per_step": raw["units"],
                          "calibration": raw["calibration"],
                          "engine_cpus": raw.get("engine_cpus"),
                          "collective_spin_us": raw.get("collective_spin_us")},
           "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                       "platform": platform.platform()},
           "elapsed_s": raw["elapsed_s"], "definitions": DEFINITIONS, "modes": {}}
    ref_load = _segments(raw, REFERENCE, "load")
    out["noise"] = _noise(raw, ref_load)
    for mode in modes:
        out["modes"][mode] = _summarize_mode(raw, mode, tp, ref_load, out["noise"])
    ref = out["modes"].get("fd-manager")
    for mode in options["modes"]:
        m = out["modes"][mode]
        m["vs_fd_manager"] = None if ref is None else {
            stat: _ratio(ref["sync_per_step_us"][stat], m["sync_per_step_us"][stat])
            for stat in ("p50_us", "p99_us", "mean_us")}
    out["targets"] = _targets(out)
    out["reference_config"] = all(options.get(k) == v for k, v in REFERENCE_CONFIG.items())
    return out


def _ratio(a, b):
    return None if a is None or not b else a / b


def _half_range_pct(values, of):
    return float(100 * (max(values) - min(values)) / 2 / of) if len(values) > 1 else 0.0


def _noise(raw, ref_load) -> dict:
    """How well this run can resolve a step-time effect: the reference's spread across
    rounds, the ranks' calibration mismatch, and machine contention (see DEFINITIONS)."""
    ref_mean_ns = _rank0(ref_load, "iter_ns").mean()
    round_means = [float(_rank(s, 0)["iter_ns"].mean()) / 1e6 for s in ref_load]
    spread = _half_range_pct(round_means, ref_mean_ns / 1e6)
    unit_us = [c.get("unit_us") for c in raw["calibration"]]
    mismatch = (max(unit_us) / min(unit_us)) if None not in unit_us and min(unit_us) > 0 else 1.0
    step_ms = raw["options"]["step_ms"]
    model_ms = float(_rank0(ref_load, "compute_ns").mean()) / 1e6
    contention = model_ms / step_ms
    quiet = (spread <= QUIET_SPREAD_PCT and mismatch <= QUIET_CALIBRATION_MISMATCH
             and contention <= QUIET_CONTENTION)
    lines = [f"reference step (no task sync) moved +-{spread:.1f} % between rounds "
             f"(round means {', '.join(f'{m:.2f}' for m in round_means)} ms)",
             f"ranks' calibrations differ {mismatch:.2f}x (time per unit of model work, "
             f"max/min; the run uses the median rank's)",
             f"the calibrated {step_ms:g} ms model step ran at {model_ms:.2f} ms in the reference "
             f"loop ({contention:.2f}x: other processes on these cores)"]
    verdict = ("quiet: step-time effects of about 1 % are resolved" if quiet else
               f"NOISY: step-time effects within each row's +-noise (at least +-{spread:.1f} %) "
               f"are not resolved; for a cleaner run free cores, pin with --cpus, or add --rounds")
    return {"quiet": quiet, "verdict": verdict, "lines": lines,
            "reference_round_means_ms": round_means, "reference_spread_pct": spread,
            "calibration_mismatch": float(mismatch), "model_step_ms_in_reference": model_ms,
            "contention_factor": float(contention),
            "thresholds": {"spread_pct": QUIET_SPREAD_PCT,
                           "calibration_mismatch": QUIET_CALIBRATION_MISMATCH,
                           "contention_factor": QUIET_CONTENTION}}


def _summarize_mode(raw, mode, tp, ref_load, noise):
    load, idle = _segments(raw, mode, "load"), _segments(raw, mode, "idle")
    ref_mean_ns = _rank0(ref_load, "iter_ns").mean()
    m = {}
    if load:
        m["step_time_ms"] = _ms(distribution_us(_rank0(load, "iter_ns")))
        m["model_compute_mean_ms"] = float(_rank0(load, "compute_ns").mean()) / 1e6
        m["model_collective_mean_ms"] = float(_rank0(load, "collective_ns").mean()) / 1e6
        m["load_cpu_pct"] = _load_cpu(load, tp)
    if mode != REFERENCE and load:
        per_rank = []
        for rank in range(tp):
            samples = {k: np.concatenate([_rank(s, rank)["sync_ns"][k] for s in load])
                       for k in (*SECTIONS, "step")}
            per_rank.append(samples)
        m["sync_per_step_us"] = distribution_us(per_rank[0]["step"])
        m["sync_by_section_us"] = {k: distribution_us(per_rank[0][k]) for k in SECTIONS}
        m["sync_per_step_by_rank_us"] = [distribution_us(r["step"]) for r in per_rank]
        m["sync_samples_rank0_us"] = np.round(per_rank[0]["step"] / 1e3, 2).tolist()
        m["inflation_pct"] = _inflation(load, ref_load, ref_mean_ns, per_rank[0]["step"], noise)
        m.update(_delivery(load, tp))
    if idle:
        m["idle"] = _idle(idle, tp)
    return m


def _inflation(load, ref_load, ref_mean_ns, sync_ns, noise):
    """The inflation and its two parts, as differences of means over the same steps in % of
    the reference's mean step (see DEFINITIONS), with this mode's noise."""
    ref = {s["round"]: _rank(s, 0)["iter_ns"].mean() for s in ref_load}
    rounds = [float(100 * (_rank(s, 0)["iter_ns"].mean() / ref[s["round"]] - 1)) for s in load]
    mean_ns = _rank0(load, "iter_ns").mean()
    total = float(100 * (mean_ns - ref_mean_ns) / ref_mean_ns)
    sync = float(100 * np.mean(sync_ns) / ref_mean_ns)
    noise_pct = max(noise["reference_spread_pct"], _half_range_pct(rounds, 100.0))
    rest = total - sync
    if rest + noise_pct < 0:
        # The model step ran faster than in the reference by more than the noise: the
        # noise estimate is too small for this run (its load changed), nothing is resolved.
        verdict = f"inconsistent (rest {rest:+.1f} % beyond noise +-{noise_pct:.1f} %)"
    elif total - noise_pct > 0:
        verdict = "resolved"
    else:
        verdict = f"inconclusive (noise +-{noise_pct:.1f} %)"
    return {"mean": total, "sync": sync, "rest": rest, "noise": noise_pct,
            "conclusive": verdict == "resolved", "verdict": verdict, "per_round": rounds,
            "median_of_rounds": float(np.median(rounds))}


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


def _load_cpu(load, tp):
    """CPU use while loaded: each worker process and its prefetch thread, and the engine
    process (all its threads), in % of one core. These are what the 2 cores share."""
    process, thread = _cpu_pct(load, tp)
    out = {"worker_process": process, "prefetch_thread": thread, "engine_process": None}
    putting = [s["engine_putting"] for s in load if s.get("engine_putting")]
    if putting:
        out["engine_process"] = (100 * sum(e["cpu_s"] for e in putting)
                                 / sum(e["wall_s"] for e in putting))
    return out


def _delivery(load, tp):
    latencies, put, taken, problems = [], 0, [0] * tp, []
    for s in load:
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
        last_take = {}
        for t in ranks:
            for _, bid, put_ns, take_ns in t:
                last_take[bid] = max(last_take.get(bid, 0), take_ns - put_ns)
        latencies += last_take.values()
    lat = np.asarray(latencies, dtype=np.float64)
    return {"delivery_latency_ms": _ms(distribution_us(lat)),
            "delivery_samples_ms": np.round(lat / 1e6, 3).tolist(),
            "batches": {"put": put, "taken_per_rank": taken,
                        "all_delivered": all(t == put for t in taken)},
            "ranks_agree": not problems, "problems": problems}


def _idle(idle, tp):
    cpu, thread = _cpu_pct(idle, tp)
    return {"worker_cpu_pct": cpu, "prefetch_thread_cpu_pct": thread,
            "iterations": sum(s["steps"] for s in idle)}


def _targets(out):
    modes = out["modes"]
    a = modes.get("async")
    if a is None:
        return []

    def p50(mode):
        return modes[mode]["sync_per_step_us"]["p50_us"] if mode in modes else None

    rows = [("async sync p50 <= 30 us", p50("async"), None, "us", lambda v: v <= 30.0),
            ("async p50 >= 20x below fd-manager", _ratio(p50("fd-manager"), p50("async")), None,
             "x", lambda v: v >= 20.0),
            ("async step-time inflation <= 3 %", a["inflation_pct"]["mean"],
             a["inflation_pct"]["noise"], "%", lambda v: v <= 3.0),
            ("async p50 >= 5x below sync", _ratio(p50("sync"), p50("async")), None, "x",
             lambda v: v >= 5.0)]
    if "idle" in a:
        rows.append(("async idle worker CPU <= 1 %", max(a["idle"]["worker_cpu_pct"]), None, "%",
                     lambda v: v <= 1.0))
    out = []
    for name, v, noise, unit, ok in rows:
        if v is None:
            met, verdict = None, "n/a"
        elif noise is not None and \
                a["inflation_pct"]["verdict"].startswith("inconsistent"):
            met, verdict = None, f"inconclusive: {a['inflation_pct']['verdict']}"
        elif noise is not None and ok(v - noise) != ok(v + noise):
            # The target lies inside the measurement's +-noise: this run cannot tell.
            met, verdict = None, f"inconclusive (noise +-{noise:.1f} %)"
        else:
            met = bool(ok(v))
            verdict = "met" if met else "MISSED"
        out.append({"target": name, "measured": v, "noise": noise, "unit": unit, "met": met,
                    "verdict": verdict})
    return out


# -- terminal ----------------------------------------------------------------------------------

def _f(v, digits=1, unit=""):
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}{unit}"
    return f"{v:.{digits}f}{unit}"


def _inflation_cells(infl):
    """(inflation, sync, rest, verdict) cells of the effect table."""
    if not infl:
        return "-", "-", "-", "reference"
    verdict = infl["verdict"]
    return (f"{infl['mean']:+.1f}+-{infl['noise']:.1f} %", f"{infl['sync']:+.1f} %",
            f"{infl['rest']:+.1f} %", verdict)


def format_table(summary) -> str:
    """The terminal report: parameters, the noise verdict, two tables, the targets, the
    definitions."""
    p, modes, noise = summary["parameters"], summary["modes"], summary["noise"]
    pinned = ("" if not p.get("cpus") else
              f"; pinned: engine cpu {p['cpus'][0]}, ranks cpus "
              f"{','.join(map(str, p['cpus'][1:]))}")
    lines = [
        f"fastdeploy-sync profile: tp {p['tp']}, step {p['step']} {p['step_ms']:g} ms "
        f"({p['units_per_step']} units), rate {p['rate']:g}/s, batch {p['batch']} x "
        f"{p['prompt_len']} tokens ({p['tokens']}), {p['steps'] // p['rounds'] * p['rounds']} "
        f"steps/mode in {p['rounds']} interleaved rounds; python {summary['machine']['python']}, "
        f"{summary['machine']['cpus']} cpus, {summary['elapsed_s']:.0f} s{pinned}",
        "",
        f"noise verdict: {noise['verdict']}",
        *(f"  {line}" for line in noise["lines"]),
        "",
        "task sync on the critical path per step, rank 0 (check + barrier + take), us",
        f"{'mode':<11}{'p50':>9}{'p99':>10}{'mean':>10}{'max':>10}  "
        f"{'check/barrier/take p50':>24}  {'p50 vs fd-manager':>18}{'mean vs fd-manager':>20}",
    ]
    for mode in p["modes"]:
        m = modes[mode]
        s, sec, vs = m["sync_per_step_us"], m["sync_by_section_us"], m.get("vs_fd_manager")
        parts = "/".join(_f(sec[k]["p50_us"]) for k in SECTIONS)
        ratio = (lambda k: "-" if not vs or vs[k] is None or mode == "fd-manager"
                 else f"{vs[k]:.1f}x lower")
        lines.append(f"{mode:<11}{_f(s['p50_us']):>9}{_f(s['p99_us']):>10}{_f(s['mean_us']):>10}"
                     f"{_f(s['max_us']):>10}  {parts:>24}  {ratio('p50_us'):>18}"
                     f"{ratio('mean_us'):>20}")
    lines += ["", "effect on the worker loop (rank 0; step in ms; inflation = sync + rest, in % of "
                  "none's mean step; CPU in % of one core)",
              f"{'mode':<11}{'step p50':>9}{'mean':>7}{'inflation':>17}{'sync':>9}{'rest':>9}"
              f"  {'delivery p50/p99':>17}  {'loaded CPU: engine/thread':>26}"
              f"  {'idle CPU: worker/thread':>24}  {'put/taken':>10}  {'agree':>5}  verdict"]
    for mode in [REFERENCE] + p["modes"]:
        m = modes[mode]
        st = m.get("step_time_ms", {})
        infl, sync, rest, verdict = _inflation_cells(m.get("inflation_pct"))
        dl = m.get("delivery_latency_ms")
        dl = "-" if not dl else f"{_f(dl['p50_ms'], 2)}/{_f(dl['p99_ms'], 2)} ms"
        idle = m.get("idle")
        if idle:
            proc = max(idle["worker_cpu_pct"])
            th = idle["prefetch_thread_cpu_pct"]
            th = "-" if None in th else _f(max(th), 2)
            idle = f"{_f(proc)} % / {th} %"
        b = m.get("batches")
        b = "-" if not b else f"{b['put']}/{min(b['taken_per_rank'])}"
        agree = "-" if "ranks_agree" not in m else ("yes" if m["ranks_agree"] else "NO")
        loaded = m.get("load_cpu_pct")
        if loaded and loaded["engine_process"] is not None:
            th = loaded["prefetch_thread"]
            th = "-" if None in th else _f(max(th))
            loaded = f"{_f(loaded['engine_process'])} % / {th} %"
        else:
            loaded = "-"
        lines.append(f"{mode:<11}{_f(st.get('p50_ms'), 2):>9}{_f(st.get('mean_ms'), 2):>7}"
                     f"{infl:>17}{sync:>9}{rest:>9}  {dl:>17}  {loaded:>26}  {idle or '-':>24}"
                     f"  {b:>10}  {agree:>5}  {verdict}")
    if summary["targets"]:
        where = ("this is the reference configuration" if summary["reference_config"] else
                 "NOT the reference configuration (--step python --step-ms 2 --rate 100 "
                 "--batch 64 --prompt-len 512 --tp 2): indicative only")
        lines += ["", f"targets ({where}):"]
        for t in summary["targets"]:
            lines.append(f"  {t['target']:<36} measured {_f(t['measured'], 2)} {t['unit']:<2}  "
                         f"{t['verdict']}")
    for mode in p["modes"]:
        for problem in modes[mode].get("problems", []):
            lines.append(f"  {mode}: {problem}")
    d = summary["definitions"]
    lines += ["", "definitions:"] + [f"  {k}: {d[k]}" for k in
                                     ("inflation_pct", "sync_pct", "rest_pct", "noise_pct")]
    return "\n".join(lines)


# -- plot ----------------------------------------------------------------------------------

_COLORS = {"none": "0.5", "async": "tab:green", "sync": "tab:orange", "fd-manager": "tab:red"}


PANEL_TITLES = ("task sync per step, rank 0 (check + barrier + take)",
                "whole step, rank 0: task sync + model step",
                "delivery latency: put -> the last rank holds the batch",
                "step-time inflation vs none = sync + rest",
                "idle CPU (rate 0), % of one core",
                "correctness: every batch delivered, ranks identical")


def plot(summary, raw, path) -> None:
    """Write ``figure(summary, raw)`` as a PNG at ``path``."""
    import matplotlib.pyplot as plt

    fig = figure(summary, raw)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def figure(summary, raw):
    """The profile as one matplotlib figure, six panels (``PANEL_TITLES``) that read
    without the table: the CDFs of task sync per step, step time and delivery latency per
    mode; the inflation split into sync and rest with its +-noise; idle CPU; the
    correctness check. The title carries the parameters and the noise verdict."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p, modes, noise = summary["parameters"], summary["modes"], summary["noise"]
    fig, axes = plt.subplots(2, 3, figsize=(19, 11))
    sync_ax, step_ax, dl_ax, infl_ax, idle_ax, ok_ax = axes.ravel()
    for ax, title in zip(axes.ravel(), PANEL_TITLES):
        ax.set_title(title, fontsize=11)

    for mode in p["modes"]:
        us = np.sort(np.maximum(np.asarray(modes[mode]["sync_samples_rank0_us"]), 0.01))
        st = modes[mode]["sync_per_step_us"]
        sync_ax.plot(us, np.arange(1, us.size + 1) / us.size, color=_COLORS[mode], lw=2,
                     label=f"{mode}: p50 {_f(st['p50_us'])} us, p99 {_f(st['p99_us'])} us")
    sync_ax.set_xscale("log")
    sync_ax.set_xlabel("us per step (log scale)")
    sync_ax.set_ylabel("fraction of steps at or below")
    sync_ax.grid(True, which="both", alpha=0.3)
    sync_ax.legend(loc="lower right", fontsize=9)

    for mode in [REFERENCE] + p["modes"]:
        ms = np.sort(_rank0(_segments(raw, mode, "load"), "iter_ns")) / 1e6
        step_ax.plot(ms, np.arange(1, ms.size + 1) / ms.size, color=_COLORS[mode], lw=2,
                     ls="--" if mode == REFERENCE else "-",
                     label=f"{mode}: mean {ms.mean():.2f} ms"
                           + (" (no task sync)" if mode == REFERENCE else ""))
    load = [s for s in raw["segments"] if s["phase"] == "load"]
    step_ax.set_xlim(0, max(np.percentile(_rank0(load, "iter_ns"), 99.5) / 1e6, 1e-3))
    step_ax.set_xlabel("ms per step")
    step_ax.grid(True, alpha=0.3)
    step_ax.legend(loc="lower right", fontsize=9)

    for mode in p["modes"]:
        ms = np.sort(np.asarray(modes[mode].get("delivery_samples_ms", []), dtype=float))
        if ms.size:
            d = modes[mode]["delivery_latency_ms"]
            dl_ax.plot(np.maximum(ms, 1e-3), np.arange(1, ms.size + 1) / ms.size,
                       color=_COLORS[mode], lw=2,
                       label=f"{mode}: p50 {_f(d['p50_ms'], 2)} ms, p99 {_f(d['p99_ms'], 2)} ms")
    dl_ax.set_xscale("log")
    dl_ax.set_xlabel("ms (log scale)")
    dl_ax.grid(True, which="both", alpha=0.3)
    if dl_ax.lines:
        dl_ax.legend(loc="lower right", fontsize=9)

    x = np.arange(len(p["modes"]))
    infl = [modes[m]["inflation_pct"] for m in p["modes"]]
    sync = np.array([i["sync"] for i in infl])
    rest = np.array([i["rest"] for i in infl])
    total = np.array([i["mean"] for i in infl])
    infl_ax.bar(x, sync, 0.5, color=[_COLORS[m] for m in p["modes"]], label="sync (on the "
                "critical path)")
    # rest stacks on sync when positive; a negative rest (faster than the reference: noise)
    # is drawn down from 0 so the two parts stay visible.
    infl_ax.bar(x, rest, 0.5, bottom=np.where(rest >= 0, sync, 0), color="none",
                edgecolor=[_COLORS[m] for m in p["modes"]], hatch="//", label="rest (model "
                "step slower: CPU/GIL)")
    infl_ax.errorbar(x, total, yerr=[i["noise"] for i in infl], fmt="ko", capsize=6,
                     label="inflation +- noise")
    for k, i in enumerate(infl):
        word = i["verdict"].split(" (")[0]
        infl_ax.annotate(f"{i['mean']:+.1f} % +-{i['noise']:.1f}\n{word}", (k, i["mean"]),
                         xytext=(12, 0), textcoords="offset points", fontsize=9, va="center")
    infl_ax.axhline(0, color="0.3", lw=0.8)
    infl_ax.set_xticks(x, p["modes"])
    infl_ax.set_ylabel("% of none's mean step")
    infl_ax.grid(True, axis="y", alpha=0.3)
    infl_ax.legend(loc="upper left", fontsize=8)

    idle_modes = [m for m in [REFERENCE] + p["modes"] if "idle" in modes[m]]
    if idle_modes:
        xi = np.arange(len(idle_modes))
        worker = [max(modes[m]["idle"]["worker_cpu_pct"]) for m in idle_modes]
        thread = [0.0 if None in modes[m]["idle"]["prefetch_thread_cpu_pct"]
                  else max(modes[m]["idle"]["prefetch_thread_cpu_pct"]) for m in idle_modes]
        idle_ax.bar(xi - 0.2, worker, 0.4, color=[_COLORS[m] for m in idle_modes],
                    label="worker process (all threads), max over ranks")
        idle_ax.bar(xi + 0.2, thread, 0.4, color="none", edgecolor="k", hatch="..",
                    label="prefetch thread alone (async)")
        for k, (m, w, t) in enumerate(zip(idle_modes, worker, thread)):
            idle_ax.annotate(f"{w:.1f} %", (k - 0.2, w), ha="center", va="bottom", fontsize=9)
            if None not in modes[m]["idle"]["prefetch_thread_cpu_pct"]:
                idle_ax.annotate(f"{t:.2f} %", (k + 0.2, t), ha="center", va="bottom", fontsize=9)
        idle_ax.set_ylim(0, max(max(worker), 0.1) * 1.4)  # room for the legend
        idle_ax.set_xticks(xi, idle_modes)
        idle_ax.legend(loc="upper left", fontsize=8)
    else:
        idle_ax.text(0.5, 0.5, "idle phase skipped (--idle-steps 0)", ha="center",
                     transform=idle_ax.transAxes)
    idle_ax.set_ylabel("% of one core")
    idle_ax.grid(True, axis="y", alpha=0.3)

    ok_ax.axis("off")
    rows, colors = [], []
    for mode in p["modes"]:
        m = modes[mode]
        b = m["batches"]
        good = b["all_delivered"] and m["ranks_agree"]
        rows.append([mode, str(b["put"]), "/".join(map(str, b["taken_per_rank"])),
                     "yes" if m["ranks_agree"] else "NO", "OK" if good else "FAILED"])
        colors.append(["w", "w", "w", "w", "#b7e4b7" if good else "#f4a6a6"])
    table = ok_ax.table(cellText=rows, cellColours=colors, loc="center",
                        colLabels=["mode", "put", "taken/rank", "ranks agree", "check"])
    table.auto_set_font_size(False)
    table.set_fontsize(11)
    table.scale(1, 2.2)

    fig.suptitle(f"fastdeploy-sync profile: tp {p['tp']}, {p['step']} step {p['step_ms']:g} ms, "
                 f"{p['rate']:g} batches/s of {p['batch']} x {p['prompt_len']} tokens "
                 f"({p['tokens']}), {p['rounds']} interleaved rounds\nnoise verdict: "
                 f"{noise['verdict']}\n" + "\n".join(noise["lines"]), fontsize=11, y=0.995)
    fig.tight_layout()  # leaves room for the suptitle itself
    return fig
