"""The profile as one PNG, drawn from the summary alone (``report.summarize``: the JSON).

A first row: the headline, the whole cost per step (inflation and interruption per step,
each with its interval and its "x lower" than the FastDeploy-style queue). Then one row per
step kind (the GIL-holding python step and the GIL-releasing paddle step side by
side, so a reader sees which kind of step our thread can delay and by how much): the
critical path's distribution, delivery's distribution, and the interruption of the model
step. A last row: the step-time inflation of every kind and mode with its interval, idle
CPU with its interval, and the targets with their verdicts. Titles and labels use the
report's definitions (``vocabulary.DELIVERY`` above all); the suptitle carries the verdict
count and the regime line the terminal prints.

Needs matplotlib (the package's ``profile`` extra); importing this module does not import
it, ``figure`` and ``save`` do (``ImportError`` where it is missing).
"""

import numpy as np

from .options import REFERENCE
from .targets import IDLE_THRESHOLDS, THRESHOLDS
from .terminal import parameters_line
from .vocabulary import DELIVERY

__all__ = ["figure", "save", "panel_titles"]

COLORS = {"none": "0.55", "async": "tab:green", "sync": "tab:orange", "fd-manager": "tab:red"}
VERDICT_COLORS = {"met": "#b7e4b7", "MISSED": "#f4a6a6", "inconclusive": "#fbe7a1",
                  "n/a": "#eeeeee"}


def panel_titles(summary) -> list:
    """The panels' titles, row by row (the tests read them)."""
    titles = ["the whole cost per step, rank 0: step-time inflation and interruption per "
              "step, each x lower than fd-manager's (same rounds) [95 % interval]"]
    for kind in summary["step_kinds"]:
        titles += [f"{kind} step: critical path per step, rank 0 (check + barrier + take)",
                   f"{kind} step: delivery, {DELIVERY}",
                   f"{kind} step: interruption of the model step's work, mean per step"]
    titles += ["step-time inflation vs none = critical path share + model slowdown",
               "idle CPU (rate 0), % of one core",
               "targets and verdicts"]
    return titles


def save(summary, path) -> None:
    """Write ``figure(summary)`` as a PNG at ``path``."""
    import matplotlib.pyplot as plt

    fig = figure(summary)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _interval_text(fig, unit, digits=1):
    if fig is None or fig["value"] is None:
        return "-"
    i = fig["interval"]
    text = f"{fig['value']:.{digits}f} {unit}"
    return text if i is None else f"{text} [{i[0]:.{digits}f}, {i[1]:.{digits}f}]"


