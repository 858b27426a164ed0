"""Check the profile's GIL-wait measurement against a thread that holds the GIL for known times.

    python scripts/tools/gil_wait_check.py [--steps 300] [--step-ms 2] [--hold-ms 1] [--gap-ms 3]

For each step kind (python, and paddle when installed) the main thread runs calibrated model
steps under ``ThreadInterruption`` (what ``fastdeploy-sync profile`` measures around every
model step), first alone, then with a *holder* thread that sleeps ``--gap-ms`` and then
spins in pure Python for ``--hold-ms``, over and over: while it spins it holds the GIL, and
its own CPU clock says for how long. Printed per step kind and case: the interruption per
step (off-CPU, run queue, GIL wait, other, switches) and the holder's total GIL holding time
beside the total GIL wait measured in the main thread.

What to expect: alone, GIL wait 0; with the holder, the holding time between the measured
lower and upper bounds, both close to it on an idle machine; when the cores are busy the
lower bound falls (a GIL waiter that finds the cores taken waits in the run queue) and the
upper one rises (it holds the other processes' preemptions too). The python step can only
lose the GIL at the interpreter's switch interval (5 ms), the paddle step at every op.
"""

import argparse
import importlib.util
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from fastdeploy_sync.profiling.interruption import ThreadInterruption  # noqa: E402
from fastdeploy_sync.profiling.workload import ModelStep  # noqa: E402


def holder(stop, hold_ms, gap_ms, held):
    """Sleep (GIL released), then spin in Python for ``hold_ms`` (GIL held); repeat."""
    while not stop.is_set():
        time.sleep(gap_ms / 1000)
        c0 = time.thread_time_ns()
        end = time.perf_counter_ns() + hold_ms * 1e6
        while time.perf_counter_ns() < end:
            pass
        held.append(time.thread_time_ns() - c0)


def measure(model, steps, hold_ms=None, gap_ms=None):
    meter = ThreadInterruption(steps)
    stop, held = threading.Event(), []
    thread = None
    if hold_ms:
        thread = threading.Thread(target=holder, args=(stop, hold_ms, gap_ms, held))
        thread.start()
    try:
        for _ in range(steps):
            meter.begin()
            model()
            meter.end()
    finally:
        stop.set()
        if thread is not None:
            thread.join(timeout=10)
        meter.close()
    return meter.arrays(), sum(held)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--hold-ms", type=float, default=1.0)
    ap.add_argument("--gap-ms", type=float, default=3.0)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    kinds = ["python"] + (["paddle"] if importlib.util.find_spec("paddle") else [])
    print(f"{args.steps} steps of {args.step_ms:g} ms per case; holder: {args.hold_ms:g} ms "
          f"holding the GIL after every {args.gap_ms:g} ms asleep; per step means, us")
    for kind in kinds:
        model = ModelStep(kind, args.step_ms)
        model.calibrate()
        for label, hold in (("alone", None), ("with the holder", args.hold_ms)):
            a, held_ns = measure(model, args.steps, hold, args.gap_ms)
            mean = {k: (v.mean() / 1e3 if v is not None else float("nan")) for k, v in a.items()}
            line = (f"{kind:<7}{label:<16} wall {mean['wall_ns']:8.1f}  off-CPU "
                    f"{mean['off_cpu_ns']:7.1f}  run queue {mean['runq_ns']:7.1f}  GIL wait "
                    f"{mean['gil_ns']:7.1f}  other {mean['other_ns']:6.1f}  switches invol. "
                    f"{a['involuntary'].mean():.2f} vol. {a['voluntary'].mean():.2f}")
            if hold:
                low, high = a["gil_ns"].sum(), a["gil_upper_ns"].sum()
                line += (f"\n{'':<23}holder held the GIL {held_ns / 1e6:.1f} ms; GIL wait "
                         f"measured {low / 1e6:.1f} ms (lower bound, {low / held_ns:.2f}x) to "
                         f"{high / 1e6:.1f} ms (upper bound, {high / held_ns:.2f}x)")
            print(line)


if __name__ == "__main__":
    main()
