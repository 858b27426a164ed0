"""One engine and its TP workers on a node whose /dev/shm is small or fills up, run by
tests/integration/test_small_shm.py inside a private mount namespace (``unshare -m``) with a small
tmpfs over /dev/shm (Docker gives containers 64 MiB). Prints one JSON line: what every
rank took (batch ids and content digests, in order), the engine's shared-memory
counters, what it logged, and any error. Exit status 0 unless the scenario itself broke.

    python tests/small_shm_scenario.py SCENARIO NAME

Scenarios (the batch sizes are chosen against a 64 MiB /dev/shm):
  larger-than-room  batches of 2, 24, 48 and 100 MiB: the pool (sized down to what
                    fits) takes the small ones, the rest must arrive over the socket
  no-pool           /dev/shm too small for any pool (run with a 1 MiB tmpfs)
  fills-mid-run     batches through the pool, then another process fills /dev/shm, then
                    more batches of every size, then it frees the room again
"""

import json
import logging
import multiprocessing
import os
import sys
import time
import traceback

import numpy as np
import xxhash

SPAWN = multiprocessing.get_context("spawn")
MiB = 1 << 20
TP = 2


def batch(i, mb):
    """Batch ``i``: ``mb`` MiB of float32 whose values depend on ``i``."""
    n = int(mb * MiB) // 4
    return i, [{"request_id": f"r{i}", "features": np.full(n, i, dtype=np.float32)},
               {"request_id": f"r{i}b", "ids": np.arange(300, dtype=np.int64) + i}]


def digest(tasks):
    i, requests = tasks
    return [i, xxhash.xxh3_64_hexdigest(requests[0]["features"].tobytes()),
            xxhash.xxh3_64_hexdigest(requests[1]["ids"].tobytes())]


def rank_main(name, rank, n, out, leave):
    """Take ``n`` batches; close only once ``leave`` is set (a rank that closes says BYE,
    and the engine retires the group and its pool: the counters are read first)."""
    from fastdeploy_sync import TaskClient

    try:
        got = []
        with TaskClient(name, TP, rank) as client:
            out.put(("ready", rank, None))
            deadline = time.monotonic() + 120
            while len(got) < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {rank} took {len(got)} of {n}")
                tasks = client.sync_step(timeout=60)
                while tasks:
                    got.append(digest(tasks.pop(0)))
                time.sleep(0.001)
            out.put(("took", rank, got))
            leave.wait(60)
    except BaseException as exc:
        out.put(("error", rank, f"{exc!r}\n{traceback.format_exc()}"))


def fill(directory, keep_free):
    """Fill the filesystem of ``directory`` until only ``keep_free`` bytes are left (as
    another process of the node would); return the file's path (written through
    write(), so it holds real pages)."""
    target = os.path.join(directory, "filler")
    st = os.statvfs(directory)
    size = st.f_bavail * st.f_frsize - keep_free
    with open(target, "wb") as f:
        chunk = bytes(MiB)
        while size > 0:
            f.write(chunk[:min(size, MiB)])
            size -= MiB
    return target


class Captured(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def main(scenario, name):
    from fastdeploy_sync import TaskQueue
    from fastdeploy_sync.names import SHM_DIR

    captured = Captured()
    logging.getLogger("fastdeploy_sync").addHandler(captured)
    logging.getLogger("fastdeploy_sync").setLevel(logging.INFO)
    if scenario == "larger-than-room":
        plan = [(0, 2), (1, 24), (2, 48), (3, 100), (4, 2), (5, 24)]
    elif scenario == "no-pool":
        plan = [(0, 2), (1, 8), (2, 2)]
    elif scenario == "fills-mid-run":
        plan = [(0, 2), (1, 4), "fill", (2, 2), (3, 4), (4, 24), (5, 48), (6, 2), "free",
                (7, 2), (8, 24)]
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    batches = [step for step in plan if isinstance(step, tuple)]
    out = SPAWN.Queue()
    leave = SPAWN.Event()
    result = {"scenario": scenario, "shm_size_mib": os.statvfs(SHM_DIR).f_blocks
              * os.statvfs(SHM_DIR).f_frsize // MiB, "error": None}
    filler = None
    with TaskQueue(name, TP, max_inflight=2) as queue:
        procs = [SPAWN.Process(target=rank_main, args=(name, r, len(batches), out, leave),
                               daemon=True)
                 for r in range(TP)]
        for p in procs:
            p.start()
        try:
            ready = 0
            while ready < TP:
                kind, rank, payload = out.get(timeout=60)
                if kind == "error":
                    raise RuntimeError(f"rank {rank}: {payload}")
                ready += kind == "ready"
            for step in plan:
                if step == "fill":
                    # wait until the ranks took what was put: then fill what is left
                    while queue.num_tasks():
                        time.sleep(0.001)
                    filler = fill(SHM_DIR, keep_free=MiB)
                    continue
                if step == "free":
                    os.unlink(filler)
                    filler = None
                    continue
                i, mb = step
                queue.put_tasks(batch(i, mb), timeout=60)
            took = {}
            while len(took) < TP:
                kind, rank, payload = out.get(timeout=120)
                if kind == "error":
                    raise RuntimeError(f"rank {rank}: {payload}")
                if kind == "took":
                    took[rank] = payload
            result["took"] = {str(r): took[r] for r in sorted(took)}
        except BaseException as exc:
            result["error"] = f"{exc!r}\n{traceback.format_exc()}"
        finally:
            stats = queue.stats()
            result["stats"] = {k: v for k, v in stats.items() if k.startswith("shm_")}
            leave.set()
            if filler:
                os.unlink(filler)
    for p in procs:
        p.join(timeout=20)
        if p.is_alive():
            p.kill()
    result["exitcodes"] = [p.exitcode for p in procs]
    result["expected"] = [digest(batch(i, mb)) for i, mb in batches]
    result["log"] = captured.lines
    result["left"] = sorted(os.listdir(SHM_DIR))
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
