#!/usr/bin/env python3
"""Everything the GPU-server figures need, in one command, with one report.

Runs, one after another, each as its own process with a time limit:

1. ``fastdeploy-sync profile --step python,gpu --tp 2`` (JSON kept),
2. the same at ``--tp 8``,
3. ``bench_sync.py`` (the critical-path calls side by side with the FastDeploy-style queue),
4. ``put_floor.py`` (put -> every rank holds a batch, beside the floor),
5. ``bench_idle.py --sections 1`` (FastDeploy's 1 ms idle loop),

then writes ``DIR/report.md`` (the tables README and docs/performance.md quote, the GPU-server
targets checked against the profiles' figures, each benchmark's printed output) and
``DIR/report.json`` (the machine, every command with its exit status and run time, the
profiles' JSON, the printed outputs). A step that fails or runs past its limit is reported
as such and the next one runs. Asserts nothing; its exit status is 1 when a profile found a
batch lost, duplicated or misordered (the profile's own exit status 1), else 0.

``--dry-run`` runs the same suite at small sizes with the ``cpu-standin`` GPU backend
(numpy on the CPU): a rehearsal of the plumbing and the report on a machine without a GPU;
its figures describe that CPU and are marked so in the report.

    python scripts/benchmarks/gpu_server.py --out DIR [--dry-run] [--gpu-backend NAME]
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# The GPU-server targets (docs/performance.md): whole cost per step at least this many
# times below the FastDeploy-style queue's, step inflation and GIL wait added at most these
# percentages of the step, and TP=8's critical path at most this multiple of TP=2's.
TARGETS = {"interruption_x_lower": 100.0, "inflation_pct": 1.0, "gil_wait_added_pct": 0.5,
           "tp8_over_tp2_critical_path": 2.0}

# (name, command, time limit in seconds), full size and dry run. The full run's limits add
# up to under 8 minutes. The dry run takes about a minute on two quiet cores; its limits
# are generous because a rehearsal on a busy machine should finish rather than be cut.
def suite(dry_run: bool, backend: str, out: str):
    profile = [sys.executable, "-m", "fastdeploy_sync.cli", "profile", "--no-progress",
               "--step", "python,gpu", "--gpu-backend", backend]
    if dry_run:
        profile += ["--steps", "30", "--rounds", "5", "--placements", "1",
                    "--idle-steps", "20"]
    bench = os.path.join(HERE, "bench_sync.py")
    floor = os.path.join(HERE, "put_floor.py")
    idle = os.path.join(HERE, "bench_idle.py")
    if dry_run:
        return [
            ("profile_tp2", profile + ["--tp", "2", "--json", f"{out}/profile_tp2.json"], 180),
            ("profile_tp8", profile + ["--tp", "8", "--json", f"{out}/profile_tp8.json"], 240),
            ("bench_sync", [sys.executable, bench, "--iters", "200", "--sections", "1,2,3"],
             150),
            ("put_floor", [sys.executable, floor, "--puts", "20", "--rounds", "1"], 90),
            ("bench_idle", [sys.executable, idle, "--seconds", "1", "--sections", "1"], 90),
        ]
    return [
        ("profile_tp2", profile + ["--tp", "2", "--json", f"{out}/profile_tp2.json"], 110),
        ("profile_tp8", profile + ["--tp", "8", "--json", f"{out}/profile_tp8.json"], 130),
        ("bench_sync", [sys.executable, bench, "--iters", "2000"], 110),
        ("put_floor", [sys.executable, floor, "--puts", "200", "--rounds", "2"], 60),
        ("bench_idle", [sys.executable, idle, "--seconds", "5", "--sections", "1"], 50),
    ]


def run_step(name, cmd, limit, out):
    """Run ``cmd`` in its own process group for at most ``limit`` seconds; its output goes to
    ``out/NAME.txt``. Returns the step's record. On time-out the whole group is killed."""
    started = time.monotonic()
    path = os.path.join(out, f"{name}.txt")
    print(f"[{name}] {' '.join(cmd[1:] if cmd[0] == sys.executable else cmd)}", flush=True)
    with open(path, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            rc, timed_out = proc.returncode, True
    elapsed = time.monotonic() - started
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    state = "timed out" if timed_out else f"exit {rc}"
    print(f"[{name}] {state} after {elapsed:.0f} s (limit {limit} s)", flush=True)
    return {"name": name, "command": cmd, "limit_s": limit, "elapsed_s": round(elapsed, 1),
            "returncode": rc, "timed_out": timed_out, "output": text}


def machine():
    """What the figures were measured on: CPUs, load, Python, frameworks, GPUs."""
    info = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "platform": platform.platform(),
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)), "load_average": os.getloadavg()}
    for dist in ("torch", "paddlepaddle", "paddlepaddle-gpu", "pyzmq", "numpy"):
        try:  # the installed version, without importing the framework
            info[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            info[dist] = None
    if shutil.which("nvidia-smi"):
        try:
            info["gpus"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                 "--format=csv,noheader"], capture_output=True, text=True,
                timeout=20).stdout.strip().splitlines()
        except (OSError, subprocess.TimeoutExpired):
            info["gpus"] = None
    else:
        info["gpus"] = []
    return info


