"""``fastdeploy-sync profile``: the subcommand's parser (``add_parser``) and what it runs.

Building the parser imports only ``options`` (no process, no framework, no tqdm or
matplotlib), so that ``fastdeploy-sync``'s other commands stay cheap. Running the command
imports the runner and the report, tqdm for the progress bar and matplotlib for ``--plot``
when they are installed (the package's ``profile`` extra); without them the profile runs
all the same, without a progress bar, and ``--plot`` is refused in one line (exit status 2
after the rest of the run).

Exit status: 0 done; 1 a mode lost, duplicated or misordered a batch, or a profiled process
failed; 2 a usage error (a bad option, no GPU for ``--step gpu``, ``--plot`` without
matplotlib), in one line. Timing targets never set the exit status.
"""

import argparse
import json
import sys

from .options import (
    DEFAULT_PLACEMENTS,
    MODES,
    STEP_KINDS,
    TOKEN_KINDS,
    ProfileOptions,
    default_step_kinds,
)

__all__ = ["add_parser", "run", "EXTRA"]

PROG = "fastdeploy-sync profile"
EXTRA = "pip install 'fastdeploy_sync[profile]'"  # what installs tqdm and matplotlib


def _step_kinds(text):
    """``--step python,paddle`` -> ["python", "paddle"]; checked by ProfileOptions.validate."""
    return [k.strip() for k in text.split(",") if k.strip()]


