#!/usr/bin/env python3
"""How long ``TaskQueue.close(timeout)`` takes after a burst of client lives, and whether
it freed the queue's names.

    python scripts/tools/close_backlog.py --lives 2000 --timeout 1

One engine and, in the same process, ``--lives`` ``TaskClient`` build/close cycles as fast
as they go (tp_size 1): each new client is a new worker group, whose HELLO makes the
engine's I/O thread retire the previous group and create a ring, so that thread falls
behind and holds a backlog when ``close()`` is called. Printed per run: the cycles' time,
how long ``close()`` took, and what of the queue is left in ``/dev/shm`` and its ipc
directory afterwards (nothing is the expected result). Timings only: nothing is asserted.
"""

import argparse
import glob
import logging
import os
import time
import uuid


def main():
    from fastdeploy_sync import TaskClient, TaskQueue, envs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lives", type=int, default=2000)
    parser.add_argument("--timeout", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    logging.disable(logging.INFO)  # one line per retired group otherwise
    for run in range(args.runs):
        name = "cb" + uuid.uuid4().hex[:10]
        engine = TaskQueue(name, 1)
        started = time.monotonic()
        for _ in range(args.lives):
            TaskClient(name, 1, 0).close()
        cycles = time.monotonic() - started
        started = time.monotonic()
        unconsumed = engine.close(timeout=args.timeout)
        took = time.monotonic() - started
        left = (glob.glob(f"/dev/shm/*{name}*")
                + glob.glob(os.path.join(envs.ipc_dir(), f"fdsync-{name}-*")))
        print(f"run {run}: {args.lives} client lives in {cycles:.1f} s; close(timeout="
              f"{args.timeout:g}) took {took:.2f} s, returned {unconsumed}; left behind: "
              f"{len(left)} name(s)", flush=True)


if __name__ == "__main__":
    main()