def _fig(d):
    """A headline figure ``{"value", "interval"}`` as text."""
    if not d:
        return "-"
    lo, hi = (d.get("interval") or [None, None])

    def fmt(v):
        return "unbounded" if v is None else f"{v:,.3g}"
    return f"{fmt(d.get('value'))} [{fmt(lo)}, {fmt(hi)}]"


def headline_table(profile):
    """Markdown rows of the profile's headline: per step kind and mode, the inflation, the
    interruption per step and the critical path p50, each with its "x lower"."""
    rows = ["| step | mode | inflation % | x lower | interruption us | x lower "
            "| critical path p50 us | x lower |", "|---|---|---|---|---|---|---|---|"]
    for kind, modes in profile.get("headline", {}).items():
        for mode, f in modes.items():
            rows.append(f"| {kind} | {mode} | {_fig(f['inflation_pct'])} "
                        f"| {_fig(f['inflation_vs_fd_manager'])} | {_fig(f['interruption_us'])} "
                        f"| {_fig(f['interruption_vs_fd_manager'])} "
                        f"| {_fig(f['critical_path_p50_us'])} "
                        f"| {_fig(f['critical_path_p50_vs_fd_manager'])} |")
    return rows


def _value(d):
    return None if not d else d.get("value")


def targets(profiles):
    """The GPU-server targets against the gpu step's async figures: one row each with the
    measured value, its interval where there is one, and whether the value meets it."""
    rows = []

    def row(what, tp, measured, interval, threshold, better):
        if measured is None:
            rows.append({"target": what, "tp": tp, "measured": None, "interval": interval,
                         "threshold": threshold, "met": None})
            return
        met = measured >= threshold if better == "above" else measured <= threshold
        rows.append({"target": what, "tp": tp, "measured": measured, "interval": interval,
                     "threshold": threshold, "met": met})

    crit = {}
    for tp, profile in profiles.items():
        head = profile.get("headline", {}).get("gpu", {}).get("async")
        kind = profile.get("step_kinds", {}).get("gpu", {}).get("modes", {}).get("async")
        if head is None or kind is None:
            continue
        ratio = head.get("interruption_vs_fd_manager")
        row("whole cost per step >= 100x below fd-manager's", tp, _value(ratio),
            (ratio or {}).get("interval"), TARGETS["interruption_x_lower"], "above")
        row("step inflation <= +1 %", tp, _value(head["inflation_pct"]),
            head["inflation_pct"].get("interval"), TARGETS["inflation_pct"], "below")
        gil = kind["interruption"].get("gil_wait_added_upper_pct")
        row("GIL wait added <= 0.5 % of the step (upper bound)", tp, _value(gil),
            (gil or {}).get("interval"), TARGETS["gil_wait_added_pct"], "below")
        crit[tp] = _value(head["critical_path_p50_us"])
    if crit.get(2) and crit.get(8) is not None:
        row("TP=8 critical path p50 <= 2x TP=2's", "8/2", crit[8] / crit[2], None,
            TARGETS["tp8_over_tp2_critical_path"], "below")
    return rows