def figure(summary):
    """Build the matplotlib figure (Agg backend) of ``summary``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = summary["parameters"]
    kinds, modes = list(summary["step_kinds"]), p["modes"]
    rows = len(kinds) + 1
    head_rows = sum(len(m) for m in summary["headline"].values())
    head_in = 0.45 + 0.22 * head_rows
    fig = plt.figure(figsize=(22, 5.6 * rows + head_in + 1.2))
    grid = fig.add_gridspec(rows + 1, 3, height_ratios=[head_in] + [5.6] * rows)
    headline_ax = fig.add_subplot(grid[0, :])
    axes = np.array([[fig.add_subplot(grid[r + 1, c]) for c in range(3)]
                     for r in range(rows)])
    titles = iter(panel_titles(summary))
    for ax in [headline_ax, *axes.ravel()]:
        ax.set_title(next(titles), fontsize=11)
    _headline(headline_ax, summary)

    for row, kind in enumerate(kinds):
        k = summary["step_kinds"][kind]
        _critical_path(axes[row][0], k, modes)
        _delivery(axes[row][1], k, modes)
        _interruption(axes[row][2], k, modes, kind)
    _inflation(axes[-1][0], summary, kinds, modes)
    _idle(axes[-1][1], summary, modes)
    _targets(axes[-1][2], summary)

    head = [parameters_line(summary), summary["verdicts"]["header"],
            summary["regime"]["line"], *summary["machine_load"]["lines"]]
    fig.suptitle("\n".join(head), fontsize=10.5, y=0.995)
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.05 + 0.09 * len(head)) / fig.get_figheight()))
    return fig


def _ratio_text(fig):
    """"12.3 x [8.1, 20.4]"; an unbounded end (a resample where the mode cost nothing
    resolvable) reads "unbounded"."""
    if fig is None or fig["value"] is None:
        return "-"
    i = fig["interval"]

    def end(v):
        return "unbounded" if v is None else f"{v:.1f}"
    return f"{fig['value']:.1f} x" + ("" if i is None else f" [{end(i[0])}, {end(i[1])}]")


def _headline(ax, summary):
    """The headline as a table: per step kind and mode, the inflation and the interruption
    per step, each with its interval and its "x lower" than fd-manager's."""
    ax.axis("off")
    rows = []
    for kind, modes in summary["headline"].items():
        for mode, f in modes.items():
            rows.append([kind, mode, _interval_text(f["inflation_pct"], "%"),
                         _ratio_text(f["inflation_vs_fd_manager"]),
                         _interval_text(f["interruption_us"], "us"),
                         _ratio_text(f["interruption_vs_fd_manager"])])
    if not rows:
        return
    table = ax.table(cellText=rows, loc="center",
                     cellColours=[["w", COLORS.get(r[1], "w")] + ["w"] * 4 for r in rows],
                     colLabels=["step", "mode", "step-time inflation", "x lower",
                                "interruption per step", "x lower"],
                     colWidths=[0.07, 0.09, 0.22, 0.17, 0.24, 0.17])
    table.auto_set_font_size(False)
    table.set_fontsize(10)
    table.scale(1, 1.3)


