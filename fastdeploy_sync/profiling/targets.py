"""The targets a profile is judged against, the reference configurations they were set
for, and the verdict count.

Two reference configurations, each with its own targets: TP=2 (the default run) and TP=8
(one node, the most common FastDeploy deployment of a large model), both at a 2 ms step and
100 batches/s of 64 x 512 numpy token ids. A run that matches neither is judged against the
targets of the nearer one (by TP size) and says it is indicative only. docs/profiling.md
says where each threshold comes from.

A row says ``met`` or ``MISSED`` only when its interval excludes the threshold
(``intervals.verdict``); the rules are the same for every configuration.
"""

from typing import Optional

import numpy as np

from . import formatting as fmt
from .intervals import LEVEL, MIN_ROUNDS, WORDS, verdict

__all__ = ["REFERENCE_CONFIGS", "THRESHOLDS", "IDLE_THRESHOLDS", "reference_config",
           "targets_for", "target", "kind_targets", "idle_targets", "count_verdicts",
           "ratio_stat"]

_COMMON = {"step_ms": 2.0, "rate": 100.0, "batch": 64, "prompt_len": 512, "tokens": "numpy"}
REFERENCE_CONFIGS = {"TP=2": {**_COMMON, "tp": 2}, "TP=8": {**_COMMON, "tp": 8}}

# Per reference configuration: the async critical path p50 (us), how many times below
# fd-manager's and sync mode's p50 it must be, the step-time inflation and the GIL wait
# added (% of none's step), async delivery p50 over sync's. At TP=8 the barrier waits for
# the last of eight ranks, so the critical path's bound is wider; every ratio stays.
THRESHOLDS = {
    "TP=2": {"critical_path_p50_us": 30.0, "vs_fd_manager": 20.0, "vs_sync": 5.0,
             "inflation_pct": 3.0, "gil_added_pct": 3.0, "delivery_vs_sync": 1.0},
    "TP=8": {"critical_path_p50_us": 150.0, "vs_fd_manager": 20.0, "vs_sync": 5.0,
             "inflation_pct": 3.0, "gil_added_pct": 3.0, "delivery_vs_sync": 1.0},
}
# Idle (any configuration): async worker CPU (% of a core) and what task sync adds to the
# bare 1 ms loop's own CPU (points).
IDLE_THRESHOLDS = {"cpu_pct": 1.0, "above_none_points": 0.5}


def reference_config(options: dict) -> Optional[str]:
    """The name of the reference configuration ``options`` matches, or None."""
    for name, config in REFERENCE_CONFIGS.items():
        if all(options.get(k) == v for k, v in config.items()):
            return name
    return None


def targets_for(options: dict) -> str:
    """The configuration whose targets judge the run: the one it matches, else the
    nearer by TP size (ties go to TP=2, the default)."""
    matched = reference_config(options)
    if matched is not None:
        return matched
    return min(REFERENCE_CONFIGS,
               key=lambda name: abs(REFERENCE_CONFIGS[name]["tp"] - options["tp"]))


def ratio_stat(a, b):
    """``a / b`` of two statistics over the same resamples (NaN or inf where ``b`` is 0)."""
    def stat(idx):
        with np.errstate(divide="ignore", invalid="ignore"):
            return a(idx) / b(idx)
    return stat


def target(kind, name, figure, threshold, better, unit) -> dict:
    """A target row: the figure, its verdict (``n/a`` without a value), no reason, no
    regime note (``regime.attach_notes`` adds those)."""
    word = verdict(figure["interval"], threshold, better) if figure["value"] is not None \
        else "n/a"
    return {"step_kind": kind, "target": name, "measured": figure["value"],
            "interval": figure["interval"], "threshold": threshold, "better": better,
            "unit": unit, "verdict": word, "met": {"met": True, "MISSED": False}.get(word),
            "reason": None, "regime": None}


