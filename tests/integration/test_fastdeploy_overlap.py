"""FastDeploy develop's overlap-scheduler loop (testing/fd_loops.py, shape ``overlap``) over the
drop-in: the queue's ``worker_process_tp_barrier`` is the only TP barrier, there is no idle
branch, an idle step is a no-op, a busy step runs the model's collective. Nothing orders a
slow rank's read of the signal before rank 0's check of the next step, so the drop-in must
make a read that comes early harmless. ``lag`` puts a rank to sleep right after the barrier
on every step (the OS descheduling it there), which makes the race certain instead of rare.

Every rank must take identical batches at identical steps, each once, in order, and no
rank may wait in a collective its peers never enter (the collective's timeout, 5 s here,
would report it). scripts/benchmarks/overlap_dropin_matrix.py runs the full acceptance matrix."""

import threading

import pytest

from conftest import SPAWN
from fastdeploy_sync.fastdeploy import EngineWorkerQueue
from fastdeploy_sync.testing.fd_loops import batches, check_group, engine_loop, ids_of, loop_worker

RESULT_TIMEOUT_S = 90
COLLECTIVE_TIMEOUT_S = 5.0


def run_overlap(name, procs, results, tp, n, *, sync=False, lag=None, step_ms=2.0):
    """The engine loop (wait while exist_tasks(), then put) in a thread, TP ranks in
    processes; develop's ``nnode = (tp + 8) // 8``: the read_finish_flag path at TP=8."""
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=tp,
                               name=name)
    try:
        address = ("0.0.0.0", server.get_server_port())
        collective, signal = SPAWN.Barrier(tp), SPAWN.Value("i", 0)
        for r in range(tp):
            procs(loop_worker, address, "overlap", tp, r, 0, collective, signal, results,
                  sync=sync, name=name, multi_node=(tp + 8) // 8 > 1, step_ms=step_ms,
                  lag=lag, barrier_timeout=COLLECTIVE_TIMEOUT_S, deadline_s=60.0)
        put = batches(0, n)
        errors = []

        def engine():
            client = EngineWorkerQueue(address=address, num_client=tp, client_id=0, name=name)
            try:
                engine_loop(client, put, put_timeout=30)
            except BaseException as exc:  # reported below, with the workers' view
                errors.append(exc)

        thread = threading.Thread(target=engine)
        thread.start()
        reports, failures = {}, []
        for _ in range(tp):
            kind, _, r, payload = results.get(timeout=RESULT_TIMEOUT_S)
            if kind == "ok":
                reports[r] = payload
            else:
                failures.append(f"rank {r}:\n{payload}")
        thread.join(timeout=30)
        assert not failures, "\n".join(failures)
        assert not errors, errors
    finally:
        server.cleanup()
    check_group(reports, tp, 0, ids_of(put))
    return reports


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_overlap_loop_tp2_slow_reader(name, procs, results, sync):
    """TP=2, the signal path, rank 1 descheduled 3 ms after every barrier. Before the fix
    rank 0 set the next step's signal while rank 1 had not read this step's: rank 1 took
    the batch a step early and waited alone in the model's collective (deadlock)."""
    run_overlap(name, procs, results, 2, 8, sync=sync, lag=(1, 0.003))


def test_overlap_loop_tp8_read_finish_flag(name, procs, results):
    """TP=8 on one node: develop's nnode = (8 + 8) // 8 = 2, so rank 0 sets
    read_finish_flag and every rank reads it; rank 5 descheduled after every barrier."""
    run_overlap(name, procs, results, 8, 4, lag=(5, 0.003))