def _plain_ticks(ax):
    """Log-scale tick labels as plain numbers (1, 10, 100), no minor labels."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _cdf(ax, values, **kw):
    v = np.sort(np.asarray(values, dtype=float))
    if v.size:
        ax.plot(np.maximum(v, 1e-3), np.arange(1, v.size + 1) / v.size, lw=2, **kw)


def _cdf_panel(ax, curves, xlabel, ylabel):
    """One CDF per ``(samples, mode, label)`` on a log x axis."""
    for samples, mode, label in curves:
        _cdf(ax, samples, color=COLORS.get(mode), label=label)
    ax.set_xscale("log")
    _plain_ticks(ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend(loc="lower right", fontsize=8.5)


def _critical_path(ax, k, modes):
    curves = []
    for mode in modes:
        m = k["modes"][mode]
        curves.append((m["critical_path_samples_us"], mode,
                       f"{mode}: p50 {_interval_text(m['critical_path_p50_us'], 'us')}, "
                       f"p99 {m['critical_path_us']['p99_us']:.0f} us"))
    _cdf_panel(ax, curves, "critical path per step, us (log scale)",
               "fraction of steps at or below")


def _delivery(ax, k, modes):
    curves = []
    for mode in modes:
        m = k["modes"][mode]
        b = m["delivery_boundaries"]["share_first"]
        curves.append((m["delivery_samples_ms"], mode,
                       f"{mode}: p50 {_interval_text(m['delivery_p50_ms'], 'ms', 2)}; "
                       f"{'-' if b is None else f'{100 * b:.0f} %'} at the 1st boundary"))
    _cdf_panel(ax, curves, "delivery, ms (log scale)", "fraction of batches at or below")


def _interruption(ax, k, modes, kind):
    """Per mode, side by side on a log scale: run queue (other threads and processes had
    the core) and GIL wait (our threads held the GIL), us per model step, with intervals;
    the GIL wait added in % of none's step and the preemptions per step written above."""
    names = [REFERENCE] + list(modes)
    x = np.arange(len(names))
    floor = 0.1  # us: where a zero is drawn on the log scale
    parts = (("run_queue_us", "run queue: another thread or process had the core", "none",
              "0.35", "//", -0.18),
             ("gil_wait_us", "GIL wait, lower bound: blocked on the GIL another thread held",
              None, None,
              "", 0.18))
    for key, label, face, edge, hatch, dx in parts:
        figs = [k["modes"][m]["interruption"].get(key) for m in names]
        vals = np.array([0.0 if f is None or f["value"] is None else f["value"] for f in figs])
        colors = face or [COLORS.get(m) for m in names]
        # A log scale has no zero: a figure of 0 gets no bar, only its label at the floor.
        drawn = vals > floor
        ax.bar((x + dx)[drawn], vals[drawn], 0.34,
               color=colors if isinstance(colors, str) else
               [c for c, d in zip(colors, drawn) if d],
               edgecolor=edge or "k", hatch=hatch, lw=0.6, label=label)
        for j, f in enumerate(figs):
            top = max(vals[j], floor)
            if f and f["interval"] and drawn[j]:
                lo, hi = (max(v, floor) for v in f["interval"])
                ax.errorbar([j + dx], [vals[j]], yerr=[[vals[j] - lo], [hi - vals[j]]],
                            fmt="none", ecolor="k", capsize=4)
                top = max(top, hi)
            # the label sits above the error bar, never under it
            ax.annotate(f"{vals[j]:.1f}" if drawn[j] else "0", (j + dx, top), xytext=(0, 2),
                        textcoords="offset points", ha="center", va="bottom", fontsize=7.5)
    upper = [k["modes"][m]["interruption"].get("gil_wait_upper_us") for m in names]
    ups = [f["value"] if f and f["value"] is not None and f["value"] > floor else None
           for f in upper]  # no zero marker on the log scale either
    ax.plot([j + 0.18 for j, u in enumerate(ups) if u is not None], [u for u in ups if u is not None],
            "kv", ms=7, label="GIL wait, upper bound: all off-CPU time of steps that blocked")
    for j, m in enumerate(names):
        i = k["modes"][m]["interruption"]
        added, inv = i.get("gil_wait_added_pct"), i.get("involuntary_switches_per_step")
        high = i.get("gil_wait_added_upper_pct")
        text = "" if not added or added["value"] is None else \
            f"GIL added\n{added['value']:+.2f}" + \
            ("" if not high else f"..{high['value']:+.2f}") + " %\n"
        text += "" if not inv else f"{inv['value']:.1f} preempt./step"
        ax.annotate(text, (j, 1.0), xycoords=("data", "axes fraction"), xytext=(0, -4),
                    textcoords="offset points", ha="center", va="top", fontsize=7)
    ax.set_yscale("log")
    top = max([p.get_height() for p in ax.patches] + [10.0])  # bars only: no zero bar
    ax.set_ylim(floor / 2, top * 60)
    ax.set_xticks(x, names)
    ax.set_ylabel(f"us per model step, log scale ({k['modes'][REFERENCE]['model_step_ms']:.2f} ms "
                  f"in none)")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(loc="center right", fontsize=7.5)