def kind_targets(kind, out, stats, modes, boot, thresholds) -> list:
    """The target rows of one step kind (async against the thresholds), from its summary
    ``out`` and the per-mode statistics ``stats`` (``p50``, ``delivery_p50``)."""
    if "async" not in modes:
        return []
    t = thresholds
    a = out["modes"]["async"]
    rows = [target(kind, f"async critical path p50 <= {t['critical_path_p50_us']:g} us",
                   a["critical_path_p50_us"], t["critical_path_p50_us"], "below", "us")]
    if "fd-manager" in modes:
        rows.append(target(kind, f"async critical path p50 >= {t['vs_fd_manager']:g}x below "
                                 f"fd-manager's", a["critical_path_p50_vs_fd_manager"],
                           t["vs_fd_manager"], "above", "x"))
    if "sync" in modes:
        rows.append(target(kind, f"async critical path p50 >= {t['vs_sync']:g}x below sync "
                                 f"mode's",
                           boot.figure(ratio_stat(stats["sync"]["p50"], stats["async"]["p50"])),
                           t["vs_sync"], "above", "x"))
    rows.append(target(kind, f"async step-time inflation <= {t['inflation_pct']:g} % of "
                             f"none's step", a["inflation_pct"], t["inflation_pct"], "below",
                       "%"))
    slowdown = a["model_slowdown_pct"]["interval"]
    if slowdown is not None and slowdown[1] < 0:
        # The model step (and its collective) ran faster than in the loop without task
        # sync, beyond the interval: task sync cannot do that, so the two loops did not
        # meet the same machine and the inflation says nothing about task sync.
        rows[-1].update(verdict="inconclusive", met=None,
                        reason=f"the model step ran faster than in none (model slowdown "
                               f"{fmt.interval(slowdown, '%', 1)}): none is no like-for-like "
                               f"reference on this machine")
    low, high = (a["interruption"][k] for k in ("gil_wait_added_pct",
                                                 "gil_wait_added_upper_pct"))
    if low is not None:
        # Judged on both bounds at once: met only if even the upper bound's interval is
        # below the target, MISSED only if even the lower bound's is above it.
        bounded = high is not None and None not in (low["interval"], high["interval"])
        both = {"value": low["value"], "interval": [low["interval"][0], high["interval"][1]]
                if bounded else None}
        rows.append(target(kind, f"async GIL wait added <= {t['gil_added_pct']:g} % of "
                                 f"none's step", both, t["gil_added_pct"], "below", "%"))
    if "sync" in modes:
        ratio = boot.figure(ratio_stat(stats["async"]["delivery_p50"],
                                       stats["sync"]["delivery_p50"]))
        a["delivery_p50_vs_sync"] = ratio
        rows.append(target(kind, f"async delivery p50 <= sync mode's (ratio <= "
                                 f"{t['delivery_vs_sync']:g})", ratio,
                           t["delivery_vs_sync"], "below", "x"))
    return rows


def idle_targets(idle_modes) -> list:
    """The idle rows (async's worker CPU, and what it adds to none's), or none without
    async."""
    if "async" not in idle_modes:
        return []
    t = IDLE_THRESHOLDS
    a = idle_modes["async"]
    return [target(None, f"async idle worker CPU <= {t['cpu_pct']:g} % of a core",
                   a["worker_cpu_pct"], t["cpu_pct"], "below", "%"),
            # What task sync itself adds: the row above also holds the bare loop's own CPU,
            # which alone can exceed the bound (docs/profiling.md, Two idle targets).
            target(None, f"async idle CPU <= {t['above_none_points']:g} points above none's",
                   a["above_none_points"], t["above_none_points"], "below", "points")]


def count_verdicts(targets, boot) -> dict:
    """How many rows say each word, and the header line that says so."""
    counts = {w: sum(t["verdict"] == w for t in targets) for w in WORDS}
    counts["n/a"] = sum(t["verdict"] == "n/a" for t in targets)
    placements = (f" in {boot.placements} process placements" if boot.placements > 1
                  else "")
    basis = (f"{LEVEL:.0%} intervals from a bootstrap over {boot.rounds} paired rounds"
             f"{placements}; met or MISSED only where the interval excludes the target"
             if boot.has_intervals else
             f"only {boot.rounds} round(s): no intervals (--rounds {MIN_ROUNDS} or more), so "
             f"every verdict is inconclusive")
    words = ", ".join(f"{counts[w]} {w}" for w in (*WORDS, "n/a") if counts[w] or w in WORDS)
    return {**counts, "header": f"verdicts: {words} ({basis})"}
