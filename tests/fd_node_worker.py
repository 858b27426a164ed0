"""One TP rank of a FastDeploy worker group on a simulated node (run by
tests/integration/test_fastdeploy_multinode.py inside its own mount and UTS namespace, with a private
/dev/shm and /tmp): paddle.distributed over gloo on 127.0.0.1, the drop-in on a tcp
address, FastDeploy's ``nnode > 1`` loop (testing/fd_loops.py, ``multi_node=True``) with
``paddle.distributed.barrier`` as the TP barrier.

    python3 tests/fd_node_worker.py '<json: see main()>'

Prints one line ``RESULT <json>``: ``{"ok": true, "coordinator": ..., "node": hostname,
"calls": [[step, call, ids], ...]}`` or ``{"ok": false, "error": traceback}``.
"""

import json
import os
import socket
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fastdeploy_sync.testing.fd_loops import ids_of, run_loop, sync_env  # noqa: E402


class PaddleBarrier:
    """FastDeploy's TP barrier across nodes: ``paddle.distributed.barrier(group)``."""

    def __init__(self, dist, group):
        self._dist, self._group = dist, group

    def wait(self, timeout=None):
        self._dist.barrier(self._group)


class LocalFlag:
    value = 0  # FastDeploy's node-local exist_task_signal: never set when nnode > 1


def main():
    a = json.loads(sys.argv[1])
    world_rank, endpoints = a["world_rank"], a["endpoints"]
    tp, dp, rank = a["tp"], a["dp"], a["rank"]
    sync_env(a["sync"])
    os.environ.update(PADDLE_TRAINER_ID=str(world_rank), PADDLE_TRAINERS_NUM=str(len(endpoints)),
                      PADDLE_TRAINER_ENDPOINTS=",".join(endpoints),
                      PADDLE_CURRENT_ENDPOINT=endpoints[world_rank], PADDLE_DISTRI_BACKEND="gloo")
    out = {"ok": False, "node": socket.gethostname(), "rank": rank, "dp": dp}
    q = None
    try:
        import paddle
        import paddle.distributed as dist

        # imported before the group is made: from the group's construction on, every
        # collective (the drop-in's first one included) waits at most gloo's own 30 s for
        # the other ranks, and this import, after the group, made a rank that a loaded
        # machine slowed arrive late enough for the others to time out. init_parallel_env
        # waits for every rank however late it comes.
        from fastdeploy_sync.fastdeploy import EngineWorkerQueue

        paddle.set_device("cpu")
        dist.init_parallel_env()
        world = dist.get_world_size()
        # FastDeploy's tp_group: one paddle group per DP group (every rank makes all, in order)
        groups = [dist.new_group(list(range(d * tp, (d + 1) * tp))) if world > tp else None
                  for d in range(world // tp)]
        barrier = PaddleBarrier(dist, groups[dp])
        q = EngineWorkerQueue(address=tuple(a["address"]), num_client=tp, client_id=rank,
                              local_data_parallel_id=dp, name=a["name"], connect_timeout=60)
        calls, steps = run_loop(q, a["shape"], tp, rank, barrier, LocalFlag(),
                                multi_node=True, deadline_s=a.get("deadline_s", 120),
                                step_ms=a.get("step_ms", 0.0))
        out["coordinator"] = q.coordinator  # known once the rank joined (its first read)
        out.update(ok=True, calls=[[s, c, ids_of(t)] for s, c, t in calls], steps=steps)
    except BaseException:
        out["error"] = traceback.format_exc()
    finally:
        if q is not None:
            q.cleanup()
    print("RESULT " + json.dumps(out), flush=True)
    time.sleep(0.5)  # let gloo peers finish their last collective before this rank exits


if __name__ == "__main__":
    main()