def _inflation(ax, summary, kinds, modes):
    width = 0.8 / max(len(kinds), 1)
    x = np.arange(len(modes))
    hatches = ["", ".."]
    for j, kind in enumerate(kinds):
        ms = summary["step_kinds"][kind]["modes"]
        pos = x - 0.4 + width * (j + 0.5)
        share = np.array([ms[m]["critical_path_share_pct"]["value"] for m in modes])
        slow = np.array([ms[m]["model_slowdown_pct"]["value"] for m in modes])
        total = np.array([ms[m]["inflation_pct"]["value"] for m in modes])
        ax.bar(pos, share, width * 0.9, color=[COLORS.get(m) for m in modes],
               hatch=hatches[j % 2], edgecolor="k", lw=0.5,
               label=f"{kind}: critical path share" if j < 2 else None)
        ax.bar(pos, slow, width * 0.9, bottom=np.where(slow >= 0, share, 0), color="none",
               edgecolor=[COLORS.get(m) for m in modes], hatch="//",
               label="model slowdown" if j == 0 else None)
        for q, m in enumerate(modes):
            f = ms[m]["inflation_pct"]
            top = max(total[q], 0)
            if f["interval"]:
                lo, hi = f["interval"]
                ax.errorbar([pos[q]], [total[q]], yerr=[[total[q] - lo], [hi - total[q]]],
                            fmt="ko", capsize=4, ms=4)
                top = max(top, hi)
            else:
                ax.plot([pos[q]], [total[q]], "ko", ms=4)
            # above the error bar, never under it
            ax.annotate(f"{kind}\n{total[q]:+.1f} %", (pos[q], top),
                        xytext=(0, 4), textcoords="offset points", ha="center", fontsize=7.5)
    ax.axhline(0, color="0.3", lw=0.8)
    bound = THRESHOLDS[summary["targets_for"]]["inflation_pct"]
    ax.axhline(bound, color="tab:blue", lw=0.8, ls="--", label=f"target for async: {bound:g} %")
    ax.set_xticks(x, modes)
    ax.set_ylabel("% of none's mean step (black: inflation with its interval)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)


def _idle(ax, summary, modes):
    idle = summary.get("idle")
    if not idle:
        ax.text(0.5, 0.5, "idle phase skipped (--idle-steps 0)", ha="center",
                transform=ax.transAxes)
        return
    names = [REFERENCE] + list(modes)
    x = np.arange(len(names))
    figs = [idle["modes"][m]["worker_cpu_pct"] for m in names]
    vals = np.array([f["value"] for f in figs])
    ax.bar(x, vals, 0.55, color=[COLORS.get(m) for m in names],
           label="worker process (all threads), max over ranks")
    for j, f in enumerate(figs):
        if f["interval"]:
            lo, hi = f["interval"]
            ax.errorbar([j], [vals[j]], yerr=[[vals[j] - lo], [hi - vals[j]]], fmt="none",
                        ecolor="k", capsize=5)
        th = idle["modes"][names[j]]["prefetch_thread_cpu_pct"]
        extra = "" if None in th else f"\nprefetch thread {max(th):.2f} %"
        ax.annotate(f"{vals[j]:.2f} %{extra}", (j, vals[j]), xytext=(8, 4),
                    textcoords="offset points", fontsize=8.5)
    bound = IDLE_THRESHOLDS["cpu_pct"]
    ax.axhline(bound, color="tab:blue", lw=0.8, ls="--", label=f"target for async: {bound:g} %")
    ax.set_ylim(0, max(float(vals.max()), 1.0) * 1.5)
    ax.set_xticks(x, names)
    ax.set_ylabel("% of one core (black: interval)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)


def _targets(ax, summary):
    ax.axis("off")
    rows, colors = [], []
    for t in summary["targets"]:
        i = t["interval"]
        unit = t["unit"]
        rows.append([t["step_kind"] or "idle", t["target"],
                     "-" if t["measured"] is None else f"{t['measured']:.2f} {unit}",
                     "none" if i is None else f"[{i[0]:.2f}, {i[1]:.2f}]", t["verdict"]])
        colors.append(["w", "w", "w", "w", VERDICT_COLORS.get(t["verdict"], "w")])
    if rows:
        table = ax.table(cellText=rows, cellColours=colors, loc="upper center",
                         colLabels=["step", "target", "measured", "interval", "verdict"],
                         colWidths=[0.08, 0.52, 0.14, 0.17, 0.13])
        table.auto_set_font_size(False)
        table.set_fontsize(8)
        table.scale(1, 1.35)
    ok = summary["correct"]
    ax.text(0.5, 0.02, "correctness: every batch delivered to every rank, ranks took identical "
            f"batches at identical steps: {'yes' if ok else 'NO'}", ha="center",
            transform=ax.transAxes, fontsize=9,
            bbox={"facecolor": "#b7e4b7" if ok else "#f4a6a6", "edgecolor": "none"})
