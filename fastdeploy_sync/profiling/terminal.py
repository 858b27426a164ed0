"""The profile's terminal report (``format_table``) and its first line
(``parameters_line``, also the plot's title), from ``report.summarize``'s summary alone.

A mode is only ever a row label, never a column name; every time, share and ratio carries
its unit. ``vocabulary.DEFINITIONS`` (printed at the end) defines every figure.
"""

from ..worker.step_profiler import StepProfiler
from . import formatting as fmt
from .intervals import LEVEL
from .options import IDLE_WARMUP_STEPS, REFERENCE
from .targets import REFERENCE_CONFIGS
from .vocabulary import DELIVERY

__all__ = ["format_table", "parameters_line", "headline_table", "reference_words",
           "in_placements"]


def in_placements(placements) -> str:
    return f" in {placements} process placements" if placements > 1 else ""


def reference_words(summary) -> str:
    """Which reference configuration the run is and whose targets judged it."""
    name, used = summary["reference_config"], summary["targets_for"]
    if name is not None:
        return f"reference configuration {name}, judged against its targets"
    config = REFERENCE_CONFIGS[used]
    flags = " ".join(f"--{k.replace('_', '-')} {v:g}" if isinstance(v, float) else
                     f"--{k.replace('_', '-')} {v}" for k, v in config.items() if k != "tp")
    return (f"NOT a reference configuration ({flags} at --tp "
            f"{' or '.join(str(c['tp']) for c in REFERENCE_CONFIGS.values())}): judged "
            f"against the {used} targets, indicative only")


def headline_table(summary) -> list:
    """The whole cost per step (``headline``): per step kind, one row per mode."""
    modes = summary["parameters"]["modes"]
    out = ["whole cost per step, rank 0: the step-time inflation over none, and the "
           "interruption per step (mean critical path + GIL wait added, lower bound); "
           "x lower = fd-manager's figure / the mode's, in the same rounds",
           f"  {'step':<7}{'mode':<11}{'inflation [interval]':>27}{'x lower':>24}"
           f"{'interruption [interval]':>27}{'x lower':>24}"
           f"{'critical path p50 (detail)':>28}{'x lower':>24}"]
    for kind, rows in summary["headline"].items():
        for mode in modes:
            h = rows[mode]
            out.append(f"  {kind:<7}{mode:<11}"
                       f"{fmt.fig(h['inflation_pct'], '%', 1, sign=True):>27}"
                       f"{fmt.ratio(h['inflation_vs_fd_manager']):>24}"
                       f"{fmt.fig(h['interruption_us'], 'us'):>27}"
                       f"{fmt.ratio(h['interruption_vs_fd_manager']):>24}"
                       f"{fmt.fig(h['critical_path_p50_us'], 'us'):>28}"
                       f"{fmt.ratio(h['critical_path_p50_vs_fd_manager']):>24}")
    return out


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
            f"{p['rounds']} paired rounds{in_placements(p.get('placements', 1))} x "
            f"{per_round} steps per mode and step kind{idle}; "
            f"python {m['python']}, {m['cpus']} cpus, {summary['elapsed_s']:.0f} s{pinned}")


def format_table(summary) -> str:
    """The terminal report: parameters, the verdict count, the regime, the headline (the
    whole cost per step); per step kind the critical path, the interruption, the effect on
    the loop and delivery; idle CPU; the targets with their intervals; notes; the
    definitions."""
    p = summary["parameters"]
    lines = [parameters_line(summary), summary["verdicts"]["header"],
             summary["regime"]["line"],
             *(f"machine: {line}" for line in summary["machine_load"]["lines"])]
    lines += ["", *headline_table(summary)]
    for kind, k in summary["step_kinds"].items():
        lines += ["", f"== {kind} step: {k['gil']} ==", *_kind_tables(k, p["modes"])]
    if summary["idle"]:
        lines += ["", "== idle (rate 0) ==", *_idle_table(summary["idle"], p["modes"])]
    if summary["targets"]:
        where = reference_words(summary)
        lines += ["", f"targets ({LEVEL:.0%} interval over {p['rounds']} paired rounds"
                      f"{in_placements(p.get('placements', 1))}; {where}):",
                  f"  {'step':<7}{'target':<52}{'measured':>12}  {'interval':<24}verdict"]
        for t in summary["targets"]:
            unit = t["unit"]
            lines.append(f"  {t['step_kind'] or 'idle':<7}{t['target']:<52}"
                         f"{fmt.num(t['measured'], 2) + ' ' + unit:>12}  "
                         f"{fmt.interval(t['interval'], unit, 2):<24}{t['verdict']}"
                         + (" (see notes)" if t["reason"] else "")
                         + (" (regime: see notes)" if t.get("regime") else ""))
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
        parts = " / ".join(fmt.num(sec[s]["p50_us"]) for s in StepProfiler.SECTIONS) + " us"
        vs = x.get("critical_path_p50_vs_fd_manager")
        out.append(f"  {mode:<11}{fmt.fig(x['critical_path_p50_us'], 'us'):>32}"
                   f"{fmt.val(d['p99_us'], 'us'):>12}{fmt.val(d['mean_us'], 'us'):>12}"
                   f"  {parts:>30}  {fmt.fig(vs, 'x') if vs else '-':>32}")
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
        out.append(f"  {mode:<11}{fmt.val(x['model_step_ms'], 'ms', 2):>11}"
                   f"{fmt.val((i['off_cpu_us'] or {}).get('value'), 'us'):>11}"
                   f"{fmt.val((i['run_queue_us'] or {}).get('value'), 'us'):>11}"
                   f"{fmt.val((i['other_us'] or {}).get('value'), 'us'):>10}"
                   f"{fmt.fig(i['gil_wait_us'], 'us'):>32}"
                   f"{fmt.val((i['gil_wait_upper_us'] or {}).get('value'), 'us'):>10}"
                   f"{fmt.fig(added, '%', 2, sign=True) if added else '-':>36}"
                   f"{upper:>9}{sw:>25}")
    out += ["effect on the loop, rank 0, % of none's mean step (inflation = critical path share "
            "+ model slowdown)",
            f"  {'mode':<11}{'step mean':>10}{'inflation [interval]':>32}"
            f"{'critical path':>15}{'model slowdown':>16}"]
    for mode in [REFERENCE] + modes:
        x = m[mode]
        if mode == REFERENCE:
            out.append(f"  {mode:<11}{fmt.val(x['step_ms']['mean_ms'], 'ms', 2):>10}"
                       f"{'(the reference)':>32}")
            continue
        out.append(f"  {mode:<11}{fmt.val(x['step_ms']['mean_ms'], 'ms', 2):>10}"
                   f"{fmt.fig(x['inflation_pct'], '%', 1, sign=True):>32}"
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
        bounds = x["delivery_boundaries"]
        out.append(f"  {mode:<11}{fmt.fig(x['delivery_p50_ms'], 'ms', 2):>32}"
                   f"{fmt.val(d['p99_ms'], 'ms', 2):>12}"
                   f"{fmt.pct(bounds['share_first']) + ' / ' + fmt.num(bounds['mean'], 2):>21}"
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
        out.append(f"  {mode:<11}{fmt.fig(x['worker_cpu_pct'], '%', 2):>40}"
                   f"{fmt.fig(above, 'points', 2, sign=True) if above else '-':>36}{th:>17}")
    return out
