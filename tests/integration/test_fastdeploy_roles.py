"""Roles of the drop-in's clients under the loops FastDeploy and docs/index.md show: a client
built with a worker's arguments (no ``role=``) must take its TP rank from its first task-path
call, or say within a second that its role is undecided and how to decide it; no loop may
stall silently, and the server's ``cleanup()`` must reach every worker."""

import threading

import pytest

from conftest import SPAWN
from fastdeploy_sync.fastdeploy import EngineWorkerQueue
from fastdeploy_sync.testing.fd_loops import batches, check_group, engine_loop, ids_of, loop_worker

RESULT_TIMEOUT_S = 90


def run_loop_shape(name, procs, results, shape, tp, n, *, sync=False, read_flag=True):
    """FastDeploy's layout: the engine builds the server and its own client (client_id=0),
    then the TP ranks start (plain clients, FastDeploy's worker arguments); the engine loop
    runs in a thread. Every rank must take identical batches at identical steps."""
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=tp,
                               name=name)
    try:
        address = ("0.0.0.0", server.get_server_port())
        client = EngineWorkerQueue(address=address, num_client=tp, client_id=0, name=name)
        collective, signal = SPAWN.Barrier(tp), SPAWN.Value("i", 0)
        for r in range(tp):
            procs(loop_worker, address, shape, tp, r, 0, collective, signal, results,
                  sync=sync, name=name, step_ms=1.0, barrier_timeout=10.0, deadline_s=60.0,
                  read_flag=read_flag)
        put = batches(0, n)
        errors = []

        def engine():
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


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_index_loop_without_role(name, procs, results, sync):
    """docs/index.md's loop (rank 0 exist_tasks(), the TP barrier, every rank get_tasks()) on
    the drop-in, TP=2, no role=. Before: ProtocolError at the first get_tasks() on both
    ranks ('rank 0 has not checked for tasks'): rank 0's exist_tasks() read False
    undecided and it joined the group only in get_tasks()."""
    run_loop_shape(name, procs, results, "index", 2, 12, sync=sync)


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
@pytest.mark.parametrize("tp", [2, 4])
def test_overlap_loop_without_read_finish_flag(name, procs, results, tp, sync):
    """FastDeploy's overlap loop that reads only its signal (never read_finish_flag.get()),
    no role=."""
    run_loop_shape(name, procs, results, "overlap", tp, 10, sync=sync, read_flag=False)


LOOPS = [("develop", True), ("v2x", True), ("v20", True), ("overlap", True),
         ("overlap", False), ("index", True)]


@pytest.mark.parametrize("shape,read_flag", LOOPS,
                         ids=[f"{s}{'' if f else '-signal-only'}" for s, f in LOOPS])
def test_cleanup_reaches_every_worker(name, procs, results, shape, read_flag):
    """The server's cleanup() with TP=2 workers idle in each loop shape (no role=): every
    rank raises EngineClosedError (the figures: scripts/tools/dropin_roles_check.py)."""
    from fastdeploy_sync.testing.fd_loops import closing_worker

    tp = 2
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=tp,
                               name=name)
    try:
        address = ("0.0.0.0", server.get_server_port())
        client = EngineWorkerQueue(address=address, num_client=tp, client_id=0, name=name)
        barrier, signal = SPAWN.Barrier(tp), SPAWN.Value("i", 0)
        for r in range(tp):
            procs(closing_worker, address, shape, tp, r, barrier, signal, results, name=name,
                  read_flag=read_flag)
        for _ in range(tp):
            kind, r, payload = results.get(timeout=RESULT_TIMEOUT_S)
            assert kind == "stepping", (kind, r, payload)
        assert not client.exist_tasks()
    finally:
        server.cleanup()
    raised = {}
    for _ in range(tp):
        kind, r, payload = results.get(timeout=RESULT_TIMEOUT_S)
        assert kind == "raised", (kind, r, payload)
        raised[r] = payload[:2]
    assert all(kind == "EngineClosedError" for kind, _ in raised.values()), raised


def _index_loop_engine_on_server(name, procs, results, queue_kw):
    """docs/index.md's loop, TP=2, with no engine client in the server's process (the test
    puts through the server object itself), so nothing tells rank 0 it is a TP rank but its
    own calls or ``queue_kw``. Returns {rank: (kind, payload)}."""
    tp = 2
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=tp,
                               name=name)
    try:
        address = ("0.0.0.0", server.get_server_port())
        collective, signal = SPAWN.Barrier(tp), SPAWN.Value("i", 0)
        for r in range(tp):
            procs(loop_worker, address, "index", tp, r, 0, collective, signal, results,
                  name=name, barrier_timeout=10.0, deadline_s=30.0, queue_kw=queue_kw)
        put = batches(0, 6)
        errors = []

        def engine():
            try:
                engine_loop(server, put, put_timeout=15)
            except BaseException as exc:  # the workers may have failed: judged below
                errors.append(exc)

        thread = threading.Thread(target=engine)
        thread.start()
        got = {}
        for _ in range(tp):
            kind, _, r, payload = results.get(timeout=RESULT_TIMEOUT_S)
            got[r] = (kind, payload)
        thread.join(timeout=30)
    finally:
        server.cleanup()
    return got, put, errors


def test_undecided_rank0_says_so(name, procs, results, monkeypatch):
    """Nothing says rank 0 is a TP rank before its get_tasks(): it raises an error that
    names the role and the fix (before: 'rank 0 has not checked for tasks ... Fix the
    worker loop', which blames the loop for what the role rule did)."""
    monkeypatch.setenv("FD_SYNC_ATTACH_TIMEOUT", "5")  # rank 1, should rank 0 be gone
    got, _, _ = _index_loop_engine_on_server(name, procs, results, None)
    kind, text = got[0]
    assert kind == "error" and "ProtocolError" in text, got
    assert "role was undecided" in text and "role='worker'" in text, text
    assert "FD_SYNC_QUEUE_ROLE=worker" in text, text
    # rank 1 names the likely cause too, or says that rank 0 was gone already: it never
    # made the group, or it made it, failed and left before rank 1 came: before rank 1
    # attached (the group's memory is gone: the attach times out) or after (rank 0's BYE
    # retired the group, and the engine refuses rank 1's HELLO). A loaded machine starts
    # rank 1 that late, and so, now and then, does an idle one.
    kind, text = got[1]
    assert kind == "error", got
    assert ("role='worker'" in text or "not created by rank 0" in text
            or "this worker group was retired earlier" in text
            or "or did it fail already" in text), text


def test_index_loop_with_role_worker(name, procs, results):
    """The same loop with role='worker': every rank takes every batch at the same step."""
    got, put, errors = _index_loop_engine_on_server(name, procs, results, {"role": "worker"})
    assert all(kind == "ok" for kind, _ in got.values()), got
    assert not errors, errors
    check_group({r: payload for r, (_, payload) in got.items()}, 2, 0, ids_of(put))
