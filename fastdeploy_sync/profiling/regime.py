"""The regime a profile ran in, and the verdicts known to depend on it.

The same code reads differently on a 2-core machine and on a 16-core GPU server: with a
core free for it, a rank's prefetch thread wakes as soon as a batch arrives, takes the
receive lock and then waits for the GIL a GIL-holding step holds, and the event loop cannot
receive meanwhile (async delivery then reads slower than sync); on shared cores it waits for
a core instead, and the two read about the same. On shared cores, the step-time inflation
also counts the cores the other processes took. So every run says:

- the cores its processes may use (``os.sched_getaffinity`` of the runner, which its
  children inherit, or the ``--cpus`` pinning) against the processes it started (the
  engine, the ranks, the fd-manager's server) and the threads they ran at the end of each
  mode's measured steps;
- its class: *free cores* (a core per process and per rank's background thread), *shared
  cores* (fewer cores than processes) or *some free cores* (in between);
- where the model step ran (the CPU, or which GPU for each rank);

and ``attach_notes`` marks the target rows whose verdict depends on the class.
"""

from .vocabulary import HOLDS_GIL

__all__ = ["describe", "attach_notes", "FREE", "SHARED", "SOME_FREE"]

FREE, SOME_FREE, SHARED = "free cores", "some free cores", "shared cores"


def _max_threads(segments, mode, key):
    """The largest count ``key`` (python / os) per rank, and the engine's, over the mode's
    load segments; None where nothing reported it."""
    ranks, engine = {}, None
    for s in segments:
        if s["phase"] != "load" or s["mode"] != mode:
            continue
        for w in s["workers"]:
            value = (w.get("threads") or {}).get(key)
            if value is not None:
                ranks[w["rank"]] = max(ranks.get(w["rank"], 0), value)
        putting = s.get("engine_putting") or {}
        value = (putting.get("threads") or {}).get(key)
        if value is not None:
            engine = max(engine or 0, value)
    return [ranks[r] for r in sorted(ranks)], engine


def describe(raw) -> dict:
    """The run's regime (JSON-ready): cores, pinning, processes, class, threads per mode
    and where each step kind ran, and ``line``, the one line the terminal prints."""
    options = raw["options"]
    tp, modes = options["tp"], options["modes"]
    cores = raw.get("cores") or []
    n = len(cores)
    processes = 1 + tp
    regime_class = SHARED if n < processes else FREE if n >= processes + tp else SOME_FREE
    threads = {}
    for mode in ["none", *modes]:
        py_ranks, py_engine = _max_threads(raw["segments"], mode, "python")
        os_ranks, os_engine = _max_threads(raw["segments"], mode, "os")
        threads[mode] = {"ranks_python": py_ranks, "engine_python": py_engine,
                         "ranks_os": os_ranks, "engine_os": os_engine}
    steps = {}
    for kind, calibrations in (raw.get("calibration") or {}).items():
        devices = [c.get("device") for c in calibrations]
        steps[kind] = {"on": "GPU" if any(devices) else "CPU", "devices": devices}
    out = {"cores": n, "core_ids": cores, "pinned": bool(raw.get("pinned")),
           "processes": {"engine": 1, "ranks": tp,
                         "fd_manager_server": int("fd-manager" in modes)},
           "class": regime_class, "threads": threads, "model_step": steps}
    out["line"] = _line(out, modes)
    return out


def _line(r, modes) -> str:
    tp = r["processes"]["ranks"]
    pinned = "pinned" if r["pinned"] else "not pinned"
    server = "; fd-manager adds its server" if r["processes"]["fd_manager_server"] else ""
    why = {SHARED: "fewer cores than processes", FREE: "a core per process and per rank's "
           "background thread", SOME_FREE: "a core per process, not per background thread"}
    counts = []
    for mode, t in r["threads"].items():
        if t["ranks_python"]:
            engine = "" if t["engine_python"] is None else f" + {t['engine_python']}"
            counts.append(f"{mode} {sum(t['ranks_python'])}{engine}")
    on_cpu = [k for k, s in r["model_step"].items() if s["on"] == "CPU"]
    on_gpu = {k: s["devices"] for k, s in r["model_step"].items() if s["on"] == "GPU"}
    where = []
    if on_cpu:
        where.append(f"{', '.join(on_cpu)} on the CPU")
    for kind, devices in on_gpu.items():
        by_device: dict = {}
        for rank, device in enumerate(devices):
            by_device.setdefault(device, []).append(str(rank))
        where.append(f"{kind} on a GPU: " + "; ".join(
            f"{device} (rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)})"
            for device, ranks in by_device.items()))
    return (f"regime: {r['class']} ({why[r['class']]}): {r['cores']} cores ({pinned}) for "
            f"{1 + tp} processes (the engine, {tp} rank{'s' if tp > 1 else ''}{server}); "
            f"Python threads while loaded, ranks + engine: {', '.join(counts) or '-'}; "
            f"model step: {'; '.join(where) or '-'}")


def attach_notes(regime, targets) -> list:
    """Mark the target rows whose verdict is known to depend on the regime (their
    ``regime`` field: why, for this run's class) and return the notes that say so. The
    verdicts themselves are not touched."""
    notes = []
    cls, cores = regime["class"], regime["cores"]
    processes = 1 + regime["processes"]["ranks"]
    for row in targets:
        kind, name = row["step_kind"], row["target"]
        note = None
        if kind in HOLDS_GIL and name.startswith("async delivery p50"):
            seen = {FREE: "this run had a free core for each, so async reads slower here "
                          "than on shared cores",
                    SHARED: "this run had shared cores, where async and sync read about the "
                            "same; with free cores (a GPU server) async reads slower",
                    SOME_FREE: "this run had some free cores, between the two"}[cls]
            note = (f"{kind}: the async delivery row depends on the cores ({seen}): with a "
                    f"core free for it, each rank's prefetch thread wakes at once, takes the "
                    f"receive lock, then waits for the GIL the step holds, and the event loop "
                    f"cannot receive meanwhile (docs/profiling.md, The regime)")
        elif name.startswith("async step-time inflation") and cls == SHARED:
            note = (f"{kind}: on shared cores ({cores} for {processes} processes) the "
                    f"step-time inflation also counts the cores the other processes took "
                    f"(run queue), not only task sync; the interruption table and the "
                    f"headline's interruption per step separate the two")
        if note is not None:
            row["regime"] = note
            notes.append(note)
    return notes
