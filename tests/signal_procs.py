"""Processes the signal tests run: ``python signal_procs.py ROLE NAME ...``.

``engine NAME N PAUSE_S``: a TaskQueue(NAME, tp_size=2) that puts N batches (``(i,
array)``), pausing PAUSE_S between them so that the ranks block in their waits, prints
``ready`` first and ``done`` once every batch was consumed, then waits for the ranks' BYE.

``rankR NAME N HOW``: a TaskClient of that group whose event loop (rank 0:
``wait_for_tasks``; every rank: ``barrier``, ``get_tasks``) takes N batches, with SIGUSR1
taken by ``HOW``: ``handler`` (a Python handler that counts) or ``faulthandler``
(``faulthandler.register``); prints ``ready``, then ``took <ids> signals <count>``.

``idleR NAME``: ``install_signal_cleanup()``, then a TaskClient whose main thread blocks
for good: rank 0 in ``wait_for_tasks`` (nothing is ever put), rank 1 in the async
``barrier``; prints ``ready``. SIGTERM must end it with status 143 and no traceback.
"""

import faulthandler
import os
import signal
import sys
import time


def engine(name, n, pause):
    import numpy as np

    from fastdeploy_sync import TaskQueue
    from workers import wait_until

    with TaskQueue(name, 2) as queue:
        print("ready", flush=True)
        for i in range(n):
            queue.put_tasks((i, np.arange(i, i + 64)), timeout=60)
            time.sleep(pause)
        # not checked here: the test judges what each rank took, and "done" arrives anyway
        wait_until(lambda: not queue.num_tasks(), timeout=60, interval=0.01)
        print("done", flush=True)
        wait_until(lambda: all(r["state"] != "connected" for r in queue.ranks()), timeout=60,
                   interval=0.01)  # the ranks' BYEs


def rank(r, name, n, how):
    from fastdeploy_sync import TaskClient

    count = [0]
    if how == "handler":
        signal.signal(signal.SIGUSR1, lambda signum, frame: count.__setitem__(0, count[0] + 1))
    else:
        # this thread's stack only: with all_threads=True, dumps at this rate read other
        # threads' frames while they run and crash CPython 3.11 itself, with or without
        # fastdeploy_sync (faulthandler's own caveat); the wait sees the same signal
        # ignored underneath: unregister() restores it, so a late signal cannot kill us
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        faulthandler.register(signal.SIGUSR1, file=open(os.devnull, "w"), all_threads=False)
    took = []
    with TaskClient(name, 2, r) as client:
        print("ready", flush=True)
        deadline = time.monotonic() + 60
        while len(took) < n and time.monotonic() < deadline:
            if r == 0:
                client.wait_for_tasks(0.05)
            client.barrier(timeout=60)
            tasks, _ = client.get_tasks()
            took.extend(i for i, ids in tasks if ids[0] == i)
    if how == "faulthandler":
        faulthandler.unregister(signal.SIGUSR1)  # back to SIG_IGN
    else:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the test may still be sending
    print("took", ",".join(map(str, took)), "signals", count[0], flush=True)


def idle(r, name):
    from fastdeploy_sync import TaskClient, install_signal_cleanup

    install_signal_cleanup()
    with TaskClient(name, 2, r) as client:
        print("ready", flush=True)
        while True:
            if r == 0:
                client.wait_for_tasks(60)
            else:
                client.barrier(timeout=60)


if __name__ == "__main__":
    role, name = sys.argv[1], sys.argv[2]
    if role == "engine":
        engine(name, int(sys.argv[3]), float(sys.argv[4]))
    elif role.startswith("rank"):
        rank(int(role[4:]), name, int(sys.argv[3]), sys.argv[4])
    else:
        idle(int(role[4:]), name)
