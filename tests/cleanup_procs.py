"""Processes the clean-up tests signal and kill: ``python cleanup_procs.py ROLE NAME [--handler]``.

ROLE ``engine``: a TaskQueue(NAME, tp_size=2) that puts one small and one 2 MiB batch (the
large one goes through a shared-memory segment) and waits. ROLE ``rank0``/``rank1``: a
TaskClient of that group that receives and never takes, so the engine keeps both batches.
Each prints ``ready`` once built and then sleeps in its main thread until signalled (or
for 120 s). ``--handler`` calls ``install_signal_cleanup()`` first.
"""

import sys
import time


def main():
    role, name = sys.argv[1], sys.argv[2]
    if "--handler" in sys.argv:
        from fastdeploy_sync import install_signal_cleanup

        install_signal_cleanup()
    import numpy as np

    from fastdeploy_sync import TaskClient, TaskQueue

    if role == "engine":
        with TaskQueue(name, 2) as queue:
            queue.put_tasks(["small"], timeout=30)
            queue.put_tasks([np.ones(1 << 18, dtype=np.int64)], timeout=30)  # 2 MiB
            print("ready", flush=True)
            time.sleep(120)
    else:
        rank = int(role[len("rank"):])
        with TaskClient(name, 2, rank) as client:
            print("ready", flush=True)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                time.sleep(0.05)
            client.close()


if __name__ == "__main__":
    main()
