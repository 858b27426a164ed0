"""The profile's headline: the whole cost of task sync per step, per step kind and mode.

Users pay the step time, not the critical path's p50. A background thread that receives
while the model runs also takes the GIL from the model step (a step that releases it at
every op, as a GPU decode step's launches do, hands it over each time), and that wait can
exceed the critical path itself. So the headline counts two ways, each beside the
FastDeploy-style queue (fd-manager) in the same rounds:

``inflation_pct``      the step-time inflation over the loop without task sync: everything
                       task sync did to the step, the cores other threads took included;
``interruption_us``    the interruption of rank 0's event loop per step: the mean critical
                       path plus the GIL wait the mode added to the model step's work
                       (lower bound; ``interruption_upper_us`` with the upper bound);

each with its cost ratio to fd-manager's (``intervals.cost_ratio``: "x lower", unbounded
when the mode's own cost is not resolved above zero). The critical path p50 and its ratio
stay as a detail.
"""

from .intervals import cost_ratio

__all__ = ["kind_headline", "FIGURES"]

# The headline's figures per mode, in the order the terminal prints them.
FIGURES = ("inflation_pct", "inflation_vs_fd_manager", "interruption_us",
           "interruption_vs_fd_manager", "interruption_upper_us",
           "interruption_upper_vs_fd_manager", "critical_path_p50_us",
           "critical_path_p50_vs_fd_manager")


def _interruption(stats, reference, bound):
    """Per-resample mean critical path + GIL wait added (``bound``: gil_wait or
    gil_wait_upper), us; None where the meter had no GIL split (not Linux)."""
    g, g0 = stats.get(bound), reference.get(bound)
    crit = stats["crit_mean"]
    if g is None or g0 is None:
        return None
    return lambda idx: (crit(idx) + g(idx) - g0(idx)) / 1e3


def kind_headline(modes_out, stats, modes, boot) -> dict:
    """``{mode: {figure: {"value", "interval"} or None}}`` for each mode of ``modes`` (not
    none), from the kind's summary per mode ``modes_out`` and its per-round statistics
    ``stats`` (``report``: ``iter``, ``crit_mean``, ``gil_wait``, ``gil_wait_upper`` per
    mode, ``none`` included, and ``inflation`` per mode). Ratios need fd-manager in
    ``modes``; they are None for fd-manager itself."""
    reference = stats["none"]
    out = {}
    per_mode = {}
    for mode in modes:
        st = stats[mode]
        per_mode[mode] = {"inflation": st["inflation"],
                          "interruption": _interruption(st, reference, "gil_wait"),
                          "interruption_upper": _interruption(st, reference, "gil_wait_upper")}
    baseline = per_mode.get("fd-manager")
    for mode in modes:
        m, stat = modes_out[mode], per_mode[mode]
        row = {"inflation_pct": {k: v for k, v in m["inflation_pct"].items()
                                 if k != "per_round"},
               "critical_path_p50_us": m["critical_path_p50_us"],
               "critical_path_p50_vs_fd_manager": m.get("critical_path_p50_vs_fd_manager")}
        for name in ("interruption", "interruption_upper"):
            row[f"{name}_us"] = None if stat[name] is None else boot.figure(stat[name])
        for name in ("inflation", "interruption", "interruption_upper"):
            key = f"{name}_vs_fd_manager"
            if baseline is None or mode == "fd-manager" or stat[name] is None \
                    or baseline[name] is None:
                row[key] = None
            else:
                row[key] = boot.figure(cost_ratio(baseline[name], stat[name]))
        out[mode] = {k: row[k] for k in FIGURES}
    return out