def _cpu_list(text):
    """``--cpus 0,1,2`` -> [0, 1, 2]; the count and availability are checked with the
    other options (``ProfileOptions.validate``)."""
    try:
        cpus = [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated core numbers, "
                                         f"e.g. 0,1,2") from None
    if any(c < 0 for c in cpus):
        raise argparse.ArgumentTypeError(f"{text!r}: core numbers are >= 0")
    return cpus


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``profile`` subcommand to ``sub`` (an argparse subparsers object)."""
    d = ProfileOptions()
    p = sub.add_parser(
        "profile", help="measure task sync's cost per worker step, side by side with a "
                        "FastDeploy-style manager queue",
        description="Start an engine and --tp worker processes running a FastDeploy-shaped "
                    "loop, for a GIL-holding (python) and a GIL-releasing (paddle) model step, "
                    "or a decode step on a GPU (gpu); measure per step the whole cost of task "
                    "sync (the step-time inflation against the same loop without task sync, "
                    "and the interruption of rank 0's event loop: critical path + GIL wait "
                    "added), each against the FastDeploy-style queue; the critical path "
                    "(check + barrier + take), the interruption of the model step (off-CPU "
                    "time, run-queue wait, GIL wait, context switches of the event-loop "
                    "thread), delivery and idle CPU, in paired interleaved rounds; say the "
                    "regime (cores against processes and threads, pinning, GPU); check every "
                    "rank took the same batches. Targets (their own for TP=2 and TP=8) get an "
                    "interval from a bootstrap over the rounds and say met or MISSED only "
                    "where it excludes the target, else inconclusive. Exit status 1 if a mode "
                    "lost, duplicated or misordered a batch; timing targets never set the "
                    "exit status. --steps, --idle-steps, --step and --placements scale the "
                    "run time; docs/profiling.md gives measured run times. Progress bar and "
                    f"--plot need the profile extra ({EXTRA}).")
    p.add_argument("--mode", default=d.mode, choices=["all", *MODES],
                   help="all: every mode, interleaved, same load (default)")
    p.add_argument("--tp", type=int, default=d.tp,
                   help=f"TP ranks (default {d.tp}; 2 and 8 are reference configurations)")
    p.add_argument("--step", type=_step_kinds, default=None, metavar="KIND[,KIND]",
                   help=f"simulated model step kinds, comma-separated, of {', '.join(STEP_KINDS)} "
                        f"(default python,paddle; python alone where paddle is not installed; "
                        f"gpu needs a CUDA build of paddlepaddle or torch and a GPU)")
    p.add_argument("--gpu-backend", default=d.gpu_backend, metavar="NAME",
                   help="the gpu step's framework: auto (paddle if it has a GPU, else torch; "
                        "the default), paddle, torch, cpu-standin (no GPU: numpy on the CPU, "
                        "to rehearse a run), or MODULE:ATTR, a backend object of your own "
                        "(docs/profiling.md)")
    p.add_argument("--step-ms", type=float, default=d.step_ms,
                   help=f"model step length, calibrated once (default {d.step_ms:g})")
    p.add_argument("--rate", type=float, default=d.rate,
                   help=f"batches per second the engine puts (default {d.rate:g})")
    p.add_argument("--batch", type=int, default=d.batch, help=f"requests per batch (default {d.batch})")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len,
                   help=f"token ids per request (default {d.prompt_len})")
    p.add_argument("--tokens", default=d.tokens, choices=TOKEN_KINDS,
                   help="token ids as int64 numpy arrays (default) or Python lists")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, default=d.steps,
                        help=f"load-phase steps per mode and step kind (default {d.steps})")
    length.add_argument("--duration", type=float, default=None,
                        help="load-phase seconds per mode at the nominal step length "
                             "(instead of --steps)")
    p.add_argument("--rounds", type=int, default=d.rounds,
                   help=f"paired, interleaved rounds the steps are split into; intervals need "
                        f"at least 5 (default {d.rounds})")
    p.add_argument("--placements", type=int, default=None,
                   help=f"blocks the rounds are split into, each run by freshly started "
                        f"engine and worker processes; the intervals resample them too, so "
                        f"what lasts a process lifetime (where the OS placed the ranks) "
                        f"widens an interval instead of flipping a verdict between runs; "
                        f"1 to --rounds (default {DEFAULT_PLACEMENTS}, 1 with one round)")
    p.add_argument("--idle-steps", type=int, default=d.idle_steps,
                   help=f"idle-phase iterations per mode, split across the rounds, 0 to skip "
                        f"(default {d.idle_steps})")
    p.add_argument("--max-inflight", type=int, default=d.max_inflight,
                   help=f"TaskQueue bound for async/sync (default {d.max_inflight}; the "
                        f"fd-manager queue holds one batch)")
    p.add_argument("--cpus", type=_cpu_list, default=None, metavar="E,R0,R1,...",
                   help="pin the engine and each rank to one core each (os.sched_setaffinity): "
                        "--tp + 1 core numbers, engine first; the fd-manager's server process "
                        "shares the engine's core. Default: not pinned")
    p.add_argument("--json", metavar="FILE", help="write every figure and the parameters")
    p.add_argument("--plot", metavar="FILE.png",
                   help=f"write the figures as a PNG (needs matplotlib: {EXTRA})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)
    return p


def _missing(module) -> bool:
    """True if ``module`` cannot be imported here (imports it otherwise)."""
    try:
        __import__(module)
    except ImportError:
        return True
    return False


def run(args) -> int:
    """Run the profile ``args`` describe, print the report, write ``--json``/``--plot``;
    return the exit status (module docstring)."""
    steps = args.steps
    if args.duration is not None:
        steps = max(args.rounds, round(args.duration * 1000 / args.step_ms))
    if args.step is None and "paddle" not in default_step_kinds():
        print(f"{PROG}: paddlepaddle is not installed: profiling the python step only (pip "
              f"install paddlepaddle adds the GIL-releasing paddle step)", file=sys.stderr)
    options = ProfileOptions(mode=args.mode, tp=args.tp, step_kinds=args.step,
                             step_ms=args.step_ms, rate=args.rate, batch=args.batch,
                             prompt_len=args.prompt_len, tokens=args.tokens, steps=steps,
                             rounds=args.rounds, placements=args.placements,
                             idle_steps=args.idle_steps, max_inflight=args.max_inflight,
                             cpus=args.cpus, gpu_backend=args.gpu_backend)
    try:
        options.validate()
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    no_plot = None
    if args.plot and _missing("matplotlib"):
        no_plot = (f"{PROG}: --plot needs matplotlib, which is not installed ({EXTRA}); "
                   f"the profile runs without the plot")
        print(no_plot, file=sys.stderr)

    # Imported here: they import the library's engine and workers.
    from . import report, terminal
    from .runner import ProfileError, run_profile

    try:
        with _progress_bar(args.no_progress) as bar:
            raw = run_profile(options, bar)
    except ProfileError as exc:
        print(f"{PROG} failed: {exc}", file=sys.stderr)
        return 1
    summary = report.summarize(raw)
    print(terminal.format_table(summary))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
        print(f"figures, definitions and parameters: {args.json}")
    if no_plot is not None:
        print(no_plot.replace("the profile runs without the plot", f"{args.plot} not written"),
              file=sys.stderr)
        return 2
    if args.plot:
        from .plot import save

        save(summary, args.plot)
        print(f"plot: {args.plot}")
    return 0 if summary["correct"] else 1


class _NoBar:
    """Stands in for tqdm where it is not installed or not wanted: shows nothing."""

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _progress_bar(disabled):
    """A tqdm bar (a context manager), or ``_NoBar`` when ``disabled`` or without tqdm
    (said once on stderr)."""
    if disabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        print(f"{PROG}: no progress bar: tqdm is not installed ({EXTRA})", file=sys.stderr)
        return _NoBar()
    return tqdm(unit="step", dynamic_ncols=True)