def report_md(info, steps, profiles, rows, dry_run):
    lines = ["# GPU-server run", ""]
    if dry_run:
        lines += ["**Dry run**: small sizes, `--gpu-backend cpu-standin` (numpy on the CPU). "
                  "These figures describe this machine's CPU, not a GPU.", ""]
    lines += ["## Machine", ""]
    for k, v in info.items():
        lines.append(f"- {k}: {v}")
    lines += ["", "## Steps", "", "| step | status | seconds | limit |", "|---|---|---|---|"]
    for s in steps:
        status = "timed out" if s["timed_out"] else f"exit {s['returncode']}"
        lines.append(f"| {s['name']} | {status} | {s['elapsed_s']} | {s['limit_s']} |")
    lines += ["", "## GPU-server targets (gpu step, async mode)", "",
              "| target | TP | measured | interval | value meets it |", "|---|---|---|---|---|"]
    for r in rows:
        m = "-" if r["measured"] is None else f"{r['measured']:,.3g}"
        iv = "-" if not r["interval"] else "[" + ", ".join(
            "unbounded" if v is None else f"{v:,.3g}" for v in r["interval"]) + "]"
        met = {True: "yes", False: "no", None: "-"}[r["met"]]
        lines.append(f"| {r['target']} | {r['tp']} | {m} | {iv} | {met} |")
    for tp, profile in sorted(profiles.items()):
        lines += ["", f"## Whole cost per step, TP={tp} (fastdeploy-sync profile)", "",
                  "x lower = the FastDeploy-style queue's figure / the mode's, same rounds; "
                  "[95 % interval].", ""]
        lines += headline_table(profile)
        load = profile.get("machine_load", {}).get("lines") or []
        if load:
            lines += [""] + [f"- {x}" for x in load]
    for s in steps:
        lines += ["", f"## {s['name']}: printed output", "", "```", s["output"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for report.md, report.json and "
                    "each step's output")
    ap.add_argument("--dry-run", action="store_true", help="small sizes, cpu-standin "
                    "backend: rehearse on a machine without a GPU")
    ap.add_argument("--gpu-backend", default=None, help="the profile's gpu step backend "
                    "(default auto; cpu-standin with --dry-run)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    backend = args.gpu_backend or ("cpu-standin" if args.dry_run else "auto")
    started = time.monotonic()
    info = machine()
    steps = [run_step(name, cmd, limit, args.out)
             for name, cmd, limit in suite(args.dry_run, backend, args.out)]
    info["load_average_after"] = os.getloadavg()
    info["elapsed_s"] = round(time.monotonic() - started, 1)
    profiles = {}
    for tp in (2, 8):
        path = os.path.join(args.out, f"profile_tp{tp}.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                profiles[tp] = json.load(f)
    rows = targets(profiles)
    with open(os.path.join(args.out, "report.md"), "w", encoding="utf-8") as f:
        f.write(report_md(info, steps, profiles, rows, args.dry_run))
    with open(os.path.join(args.out, "report.json"), "w", encoding="utf-8") as f:
        json.dump({"dry_run": args.dry_run, "gpu_backend": backend, "machine": info,
                   "steps": steps, "targets": rows,
                   "profiles": {str(k): v for k, v in profiles.items()}}, f, indent=1)
    print(f"report: {os.path.join(args.out, 'report.md')} and report.json "
          f"({info['elapsed_s']:.0f} s)")
    lost = any(s["name"].startswith("profile") and s["returncode"] == 1 for s in steps)
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
