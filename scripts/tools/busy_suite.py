"""Run the test suite beside a busy machine, as the project's acceptance does: N CPU-bound
processes and another program holding live names of its own in /dev/shm run while
``.ci/run`` (both parts: three at a time, then the serial tests) runs K times in a row.

    python scripts/tools/busy_suite.py [--hogs 2] [--rounds 3] [--install]
                                       [--logs DIR] [-- PYTEST ARGS...]

Without ``--install`` the suite runs against whatever Python imports (put a checkout first
on PYTHONPATH to test it; subprocesses inherit it). Each round's whole output goes to
``DIR/round<K>.log``; printed per round: its exit status, its duration and pytest's summary
lines (the FAILED/ERROR lines and the final counts of each part). Exits 1 if any round
failed. The hogs and the foreign names' holder (``tests/foreign_names.py``) are ended,
and their names removed, however the script ends (Ctrl-C included).
"""

import argparse
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUMMARY = re.compile(r"^(FAILED|ERROR) |^=* ?\d+ (passed|failed|error|skipped|deselected)"
                     r"|^=* ?no tests ran|^\.ci/run: ")


# A CPU-bound loop that ends once its parent (this script) is gone, however that ended.
HOG = """
import os
parent = os.getppid()
while os.getppid() == parent:
    for _ in range(1_000_000):
        pass
"""


def start_hogs(n):
    return [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(n)]


def start_foreign():
    """The holder of another program's names; returns (process, its paths)."""
    holder = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "foreign_names.py")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([holder.stdout], [], [], 60)
    if not ready:
        holder.kill()
        holder.wait(timeout=10)
        raise SystemExit("tests/foreign_names.py printed no names within 60 s")
    return holder, json.loads(holder.stdout.readline())


def run_round(k, logs, install, pytest_args):
    command = [os.path.join(ROOT, ".ci", "run")] + ([] if install else ["--no-install"])
    log = os.path.join(logs, f"round{k}.log")
    started = time.monotonic()
    with open(log, "w") as out:
        # a session of its own: if this script is stopped, the whole round (pytest and the
        # processes its tests started) is stopped with it
        suite = subprocess.Popen(command + pytest_args, cwd=ROOT, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = suite.wait()
        except BaseException:
            os.killpg(suite.pid, signal.SIGKILL)
            suite.wait()
            raise
    elapsed = time.monotonic() - started
    with open(log) as f:
        summary = [line.rstrip() for line in f if SUMMARY.search(line)]
    return rc, elapsed, log, summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hogs", type=int, default=2, help="CPU-bound processes (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of .ci/run (default 3)")
    parser.add_argument("--install", action="store_true",
                        help="let .ci/run pip-install the checkout first")
    parser.add_argument("--logs", help="directory for round<K>.log (default: a new temp dir)")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to both parts")
    args = parser.parse_args(argv)
    # SIGTERM (timeout, kill) ends it through the finally below, like Ctrl-C
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    logs = args.logs or tempfile.mkdtemp(prefix="busy_suite-")
    os.makedirs(logs, exist_ok=True)
    hogs, holder, foreign = [], None, []
    failed, missing = 0, []
    try:
        hogs = start_hogs(args.hogs)
        holder, foreign = start_foreign()
        print(f"{args.hogs} CPU hogs (pids {[h.pid for h in hogs]}); foreign names held by "
              f"pid {holder.pid}: {foreign}; logs in {logs}", flush=True)
        for k in range(1, args.rounds + 1):
            rc, elapsed, log, summary = run_round(k, logs, args.install, args.pytest_args)
            failed += rc != 0
            print(f"round {k}: exit {rc} in {elapsed:.0f} s ({log})", flush=True)
            for line in summary:
                print("    " + line, flush=True)
        missing = [p for p in foreign if not os.path.lexists(p)]
        if missing:
            print(f"the suite removed another program's names: {missing}")
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(timeout=10)
        if holder is not None:
            holder.stdin.close()
            try:
                holder.wait(timeout=30)
            except subprocess.TimeoutExpired:
                holder.kill()
                holder.wait(timeout=10)
            for path in foreign:
                if os.path.lexists(path):
                    os.unlink(path)
    print(f"{args.rounds - failed} of {args.rounds} rounds passed")
    return 1 if failed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
