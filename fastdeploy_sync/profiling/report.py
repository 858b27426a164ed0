"""Figures from a profile run: ``summarize`` (JSON-ready), ``format_table`` (terminal),
``plot`` (one PNG).

Definitions (the JSON and the table use the same ones):

* sync per step: ``check + barrier + take`` as the ``StepProfiler`` recorded them on
  rank 0 (the rank that also checks), load phase, all rounds pooled. The barrier part
  includes waiting for a rank that is late.
* step time: one iteration of the loop on rank 0 (task sync + model step + collective).
* inflation: per round, mean step time of the mode over mean step time of the reference
  loop (no task sync) in the same round, minus one; the median over rounds is headlined,
  the pooled ratio is in the JSON too.
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


def summarize(raw) -> dict:
    """Every figure of the run, JSON-ready (plain floats, ints, lists, dicts)."""
    options = raw["options"]
    tp = options["tp"]
    modes = [REFERENCE] + options["modes"]
    out = {"parameters": {**{k: v for k, v in options.items() if k != "modes"},
                          "modes": options["modes"], "units_per_step": raw["units"],
                          "calibration": raw["calibration"]},
           "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                       "platform": platform.platform()},
           "elapsed_s": raw["elapsed_s"], "modes": {}}
    ref_load = _segments(raw, REFERENCE, "load")
    for mode in modes:
        out["modes"][mode] = _summarize_mode(raw, mode, tp, ref_load)
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


def _summarize_mode(raw, mode, tp, ref_load):
    load, idle = _segments(raw, mode, "load"), _segments(raw, mode, "idle")
    ref_mean_ns = _rank0(ref_load, "iter_ns").mean()
    m = {}
    if load:
        m["step_time_ms"] = _ms(distribution_us(_rank0(load, "iter_ns")))
        m["model_compute_mean_ms"] = float(_rank0(load, "compute_ns").mean()) / 1e6
        m["model_collective_mean_ms"] = float(_rank0(load, "collective_ns").mean()) / 1e6
        m["inflation_pct"] = None if mode == REFERENCE else _inflation(load, ref_load, ref_mean_ns)
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
        m.update(_delivery(load, tp))
        # How much of the inflation the critical path itself explains: the rest is CPU
        # and GIL taken away from the model step (see load_cpu_pct).
        m["sync_share_of_reference_step_pct"] = float(
            100 * m["sync_per_step_us"]["mean_us"] * 1e3 / ref_mean_ns)
    if idle:
        m["idle"] = _idle(idle, tp)
    return m


def _inflation(load, ref_load, ref_mean_ns):
    ref = {s["round"]: _rank(s, 0)["iter_ns"].mean() for s in ref_load}
    rounds = [100 * (_rank(s, 0)["iter_ns"].mean() / ref[s["round"]] - 1) for s in load]
    return {"median_of_rounds": float(np.median(rounds)), "per_round": [float(r) for r in rounds],
            "pooled": float(100 * (_rank0(load, "iter_ns").mean() / ref_mean_ns - 1))}


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
    return {"delivery_latency_ms": _ms(distribution_us(np.asarray(latencies, dtype=np.float64))),
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

    rows = [("async sync p50 <= 30 us", p50("async"), "us", lambda v: v <= 30.0),
            ("async p50 >= 20x below fd-manager", _ratio(p50("fd-manager"), p50("async")), "x",
             lambda v: v >= 20.0),
            ("async step-time inflation <= 3 %", a["inflation_pct"]["median_of_rounds"], "%",
             lambda v: v <= 3.0),
            ("async p50 >= 5x below sync", _ratio(p50("sync"), p50("async")), "x",
             lambda v: v >= 5.0)]
    if "idle" in a:
        rows.append(("async idle worker CPU <= 1 %", max(a["idle"]["worker_cpu_pct"]), "%",
                     lambda v: v <= 1.0))
    return [{"target": name, "measured": v, "unit": unit, "met": None if v is None else bool(ok(v))}
            for name, v, unit, ok in rows]


# -- terminal ----------------------------------------------------------------------------------

def _f(v, digits=1, unit=""):
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}{unit}"
    return f"{v:.{digits}f}{unit}"


def format_table(summary) -> str:
    """The terminal report: parameters, two tables, the targets."""
    p, modes = summary["parameters"], summary["modes"]
    lines = [
        f"fastdeploy-sync profile: tp {p['tp']}, step {p['step']} {p['step_ms']:g} ms "
        f"({p['units_per_step']} units), rate {p['rate']:g}/s, batch {p['batch']} x "
        f"{p['prompt_len']} tokens ({p['tokens']}), {p['steps'] // p['rounds'] * p['rounds']} "
        f"steps/mode in {p['rounds']} interleaved rounds; python {summary['machine']['python']}, "
        f"{summary['machine']['cpus']} cpus, {summary['elapsed_s']:.0f} s",
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
    lines += ["", "effect on the worker loop (rank 0, ms; inflation: step mean vs none, median of "
                  "rounds; of which sync: the mean above over none's mean step;",
              " delivery: put -> the last rank holds it; CPU in % of one core)",
              f"{'mode':<11}{'step p50':>9}{'mean':>7}{'inflation':>11}{'of which sync':>15}"
              f"  {'delivery p50/p99':>17}  {'loaded CPU: engine/thread':>26}"
              f"  {'idle CPU: worker/thread':>24}  {'put/taken':>10}  {'agree':>5}"]
    for mode in [REFERENCE] + p["modes"]:
        m = modes[mode]
        st = m.get("step_time_ms", {})
        infl = m.get("inflation_pct")
        infl = "-" if not infl else f"{infl['median_of_rounds']:+.1f} %"
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
        share = m.get("sync_share_of_reference_step_pct")
        share = "-" if share is None else f"{share:.1f} %"
        loaded = m.get("load_cpu_pct")
        if loaded and loaded["engine_process"] is not None:
            th = loaded["prefetch_thread"]
            th = "-" if None in th else _f(max(th))
            loaded = f"{_f(loaded['engine_process'])} % / {th} %"
        else:
            loaded = "-"
        lines.append(f"{mode:<11}{_f(st.get('p50_ms'), 2):>9}{_f(st.get('mean_ms'), 2):>7}"
                     f"{infl:>11}{share:>15}  {dl:>17}  {loaded:>26}  {idle or '-':>24}"
                     f"  {b:>10}  {agree:>5}")
    if summary["targets"]:
        where = ("this is the reference configuration" if summary["reference_config"] else
                 "NOT the reference configuration (--step python --step-ms 2 --rate 100 "
                 "--batch 64 --prompt-len 512 --tp 2): indicative only")
        lines += ["", f"targets ({where}):"]
        for t in summary["targets"]:
            mark = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
            lines.append(f"  {t['target']:<36} measured {_f(t['measured'], 2)} {t['unit']:<2}  {mark}")
    for mode in p["modes"]:
        for problem in modes[mode].get("problems", []):
            lines.append(f"  {mode}: {problem}")
    return "\n".join(lines)


# -- plot ----------------------------------------------------------------------------------

_COLORS = {"none": "0.5", "async": "tab:green", "sync": "tab:orange", "fd-manager": "tab:red"}


def plot(summary, raw, path) -> None:
    """One PNG: left, the distribution (CDF) of task-sync time per step on rank 0 for every
    mode, log scale; right, the distribution of step time for every mode and the reference
    loop. Titles carry the parameters, legends the p50s, so it reads without the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p, modes = summary["parameters"], summary["modes"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2))
    for mode in p["modes"]:
        us = np.sort(np.maximum(np.asarray(modes[mode]["sync_samples_rank0_us"]), 0.01))
        s = modes[mode]["sync_per_step_us"]
        left.plot(us, np.arange(1, us.size + 1) / us.size, color=_COLORS[mode], lw=2,
                  label=f"{mode}: p50 {_f(s['p50_us'])} us, p99 {_f(s['p99_us'])} us")
    left.set_xscale("log")
    left.set_xlabel("task sync on the critical path per step, rank 0 (us, log scale)")
    left.set_ylabel("fraction of steps at or below")
    left.set_title("check + barrier + take, per step")
    left.grid(True, which="both", alpha=0.3)
    left.legend(loc="lower right", fontsize=9)
    for mode in [REFERENCE] + p["modes"]:
        ms = np.sort(_rank0(_segments(raw, mode, "load"), "iter_ns")) / 1e6
        infl = modes[mode].get("inflation_pct")
        label = f"{mode}: mean {ms.mean():.2f} ms" + (
            f", {infl['median_of_rounds']:+.1f} %" if infl else " (no task sync)")
        right.plot(ms, np.arange(1, ms.size + 1) / ms.size, color=_COLORS[mode], lw=2,
                   ls="--" if mode == REFERENCE else "-", label=label)
    right.set_xlabel("step time, rank 0 (ms)")
    right.set_title("whole step: task sync + model step")
    right.grid(True, alpha=0.3)
    right.legend(loc="lower right", fontsize=9)
    load = [s for s in raw["segments"] if s["phase"] == "load"]
    hi = max(np.percentile(_rank0(load, "iter_ns"), 99.5) / 1e6, 1e-3)
    right.set_xlim(0, hi)
    fig.suptitle(f"fastdeploy-sync profile: tp {p['tp']}, {p['step']} step {p['step_ms']:g} ms, "
                 f"{p['rate']:g} batches/s of {p['batch']} x {p['prompt_len']} tokens "
                 f"({p['tokens']}), {p['rounds']} interleaved rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

